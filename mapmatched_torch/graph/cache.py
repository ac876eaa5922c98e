"""An LRU cache of exact bounded distances, in rows keyed by source node.

Every entry ``(source, target) -> distance`` is *exact*: a float64 shortest-path
length within the bound, or ``inf`` for "no path within the bound" (callers turn
``inf`` into ``maximum_distance``). A row is *complete* when it holds every node the
source reaches within the bound (a full bounded search), so a target absent from it is
known to be beyond the bound; a partial row (the targets of a target-aware search)
only answers the targets it holds.

Two tiers, one memory bound (``16 * max_entries`` bytes, 256 MiB by default):

- **dense rows** (on the CPU, when every node's complete row fits in the bound: ``8 *
  N**2 <= 16 * max_entries`` and ``max_rows >= N``, i.e. N <= 5,792 by default): a
  complete row is stored as N float64 values in a lazily filled ``(N, N)`` table (the
  memory of a row is committed when it is first written: untouched rows cost no
  memory). Inserting a row costs O(N), a lookup O(1) per pair. No eviction is ever
  needed: every row fits, so the table is bounded by ``8 * N**2`` bytes. This is the
  tier a small graph whose bound reaches most of it needs (a search covers the whole
  graph anyway; see docs/scale.md): the searches then store complete rows here
  (:attr:`DistanceCache.dense_rows`).
- **sparse rows** (every other graph, and partial rows): rows are the unit of recency
  and eviction (least recently used first), bounded by a number of rows and a number of
  entries. Each row is one run of keys sorted by target in an arena (``source * N +
  target`` keys and their values): an insertion writes the merged runs of the rows it
  touches at the arena's end (O(those rows + the new entries), not O(the cache)), an
  eviction only marks runs free, and the arena is compacted (O(live entries)) when the
  free entries outnumber the live ones, so its cost is paid by the insertions and
  evictions that freed them. All state is tensors on one device; a lookup is a binary
  search within its source's run (compiled on the CPU, a fixed-depth vectorised search
  elsewhere), so a warm trellis batch is a handful of kernels on GPU.

Thread safety: every public method holds the cache's lock for its whole
read-modify-write (a lookup, which also refreshes recency and counters, reads the
arena under it too), so threads sharing one graph (a server's sessions) see one
consistent state, and no method returns a view of the cache's storage. Searches run outside the lock (the graph looks up, searches, then
inserts); two threads may then search the same pair, and the second insertion keeps
the first entry (both are exact, hence equal).
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..core.checks import check_positive_int
from ..core.errors import MapMatchedRuntimeError, MapMatchedValueError
from ..core.graph_types import CacheInfo
from .engines import compiled as _compiled

__all__ = ["DistanceCache", "CacheInfo"]

#: The table passed to the compiled grid lookup while no dense row exists.
_NO_TABLE = torch.empty((0, 0), dtype=torch.float64)


class DistanceCache:
    """LRU rows of exact distances from source nodes of an N-node graph.

    Args:
        num_nodes: N (keys are ``source * N + target``).
        max_rows: the most source rows kept, an ``int`` > 0.
        max_entries: the most ``(source, target)`` entries kept, an ``int`` > 0
            (16 bytes each). A row larger than this is dropped right after insertion.
            ``16 * max_entries`` bytes is also the bound of the dense rows (see
            :attr:`dense_rows`).
        device: where the state lives (the graph's device).

    Cost: sparse rows: a lookup of Q pairs is O(Q log N); an insertion of Q new
    entries is O((R + Q) log (R + Q)) for the R entries already cached in the rows it
    touches (amortized, compaction included), whatever else the cache holds; memory is
    16 bytes per arena entry (at most about four times ``max_entries``: live entries,
    as many free ones, and room to grow) plus 26 bytes per node. Dense rows: a lookup
    is O(1) per pair; inserting R rows is O(R N); memory 8 bytes per entry of a filled
    row.

    Thread-safe (see the module docstring); picklable (the lock is not pickled, a new
    one is made on unpickling).
    """

    def __init__(
        self,
        num_nodes: int,
        *,
        max_rows: int = 65536,
        max_entries: int = 1 << 24,
        device: Union[torch.device, str, None] = None,
    ) -> None:
        self.num_nodes = int(num_nodes)
        self.max_rows = check_positive_int(max_rows, "distance_cache_size")
        self.max_entries = check_positive_int(max_entries, "distance_cache_entries")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        #: guards every read-modify-write of the state below (reentrant: insert evicts)
        self._lock = threading.RLock()
        self.clear()

    def __getstate__(self) -> Dict[str, Any]:
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"]  # locks cannot be pickled
        if state["_table"] is not None:  # only the filled rows, not the (N, N) table
            state["_table"] = state["_table"][state["_filled"]].clone()
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        rows = state["_table"]
        self.__dict__.update(state)
        self._lock = threading.RLock()
        if rows is not None:
            self._table = None
            self._write_rows(self._filled.nonzero().squeeze(1), rows)

    @property
    def dense_rows(self) -> bool:
        """Whether complete rows are kept as dense rows of N values: on the CPU, when
        every node's row fits in the memory bound (``8 * N**2 <= 16 * max_entries``)
        and in the row capacity (``max_rows >= N``). Searches should then compute
        complete rows (:meth:`insert_rows`): the next lookups of those sources are all hits."""
        nodes = self.num_nodes
        return self.device.type == "cpu" and self.max_rows >= nodes and 8 * nodes * nodes <= 16 * self.max_entries

    def clear(self) -> None:
        """Drop every row and reset the hit and miss counters."""
        with self._lock:
            self._reset()

    def _reset(self) -> None:
        # shape: (C,) the arena: keys source * N + target and their distances; row s is
        # the run [start[s], stop[s]) sorted by key (empty: start == stop); entries past
        # _used are free space, runs of evicted or rewritten rows are garbage
        self._keys = torch.empty(0, dtype=torch.long, device=self.device)
        self._values = torch.empty(0, dtype=torch.float64, device=self.device)
        self._start = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
        self._stop = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
        self._used = 0
        self._live = 0
        # shape: (N,) last use of each source row (0: not cached) and completeness
        self._stamp = torch.zeros(self.num_nodes, dtype=torch.long, device=self.device)
        self._complete = torch.zeros(self.num_nodes, dtype=torch.bool, device=self.device)
        # dense rows: the (N, N) table, allocated on the first row (its pages committed as
        # rows are written), and (N,) which of its rows are filled; rows are written once
        # and never evicted, so a snapshot of the mask stays valid while others are added
        self._table: Optional[torch.Tensor] = None
        self._filled = torch.zeros(self.num_nodes, dtype=torch.bool, device=self.device)
        self._clock = 0
        self._hits = 0
        self._misses = 0

    def cache_info(self) -> CacheInfo:
        """Hits and misses (counted per distinct source of each lookup: a hit answers
        all of that source's targets), rows cached, and the row capacity."""
        with self._lock:
            return CacheInfo(self._hits, self._misses, int((self._stamp > 0).sum()), self.max_rows)

    @property
    def entry_count(self) -> int:
        """K, the number of cached sparse ``(source, target)`` entries (dense rows not counted)."""
        with self._lock:
            return self._live

    def entries(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every cached entry, sorted by (source, target): the sparse entries and the
        entries within the bound of the dense rows.

        Returns:
            ``(sources, targets, values)``: ``(K,)`` int64, int64 and float64 on the
            cache's device (``inf``: beyond the bound); new tensors, not views of the
            cache's storage.
        """
        with self._lock:
            keys, values = self._runs((self._stop > self._start).nonzero().squeeze(1))
            filled = self._filled.nonzero().squeeze(1)
            rows = None if self._table is None else self._table[filled]
        if rows is not None:
            row, target = torch.isfinite(rows).nonzero(as_tuple=True)
            keys = torch.cat([keys, filled[row] * self.num_nodes + target])
            values = torch.cat([values, rows[row, target]])
            keys, order = torch.sort(keys)
            values = values[order]
        sources = torch.div(keys, self.num_nodes, rounding_mode="floor")
        return sources, keys - sources * self.num_nodes, values.clone()

    def lookup(self, sources: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Cached distances of node pairs.

        Args:
            sources: ``(Q,)`` int64 node indices in ``[0, N)``.
            targets: ``(Q,)`` int64 node indices in ``[0, N)``.

        Returns:
            ``(values, answered)``: ``(Q,)`` float64 distances (``inf`` = beyond the
            bound; meaningless where not answered) and a ``(Q,)`` bool mask of the
            pairs the cache could answer. Looked-up rows become most recently used.

        Raises:
            ValueError: a node index outside ``[0, N)``.
        """
        self._check_range(sources, targets, smallest=0)
        with self._lock:
            values, found = self._find(sources, targets)
            # shape: (Q,) whether the source's row is cached whole, and whether densely
            whole = (self._stamp[sources] > 0) & self._complete[sources]
            dense = self._filled[sources]
            if self._table is not None and bool(dense.any()):
                rows = dense.nonzero().squeeze(1)
                values[rows] = self._table[sources[rows], targets[rows]]
                found = found | dense
            answered = found | whole
            self._count(sources, answered)
        return values, answered

    def _find(self, sources: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(values, found)`` of ``(Q,)`` node pairs in the sparse rows (with the lock held):
        per pair a binary search within its source's run."""
        if not self._live or not sources.numel():
            found = torch.zeros(sources.shape, dtype=torch.bool, device=self.device)
            return torch.full(sources.shape, torch.inf, dtype=torch.float64, device=self.device), found
        if self.device.type == "cpu" and _compiled.available():
            return _compiled.compiled_lookup(self._keys, self._values, self._start, self._stop, sources.contiguous(),
                                             targets.contiguous(), self.num_nodes)
        # the same search, vectorised: a fixed number of halvings of every pair's run
        keys = sources * self.num_nodes + targets
        low, high = self._start[sources], self._stop[sources]
        for _ in range(max(int(self.num_nodes).bit_length(), 1)):
            middle = torch.div(low + high, 2, rounding_mode="floor")
            less = (low < high) & (self._keys[middle.clamp(max=self._keys.numel() - 1)] < keys)
            low = torch.where(less, middle + 1, low)
            high = torch.where(less, high, middle)
        position = low.clamp(max=self._keys.numel() - 1)
        found = (low < self._stop[sources]) & (self._keys[position] == keys)
        return torch.where(found, self._values[position], torch.inf), found

    @property
    def grid_lookup(self) -> bool:
        """Whether :meth:`lookup_grid` runs here (a CPU cache with numba installed)."""
        return self.device.type == "cpu" and _compiled.available()

    def lookup_grid(
        self, sources: torch.Tensor, targets: torch.Tensor, maximum_distance: float
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """SPEC distances of every pair ``(sources[g, j], targets[g, i])`` of index codes
        that needs no search, in one compiled pass (only where :attr:`grid_lookup`).

        Args:
            sources: ``(G, M)`` int64 index codes (``-1`` padding, ``<= -2`` unknown).
            targets: ``(G, M')`` int64 index codes.
            maximum_distance: the bound.

        Returns:
            ``(values, answered)``, ``(G, M, M')`` float64 and bool: equal codes 0.0
            (padding excepted), pairs with padding or an unknown ID
            ``maximum_distance``, node pairs from the cache (beyond the bound:
            ``maximum_distance``); unanswered node pairs ``inf``. Hits and misses are
            counted, and rows refreshed, as :meth:`lookup` does for the node pairs.

        Raises:
            ValueError: a code ``>= N``. RuntimeError: not :attr:`grid_lookup`.

        Cost: one binary search per node pair within its source's run of the keys; no
        ``(G, M, M')`` intermediate but the outputs.
        """
        if not self.grid_lookup:
            raise MapMatchedRuntimeError("DistanceCache.lookup_grid needs a CPU cache and numba")
        self._check_range(sources, targets, smallest=None)
        with self._lock:
            table = self._table if self._table is not None else _NO_TABLE
            values, answered, row_needed, row_hit = _compiled.compiled_lookup_grid(
                self._keys, self._values, self._start, self._stop, (self._stamp > 0) & self._complete, self._filled,
                table, sources.contiguous(), targets.contiguous(), self.num_nodes, maximum_distance,
            )
            # shape: (G * M,) rows with a node pair: hits and misses per distinct source
            needed = row_needed.view(-1)
            self._count(sources.reshape(-1)[needed], row_hit.view(-1)[needed])
        return values, answered

    def _check_range(self, *codes: torch.Tensor, smallest: Optional[int]) -> None:
        """Every value ``< N`` (and ``>= smallest``): the compiled kernels index rows by
        them without bounds checks."""
        for tensor in codes:
            if not tensor.numel():
                continue
            low, high = torch.aminmax(tensor)
            if int(high) >= self.num_nodes or (smallest is not None and int(low) < smallest):
                what = "node indices must lie in [0, N)" if smallest is not None else "index codes must be < N"
                raise MapMatchedValueError(f"{what} (N = {self.num_nodes}), got values from {int(low)} to {int(high)}")

    def _runs(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the runs of ``(R,)`` rows, one after another (new
        tensors; with the lock held). Cost: O(R + their entries)."""
        starts, counts = self._start[rows], self._stop[rows] - self._start[rows]
        total = int(counts.sum()) if rows.numel() else 0
        # shape: (total,) the arena position of every entry of the runs
        offsets = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts)
        positions = offsets + torch.arange(total, device=self.device)
        return self._keys[positions], self._values[positions]

    def _count(self, sources: torch.Tensor, answered: torch.Tensor) -> None:
        """Count hits/misses per distinct source and refresh the cached rows' recency
        (with the lock held)."""
        if not sources.numel():
            return
        # shape: (N,) which nodes were looked up, and whether all their targets were answered
        looked = torch.zeros(self.num_nodes, dtype=torch.bool, device=sources.device).index_fill_(0, sources, True)
        hit = torch.ones(self.num_nodes, dtype=torch.bool, device=sources.device)
        hit.scatter_reduce_(0, sources, answered, reduce="amin")
        hits = int((looked & hit).sum())
        self._hits += hits
        self._misses += int(looked.sum()) - hits
        self._clock += 1
        self._stamp.masked_fill_(looked & (self._stamp > 0), self._clock)

    def insert(
        self,
        sources: torch.Tensor,
        targets: torch.Tensor,
        values: torch.Tensor,
        *,
        complete: bool = False,
    ) -> None:
        """Store exact distances, then evict least recently used rows if over capacity.

        Args:
            sources: ``(Q,)`` int64 node indices.
            targets: ``(Q,)`` int64 node indices.
            values: ``(Q,)`` float64 exact distances (``inf`` = beyond the bound).
            complete: whether these entries are, for each of their sources, every node
                that source reaches within the bound (a full bounded row; ``inf``
                entries are then unnecessary).

        Entries already cached are kept (both are exact, hence equal), and so are the
        dense rows (entries of their sources are not stored again). An insertion of
        more than ``max_entries`` entries is ignored (it could never fit).
        """
        if not sources.numel() or sources.numel() > self.max_entries:
            return
        # shape: (Q',) new keys, sorted and unique
        keys, order = torch.sort(sources * self.num_nodes + targets)
        values = values[order]
        first = torch.ones_like(keys, dtype=torch.bool)
        first[1:] = keys[1:] != keys[:-1]
        with self._lock:  # the check for cached keys and the merge are one atomic step
            sorted_sources = sources[order]
            first &= ~self._filled[sorted_sources]  # a dense row already holds every target
            first &= ~self._find(sorted_sources, keys - sorted_sources * self.num_nodes)[1]
            self._merge(keys[first], values[first])
            self._clock += 1
            self._stamp[sources] = self._clock
            if complete:
                self._complete[sources] = True
            self._evict()

    def insert_rows(self, sources: torch.Tensor, rows: torch.Tensor) -> None:
        """Store complete bounded rows: as dense rows where :attr:`dense_rows`, else as
        complete sparse rows (their entries within the bound).

        Args:
            sources: ``(R,)`` int64 distinct node indices.
            rows: ``(R, N)`` float64, ``rows[r, v]`` = d(``sources[r]``, v), ``inf``
                beyond the bound (:func:`~.shortest_paths.bounded_rows`).

        Cost: dense: O(R N) (a copy of the rows not yet filled); sparse: as :meth:`insert`.
        """
        if not sources.numel():
            return
        if not self.dense_rows:  # each row holds its source (0.0): no source is left out
            row, target = torch.isfinite(rows).nonzero(as_tuple=True)
            self.insert(sources[row], target, rows[row, target], complete=True)
            return
        with self._lock:
            fresh = ~self._filled[sources]
            self._write_rows(sources[fresh], rows[fresh])
            self._clock += 1
            self._stamp[sources] = self._clock

    def _write_rows(self, sources: torch.Tensor, rows: torch.Tensor) -> None:
        """Fill dense rows (with the lock held, or unshared): the values first, then the mask."""
        if not sources.numel():
            return
        if self._table is None:
            # untouched pages of the table are not committed (4 KiB pages: no huge page to
            # round a row up to): about 8 N bytes per filled row
            self._table = torch.empty((self.num_nodes, self.num_nodes), dtype=torch.float64, device=self.device)
        self._table[sources] = rows
        self._filled[sources] = True

    def _merge(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add sorted new keys (none already cached) with the lock held: the runs of the
        rows they belong to, merged with them, are written at the arena's end (the old
        runs become garbage). Cost: O((those runs + new) log (those runs + new))."""
        if not keys.numel():
            return
        # shape: (R,) the rows touched; their old runs and the new entries, sorted by key
        rows = torch.unique_consecutive(torch.div(keys, self.num_nodes, rounding_mode="floor"))
        old_keys, old_values = self._runs(rows)
        merged_keys, order = torch.sort(torch.cat([old_keys, keys]))
        merged_values = torch.cat([old_values, values])[order]
        self._reserve(merged_keys.numel())
        self._live += keys.numel()
        first = self._used
        self._keys[first:first + merged_keys.numel()] = merged_keys
        self._values[first:first + merged_keys.numel()] = merged_values
        self._used += merged_keys.numel()
        # shape: (R,) each touched row's new run
        bounds = torch.searchsorted(merged_keys, torch.stack([rows * self.num_nodes, (rows + 1) * self.num_nodes]))
        self._start[rows], self._stop[rows] = first + bounds[0], first + bounds[1]

    def _reserve(self, count: int) -> None:
        """Room for ``count`` more entries at the arena's end (with the lock held): first
        by compaction when the garbage outnumbers the live entries, else by doubling."""
        if self._used + count <= self._keys.numel():
            return
        if self._used - self._live >= self._live:  # the garbage outnumbers the live entries
            self._compact()
        if self._used + count > self._keys.numel():
            capacity = max(2 * self._keys.numel(), self._used + count, 1024)
            keys = torch.empty(capacity, dtype=torch.long, device=self.device)
            values = torch.empty(capacity, dtype=torch.float64, device=self.device)
            keys[: self._used], values[: self._used] = self._keys[: self._used], self._values[: self._used]
            self._keys, self._values = keys, values

    def _compact(self) -> None:
        """Rewrite the live runs at the arena's start, by source (with the lock held; O(live))."""
        rows = (self._stop > self._start).nonzero().squeeze(1)
        counts = self._stop[rows] - self._start[rows]
        keys, values = self._runs(rows)
        self._keys[: keys.numel()], self._values[: keys.numel()] = keys, values
        self._stop[rows] = torch.cumsum(counts, 0)
        self._start[rows] = self._stop[rows] - counts
        self._used = keys.numel()

    def _evict(self) -> None:
        """Drop least recently used rows until both capacities hold (with the lock held):
        their runs become garbage."""
        cached = ((self._stamp > 0) & ~self._filled).nonzero().squeeze(1)  # dense rows are never evicted
        if cached.numel() <= self.max_rows and self._live <= self.max_entries:
            return
        # shape: (R,) cached rows, most recently used first, and their entry counts
        rows = cached[torch.argsort(self._stamp[cached], descending=True, stable=True)]
        counts = (self._stop - self._start)[rows]
        keep = (torch.arange(rows.numel(), device=rows.device) < self.max_rows) & (
            torch.cumsum(counts, 0) <= self.max_entries
        )
        dropped = rows[~keep]
        self._stamp[dropped] = 0
        self._complete[dropped] = False
        self._live -= int(counts[~keep].sum())
        self._start[dropped] = 0
        self._stop[dropped] = 0

    def to(self, device: Union[torch.device, str]) -> "DistanceCache":
        """An empty cache with the same capacities on ``device``."""
        return DistanceCache(self.num_nodes, max_rows=self.max_rows, max_entries=self.max_entries, device=device)
