"""The torch engine: batched bounded frontier relaxation over a CSR graph.

Distances from a chunk of S sources live in one flat float64 buffer of ``S * N``
entries (entry ``s * N + v`` = the current distance from source ``s`` to node ``v``).
The frontier is a list of such flat keys: the entries whose distance decreased and
whose out-arcs have not been relaxed with that value yet. Each round relaxes every
out-arc ``(u, v, w)`` of every frontier entry: the candidate ``dist[u] + w`` (float64,
the standalone's left fold) is kept when it is ``<= bound`` and below the current
``dist[v]`` (and below the source's cap, see below), and merged with
``scatter_reduce(reduce="amin")``. The search ends when the frontier is empty; then
every entry holds the exact minimum over paths within the bound (Bellman-Ford: float
addition is monotone and the distances positive).

Target caps: with targets, each source's cap is the largest current distance among
its targets (``inf`` while one is unreached). A candidate ``>= cap`` and a frontier
entry ``>= cap`` are dropped: a path through them is at least that long and cannot
shorten any target. Every target is still exact when the frontier empties, and so is
every entry below the final cap.

Work is proportional to the arcs relaxed, not to ``S * N``: a buffer is allocated
once per call and only the touched entries are reset (:meth:`FrontierWorkspace.reset`).
Deduplication uses a scatter of positions into an int32 buffer (no sort).
"""

from __future__ import annotations

import math
from typing import Iterator, List, Optional, Tuple

import torch

from .._csr import CSRAdjacency
from .._memory import budget, rows_per_chunk
from .base import GroupedPairs, SearchOptions

__all__ = [
    "FrontierWorkspace", "frontier_search", "FrontierEngine", "FRONTIER_ENGINE", "frontier_pairs", "BYTES_PER_ENTRY",
]

#: Bytes of workspace per (source, node) entry: float64 distance + int32 slot.
BYTES_PER_ENTRY = 12
#: Bytes of temporaries per relaxed arc (sizes the arc batches).
_BYTES_PER_ARC = 64
#: The smallest arc batch (tests lower it to exercise the splitting).
_MIN_ARC_BATCH = 1 << 16


class FrontierWorkspace:
    """Flat buffers for up to ``rows`` sources of an N-node graph, reused across chunks.

    Attributes:
        dist: ``(rows * N,)`` float64, ``inf`` except where a search wrote.
        slot: ``(rows * N,)`` int32 scratch for deduplication (never needs resetting).
    """

    __slots__ = ("num_nodes", "rows", "dist", "slot")

    def __init__(self, num_nodes: int, rows: int, device: torch.device) -> None:
        self.num_nodes = num_nodes
        self.rows = rows
        self.dist = torch.full((rows * num_nodes,), torch.inf, dtype=torch.float64, device=device)
        self.slot = torch.empty(rows * num_nodes, dtype=torch.int32, device=device)

    def reset(self, touched: torch.Tensor) -> None:
        """Set the given flat keys back to ``inf`` (the buffer is then clean again)."""
        self.dist.index_fill_(0, touched, torch.inf)


