"""The compiled engine: target-aware bounded Dijkstra for many sources, in numba (CPU).

One call answers every pair of a batch. Sources are split into one block per thread
(``numba.prange``); each thread owns its workspace (a distance array, settle stamps,
target stamps and a binary heap), so a source costs only what its search touches:
no O(N) initialisation per source (stamps and a touched list reset it), no Python per
source, and the search stops as soon as every target of the source is settled, or the
heap holds nothing within the bound. Pairs whose ends lie in different weakly
connected components (labelled once per graph) are answered ``inf`` without a search:
one would have to exhaust the source's whole bounded ball to prove them unreachable.

Values: ``dist[v] = min(dist[v], dist[u] + w)`` in float64, popping the smallest
tentative distance first (lazy deletion). Float addition is monotone and the arc
distances positive, so a node's value when it is settled is the minimum over paths of
the left-fold ``((w1 + w2) + w3) + ...`` within the bound: bit for bit what the
standalone graph and scipy compute (the tests check ``==``). numba compiles without
``fastmath``, so no reassociation or FMA contraction changes a sum.

numba is optional (the ``numba`` extra): :func:`available` says whether it imports;
the first call compiles the kernel (a few seconds, cached on disk afterwards).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ...kernels import numba_runtime
from .._csr import CSRAdjacency
from .._memory import rows_per_chunk
from .base import GroupedPairs, SearchOptions

__all__ = [
    "available", "CompiledEngine", "COMPILED_ENGINE", "compiled_balls", "compiled_lookup", "compiled_lookup_grid",
    "compiled_table_grid",
]


def available() -> bool:
    """Whether numba imports (the ``"compiled"`` engine can run)."""
    return numba_runtime.available()


class _Kernels:
    """The numba kernels, each called through :func:`~mapmatched_torch.kernels.numba_runtime.call`
    (one lock for every numba kernel of the package, torch's thread count kept); the
    last argument, ``blocks``, is the thread count (1: the serial variant)."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def pairs(self, *args: Any) -> None:
        self._call(self._module.pairs, self._module.pairs_serial, args)

    def balls(self, *args: Any) -> None:
        self._call(self._module.balls, self._module.balls_serial, args)

    def lookup(self, *args: Any) -> None:
        self._call(self._module.lookup, self._module.lookup_serial, args)

    def lookup_grid(self, *args: Any) -> None:
        self._call(self._module.lookup_grid, self._module.lookup_grid_serial, args)

    def table_grid(self, *args: Any) -> None:
        self._call(self._module.table_grid, self._module.table_grid_serial, args)

    @staticmethod
    def _call(parallel: Any, serial: Any, args: tuple) -> None:
        numba_runtime.call(parallel, serial, args[:-1], args[-1])


_blocks = numba_runtime.blocks_for


def _kernels() -> _Kernels:
    """The numba kernels (compiled on first use; numba's disk cache keeps them)."""
    from . import compiled_kernels as _compiled_kernels

    return _Kernels(_compiled_kernels)


def _csr_arrays(adjacency: CSRAdjacency, reverse: bool = False) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, indices, weights)`` numpy arrays of the arcs (reversed: of the transpose),
    made once per adjacency."""
    key = "compiled_reverse" if reverse else "compiled"
    if key not in adjacency.derived:
        adjacency.derived[key] = _make_csr_arrays(adjacency, reverse)
    return adjacency.derived[key]


def _make_csr_arrays(adjacency: CSRAdjacency, reverse: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    matrix = adjacency.scipy_matrix()
    if reverse:
        matrix = matrix.T.tocsr()
        matrix.sort_indices()
    return (
        np.ascontiguousarray(matrix.indptr, dtype=np.int64),
        np.ascontiguousarray(matrix.indices, dtype=np.int64),
        np.ascontiguousarray(matrix.data, dtype=np.float64),
    )


def _heuristic_scale(adjacency: CSRAdjacency, bound: float) -> Optional[float]:
    """``1 - alpha``: the factor that makes a backward-distance heuristic strictly consistent.

    A* with ``key = g + (1 - alpha) h`` settles every node with its exact left-fold
    distance when each arc raises the key by more than the rounding of the sums
    involved (a few ulps of ``bound``): ``alpha * w_min`` must exceed them, with room.
    None when the smallest arc is too small for any useful ``alpha`` (guidance off).
    """
    if not adjacency.edge_count:
        return None
    smallest = float(adjacency.weights.min())
    alpha = max(1e-12, 64.0 * math.ulp(max(bound, 1.0)) / smallest)
    return 1.0 - alpha if alpha <= 0.5 else None


def _ptr(sorted_keys: np.ndarray, count: int) -> np.ndarray:
    """``(count + 1,)`` int64 offsets of the runs of 0..count-1 in ``sorted_keys``."""
    return np.searchsorted(sorted_keys, np.arange(count + 1)).astype(np.int64)


class CompiledEngine:
    """The ``"compiled"`` engine (:class:`~.base.DistanceEngine`): target-aware Dijkstra
    and guided A* in numba on the CPU threads (needs the ``[numba]`` extra)."""

    name = "compiled"

    def rows(self, adjacency: CSRAdjacency, sources: torch.Tensor, options: SearchOptions) -> torch.Tensor:
        """``(S, N)`` bounded rows (see :meth:`.base.DistanceEngine.rows`) from complete
        ball searches on every thread (e.g. a dense table's N rows)."""
        rows = np.full((sources.numel(), adjacency.num_nodes), np.inf)
        for first, ball_nodes, ball_values, ball_count, _ in _ball_chunks(
            adjacency, sources.cpu().numpy().astype(np.int64, copy=False), options.bound, options.memory_budget
        ):
            for row, count in enumerate(ball_count.tolist()):
                rows[first + row, ball_nodes[row, :count]] = ball_values[row, :count]
        return torch.from_numpy(rows).to(adjacency.device)

    def pairs(self, adjacency: CSRAdjacency, pairs: GroupedPairs, options: SearchOptions) -> torch.Tensor:
        """``(P,)`` distances of grouped pairs (see :meth:`.base.DistanceEngine.pairs`).

        Always target-aware. With ``pairs.pair_group``, the pairs a source's first
        search does not settle within ``options.settle_limit`` nodes (default
        ``max(64, N // 64)``) are answered by A* searches guided by a backward ball of
        ``options.ball_limit`` nodes (default ``max(256, N // 8)``) around each group's
        targets, ``memory_budget // (16 ball_limit)`` groups per round; without groups
        each source gets one complete search. ``options.threads``: parallel blocks
        (default numba's thread count). The same values either way.
        """
        bound = options.bound
        kernels = _kernels()
        arrays = _csr_arrays(adjacency)
        nodes = adjacency.num_nodes
        sources = pairs.row_sources.cpu().numpy().astype(np.int64, copy=False)
        rows = pairs.pair_row.cpu().numpy().astype(np.int64, copy=False)
        targets = pairs.pair_target.cpu().numpy().astype(np.int64, copy=False)
        out = np.full(targets.size, np.inf)
        # Pairs in different weakly connected components are unreachable: answered here,
        # never searched (a search for one would exhaust its source's whole bounded ball).
        labels = _component_labels(adjacency)
        # shape: (P',) the pairs that need a search
        searched = np.flatnonzero(labels[sources[rows]] == labels[targets])
        if searched.size:
            rows, targets = rows[searched], targets[searched]
            values = np.empty(searched.size, dtype=np.float64)
            found = np.zeros(searched.size, dtype=np.bool_)
            scale = _heuristic_scale(adjacency, bound)
            guided = pairs.pair_group is not None and scale is not None
            settle_limit = options.settle_limit
            limit = (max(64, nodes // 64) if settle_limit is None else settle_limit) if guided else 0
            no_groups = (np.zeros(sources.size + 1, dtype=np.int64), np.empty(0, np.int64))
            _run_units(kernels, arrays, sources, _ptr(rows, sources.size), targets, no_groups, _NO_BALLS,
                       1.0, bound, limit, values, found, options.threads)
            if guided and not found.all():
                ball_limit = max(256, nodes // 8) if options.ball_limit is None else options.ball_limit
                _guided_pass(kernels, arrays, adjacency, sources[rows], targets,
                             pairs.pair_group.cpu().numpy()[searched], bound, scale, min(ball_limit, nodes),
                             options.memory_budget, options.threads, values, found)
            out[searched] = values
        return torch.from_numpy(out).to(adjacency.device)


#: The engine object :mod:`~mapmatched_torch.graph.shortest_paths` dispatches to.
COMPILED_ENGINE = CompiledEngine()


def _component_labels(adjacency: CSRAdjacency) -> np.ndarray:
    """``(N,)`` int32 weakly connected component of every node, computed once per adjacency."""
    if "components" not in adjacency.derived:
        from scipy.sparse.csgraph import connected_components

        _, labels = connected_components(adjacency.scipy_matrix(), directed=True, connection="weak")
        adjacency.derived["components"] = labels
    return adjacency.derived["components"]


#: (ball_start, ball_end, ball_nodes, ball_values, ball_radius) of no balls (unguided units).
_NO_BALLS = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64),
             np.empty(0, np.float64))


def _run_units(kernels, arrays, unit_source, unit_ptr, targets, unit_groups, balls, scale, bound, limit,
               out, found, threads) -> None:
    """Run :func:`.compiled_kernels.pairs` over the units on at most ``threads``
    threads; ``unit_groups`` is ``(unit_group_ptr, groups)`` (all-zero offsets for
    unguided units)."""
    unit_group_ptr, unit_groups = unit_groups
    kernels.pairs(*arrays, unit_source, unit_ptr, targets, unit_group_ptr, unit_groups, *balls, scale, float(bound),
                  limit, out, found, _blocks(threads, unit_source.size))


def _guided_pass(kernels, arrays, adjacency, pair_source, targets, pair_group, bound, scale, ball_limit,
                 memory_budget, threads, out, found) -> None:
    """Answer the pairs not ``found`` yet: per group, a backward ball from its pending
    targets; per source, one A* search guided by the balls of its pending groups."""
    nodes = adjacency.num_nodes
    reverse = _csr_arrays(adjacency, reverse=True)
    # A ball sums from the targets' end, the answer from the source's: a path within the
    # bound can sum to a little more backwards (by at most (bound / w_min) ulps of the
    # bound, far below alpha * bound). A complete ball must still hold every node of
    # such a path, or its missing nodes (h = inf) would be pruned: search it wider.
    ball_bound = float(bound) * (1.0 + 2.0 * (1.0 - scale))
    # shape: (R,) the pending pairs; their groups renumbered 0..G-1
    pending = np.flatnonzero(~found)
    groups, group_of = np.unique(pair_group[pending], return_inverse=True)
    per_round = rows_per_chunk(ball_limit, groups.size, memory_budget, bytes_per_entry=16)
    for first in range(0, groups.size, per_round):
        last = min(first + per_round, groups.size)
        in_round = (group_of >= first) & (group_of < last)
        chunk, chunk_group = pending[in_round], group_of[in_round] - first
        count = last - first
        # the balls, from each group's distinct pending targets
        target_keys = np.unique(chunk_group * nodes + targets[chunk])
        ball_nodes = np.empty((count, ball_limit), dtype=np.int64)
        ball_values = np.empty((count, ball_limit), dtype=np.float64)
        ball_count = np.empty(count, dtype=np.int64)
        ball_radius = np.empty(count, dtype=np.float64)
        kernels.balls(*reverse, _ptr(target_keys // nodes, count), target_keys % nodes, ball_bound, ball_limit,
                      ball_nodes, ball_values, ball_count, ball_radius, _blocks(threads, count))
        # flat views: group g's entries are [g * ball_limit, g * ball_limit + ball_count[g])
        ball_start = np.arange(count, dtype=np.int64) * ball_limit
        # one unit per source: its pending pairs of this round, ordered by source
        order = np.argsort(pair_source[chunk], kind="stable")
        chunk, chunk_group = chunk[order], chunk_group[order]
        sources_of = pair_source[chunk]
        starts = np.flatnonzero(np.r_[True, sources_of[1:] != sources_of[:-1]])
        unit_ptr = np.r_[starts, chunk.size].astype(np.int64)
        # each unit's distinct groups
        unit_of = np.repeat(np.arange(starts.size), np.diff(unit_ptr))
        unit_group_keys = np.unique(unit_of * count + chunk_group)
        unit_group_ptr = _ptr(unit_group_keys // count, starts.size)
        values = np.empty(chunk.size, dtype=np.float64)
        done = np.zeros(chunk.size, dtype=np.bool_)
        _run_units(kernels, arrays, sources_of[starts].astype(np.int64), unit_ptr, targets[chunk],
                   (unit_group_ptr, (unit_group_keys % count).astype(np.int64)),
                   (ball_start, ball_start + ball_count, ball_nodes.reshape(-1), ball_values.reshape(-1), ball_radius),
                   scale, bound, 0, values, done, threads)
        out[chunk] = values
        found[chunk] = done


#: The nodes a ball search keeps per centre at first (:func:`compiled_balls`): a centre
#: whose ball is larger is searched again with room for all N. Rows as wide as N cost a
#: page fault per row and page written (measured: 542 balls of about 50 nodes in a 20k
#: graph took 30 ms on two threads with (542, N) rows, 6 ms with 1024-wide ones).
BALL_FIRST_WIDTH = 1024


def _ball_chunks(
    adjacency: CSRAdjacency, centres: np.ndarray, limit: float, memory_budget: Optional[int],
    width: Optional[int] = None,
) -> Iterator[Tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Bounded balls of the centres, a round at a time: ``(first, nodes, values, counts,
    radii)`` with row ``r`` holding centre ``first + r``'s ``counts[r]`` nodes in
    settle order (nondecreasing distance).

    ``width`` None: complete balls (rows of N; ``radii`` all inf). Else at most
    ``width`` nodes per centre: a search stops once it settled that many, and its
    ``radii[r]`` is then the distance it reached (< inf: the ball may be incomplete);
    inf means the ball is complete."""
    kernels = _kernels()
    arrays = _csr_arrays(adjacency)
    nodes = adjacency.num_nodes
    kept = nodes if width is None else max(1, min(int(width), nodes))
    settle_limit = 0 if kept >= nodes else kept
    per_round = rows_per_chunk(kept, max(centres.size, 1), memory_budget, bytes_per_entry=16)
    for first in range(0, centres.size, per_round):
        chunk = centres[first:first + per_round]
        ball_nodes = np.empty((chunk.size, kept), dtype=np.int64)
        ball_values = np.empty((chunk.size, kept), dtype=np.float64)
        ball_count = np.empty(chunk.size, dtype=np.int64)
        ball_radius = np.empty(chunk.size, dtype=np.float64)
        kernels.balls(*arrays, np.arange(chunk.size + 1, dtype=np.int64), chunk, float(limit), settle_limit,
                      ball_nodes, ball_values, ball_count, ball_radius, _blocks(None, chunk.size))
        yield first, ball_nodes, ball_values, ball_count, ball_radius


def compiled_balls(
    adjacency: CSRAdjacency, centres: torch.Tensor, limit: float, memory_budget: Optional[int] = None
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The bounded ball of each centre: every node within ``limit``, by one search each.

    Args:
        adjacency: the graph.
        centres: ``(C,)`` int64 node indices.
        limit: the search bound (a node exactly at it counts).
        memory_budget: bytes of ball storage per round.

    Returns:
        ``(counts, nodes, distances)``: ``(C,)`` int64 ball sizes, and the balls one
        after another, ``(sum counts,)`` int64 nodes and float64 distances (centre
        ``c``'s ball first, the centre included at 0.0, in nondecreasing distance).
        Cost O(ball) per centre, not O(N): balls are searched with room for
        :data:`BALL_FIRST_WIDTH` nodes, and only larger ones again in full.
    """
    sources = centres.cpu().numpy().astype(np.int64, copy=False)
    counts = np.zeros(sources.size, dtype=np.int64)
    parts: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (centre positions, nodes, distances) per round

    def collect(positions: np.ndarray, ball_nodes, ball_values, ball_count, keep: np.ndarray) -> None:
        rows, lengths = np.flatnonzero(keep), ball_count[keep]
        counts[positions[rows]] = lengths
        # shape: (sum lengths,) flat places of the kept rows' entries, row after row
        starts = np.cumsum(lengths) - lengths
        places = np.repeat(rows * ball_nodes.shape[1] - starts, lengths) + np.arange(int(lengths.sum()))
        parts.append((np.repeat(positions[rows], lengths), ball_nodes.reshape(-1)[places], ball_values.reshape(-1)[places]))

    incomplete = []
    for first, ball_nodes, ball_values, ball_count, ball_radius in _ball_chunks(
        adjacency, sources, limit, memory_budget, width=BALL_FIRST_WIDTH
    ):
        positions = np.arange(first, first + ball_count.size)
        complete = np.isinf(ball_radius)
        collect(positions, ball_nodes, ball_values, ball_count, complete)
        incomplete.append(positions[~complete])
    again = np.concatenate(incomplete) if incomplete else np.empty(0, dtype=np.int64)
    if again.size:
        for first, ball_nodes, ball_values, ball_count, _ in _ball_chunks(adjacency, sources[again], limit, memory_budget):
            positions = again[first:first + ball_count.size]
            collect(positions, ball_nodes, ball_values, ball_count, np.ones(ball_count.size, dtype=bool))
    if not parts:
        return counts, np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
    owner = np.concatenate([part[0] for part in parts])
    order = np.argsort(owner, kind="stable")  # centre by centre, each ball in settle order
    return counts, np.concatenate([part[1] for part in parts])[order], np.concatenate([part[2] for part in parts])[order]


#: Below this many queries a cache lookup runs on the calling thread.
LOOKUP_SERIAL_BELOW = 1 << 16


def compiled_lookup(
    keys: torch.Tensor, values: torch.Tensor, row_start: torch.Tensor, row_stop: torch.Tensor, sources: torch.Tensor,
    targets: torch.Tensor, nodes: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A :class:`~.cache.DistanceCache` lookup on the CPU: per query, a binary search
    within its source's run of the keys.

    Args:
        keys: ``(K,)`` int64 ``source * nodes + target``, sorted within each source's
            run; ``values``: ``(K,)``.
        row_start, row_stop: ``(nodes,)`` int64, each source's run ``keys[row_start[s]:row_stop[s]]``.
        sources, targets: ``(Q,)`` int64 node indices.

    Returns:
        ``(values, found)``: ``(Q,)`` float64 (``inf`` where not found) and bool.
    """
    out = np.empty(sources.numel(), dtype=np.float64)
    found = np.empty(sources.numel(), dtype=np.bool_)
    blocks = 1 if sources.numel() < LOOKUP_SERIAL_BELOW else _blocks(None, sources.numel())
    _kernels().lookup(keys.numpy(), values.numpy(), row_start.numpy(), row_stop.numpy(), sources.numpy(),
                      targets.numpy(), int(nodes), out, found, blocks)
    return torch.from_numpy(out), torch.from_numpy(found)


def compiled_lookup_grid(
    keys: torch.Tensor, values: torch.Tensor, row_start: torch.Tensor, row_stop: torch.Tensor, complete: torch.Tensor,
    filled: torch.Tensor,
    table: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, nodes: int, bound: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A :class:`~.cache.DistanceCache` lookup of every pair of index codes
    ``(sources[g, j], targets[g, i])``, with SPEC's distances of codes filled in.

    Args:
        keys, values, row_start, row_stop: as for :func:`compiled_lookup`.
        complete: ``(nodes,)`` bool, rows cached whole (a target absent is beyond the bound).
        filled: ``(nodes,)`` bool, the sources whose dense row ``table[source]`` is
            filled (``table``: ``(nodes, nodes)`` float64, ``inf`` beyond the bound;
            ``(0, 0)`` when none is).
        sources: ``(G, M)`` int64 index codes; ``targets``: ``(G, M')``.
        bound: the maximum distance.

    Returns:
        ``(values, answered, row_needed, row_hit)``: ``(G, M, M')`` float64 distances
        (``inf`` where not answered) and bool; ``(G, M)`` bool, whether row ``j`` of
        group ``g`` has a node pair (one that needs the cache), and whether all of
        them were answered.
    """
    groups, width, columns = sources.shape[0], sources.shape[1], targets.shape[1]
    out = np.empty((groups, width, columns), dtype=np.float64)
    answered = np.empty((groups, width, columns), dtype=np.bool_)
    row_needed = np.empty((groups, width), dtype=np.bool_)
    row_hit = np.empty((groups, width), dtype=np.bool_)
    blocks = 1 if out.size < LOOKUP_SERIAL_BELOW else _blocks(None, groups)
    _kernels().lookup_grid(keys.numpy(), values.numpy(), row_start.numpy(), row_stop.numpy(), complete.numpy(),
                           filled.numpy(), table.numpy(), sources.numpy(), targets.numpy(), int(nodes), float(bound),
                           out, answered, row_needed, row_hit, blocks)
    return torch.from_numpy(out), torch.from_numpy(answered), torch.from_numpy(row_needed), torch.from_numpy(row_hit)


def compiled_table_grid(table: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, bound: float) -> torch.Tensor:
    """:func:`~mapmatched_torch.graph.shortest_paths.table_distances` of every pair
    ``(sources[g, j], targets[g, i])`` in one compiled pass (no index or mask temporaries).

    Args:
        table: ``(N, N)`` float64 CPU dense table (``inf``: beyond the bound).
        sources: ``(G, M)`` int64 index codes; ``targets``: ``(G, M')`` (validated by the caller).
        bound: the maximum distance.

    Returns:
        ``(G, M, M')`` float64, equal to ``table_distances`` bit for bit.
    """
    out = np.empty((sources.shape[0], sources.shape[1], targets.shape[1]), dtype=np.float64)
    blocks = 1 if out.size < LOOKUP_SERIAL_BELOW else _blocks(None, sources.shape[0])
    _kernels().table_grid(table.numpy(), sources.contiguous().numpy(), targets.contiguous().numpy(), float(bound), out,
                          blocks)
    return torch.from_numpy(out)
