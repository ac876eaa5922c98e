"""One serving step's ball-table lookups: the per-pair search against the grid kernel.

Reads a graph artifact with a ball table (``benchmarks/scale.py --keep`` writes one,
with ``turns.npy``, the serving phase's candidates) and times, for each consecutive
turn pair of ``DIR/turns.npy`` ((T, S, M) node indices), the S x M x M distances:

- ``pairwise``: the per-pair binary search (:func:`mapmatched_torch.graph._ball_kernels.lookup`,
  what every lookup was before the grid kernel);
- ``grid``: :func:`~mapmatched_torch.graph._ball_kernels.lookup_grid` on 1 thread and on
  numba's threads (what ``trellis_distances`` and a serving step now run).

The first turn pair touches the table's pages for the first time in this process
(``first``); the figures of record are the p50 of the later ones. Every answer is
checked equal to the per-pair one.

Usage::

    python benchmarks/ball_lookup.py --dir /tmp/scale-1m
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="a scale.py directory: graph/ (the artifact) and turns.npy")
    args = parser.parse_args()

    import numba

    from mapmatched_torch.graph import load_graph
    from mapmatched_torch.graph._ball_kernels import lookup, lookup_grid

    folder = Path(args.dir)
    graph = load_graph(folder / "graph")
    table = graph.ball_table
    if table is None:
        raise SystemExit(f"{folder / 'graph'} has no ball table")
    arrays = table.indptr.numpy(), table.neighbors.numpy(), table.distances.numpy()
    maximum = graph.maximum_distance
    turns = np.load(folder / "turns.npy")  # (T, S, M)
    if turns.ndim != 3 or turns.min() < 0 or turns.max() >= table.num_nodes:
        raise SystemExit(f"turns.npy must be (T, S, M) node indices below {table.num_nodes}")
    count, width = turns.shape[1:]
    threads = numba.get_num_threads()
    # compile / load every kernel once on a tiny input, outside the timings
    lookup(turns[0, 0], turns[1, 0], *arrays, maximum)
    lookup_grid(turns[0, :1], turns[1, :1], *arrays, maximum, threads=1)
    lookup_grid(turns[0], turns[1], *arrays, maximum)
    times: dict = {"pairwise": [], "grid_1_thread": [], f"grid_{threads}_threads": []}
    for turn in range(turns.shape[0] - 1):
        sources, targets = turns[turn], turns[turn + 1]
        flat_sources = np.repeat(sources.reshape(-1), width)
        flat_targets = np.broadcast_to(targets[:, None, :], (count, width, width)).reshape(-1).copy()
        started = time.perf_counter()
        expected = lookup(flat_sources, flat_targets, *arrays, maximum).reshape(count, width, width)
        times["pairwise"].append(time.perf_counter() - started)
        for name, use in (("grid_1_thread", 1), (f"grid_{threads}_threads", 0)):
            started = time.perf_counter()
            got = lookup_grid(sources, targets, *arrays, maximum, threads=use)
            times[name].append(time.perf_counter() - started)
            if not np.array_equal(got, expected):
                raise SystemExit(f"turn {turn}: {name} differs from the per-pair lookup")
    report = {
        "pairs_per_step": count * width * width, "steps": turns.shape[0] - 1, "numba_threads": threads,
        **{f"{name}_first_ms": round(values[0] * 1e3, 1) for name, values in times.items()},
        **{f"{name}_p50_ms": round(statistics.median(values[1:]) * 1e3, 1) for name, values in times.items()},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
