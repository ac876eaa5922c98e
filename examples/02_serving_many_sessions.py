"""Serving loop: many concurrent conversations, one batched decoding step per tick.

A toy corpus of 8 topics x 12 passages (a chain per topic, a few cross links) with
random embeddings clustered by topic sits in a DenseProvider (exact top-k on the
device). 64 users talk at once; each tick, every active user sends a query embedding
(here: a noisy point near the passage they are reading), and the server decodes all of
their new turns in one batched step. Users join and leave over time, and one sends a
broken request (NaN scores) that fails alone.

Run: python examples/02_serving_many_sessions.py
"""

from __future__ import annotations

import sys
import time

import torch

from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.providers import DenseProvider
from mapmatched_torch.serving import MapMatchedServer

TOPICS, CHAIN, DIM, USERS, TICKS = 8, 12, 32, 64, 10


def corpus(generator):
    ids = [f"t{topic}:{i}" for topic in range(TOPICS) for i in range(CHAIN)]
    centers = torch.randn(TOPICS, DIM, generator=generator)
    embeddings = torch.stack(
        [centers[topic] + 0.6 * torch.randn(DIM, generator=generator) for topic in range(TOPICS) for _ in range(CHAIN)]
    )
    edges = [(f"t{t}:{i}", f"t{t}:{i + 1}") for t in range(TOPICS) for i in range(CHAIN - 1)]
    edges += [(f"t{t}:0", f"t{(t + 1) % TOPICS}:0") for t in range(TOPICS)]
    return ids, embeddings, TensorCorpusGraph.from_edges(edges, maximum_distance=6.0)


def main() -> int:
    generator = torch.Generator().manual_seed(0)
    ids, embeddings, graph = corpus(generator)
    provider = DenseProvider(embeddings, ids, metric="cosine")
    # turn_capacity: the session tables start with room for 16 turns (no table growth in
    # a live step before then); precompute_contexts: every context neighbourhood is
    # searched now, before serving, not when a chunk is first decoded
    server = MapMatchedServer(graph, candidate_limit=8, fixed_lag=2, transition_weight=0.5, turn_capacity=16)
    server.precompute_contexts()
    node_of = graph.index(ids)  # the provider's rows -> the graph's node indices
    reading = {}  # user -> index of the passage the user is reading
    served = failed = 0
    started = time.perf_counter()
    for tick in range(TICKS):
        for user in range(USERS):
            name = f"user{user}"
            if name not in server and (tick == 0 or user % 7 == tick % 7):
                server.open(name)
                reading[name] = int(torch.randint(len(ids), (1,), generator=generator))
        names = sorted(reading)
        for name in names:
            # Drift along the topic chain; the query is a noisy view of the passage.
            step = int(torch.randint(0, 2, (1,), generator=generator))
            reading[name] = min(reading[name] + step, len(ids) - 1)
        # One batched search for every active user (queries as the embedder would give them).
        positions = torch.tensor([reading[name] for name in names])
        queries = embeddings[positions] + 0.9 * torch.randn(len(names), DIM, generator=generator)
        scores, rows = provider.search_tensors(queries, limit=8)
        if tick == 3:
            scores[0, 0] = float("nan")
        results, errors = server.step_indexed(names, node_of[rows], scores)
        served += len(results)
        failed += len(errors)
        for name, error in errors.items():
            print(f"tick {tick}: {name} failed alone: {error}")
        if tick == TICKS - 1:
            sample = sorted(results)[0]
            print(f"\nlast trace of {sample}:\n{results[sample].trace.render()}\n")
        for name in [n for n in list(reading) if (int(n[4:]) + tick) % 13 == 0]:
            server.close(name)
            del reading[name]
    elapsed = time.perf_counter() - started
    print(f"{served} turns served, {failed} failed, {len(server)} sessions open, {elapsed:.2f} s in total")
    if failed != 1 or served == 0:
        print("FAIL: expected exactly one isolated failure", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
