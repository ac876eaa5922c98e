"""The serving step a new user first meets: 300 sessions over a 5,000-node kNN graph of
unclustered embeddings, with nothing opted into (issue 34's target: 20 ms per step by
default), beside the same step with a dense table, with a ball table under the calibrated
bound, and with the calibrated bound alone.

Each session's turn is the top 20 of a random query against the embeddings (what a
dense provider returns); the graph is the exact kNN graph (k = 10).

Run:  python benchmarks/new_user_step.py [--nodes 5000] [--sessions 300] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch.graph import knn_graph  # noqa: E402
from mapmatched_torch.serving import MapMatchedServer  # noqa: E402


def steps(graph, embeddings, sessions: int, count: int, warmup: int, seed: int) -> tuple:
    """The seconds of the `warmup` first steps together (the first turn has no transitions;
    the next ones fill the distance cache), and of each of the `count` steps after them."""
    server = MapMatchedServer(graph, candidate_limit=20)
    ids = [f"s{i}" for i in range(sessions)]
    for name in ids:
        server.open(name)
    generator = torch.Generator().manual_seed(seed)
    times = []
    for step in range(warmup + count):
        queries = torch.nn.functional.normalize(torch.randn(sessions, embeddings.shape[1], generator=generator), dim=1)
        scores, candidates = (queries @ embeddings.T).topk(20, dim=1)
        start = time.perf_counter()
        _, errors = server.step_indexed(ids, candidates, scores.double())
        times.append(time.perf_counter() - start)
        assert not errors, list(errors.items())[:2]
    return sum(times[:warmup]), times[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--dimension", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.nn.functional.normalize(torch.randn(args.nodes, args.dimension, generator=generator), dim=1)
    ids = [f"c{i}" for i in range(args.nodes)]
    print(f"{args.nodes} unclustered {args.dimension}-d embeddings, exact kNN k = 10, {args.sessions} sessions, "
          f"20 candidates, p50 of {args.steps} steps after {args.warmup}; torch threads {torch.get_num_threads()}")
    print(f"| graph | setup (s) | first {args.warmup} steps (s) | p50 step (ms) | p90 step (ms) |")
    print("|---|---:|---:|---:|---:|")
    for label in ("default (bound 10, distance cache)", "dense table", "bound auto", "bound auto + ball table"):
        start = time.perf_counter()
        graph = knn_graph(embeddings, ids, 10, maximum_distance="auto" if "auto" in label else 10.0, progress=False)
        if label == "dense table":
            graph.precompute_dense(memory_budget=8 * args.nodes ** 2)
        elif "ball" in label:
            graph.precompute_balls(progress=False)
        setup = time.perf_counter() - start
        first, times = steps(graph, embeddings, args.sessions, args.steps, args.warmup, 1)
        times = sorted(times)
        p90 = times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))]
        print(f"| {label} | {setup:.1f} | {first:.2f} | {statistics.median(times) * 1e3:.1f} | {p90 * 1e3:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
