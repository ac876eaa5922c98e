"""Trellis-distance benchmark: every distance engine vs the predecessor and the standalone graph.

For each graph size N: clustered embeddings (clusters of ~100 points), a kNN graph
(k = 10, cosine distances, undirected; ``mapmatched_torch.graph.knn.knn_graph`` when
importable, else a blockwise top-k of this script), and a trellis batch B x T x M whose
candidates follow topic walks: each conversation's topic moves two random-walk steps
along the graph per turn and jumps to a random node with probability ``--jump``; a
turn's M candidates are the top-M cosine neighbours of a noisy query around the topic.
Then the (B, T-1, M, M) distances are filled with:

- ``compiled`` (the CPU ``auto`` with numba; on all threads and on one thread),
  whose far pairs get A* searches guided per turn pair,
- ``hybrid`` (the CPU ``auto`` without numba), ``scipy`` and ``torch`` with
  target-aware search,
- ``torch`` and ``scipy`` with full bounded searches; ``scipy full`` is the
  predecessor's kNN engine (scipy Dijkstra per distinct source bounded by
  ``maximum_distance``, then per-pair lookups),
- the pure-Python ``InMemoryCorpusGraph`` (the standalone graph, row cache large
  enough that each source runs one Dijkstra: its best case),
- a warm distance cache (the same batch again), and the dense (N, N) table when N is
  small enough (its build is reported separately: it costs N full searches once).

An engine whose full run would exceed ``--max-seconds`` (estimated from a pilot of a few
sources) runs on a random sample of the distinct sources instead; its batch time is
extrapolated linearly in the number of sources and marked ``*``. Every engine's values
are checked to be identical (``torch.equal``) to the reference (the first engine run in
full, or the predecessor on the common sample).

Run:  python benchmarks/distances.py                 (N = 20,000 and 200,000)
      python benchmarks/distances.py --sizes 20000   (one size)
      python benchmarks/distances.py --quick         (a smoke run, seconds)
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from mapmatched_torch.graph import TensorCorpusGraph, source_target_distances
from mapmatched_torch.standalone import InMemoryCorpusGraph


# ---------------------------------------------------------------------- data


def clustered_embeddings(nodes: int, dim: int, spread: float, generator: torch.Generator) -> torch.Tensor:
    """(N, D) float32 unit rows around N/100 random centres."""
    centres = torch.randn(max(1, nodes // 100), dim, generator=generator)
    assignment = torch.randint(0, centres.shape[0], (nodes,), generator=generator)
    points = centres[assignment] + spread * torch.randn(nodes, dim, generator=generator)
    return torch.nn.functional.normalize(points, dim=1)


def own_knn_graph(embeddings: torch.Tensor, k: int, maximum_distance: float, block: int = 2048) -> TensorCorpusGraph:
    """Blockwise float32 top-k cosine kNN graph (undirected min-union), no exact tie rules."""
    nodes = embeddings.shape[0]
    sources, targets, weights = [], [], []
    for first in range(0, nodes, block):
        # shape: (b, N) similarities of a block of rows to every row
        similarity = embeddings[first:first + block] @ embeddings.T
        rows = torch.arange(first, first + similarity.shape[0])
        similarity[rows - first, rows] = -math.inf
        value, index = similarity.topk(k, dim=1)
        sources.append(rows.repeat_interleave(k))
        targets.append(index.reshape(-1))
        weights.append((1.0 - value.clamp(-1.0, 1.0)).reshape(-1).double())
    edge_weight = torch.cat(weights).clamp(1e-6, maximum_distance)
    ids = [f"c{i}" for i in range(nodes)]
    return TensorCorpusGraph.from_edge_index(
        torch.stack([torch.cat(sources), torch.cat(targets)]), edge_weight, chunk_ids=ids,
        maximum_distance=maximum_distance,
    )


def build_graph(embeddings: torch.Tensor, k: int, maximum_distance: float, knn: str) -> Tuple[TensorCorpusGraph, str]:
    """The kNN graph and which builder made it."""
    if knn != "own":
        try:
            from mapmatched_torch.graph.knn import knn_graph
        except ImportError:
            if knn == "library":
                raise
        else:
            ids = [f"c{i}" for i in range(embeddings.shape[0])]
            return knn_graph(embeddings.double(), ids, k, maximum_distance=maximum_distance, progress=False), "knn_graph"
    return own_knn_graph(embeddings, k, maximum_distance), "own blockwise top-k"


def topic_walk_trellis(
    graph: TensorCorpusGraph, embeddings: torch.Tensor, batch: int, turns: int, width: int, jump: float,
    noise: float, generator: torch.Generator,
) -> torch.Tensor:
    """(B, T, M) candidate node indices following topic walks with occasional jumps."""
    nodes = graph.num_nodes
    indptr, indices = graph.indptr, graph.indices
    topic = torch.randint(0, nodes, (batch,), generator=generator)
    result = []
    for turn in range(turns):
        if turn:
            for _ in range(2):
                degree = indptr[topic + 1] - indptr[topic]
                step = (torch.rand(batch, generator=generator) * degree).long()
                topic = torch.where(degree > 0, indices[(indptr[topic] + step).clamp_max(max(indices.numel() - 1, 0))], topic)
            jumped = torch.rand(batch, generator=generator) < jump
            topic = torch.where(jumped, torch.randint(0, nodes, (batch,), generator=generator), topic)
        query = embeddings[topic] + noise * torch.randn(batch, embeddings.shape[1], generator=generator)
        query = torch.nn.functional.normalize(query, dim=1)
        picks = [(query[first:first + 256] @ embeddings.T).topk(width, dim=1).indices for first in range(0, batch, 256)]
        result.append(torch.cat(picks))
    return torch.stack(result, dim=1)


def trellis_pairs(chunk_index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (B*(T-1)*M*M,) flat source and target of every transition slot."""
    batch, turns, width = chunk_index.shape
    sources = chunk_index[:, :-1, :, None].expand(batch, turns - 1, width, width).reshape(-1)
    targets = chunk_index[:, 1:, None, :].expand(batch, turns - 1, width, width).reshape(-1)
    return sources, targets


