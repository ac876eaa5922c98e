"""The warm distance-cache lookup of a serving step, alone: ``DistanceCache.lookup_grid``.

The graph, sessions and topic walks of ``benchmarks/serving.py`` (20k-node clustered
graph, M = 32); every walked step's pairs are asked of the graph first, so the cache
holds them; then each step's (S, M) x (S, M) lookup is timed, ``--repeats`` times.

Run:  python benchmarks/lookup_grid.py                     (1024 sessions)
      python benchmarks/lookup_grid.py --sessions 4096
For an A/B against a commit, run it from a worktree of that commit with PYTHONPATH set
to the worktree, alternately with this tree.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402  (the benchmark's graph and walks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1024)
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    graph = serving.clustered_graph(args.nodes, torch.Generator().manual_seed(args.seed), distance_cache_entries=1 << 26)
    walkers = serving.Walkers(args.sessions, len(graph), 32, torch.Generator().manual_seed(args.seed))
    turns = [walkers.turn(True)[0] for _ in range(args.steps)]
    for before, after in zip(turns, turns[1:]):
        graph.trellis_distances(torch.stack([before, after], 1))
    times = []
    for _ in range(args.repeats):
        for before, after in zip(turns, turns[1:]):
            start = time.perf_counter()
            _, answered = graph._cache.lookup_grid(before, after, graph.maximum_distance)
            times.append(time.perf_counter() - start)
            if not bool(answered.all()):
                raise RuntimeError("a timed lookup missed the cache")
    print(f"{args.sessions} sessions, {len(times)} lookups of {args.sessions * 32 * 32:,} pairs: "
          f"p50 {statistics.median(times) * 1e3:.2f} ms, min {min(times) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