def frontier_search(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    bound: float,
    workspace: FrontierWorkspace,
    *,
    targets: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    memory_budget: int,
    work_limit: Optional[int] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the bounded relaxation from S sources into ``workspace.dist``.

    Args:
        adjacency: the graph (N nodes).
        sources: ``(S,)`` int64 node indices, ``S <= workspace.rows``; source ``s``
            owns the flat keys ``s * N .. s * N + N - 1``.
        bound: candidates ``<= bound`` are kept (``inf`` allowed).
        workspace: a clean workspace (all ``inf``).
        targets: ``(pair_keys, pair_row)``, both ``(P,)`` int64: flat keys of the
            wanted entries and their source row, to stop each source early; None
            for full bounded rows.
        memory_budget: bytes for the per-round temporaries (sizes arc batches).
        work_limit: if given, a source is abandoned once it has expanded more than
            this many frontier entries; its distances are then NOT exact.

    Returns:
        ``(touched, abandoned)``: ``(K,)`` int64 flat keys of every entry written, for
        :meth:`FrontierWorkspace.reset`, and a ``(S,)`` bool mask of the abandoned
        sources (None without ``work_limit``).

    Cost: O(arcs relaxed) time per round, plus one round per hop of the longest
    improving path.
    """
    nodes = adjacency.num_nodes
    dist = workspace.dist
    # shape: (S,) the sources' flat keys: the first frontier
    frontier = torch.arange(sources.numel(), device=sources.device) * nodes + sources
    dist.index_fill_(0, frontier, 0.0)
    touched: List[torch.Tensor] = [frontier]
    # candidates must be < this per source: nextafter(bound) makes "<= bound" strict
    ceiling = math.nextafter(bound, math.inf)
    # shape: (S,)
    threshold = torch.full(sources.shape, ceiling, dtype=torch.float64, device=sources.device)
    arc_budget = max(_MIN_ARC_BATCH, memory_budget // _BYTES_PER_ARC)
    abandoned = None if work_limit is None else torch.zeros(sources.shape, dtype=torch.bool, device=sources.device)
    work = torch.zeros(sources.shape, dtype=torch.long, device=sources.device)
    while frontier.numel():
        if targets is not None:
            threshold = _target_caps(dist, targets, sources.numel()).clamp_(max=ceiling)
            # a frontier entry at or past its source's cap can shorten no target
            frontier = frontier[dist.index_select(0, frontier) < threshold.index_select(0, frontier // nodes)]
        if abandoned is not None:
            work += torch.bincount(frontier // nodes, minlength=sources.numel())
            abandoned |= work > work_limit
            frontier = frontier[~abandoned.index_select(0, frontier // nodes)]
        pieces = _arc_batches(adjacency, frontier, arc_budget)
        improved = [_relax(adjacency, dist, piece, threshold) for piece in pieces]
        frontier = _distinct(torch.cat(improved), workspace.slot) if improved else frontier[:0]
        touched.append(frontier)
    return torch.cat(touched), abandoned


def _target_caps(dist: torch.Tensor, targets: Tuple[torch.Tensor, torch.Tensor], count: int) -> torch.Tensor:
    """``(S,)`` the largest current distance among each source's targets (``inf`` if one is unreached)."""
    pair_keys, pair_row = targets
    cap = torch.full((count,), -torch.inf, dtype=torch.float64, device=dist.device)
    return cap.scatter_reduce_(0, pair_row, dist.index_select(0, pair_keys), reduce="amax")


def _arc_batches(adjacency: CSRAdjacency, frontier: torch.Tensor, arc_budget: int) -> Iterator[torch.Tensor]:
    """Consecutive pieces of the frontier with at most ``arc_budget`` out-arcs each
    (a single entry with more arcs is a piece of its own)."""
    if not frontier.numel():
        return
    node = torch.remainder(frontier, adjacency.num_nodes)
    # shape: (F,) arcs leaving the frontier up to each entry
    reach = torch.cumsum(adjacency.indptr.index_select(0, node + 1) - adjacency.indptr.index_select(0, node), 0)
    total = int(reach[-1])
    if total <= arc_budget:
        yield frontier
        return
    cuts = torch.searchsorted(reach, torch.arange(arc_budget, total, arc_budget, device=reach.device), right=True)
    bounds = [0] + sorted(set(cuts.tolist()) - {0}) + [frontier.numel()]
    for first, last in zip(bounds[:-1], bounds[1:]):
        if last > first:
            yield frontier[first:last]


def _relax(
    adjacency: CSRAdjacency, dist: torch.Tensor, frontier: torch.Tensor, threshold: torch.Tensor
) -> torch.Tensor:
    """Relax every out-arc of the frontier entries; returns the keys that decreased (with repeats).

    A candidate is kept when it is below both the target entry's current distance
    and its source's ``threshold`` (the bound made strict, or the target cap).
    """
    nodes = adjacency.num_nodes
    # shape: (F,) per frontier entry: source row base key, node, first arc, arc count
    row = torch.div(frontier, nodes, rounding_mode="floor")
    row_base = row * nodes
    node = frontier - row_base
    start = adjacency.indptr.index_select(0, node)
    degree = adjacency.indptr.index_select(0, node + 1) - start
    arc_shift = start - (torch.cumsum(degree, 0) - degree)
    # shape: (A,) one entry per arc leaving the frontier
    owner = torch.repeat_interleave(degree)
    arc = torch.arange(owner.numel(), device=owner.device) + arc_shift.index_select(0, owner)
    candidate = dist.index_select(0, frontier).index_select(0, owner) + adjacency.weights.index_select(0, arc)
    keys = row_base.index_select(0, owner) + adjacency.indices.index_select(0, arc)
    limit = torch.minimum(dist.index_select(0, keys), threshold.index_select(0, row).index_select(0, owner))
    accept = candidate < limit
    # shape: (A',) accepted candidates
    keys, candidate = keys[accept], candidate[accept]
    dist.scatter_reduce_(0, keys, candidate, reduce="amin")
    return keys


def _distinct(keys: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The distinct values of ``keys`` (any order) via a scatter of positions: no sort."""
    # shape: (A',)
    position = torch.arange(keys.numel(), dtype=torch.int32, device=keys.device)
    slot.index_put_((keys,), position)
    return keys[slot.index_select(0, keys) == position]


# ---------------------------------------------------------------------- chunk drivers


def _workspaces(
    adjacency: CSRAdjacency, count: int, memory_budget: Optional[int]
) -> Iterator[Tuple[int, int, FrontierWorkspace]]:
    """Chunks ``[first, last)`` of ``count`` sources sharing one clean workspace.

    Whoever uses the workspace must reset the entries it touched before the next chunk.
    """
    if not count:
        return
    rows = rows_per_chunk(adjacency.num_nodes, count, memory_budget, BYTES_PER_ENTRY)
    workspace = FrontierWorkspace(adjacency.num_nodes, rows, adjacency.device)
    for first in range(0, count, rows):
        yield first, min(count, first + rows), workspace


class FrontierEngine:
    """The ``"torch"`` engine (:class:`~.base.DistanceEngine`): batched frontier
    relaxation on the graph's device, chunks of sources sized by ``memory_budget``."""

    name = "torch"

    def rows(self, adjacency: CSRAdjacency, sources: torch.Tensor, options: SearchOptions) -> torch.Tensor:
        """``(S, N)`` bounded rows (see :meth:`.base.DistanceEngine.rows`)."""
        nodes = adjacency.num_nodes
        # shape: (S, N)
        rows = torch.empty((sources.numel(), nodes), dtype=torch.float64, device=adjacency.device)
        for first, last, workspace in _workspaces(adjacency, sources.numel(), options.memory_budget):
            touched, _ = frontier_search(
                adjacency, sources[first:last], options.bound, workspace, memory_budget=budget(options.memory_budget)
            )
            rows[first:last] = workspace.dist[: (last - first) * nodes].view(last - first, nodes)
            workspace.reset(touched)
        return rows

    def pairs(self, adjacency: CSRAdjacency, pairs: GroupedPairs, options: SearchOptions) -> torch.Tensor:
        """``(P,)`` distances of grouped pairs (see :meth:`.base.DistanceEngine.pairs`);
        target-aware when ``options.target_aware``."""
        return frontier_pairs(adjacency, pairs, options)[0]


def frontier_pairs(
    adjacency: CSRAdjacency, pairs: GroupedPairs, options: SearchOptions, *, abandon_after: Optional[int] = None
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(P,)`` distances of grouped pairs by frontier relaxation, chunk by chunk.

    Args:
        adjacency, pairs, options: as for :meth:`FrontierEngine.pairs`.
        abandon_after: if given, a source is abandoned once it has expanded more than
            this many frontier entries (the hybrid engine's hand-over to scipy).

    Returns:
        ``(values, abandoned)``: ``(P,)`` float64, and the ``(S,)`` bool mask of the
        abandoned sources (their values are not exact), None without ``abandon_after``.
    """
    row_sources, pair_row, pair_target = pairs.row_sources, pairs.pair_row, pairs.pair_target
    nodes = adjacency.num_nodes
    # shape: (P,)
    values = torch.empty(pair_row.shape, dtype=torch.float64, device=adjacency.device)
    # shape: (S,)
    abandoned = (
        None if abandon_after is None else torch.zeros(row_sources.shape, dtype=torch.bool, device=values.device)
    )
    for first, last, workspace in _workspaces(adjacency, row_sources.numel(), options.memory_budget):
        lo, hi = torch.searchsorted(pair_row, torch.tensor([first, last], device=pair_row.device)).tolist()
        # shape: (P_chunk,) flat workspace keys of this chunk's pairs
        local_row = pair_row[lo:hi] - first
        pair_keys = local_row * nodes + pair_target[lo:hi]
        touched, dropped = frontier_search(
            adjacency, row_sources[first:last], options.bound, workspace,
            targets=(pair_keys, local_row) if options.target_aware else None,
            memory_budget=budget(options.memory_budget), work_limit=abandon_after,
        )
        values[lo:hi] = workspace.dist.index_select(0, pair_keys)
        workspace.reset(touched)
        if abandoned is not None:
            abandoned[first:last] = dropped
    return values, abandoned


#: The engine object :mod:`~mapmatched_torch.graph.shortest_paths` dispatches to.
FRONTIER_ENGINE = FrontierEngine()