def standalone_twin(graph: TensorCorpusGraph, cache_rows: int) -> InMemoryCorpusGraph:
    """The same graph as the pure-Python reference."""
    edge_index, edge_weight = graph.to_edge_index()
    ids = graph.nodes
    arcs = [(ids[a], ids[b], w) for a, b, w in zip(edge_index[0].tolist(), edge_index[1].tolist(), edge_weight.tolist())]
    return InMemoryCorpusGraph(
        arcs, nodes=ids, directed=True, maximum_distance=graph.maximum_distance, distance_cache_size=cache_rows
    )


# ---------------------------------------------------------------------- measurement


@dataclass
class Row:
    name: str
    sources: int  # distinct sources actually searched
    seconds: float  # measured
    batch_seconds: float  # for the whole batch (extrapolated when sampled)
    sampled: bool
    identical: Optional[bool]


def timed(function: Callable[[], torch.Tensor]) -> Tuple[torch.Tensor, float]:
    start = time.perf_counter()
    value = function()
    return value, time.perf_counter() - start


class Bench:
    """Holds one size's graph, trellis and distinct pairs; measures engines."""

    def __init__(self, graph: TensorCorpusGraph, chunk_index: torch.Tensor, args: argparse.Namespace) -> None:
        self.graph, self.chunk_index, self.args = graph, chunk_index, args
        sources, targets = trellis_pairs(chunk_index)
        batch, turns, width = chunk_index.shape
        # shape: (slots,) the turn pair of every transition slot
        slot_groups = torch.arange(batch * (turns - 1)).repeat_interleave(width * width)
        keep = sources != targets
        keys, inverse = torch.unique(sources[keep] * graph.num_nodes + targets[keep], return_inverse=True)
        # shape: (P,) distinct node pairs the batch needs, sorted by source, and a turn pair of each
        self.pair_sources, self.pair_targets = keys // graph.num_nodes, keys % graph.num_nodes
        self.pair_groups = torch.empty_like(keys)
        self.pair_groups[inverse] = slot_groups[keep]
        self.distinct_sources = torch.unique(self.pair_sources)
        self.slots = sources.numel()
        self.reference: Optional[torch.Tensor] = None  # (P,) values of a full run
        generator = torch.Generator().manual_seed(args.seed + 7)
        # a fixed random order of the distinct sources: every sample is a prefix of it
        self.order = self.distinct_sources[torch.randperm(self.distinct_sources.numel(), generator=generator)]
        # every run: (row, mask of the distinct pairs it computed, their values)
        self.runs: List[Tuple[Row, torch.Tensor, torch.Tensor]] = []

    def sample(self, count: int) -> torch.Tensor:
        """A fixed random subset of ``count`` distinct sources (nested: smaller ones are subsets)."""
        return self.order[:count]

    def pairs_of(self, sources: torch.Tensor) -> torch.Tensor:
        return torch.isin(self.pair_sources, sources)

    def engine(self, name: str, engine: str, target_aware: bool) -> Row:
        """One search engine: full batch via trellis_distances, or a sample of sources."""
        graph, total = self.graph, self.distinct_sources.numel()
        pilot = self.sample(min(self.args.pilot, total))
        mask = self.pairs_of(pilot)
        run = lambda m: source_target_distances(  # noqa: E731
            graph.adjacency, self.pair_sources[m], self.pair_targets[m], bound=graph.maximum_distance,
            engine=engine, target_aware=target_aware, groups=self.pair_groups[m],
        )
        run(self.pairs_of(self.sample(1)))  # warm-up: imports, the scipy CSR copy
        values, seconds = timed(lambda: run(mask))
        estimate = seconds * total / max(pilot.numel(), 1)
        if estimate <= self.args.max_seconds or pilot.numel() == total:
            distances, seconds = timed(
                lambda: graph.trellis_distances(self.chunk_index, engine=engine, target_aware=target_aware, use_cache=False)
            )
            values = self.flat_values(distances)
            if self.reference is None:
                self.reference = values
            row = Row(name, total, seconds, seconds, False, None)
            self.runs.append((row, torch.ones_like(self.pair_sources, dtype=torch.bool), values))
            return row
        count = max(pilot.numel(), min(total, int(total * self.args.max_seconds / max(estimate, 1e-9))))
        chosen = self.sample(count)
        mask = self.pairs_of(chosen)
        values, seconds = timed(lambda: run(mask))
        values = torch.where(torch.isinf(values), graph.maximum_distance, values)
        row = Row(name, count, seconds, seconds * total / count, True, None)
        self.runs.append((row, mask, values))
        return row

    def flat_values(self, distances: torch.Tensor) -> torch.Tensor:
        """The values of the distinct pairs, read back from a (B, T-1, M, M) result."""
        sources, targets = trellis_pairs(self.chunk_index)
        flat = distances.reshape(-1)
        keys = sources * self.graph.num_nodes + targets
        wanted = self.pair_sources * self.graph.num_nodes + self.pair_targets
        order = torch.argsort(keys)
        position = order[torch.searchsorted(keys[order], wanted)]
        return flat[position]

    def verify(self) -> None:
        """Compare every run with the reference (the first full run) on the pairs it
        computed; without one, with the first run on their common pairs."""
        if not self.runs:
            return
        base_mask, base_values = (
            (torch.ones_like(self.pair_sources, dtype=torch.bool), self.reference)
            if self.reference is not None else self.runs[0][1:]
        )
        for row, mask, values in self.runs:
            common = base_mask & mask
            row.identical = bool(torch.equal(values[common[mask]], base_values[common[base_mask]]))

    def standalone(self) -> Row:
        """The pure-Python graph on a sample of sources (each source's Dijkstra runs once)."""
        count = min(self.args.standalone_sources, self.distinct_sources.numel())
        chosen = self.sample(count)
        mask = self.pairs_of(chosen)
        twin = standalone_twin(self.graph, cache_rows=max(count, 1))
        ids = self.graph.nodes
        pairs = [(ids[a], ids[b]) for a, b in zip(self.pair_sources[mask].tolist(), self.pair_targets[mask].tolist())]
        start = time.perf_counter()
        values = [twin.distance(a, b) for a, b in pairs]
        seconds = time.perf_counter() - start
        values = torch.tensor(values, dtype=torch.float64)
        total = self.distinct_sources.numel()
        row = Row("standalone InMemoryCorpusGraph (pure Python)", count, seconds, seconds * total / count, True, None)
        self.runs.append((row, mask, values))
        return row

    def warm_cache(self) -> Optional[Row]:
        """The batch again with every pair cached (needs a full reference run)."""
        if self.reference is None:
            return None
        graph = self.graph
        graph.clear_cache()
        graph._cache.insert(self.pair_sources, self.pair_targets, self.reference)  # the values of the cold run
        distances, seconds = timed(lambda: graph.trellis_distances(self.chunk_index))
        row = Row("warm distance cache (all pairs cached)", 0, seconds, seconds, False, None)
        self.runs.append((row, torch.ones_like(self.pair_sources, dtype=torch.bool), self.flat_values(distances)))
        graph.clear_cache()
        return row

    def dense(self) -> Tuple[Optional[Row], float]:
        """The dense table: (gather row, build seconds), when N fits the budget."""
        graph = self.graph
        budget = 8 * graph.num_nodes ** 2
        if graph.num_nodes > self.args.dense_max_nodes:
            return None, 0.0
        _, build = timed(lambda: graph.precompute_dense(memory_budget=budget))
        distances, seconds = timed(lambda: graph.trellis_distances(self.chunk_index, use_cache=False))
        row = Row("dense table gather (after build)", 0, seconds, seconds, False, None)
        self.runs.append((row, torch.ones_like(self.pair_sources, dtype=torch.bool), self.flat_values(distances)))
        graph.drop_dense()
        return row, build


