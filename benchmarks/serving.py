"""Serving benchmark: latency of one batched MapMatchedServer step vs sessions one by one.

A clustered kNN-like corpus graph (N nodes, 10 neighbours each) as a TensorCorpusGraph;
S concurrent sessions whose 32 candidates per turn follow topic walks (24 from the
user's cluster, 8 from the neighbouring one; 10% of turns jump to a random cluster).
Each timed step sends every session one new turn. Reports p50/p99 latency and turns/s
of one step, the time to read every context and every whole result after it, and the
same turns served one session at a time by independent standalone sessions
(MapMatchedRetriever + StandaloneDecoder, re-decoding the whole trellis each turn, on
the same graph as an InMemoryCorpusGraph), measured on a subset and scaled per turn.

Defaults (the issue's setting): candidates as (S, M) node-index and score tensors
(``MapMatchedServer.step_indexed``: what a dense provider on the device returns), M = 32,
full decoding, and the distance cache warm: every timed step's pairs are asked of the
graph once before the timing, so its LRU distance cache holds them.

Run:  python benchmarks/serving.py                  (sessions 1, 64, 1024, 4096)
      python benchmarks/serving.py --input objects  (ScoredCandidate lists to MapMatchedServer.step)
      python benchmarks/serving.py --input slots    (MapMatchedServer.step_slots: the tensor step)
      python benchmarks/serving.py --input device   (step_slots(synchronize=False): the device step, no host reads)
      python benchmarks/serving.py --input captured --device cuda  (the device step replayed from a CUDA graph)
      python benchmarks/serving.py --distances dense  (every distance in a precomputed dense table)
      python benchmarks/serving.py --distances cold   (nothing cached: the step's pairs are searched)
      python benchmarks/serving.py --distances balls  (every node's bounded ball precomputed: a binary search per pair)
      python benchmarks/serving.py --read contexts  (read only the contexts after each step)
      python benchmarks/serving.py --gc-freeze      (gc.freeze() after the warm-up)
      python benchmarks/serving.py --precompute-contexts  (every context neighbourhood searched before the steps)
      python benchmarks/serving.py --turn-capacity 16     (no table growth within 16 turns)
      python benchmarks/serving.py --quick          (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.standalone import InMemoryCorpusGraph
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.serving import MapMatchedServer


def clustered_edges(nodes: int, generator: torch.Generator, neighbours: int = 10):
    """``(edge_index (2, E), distances (E,) float64)``: nodes on clusters of 50; each links to
    ``neighbours`` random nodes of its cluster (distance 0.1-0.6) and rarely (5%) to a
    random node anywhere (distance 0.9). Self-loops are dropped."""
    cluster = torch.arange(nodes) // 50
    offsets = torch.randint(1, 50, (nodes, neighbours), generator=generator)
    targets = (cluster.unsqueeze(1) * 50 + (torch.arange(nodes).unsqueeze(1) % 50 + offsets) % 50).clamp_max(nodes - 1)
    weights = 0.1 + 0.5 * torch.rand(nodes, neighbours, generator=generator, dtype=torch.float64)
    far = torch.rand(nodes, generator=generator) < 0.05
    targets[far, 0] = torch.randint(0, nodes, (int(far.sum()),), generator=generator)
    weights[far, 0] = 0.9
    sources = torch.arange(nodes).unsqueeze(1).expand(-1, neighbours)
    keep = sources != targets
    return torch.stack([sources[keep], targets[keep]]), weights[keep]


def clustered_graph(nodes: int, generator: torch.Generator, neighbours: int = 10, **options) -> TensorCorpusGraph:
    """The :func:`clustered_edges` graph as a TensorCorpusGraph (bound 3.0)."""
    edge_index, weights = clustered_edges(nodes, generator, neighbours)
    ids = [f"c{i}" for i in range(nodes)]
    return TensorCorpusGraph.from_edge_index(edge_index, weights, chunk_ids=ids, maximum_distance=3.0, **options)


class Walkers:
    """Each session reads one node; its turns' candidates sit around that node."""

    def __init__(self, sessions: int, nodes: int, width: int, generator: torch.Generator) -> None:
        self.position = torch.randint(0, nodes, (sessions,), generator=generator)
        self.nodes, self.width, self.generator = nodes, width, generator

    def turn(self, indexed: bool = False):
        """The next turn of every session: ScoredCandidate lists, or with ``indexed``
        ``(candidates (S, M) node indices with -1 padding, scores (S, M))``."""
        g = self.generator
        cluster = self.position // 50
        # Topic walk: three quarters of the candidates from the user's cluster, the rest
        # from the neighbouring cluster (what a dense retriever returns around a topic).
        near = cluster.unsqueeze(1) * 50 + torch.randint(0, 50, (len(self.position), 3 * self.width // 4), generator=g)
        nearby = ((cluster + 1) % (self.nodes // 50)).unsqueeze(1) * 50 + torch.randint(
            0, 50, (len(self.position), self.width - 3 * self.width // 4), generator=g
        )
        candidates = torch.cat([near, nearby], dim=1).clamp_max(self.nodes - 1)
        scores = torch.randn(candidates.shape, generator=g, dtype=torch.float64)
        jump = torch.rand(len(self.position), generator=g) < 0.1
        self.position = torch.where(jump, torch.randint(0, self.nodes, self.position.shape, generator=g), near[:, 0])
        rows = [list(dict.fromkeys(row)) for row in candidates.tolist()]  # drop duplicates, keep provider order
        if indexed:
            padded = torch.tensor([row + [-1] * (self.width - len(row)) for row in rows])
            return padded, torch.where(padded >= 0, scores, 0.0)
        return [[ScoredCandidate(f"c{node}", score) for node, score in zip(row, score_row)]
                for row, score_row in zip(rows, scores.tolist())]


def measure(graph, sessions: int, width: int, steps: int, warmup: int, device: str, lag, seed: int,
            gc_freeze: bool = False, indexed: bool = True, read: str = "all", warm_cache: bool = True,
            slots_api: bool = False, precompute: bool = False, turn_capacity: int = 8, mode: str = "slots"):
    """Seconds of each timed step, (contexts, every whole result) read after it, the
    distance-cache misses (sources searched) of the timed steps, and the seconds of each
    timed step's distance lookups alone (the same pairs asked of the graph again)."""
    generator = torch.Generator().manual_seed(seed)
    server = MapMatchedServer(graph, candidate_limit=width, fixed_lag=lag, transition_weight=1.0, device=device,
                              capacity=sessions, turn_capacity=turn_capacity)
    if precompute:
        start = time.perf_counter()
        server.precompute_contexts()
        print(f"  (contexts precomputed in {time.perf_counter() - start:.2f} s)")
    ids = [f"s{i}" for i in range(sessions)]
    for name in ids:
        server.open(name)
    slots = server.slots(ids)
    captured = server.capture(sessions, turns=turn_capacity) if mode == "captured" else None
    walkers = Walkers(sessions, len(graph), width, generator)
    planned = [walkers.turn(indexed) for _ in range(warmup + steps)]
    if warm_cache:
        # every timed step's pairs, asked of the graph once beforehand: its LRU cache holds them
        graph.clear_cache()
        codes = [turn[0] if indexed else padded_codes(graph, turn, width) for turn in planned]
        for before, after in zip(codes, codes[1:]):
            graph.trellis_distances(torch.stack([before, after], 1).to(graph.device))
    times, reads = [], []
    misses = 0
    for step, turn in enumerate(planned):
        if gc_freeze and step == warmup:
            gc.freeze()  # the sessions' long-lived objects leave the collector's generations
        if indexed:
            candidates, scores = turn[0].to(device), turn[1].to(device)
        else:
            turns = dict(zip(ids, turn))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        before = graph.cache_info().misses
        start = time.perf_counter()
        if captured is not None:
            out = captured(slots, candidates, scores)
            errors = {} if not bool((out.status != 0).any()) else {"rows": out.status.unique().tolist()}
        elif slots_api:  # the tensor step, contexts (as codes) included
            out = server.step_slots(slots, candidates, scores, contexts=True, synchronize=mode != "device")
            errors = {} if not bool((out.status != 0).any()) else {"rows": out.status.unique().tolist()}
        else:
            results, errors = server.step_indexed(ids, candidates, scores) if indexed else server.step(turns)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        middle = time.perf_counter()
        if step >= warmup:
            misses += graph.cache_info().misses - before
        if not slots_api:
            results.contexts()  # every session's context chunk IDs (what a RAG server sends on)
        contexts = time.perf_counter()
        if read == "all" and not slots_api:
            results.materialize()  # every session's whole RetrievalResult (trace, path, ranking)
        end = time.perf_counter()
        if errors:
            raise RuntimeError(f"unexpected errors: {list(errors.items())[:3]}")
        if step >= warmup:
            times.append(middle - start)
            reads.append((contexts - middle, end - middle))
    codes = [turn[0] if indexed else padded_codes(graph, turn, width) for turn in planned]
    lookups = []
    for step in range(max(warmup, 1), len(codes)):  # the pairs from each timed step's previous turn
        pair = torch.stack([codes[step - 1], codes[step]], 1).to(graph.device)
        start = time.perf_counter()
        graph.trellis_distances(pair)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        lookups.append(time.perf_counter() - start)
    return times, reads, misses, lookups


def padded_codes(graph: TensorCorpusGraph, turn, width: int) -> torch.Tensor:
    """(S, M) node indices of a turn of ScoredCandidate lists, -1 padding."""
    codes = torch.full((len(turn), width), -1, dtype=torch.long)
    for row, candidates in enumerate(turn):
        codes[row, : len(candidates)] = graph.index([c.chunk_id for c in candidates])
    return codes


def standalone_graph(graph: TensorCorpusGraph) -> InMemoryCorpusGraph:
    """The same graph as the pure-Python reference (both directions are stored arcs)."""
    edge_index, weights = graph.to_edge_index()
    ids = graph.nodes
    edges = [(ids[a], ids[b], w) for (a, b), w in zip(edge_index.t().tolist(), weights.tolist())]
    return InMemoryCorpusGraph(edges, nodes=ids, directed=True, maximum_distance=graph.maximum_distance)


def standalone_per_turn(graph, width: int, turns: int, lag, seed: int, sessions: int = 8) -> float:
    """Seconds per turn of independent standalone sessions (turns 1..turns averaged)."""
    generator = torch.Generator().manual_seed(seed)
    graph = standalone_graph(graph)
    walkers = Walkers(sessions, len(graph), width, generator)
    plain = [MapMatchedRetriever(graph, candidate_limit=width, fixed_lag=lag).session() for _ in range(sessions)]
    start = time.perf_counter()
    for _ in range(turns):
        for session, candidates in zip(plain, walkers.turn()):
            session.retrieve_candidates(candidates)
    return (time.perf_counter() - start) / (turns * sessions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64, 1024, 4096])
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--lag", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--input", choices=["tensors", "objects", "slots", "device", "captured"], default="tensors",
                        help="(S, M) node-index and score tensors to step_indexed (default), ScoredCandidate "
                             "lists to step, or slots + tensors to step_slots (the tensor step: its contexts "
                             "come with the step, as codes); device: step_slots(synchronize=False); captured: "
                             "that step replayed from a CUDA graph (server.capture)")
    parser.add_argument("--distances", choices=["cache", "dense", "cold", "balls"], default="cache",
                        help="cache (default): every timed step's pairs in the graph's LRU distance cache first; "
                             "dense: a precomputed dense table; cold: nothing cached; balls: a precomputed ball table")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() after the warm-up steps (what latency-sensitive Python servers do)")
    parser.add_argument("--read", choices=["all", "contexts"], default="all",
                        help="after each step read every whole result (default) or only the contexts")
    parser.add_argument("--cache-entries", type=int, default=1 << 26,
                        help="the graph's distance cache capacity in (source, target) entries (16 bytes each)")
    parser.add_argument("--precompute-contexts", action="store_true",
                        help="server.precompute_contexts() before the steps: no step searches a neighbourhood on "
                             "first visit (default: searched when a chunk is first decoded)")
    parser.add_argument("--turn-capacity", type=int, default=8,
                        help="the server's initial turns per session (default 8: the tables double at turn 9)")
    parser.add_argument("--no-standalone", action="store_true",
                        help="skip the standalone sessions one by one (a CPU figure; ~40 s at 24 turns)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.nodes, args.steps, args.warmup = [1, 64], 2000, 3, 2
    graph = clustered_graph(args.nodes, torch.Generator().manual_seed(args.seed),
                            distance_cache_entries=args.cache_entries).to(args.device)
    if args.distances == "dense":
        start = time.perf_counter()
        graph.precompute_dense(memory_budget=8 * args.nodes ** 2)
        print(f"dense table built in {time.perf_counter() - start:.1f} s")
    elif args.distances == "balls":
        start = time.perf_counter()
        graph.precompute_balls()
        table = graph.ball_table
        print(f"ball table built in {time.perf_counter() - start:.1f} s: {table.nbytes / 2**20:.0f} MiB, "
              f"{table.nbytes / len(graph):.0f} bytes per node, widest ball {table.widest_row()}")
    per_turn = None if args.no_standalone else standalone_per_turn(
        graph, args.width, args.warmup + args.steps, args.lag, args.seed
    )
    mode = "full" if args.lag is None else f"fixed-lag {args.lag}"
    print(f"graph: {len(graph)} nodes, {graph.edge_count} arcs; M = {args.width}; mode {mode}; device {args.device}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"input: {args.input}; distances: {args.distances}; read after each step: {args.read}; "
          f"gc.freeze: {args.gc_freeze}; {args.steps} timed steps after {args.warmup} warm-up steps; contexts "
          f"{'precomputed' if args.precompute_contexts else 'searched on first visit'}; turn capacity {args.turn_capacity}")
    if per_turn is not None:
        print(f"standalone sessions one by one: {per_turn * 1e3:.2f} ms per turn "
              f"(8 sessions x {args.warmup + args.steps} turns)")
    print()
    print("| sessions | p50 step (ms) | p99 step (ms) | turns/s (p50) | + every context, p50 (ms) "
          "| + every whole result, p50 (ms) | distance lookups alone, p50 (ms) | standalone one by one (ms, scaled) "
          "| speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for sessions in args.sessions:
        times, reads, misses, lookups = measure(
            graph, sessions, args.width, args.steps, args.warmup, args.device, args.lag, args.seed, args.gc_freeze,
            args.input != "objects", args.read, args.distances == "cache", args.input in ("slots", "device", "captured"),
            args.precompute_contexts, args.turn_capacity, args.input,
        )
        gc.unfreeze()
        times = sorted(times)
        p50 = statistics.median(times)
        p99 = times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))]
        context = statistics.median(read[0] for read in reads)
        whole = statistics.median(read[1] for read in reads)
        whole = f"{(p50 + whole) * 1e3:.1f}" if args.read == "all" else "-"
        baseline = f"{per_turn * sessions * 1e3:,.0f} | {per_turn * sessions / p50:.0f}x" if per_turn else "- | -"
        lookup = statistics.median(lookups) * 1e3
        print(f"| {sessions} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | {sessions / p50:,.0f} | {(p50 + context) * 1e3:.1f} "
              f"| {whole} | {lookup:.1f} | {baseline} |", flush=True)
        if args.distances != "cold" and misses:
            print(f"  (the timed steps missed the distance cache {misses} times: searches included)")


if __name__ == "__main__":
    main()
