"""Context neighbourhoods for a server: an LRU of chunk IDs, and a table of codes on the device.

A turn's context is the decoded chunk, the chunks of its neighbourhood (within the
context radius, by distance then chunk ID, as ``graph.neighborhood`` returns them) and
the turn's candidates, first occurrences kept. :class:`NeighborhoodCache` keeps the
neighbourhoods as chunk IDs (what lazily built results read); :class:`ContextTable`
keeps them as chunk codes in one ``(V, W)`` tensor on the server's device, filled the
first time a chunk is decoded, so a step's contexts are a gather and a de-duplication.
:meth:`ContextTable.precompute` fills rows ahead of the steps (a server's warm-up:
``MapMatchedServer.precompute_contexts``), so no step pays a first visit.

Bounds and eviction (docs/serving-guarantees.md, "What is bounded"):

- :class:`NeighborhoodCache`: at most ``capacity`` neighbourhoods (the server's
  ``neighborhood_cache``), the least recently used evicted first; nothing is kept for a
  graph that answers one neighbourhood at a time.
- :class:`ContextTable`: ``V x W`` int32, V at most twice the server's chunk codes (it
  grows by doubling to cover every code numbered) and W the widest neighbourhood read.
  The chunk codes are bounded (:mod:`.codes`); a compaction of them replaces the table
  with :meth:`ContextTable.renumbered` (a tensor graph's node rows carried over, every
  other row searched again when next needed), so rows of dropped codes go with them.

A tensor graph may carry a stored context table (a
:class:`~mapmatched_torch.graph.neighborhood_table.NeighborhoodTable`, e.g. from a graph
artifact): its rows are read, not searched, but only at a radius of the same limit
(``min(radius, maximum_distance)``). :func:`context_table_mismatch` says why a stored
table would go unread; a server over such a graph warns once
(:func:`warn_unread_context_table`, :class:`ContextTableWarning`).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

from ..core.progress import progress_bar, progress_wanted
from ..core.checks import check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.protocols import CorpusGraph, implements
from ..graph.protocols import NeighborhoodGraph, TensorGraph
from ..kernels.ragged import padded_rows
from .codes import ChunkCodes

__all__ = ["NeighborhoodCache", "ContextTable", "ContextTableWarning", "context_table_mismatch",
           "warn_unread_context_table"]


class ContextTableWarning(UserWarning):
    """A graph's stored context table is not read at the server's context radius (its
    context rows are searched instead): :func:`context_table_mismatch` says why."""


def context_table_mismatch(table_radius: float, table_limit: float, radius: float,
                           maximum_distance: float) -> Optional[str]:
    """Why a stored context table goes unread at ``radius``, or None when it is read.

    A table built at ``table_radius`` holds every neighbourhood within ``table_limit``
    (``min(table_radius, bound)`` of the graph it was built from); contexts at ``radius``
    over a graph bounded at ``maximum_distance`` reach ``min(radius, maximum_distance)``:
    the rows are read when the two limits are equal (radii above the bound included),
    searched otherwise.

    Returns:
        None, or a message naming both radii and limits and the fix (rebuild the table
        at ``radius``).
    """
    limit = min(float(radius), float(maximum_distance))
    if limit == table_limit:
        return None
    return (
        f"the graph's context table was built for radius {table_radius!r} (neighbourhoods within {table_limit!r}), "
        f"but the context radius is {float(radius)!r} (within {limit!r}): contexts at this radius cannot read it, "
        f"every context row is searched instead; rebuild it at radius {float(radius)!r} (graph.precompute_neighborhoods({float(radius)!r})"
        f" before save_graph, or mapmatched-torch graph build --context-radius {float(radius)!r})"
    )


def warn_unread_context_table(graph: Any, radius: float) -> Optional[str]:
    """Warn (:class:`ContextTableWarning`) when ``graph`` carries a context table
    (``graph.neighborhood_table``) that contexts at ``radius`` do not read; returns the
    message, or None (no table, or one that is read)."""
    table = getattr(graph, "neighborhood_table", None)
    if table is None:
        return None
    problem = context_table_mismatch(table.radius, table.limit, radius, graph.maximum_distance)
    if problem is not None:
        warnings.warn(problem, ContextTableWarning, stacklevel=3)
    return problem


class NeighborhoodCache:
    """An LRU of context neighbourhoods (chunk ID -> ``graph.neighborhood(chunk, radius)``,
    the chunk IDs by distance) for a graph that answers many at once (an immutable
    :class:`~mapmatched_torch.graph.NeighborhoodGraph`, e.g. a tensor graph); any other
    graph is asked one chunk at a time, every time."""

    def __init__(self, graph: CorpusGraph, radius: float, capacity: int = 65536) -> None:
        self.graph, self.radius, self.capacity = graph, radius, capacity
        self._batched = graph.neighborhoods if implements(graph, NeighborhoodGraph) else None
        #: whether the graph answers many neighbourhoods at once (and they can be kept)
        self.batched = self._batched is not None
        self._cache: "OrderedDict[str, tuple]" = OrderedDict()

    def get(self, chunk_ids: Sequence[str]) -> List[tuple]:
        """Each chunk's neighbourhood (from the cache, else one batched call)."""
        if self._batched is None:
            return [tuple(self.graph.neighborhood(chunk_id, self.radius)) for chunk_id in chunk_ids]
        cache = self._cache
        missing = list(dict.fromkeys(chunk_id for chunk_id in chunk_ids if chunk_id not in cache))
        if missing:
            for chunk_id, neighborhood in zip(missing, self._batched(missing, self.radius)):
                cache[chunk_id] = neighborhood
        found = []
        for chunk_id in chunk_ids:
            cache.move_to_end(chunk_id)
            found.append(cache[chunk_id])
        while len(cache) > self.capacity:
            cache.popitem(last=False)
        return found