def report(size: int, bench: Bench, rows: List[Row], build_note: str, dense_build: float) -> None:
    predecessor = next((r for r in rows if r.name.startswith("scipy full")), None)
    standalone = next((r for r in rows if r.name.startswith("standalone")), None)
    print(f"\nN = {size:,} nodes, {bench.graph.edge_count:,} arcs ({build_note}); batch "
          f"{tuple(bench.chunk_index.shape)} = {bench.slots:,} transition slots, "
          f"{bench.pair_sources.numel():,} distinct pairs, {bench.distinct_sources.numel():,} distinct sources")
    header = f"{'engine':<48} {'sources':>8} {'measured s':>11} {'batch s':>10} {'pairs/s':>11} {'x pred.':>8} {'x standalone':>13} {'identical':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        mark = "*" if row.sampled else " "
        rate = bench.slots / row.batch_seconds if row.batch_seconds > 0 else math.inf
        vs_pred = predecessor.batch_seconds / row.batch_seconds if predecessor else math.nan
        vs_alone = standalone.batch_seconds / row.batch_seconds if standalone else math.nan
        same = "n/a" if row.identical is None else ("yes" if row.identical else "NO")
        print(f"{row.name:<48} {row.sources:>8} {row.seconds:>11.2f} {row.batch_seconds:>9.2f}{mark} "
              f"{rate:>11.3g} {vs_pred:>8.2f} {vs_alone:>13.1f} {same:>9}")
    if dense_build:
        print(f"dense table build: {dense_build:.1f} s once ({8 * bench.graph.num_nodes ** 2 / 2**30:.2f} GiB)")
    print("* extrapolated from a random sample of distinct sources (linear in sources); "
          "pairs/s counts transition slots (B*(T-1)*M*M) per batch second")


