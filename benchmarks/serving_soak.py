"""Serving soak: sessions open and close over many steps; step time and memory stay flat.

A clustered corpus graph of ``--nodes`` chunks (clusters of 50, ``benchmarks/serving.py``'s
shape), served as a ``TensorCorpusGraph`` (``--graph tensor``) or as the standalone
in-memory graph (``--graph mapping``: a non-tensor graph, every chunk ID coded by
arrival). A pool of ``--live`` sessions; each step decodes a new turn for ``--batch`` of
them (``MapMatchedServer.step`` with chunk IDs, or ``--api slots``: ``step_slots`` with
codes numbered by ``server.store.codes``) and reads their contexts (what a RAG server
hands its LLM); sessions end after 1 to ``--max-turns`` turns and new ones take their
place, so far more sessions are served than are ever open at once. With
``--unknown-ids F``, a share F of every turn's candidates are chunk IDs outside the
graph, fresh ones each time (a provider over a corpus that moved on).

Every ``--report-every`` steps it prints the resident memory, the objects the garbage
collector tracks, the slot table (slots, turn capacity), the chunk codes, the context
table's rows, the graph's distance cache and the step time (p50, p99 of that window).
It ends with a verdict: the first window after the warm-up against the last one, the
growth of the resident memory in MB and the ratio of the p50 step times.

Run:  python benchmarks/serving_soak.py --graph tensor                  (50,000 steps)
      python benchmarks/serving_soak.py --graph mapping --unknown-ids 0.25
      python benchmarks/serving_soak.py --steps 2000 --quick            (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch import InMemoryCorpusGraph  # noqa: E402
from mapmatched_torch.graph import TensorCorpusGraph  # noqa: E402
from mapmatched_torch.serving import MapMatchedServer  # noqa: E402
from serving import clustered_edges  # noqa: E402


def resident_mb() -> float:
    """The process's resident memory now (Linux /proc), else its peak."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as stream:
            return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_graph(kind: str, nodes: int, generator: torch.Generator, maximum_distance: float):
    """The graph of ``kind`` over ``benchmarks/serving.py``'s clustered edges, a distance
    cache of one row per node."""
    edge_index, weights = clustered_edges(nodes, generator)
    edges = [(f"c{a}", f"c{b}", w) for a, b, w in zip(*edge_index.tolist(), weights.tolist())]
    ids = [f"c{i}" for i in range(nodes)]
    if kind == "tensor":
        return TensorCorpusGraph.from_edges(edges, nodes=ids, maximum_distance=maximum_distance,
                                            distance_cache_size=nodes)
    return InMemoryCorpusGraph(edges, nodes=ids, maximum_distance=maximum_distance, distance_cache_size=nodes)