class ContextTable:
    """Each decoded chunk's neighbourhood as chunk codes, one row per code, on the device.

    Args:
        graph: the corpus graph. codes: the server's :class:`ChunkCodes`.
        radius: the context radius. device: where the table lives.
        cache: neighbourhoods kept as chunk IDs (:class:`NeighborhoodCache`'s capacity).

    Rows are kept for a graph that answers many neighbourhoods at once (an immutable
    :class:`~mapmatched_torch.graph.NeighborhoodGraph`, e.g. a tensor graph); any other
    graph is asked for the rows a step needs every time.

    Memory: ``V x W`` int32 (V: chunk codes seen, W: the widest neighbourhood read).

    Thread safety: the server steps one batch at a time, but results are read from
    other threads (their contexts fill rows too), so every read and fill of the table
    holds one lock of the table's.
    """

    def __init__(self, graph: CorpusGraph, codes: ChunkCodes, radius: float, device: torch.device, cache: int) -> None:
        self.neighborhoods = NeighborhoodCache(graph, radius, cache)
        self._codes, self._device = codes, device
        tensor_graph = implements(graph, TensorGraph)
        #: a tensor graph's neighbourhoods of index codes (its node indices are the first codes), or None
        self._indexed = graph.neighborhood_indices if tensor_graph else None
        self._graph_device = graph.device if tensor_graph else None
        self._table = torch.full((0, 1), -1, dtype=torch.int32, device=self._device)
        self._filled = torch.zeros(0, dtype=torch.bool, device=self._device)
        #: every node of a tensor graph has its row (a precompute over all of them): the
        #: other codes are unknown IDs, whose neighbourhoods are empty, so nothing is
        #: ever searched again and rows are a gather (:meth:`rows` without host reads)
        self.complete = False
        # a fill replaces the table when it grows or widens: a row written into the old one
        # meanwhile (another thread's fill) would be lost but marked filled
        self._lock = threading.RLock()

    @property
    def width(self) -> int:
        """W, the widest neighbourhood kept so far."""
        return int(self._table.shape[1])

    @property
    def row_count(self) -> int:
        """V, the rows the table holds (at most the chunk codes numbered, doubled)."""
        return int(self._table.shape[0])

    def rows(self, chunks: Tensor, *, synchronize: bool = True) -> Tensor:
        """``(S, W)`` long: the neighbourhood codes of ``(S,)`` chunk codes (-1 padded);
        rows not filled yet are asked of the graph in one batched call. With
        ``synchronize`` False and a :attr:`complete` table: a gather, no host read."""
        with self._lock:
            if synchronize or not self.complete:
                self._fill(chunks)
                return self._table[chunks].long()
            known = chunks < self._table.shape[0]
            found = self._table[torch.where(known, chunks, 0)].long()
            return torch.where(known.unsqueeze(1), found, -1)

    def check_keepable(self) -> None:
        """Raise unless rows are kept (:meth:`precompute` needs that)."""
        if not self.neighborhoods.batched:
            raise MapMatchedValueError(
                "precomputed contexts need a graph that answers many neighbourhoods at once (an immutable "
                "NeighborhoodGraph, e.g. a TensorCorpusGraph); this graph is asked every step, as a session asks it"
            )

    def precompute(self, codes: Tensor, *, batch_size: int = 4096, progress: Optional[bool] = None) -> int:
        """Fill the rows of ``(R,)`` chunk codes now (a server's warm-up), so no later
        step searches a neighbourhood on first visit.

        Args:
            codes: ``(R,)`` long chunk codes (e.g. every node of a tensor graph).
            batch_size: codes searched per batched call.
            progress: a tqdm bar (None: only when stderr is a terminal).

        Returns:
            W, the table's width afterwards (memory: ``V x W`` int32; every step's
            context gather reads rows this wide).

        Raises:
            ValueError: rows of this graph are never kept: it is not an immutable
                :class:`~mapmatched_torch.graph.NeighborhoodGraph` (one that answers many
                neighbourhoods at once, e.g. a tensor graph).
        """
        self.check_keepable()
        batch_size = check_positive_int(batch_size, "batch_size")
        codes = codes.to(self._device, torch.long).view(-1)
        if codes.numel() and not (0 <= int(codes.min()) and int(codes.max()) < len(self._codes)):
            raise MapMatchedValueError(
                f"precompute needs chunk codes in [0, {len(self._codes)}) (numbered by the server's ChunkCodes), "
                f"got [{int(codes.min())}, {int(codes.max())}]"
            )
        with progress_bar(total=codes.numel(), unit="chunk", desc="contexts", show=progress_wanted(progress),
                          leave=False) as bar:
            for start in range(0, codes.numel(), batch_size):
                batch = codes[start: start + batch_size]
                with self._lock:  # per batch: result reads in other threads wait one batch at most
                    self._fill(batch)
                bar.update(batch.numel())
        if self._indexed is not None:
            nodes = self._codes.graph_nodes
            with self._lock:
                self.complete = self.complete or bool(self._filled[:nodes].all()) and self._filled.shape[0] >= nodes
        return int(self._table.shape[1])

    def renumbered(self, codes: ChunkCodes) -> "ContextTable":
        """A table for new chunk codes (a restored state's): a tensor graph's node rows
        carry over (its node indices are the first codes of any numbering); any other
        graph's rows depend on the numbering and start empty."""
        table = ContextTable(self.neighborhoods.graph, codes, self.neighborhoods.radius, self._device,
                             self.neighborhoods.capacity)
        if self._indexed is not None:
            with self._lock:
                kept = min(codes.graph_nodes, self._table.shape[0])
                table._table = self._table[:kept].clone()
                table._filled = self._filled[:kept].clone()
                table.complete = self.complete and kept >= codes.graph_nodes
        return table

    def _fill(self, chunks: Tensor) -> None:
        """Search and keep the rows of the ``(S,)`` chunk codes not filled yet (the table
        grows to every code numbered so far, and to the widest row); the caller holds
        the lock."""
        size = len(self._codes)
        if self._table.shape[0] < size:
            grown = max(size, 2 * self._table.shape[0])
            table = torch.full((grown, self._table.shape[1]), -1, dtype=torch.int32, device=self._device)
            table[: self._table.shape[0]] = self._table
            filled = torch.zeros(grown, dtype=torch.bool, device=self._device)
            filled[: self._filled.shape[0]] = self._filled
            self._table, self._filled = table, filled
        missing = chunks[~self._filled[chunks]].unique()
        if missing.numel():
            found = self._neighborhood_codes(missing)
            if found.shape[1] > self._table.shape[1]:
                table = torch.full((self._table.shape[0], found.shape[1]), -1, dtype=torch.int32, device=self._device)
                table[:, : self._table.shape[1]] = self._table
                self._table = table
            self._table[missing] = torch.nn.functional.pad(found, (0, self._table.shape[1] - found.shape[1]), value=-1)
            # kept only for a graph that answers many at once (an immutable NeighborhoodGraph):
            # any other graph is asked again every time, as a session asks it
            # (new codes the neighbourhoods added get rows next time)
            self._filled[missing] = self.neighborhoods.batched

    def neighborhood_ids(self, chunk_ids: Sequence[str]) -> List[tuple]:
        """Each chunk's neighbourhood as chunk IDs (what built results read).

        For a tensor graph they are the table's rows, so a chunk's neighbourhood is
        searched once for its contexts and its results alike; any other graph answers
        through :class:`NeighborhoodCache`."""
        if self._indexed is None:
            with self._lock:  # the LRU is an OrderedDict: one reader or writer at a time
                return self.neighborhoods.get(chunk_ids)
        codes = torch.tensor(self._codes.codes(chunk_ids), dtype=torch.long, device=self._device)
        names = self._codes.names
        return [tuple(names([code for code in row if code >= 0])) for row in self.rows(codes).tolist()]

    def _neighborhood_codes(self, missing: Tensor) -> Tensor:
        """``(R, W)`` int32 neighbourhood codes of ``(R,)`` chunk codes (-1 padded).

        A tensor graph answers with node indices, which are its codes (no chunk ID is
        built; a code beyond its nodes has no neighbourhood there); any other graph
        answers chunk IDs, coded here."""
        if self._indexed is not None:
            # shape: (R,) index codes of the graph: -1 for the chunks it does not know
            centres = torch.where(missing < self._codes.graph_nodes, missing, -1)
            return self._indexed(centres.to(self._graph_device), self.neighborhoods.radius).to(self._device, torch.int32)
        found = [self._codes.codes(row) for row in self.neighborhoods.get(self._codes.names(missing.tolist()))]
        return _padded_rows(found, max(map(len, found), default=0)).to(self._device)


def _padded_rows(rows: Sequence[Sequence[int]], width: int) -> Tensor:
    """``(R, width)`` int32: each row's codes first, -1 after."""
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    flat = torch.tensor([code for row in rows for code in row], dtype=torch.int32)
    return padded_rows(flat, lengths, width)