def compiled_threads() -> int:
    """numba's thread count (0 when numba is not installed)."""
    try:
        import numba
    except ImportError:
        return 0
    return numba.get_num_threads()


def set_compiled_threads(count: int) -> None:
    if count:
        import numba

        numba.set_num_threads(count)


def cached_graph(
    size: int, embeddings: torch.Tensor, args: argparse.Namespace
) -> Tuple[TensorCorpusGraph, str]:
    """The kNN graph, read from / saved to ``--graph-cache`` when given."""
    key = f"knn_{size}_{args.dim}_{args.spread}_{args.neighbors}_{args.maximum_distance}_{args.seed}_{args.knn}.pt"
    path = os.path.join(args.graph_cache, key) if args.graph_cache else None
    if path and os.path.exists(path):
        edge_index, edge_weight, ids, builder = torch.load(path)
        graph = TensorCorpusGraph.from_edge_index(
            edge_index, edge_weight, chunk_ids=ids, maximum_distance=args.maximum_distance
        )
        return graph, f"{builder}, cached"
    start = time.perf_counter()
    graph, builder = build_graph(embeddings, args.neighbors, args.maximum_distance, args.knn)
    builder = f"{builder} in {time.perf_counter() - start:.1f} s"
    if path:
        os.makedirs(args.graph_cache, exist_ok=True)
        torch.save((*graph.to_edge_index(), list(graph.nodes), builder), path)
    return graph, builder