def cache_entries(graph) -> str:
    """The graph's distance cache: rows (and, for a tensor graph's cache, its sparse entries;
    rows kept dense are not entries)."""
    info = graph.cache_info()
    cache = getattr(graph, "_cache", None)
    return f"{info.size} rows" + (f", {cache.entry_count} sparse entries" if hasattr(cache, "entry_count") else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", choices=("tensor", "mapping"), default="tensor")
    parser.add_argument("--unknown-ids", type=float, default=0.0,
                        help="share of each turn's candidates that are fresh chunk IDs outside the graph")
    parser.add_argument("--api", choices=("step", "slots"), default="step")
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--live", type=int, default=64, help="sessions open at any time")
    parser.add_argument("--batch", type=int, default=16, help="sessions stepped per step")
    parser.add_argument("--width", type=int, default=20, help="candidates per turn (candidate_limit)")
    parser.add_argument("--nodes", type=int, default=2_000)
    parser.add_argument("--max-turns", type=int, default=40)
    parser.add_argument("--maximum-distance", type=float, default=1.0, help="the graph's distance bound")
    parser.add_argument("--warmup", type=int, default=1_000, help="steps before the first window")
    parser.add_argument("--report-every", type=int, default=5_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not 0.0 <= args.unknown_ids <= 1.0:
        parser.error("--unknown-ids must be in [0, 1]")
    if args.quick:
        args.report_every = max(1, args.steps // 4)
        args.warmup = min(args.warmup, args.report_every)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(args.seed)
    graph = make_graph(args.graph, args.nodes, generator, args.maximum_distance)
    server = MapMatchedServer(graph, candidate_limit=args.width, capacity=args.live)
    names = [f"s{i}" for i in range(args.live)]
    for name in names:
        server.open(name)
    left = torch.randint(1, args.max_turns + 1, (args.live,), generator=generator)
    topic = torch.randint(0, args.nodes, (args.live,), generator=generator)
    opened, next_id, fresh = args.live, args.live, 0
    unknown = round(args.unknown_ids * args.width)
    known = args.width - unknown
    times, windows = [], []
    print(f"graph {args.graph}, {args.nodes} nodes; {args.live} live sessions, {args.batch} stepped per step, "
          f"M = {args.width} ({unknown} fresh unknown IDs per turn); api {args.api}; torch {torch.__version__}, "
          f"1 thread, load average {os.getloadavg()[0]:.1f}")
    print("| step | sessions opened | resident MB | gc objects | slots | turn capacity | chunk codes | "
          "context rows | distance cache | p50 step ms | p99 step ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        rows = torch.randperm(args.live, generator=generator)[: args.batch]
        cluster = topic[rows] // 50
        nodes = (cluster.unsqueeze(1) * 50 + torch.randint(0, 50, (args.batch, known), generator=generator))
        nodes = nodes.clamp_max(args.nodes - 1).tolist()
        scores = torch.randn((args.batch, args.width), generator=generator, dtype=torch.float64).tolist()
        turns = {}
        for row, picked, score in zip(rows.tolist(), nodes, scores):
            chunks = list(dict.fromkeys(f"c{node}" for node in picked))
            chunks += [f"unknown-{fresh + i}" for i in range(unknown)]
            fresh += unknown
            turns[names[row]] = list(zip(chunks, score))
        tick = time.perf_counter()
        if args.api == "step":
            results, errors = server.step(turns)
            results.contexts()
        else:
            keys = list(turns)
            coded = server.store.codes.codes
            codes = torch.full((len(keys), args.width), -1, dtype=torch.long)
            raw = torch.zeros((len(keys), args.width), dtype=torch.float64)
            for position, key in enumerate(keys):
                row_codes = coded([chunk for chunk, _ in turns[key]])
                codes[position, : len(row_codes)] = torch.tensor(row_codes)
                raw[position, : len(row_codes)] = torch.tensor([score for _, score in turns[key]])
            out = server.step_slots(server.slots(keys), codes, raw, contexts=True)
            server.store.codes.name_rows(out.contexts)
            errors = {} if not bool((out.status != 0).any()) else {"rows": out.status.unique().tolist()}
        times.append(time.perf_counter() - tick)
        if errors:
            raise RuntimeError(f"step {step}: unexpected failures {errors}")
        left[rows] -= 1
        for row in rows[left[rows] <= 0].tolist():  # a conversation ends; a new one takes its place
            server.close(names[row])
            names[row] = f"s{next_id}"
            next_id += 1
            server.open(names[row])
            left[row] = int(torch.randint(1, args.max_turns + 1, (1,), generator=generator))
            topic[row] = int(torch.randint(0, args.nodes, (1,), generator=generator))
            opened += 1
        if step == args.warmup:
            times = []
        elif step > args.warmup and ((step - args.warmup) % args.report_every == 0 or step == args.steps):
            window = sorted(times)
            store, decoder = server.store, server.store.decoder
            resident = resident_mb()
            p50 = statistics.median(window) * 1e3
            windows.append((step, resident, p50, len(store.codes)))
            print(f"| {step} | {opened} | {resident:.0f} | {len(gc.get_objects())} | {decoder.capacity} | "
                  f"{decoder.turn_capacity} | {len(store.codes)} | {store.contexts.row_count} | {cache_entries(graph)} | "
                  f"{p50:.2f} | {window[int(0.99 * (len(window) - 1))] * 1e3:.2f} |", flush=True)
            times = []
    elapsed = time.perf_counter() - start
    print(f"{args.steps} steps in {elapsed:.0f} s; {opened} sessions opened in all, {len(server)} open at the end, "
          f"{fresh} unknown IDs sent; load average {os.getloadavg()[0]:.1f}")
    if len(windows) >= 2:
        (first_step, first_mb, first_p50, first_codes), (last_step, last_mb, last_p50, last_codes) = windows[0], windows[-1]
        growth, ratio = last_mb - first_mb, last_p50 / first_p50
        flat = growth < 50 and ratio < 1.25
        print(f"verdict: {'FLAT' if flat else 'GROWING'}: resident memory {first_mb:.0f} -> {last_mb:.0f} MB "
              f"({growth:+.0f} MB) and p50 step {first_p50:.2f} -> {last_p50:.2f} ms (x{ratio:.2f}) from step "
              f"{first_step} to {last_step}; chunk codes {first_codes} -> {last_codes} "
              "(flat: under +50 MB and under x1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