def run_size(size: int, args: argparse.Namespace) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    embeddings = clustered_embeddings(size, args.dim, args.spread, generator)
    graph, build_note = cached_graph(size, embeddings, args)
    chunk_index = topic_walk_trellis(
        graph, embeddings, args.batch, args.turns, args.candidates, args.jump, args.noise, generator
    )
    bench = Bench(graph, chunk_index, args)
    rows: List[Row] = []
    threads = compiled_threads()
    for name, engine, target_aware, key in [
        ("scipy full = predecessor's kNN engine", "scipy", False, "scipy-full"),
        (f"compiled + guided (CPU auto), {threads} threads", "compiled", True, "compiled"),
        ("compiled + guided, 1 thread", "compiled", True, "compiled-1"),
        ("hybrid target-aware (CPU auto without numba)", "hybrid", True, "hybrid"),
        ("scipy target-aware (widening limit)", "scipy", True, "scipy"),
        ("torch target-aware (caps)", "torch", True, "torch"),
        ("torch full bounded rows", "torch", False, "torch-full"),
    ]:
        if args.engines and key not in args.engines:
            continue
        if engine == "compiled" and not threads:
            continue  # numba is not installed
        if key == "compiled-1":
            set_compiled_threads(1)
        try:
            rows.append(bench.engine(name, engine, target_aware))
        finally:
            set_compiled_threads(threads)
        print(f"  {rows[-1]}", flush=True)
    rows.append(bench.standalone())
    warm = bench.warm_cache()
    if warm is not None:
        rows.append(warm)
    dense_row, dense_build = bench.dense()
    if dense_row is not None:
        rows.append(dense_row)
    bench.verify()
    report(size, bench, rows, build_note, dense_build)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20000, 200000])
    parser.add_argument("--quick", action="store_true", help="a smoke run: N=2000, B=64, T=6, M=8")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--candidates", type=int, default=32)
    parser.add_argument("--neighbors", type=int, default=10)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--spread", type=float, default=1.0, help="cluster noise (1.0: one giant component)")
    parser.add_argument("--noise", type=float, default=0.05, help="query noise around the topic")
    parser.add_argument("--jump", type=float, default=0.1, help="per-turn topic jump probability")
    parser.add_argument("--maximum-distance", type=float, default=10.0)
    parser.add_argument("--knn", choices=["auto", "library", "own"], default="auto")
    parser.add_argument("--engines", nargs="*", default=None,
                        help="subset of: compiled compiled-1 hybrid scipy scipy-full torch torch-full (default all)")
    parser.add_argument("--max-seconds", type=float, default=150.0, help="sample an engine above this estimate")
    parser.add_argument("--pilot", type=int, default=256, help="sources in the pilot run of each engine")
    parser.add_argument("--standalone-sources", type=int, default=20)
    parser.add_argument("--dense-max-nodes", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--graph-cache", default=None, help="a folder to save and reuse the built kNN graphs")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.batch, args.turns, args.candidates = [2000], 64, 6, 8
        args.max_seconds, args.pilot, args.standalone_sources = 10.0, 16, 10
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; maximum_distance {args.maximum_distance}, jump {args.jump}")
    for size in args.sizes:
        run_size(size, args)


if __name__ == "__main__":
    main()
