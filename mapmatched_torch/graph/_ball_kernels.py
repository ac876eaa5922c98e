"""numba kernels of the ball-table lookup (imported only when numba is installed).

Two shapes of question:

- :func:`lookup`: any pairs, ``(Q,)`` sources and targets: a binary search per pair;
- :func:`lookup_grid`: a trellis turn pair, every source of a group against every
  target of the same group (``(G, A)`` x ``(G, C)`` -> ``(G, A, C)``), the question of
  :meth:`~mapmatched_torch.graph.TensorCorpusGraph.trellis_distances` and of a serving
  step. Each source's row is read once for its ``C`` targets: its cache lines are
  touched first (independent loads the CPU overlaps), then the ``C`` binary searches
  run in lockstep, one level at a time over all targets (every search of a row has
  the same depth, and a level's loads are independent of each other), then the
  distances of the targets found are read in a loop of their own (independent
  loads again), on ``blocks`` threads over the groups.

Both answer docs/spec.md section 4 exactly: 0.0 between equal codes other than
padding (-1), ``maximum`` for padding and unknown IDs (``<= -2``), the ball entry
when the target is in the source's ball within ``maximum``, else ``maximum``.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def ball_lookup(sources, targets, indptr, neighbors, distances, maximum, out):  # pragma: no cover - compiled
    """``out[q]`` = docs/spec.md d(sources[q], targets[q]) of index codes from a ball table
    (a binary search in the source's row, sorted by member). O(log ball) per pair."""
    for q in range(sources.size):
        source = sources[q]
        target = targets[q]
        if source == target and source != -1:
            out[q] = 0.0
            continue
        if source < 0 or target < 0:
            out[q] = maximum
            continue
        low = indptr[source]
        high = indptr[source + 1]
        while low < high:
            middle = (low + high) >> 1
            if neighbors[middle] < target:
                low = middle + 1
            else:
                high = middle
        value = maximum
        if low < indptr[source + 1] and neighbors[low] == target:
            found = distances[low]
            if found <= maximum:
                value = found
        out[q] = value


@numba.njit(cache=True, nogil=True)
def _grid_block(sources, targets, indptr, neighbors, distances, maximum, out, sink, block, blocks):  # pragma: no cover
    """Groups ``block, block + blocks, ...`` of :func:`grid`."""
    groups, width_a = sources.shape
    width_c = targets.shape[1]
    line = max(1, 64 // neighbors.itemsize)  # ball members per 64-byte cache line
    base = np.empty(width_c, np.int64)
    hit_place = np.empty(width_c, np.int64)
    hit_column = np.empty(width_c, np.int64)
    touched = 0
    for group in range(block, groups, blocks):
        wanted = targets[group]
        for a in range(width_a):
            source = sources[group, a]
            if source < 0 or indptr[source + 1] == indptr[source]:  # padding, unknown, or an empty ball
                for c in range(width_c):
                    out[group, a, c] = 0.0 if (wanted[c] == source and source != -1) else maximum
                continue
            start = indptr[source]
            stop = indptr[source + 1]
            size = stop - start
            for place in range(start, stop, line):  # bring the row in: independent loads
                touched += neighbors[place]
            for c in range(width_c):
                base[c] = start
            # lockstep lower bounds (branch-free halving: the row's size fixes the depth)
            remaining = size
            while remaining > 1:
                half = remaining >> 1
                for c in range(width_c):  # arithmetic, not a branch: compiles to a select
                    base[c] += half * (neighbors[base[c] + half] < wanted[c])
                remaining -= half
            # the members found first, then their distances in a loop of independent
            # loads (the distances of a row are read only where a target is a member)
            hits = 0
            for c in range(width_c):
                target = wanted[c]
                place = base[c] + (neighbors[base[c]] < target)
                out[group, a, c] = 0.0 if target == source else maximum
                if target >= 0 and target != source and place < stop and neighbors[place] == target:
                    hit_place[hits] = place
                    hit_column[hits] = c
                    hits += 1
            for hit in range(hits):
                found = distances[hit_place[hit]]
                if found <= maximum:
                    out[group, a, hit_column[hit]] = found
    sink[block] = touched


@numba.njit(cache=True, parallel=True)
def grid(sources, targets, indptr, neighbors, distances, maximum, out, sink, blocks):  # pragma: no cover - compiled
    """``out[g, a, c]`` = d(sources[g, a], targets[g, c]), on ``blocks`` threads."""
    for block in numba.prange(blocks):
        _grid_block(sources, targets, indptr, neighbors, distances, maximum, out, sink, block, blocks)


@numba.njit(cache=True, nogil=True)
def grid_serial(sources, targets, indptr, neighbors, distances, maximum, out, sink):  # pragma: no cover - compiled
    """:func:`grid` on the calling thread."""
    _grid_block(sources, targets, indptr, neighbors, distances, maximum, out, sink, 0, 1)


def lookup(sources: np.ndarray, targets: np.ndarray, indptr: np.ndarray, neighbors: np.ndarray,
           distances: np.ndarray, maximum: float) -> np.ndarray:
    """``(Q,)`` float64 distances of ``(Q,)`` int64 code pairs (serial)."""
    out = np.empty(sources.size, dtype=np.float64)
    ball_lookup(sources, targets, indptr, neighbors, distances, float(maximum), out)
    return out


def lookup_grid(sources: np.ndarray, targets: np.ndarray, indptr: np.ndarray, neighbors: np.ndarray,
                distances: np.ndarray, maximum: float, threads: int = 0) -> np.ndarray:
    """``(G, A, C)`` float64 distances from each group's ``(G, A)`` int64 source codes to
    its ``(G, C)`` target codes; ``threads``: parallel blocks (:func:`~mapmatched_torch.graph.ball_distances`
    passes torch's thread count, as every numba kernel of the package does; 0 for
    numba's), serial below :data:`~mapmatched_torch.kernels.numba_runtime.SERIAL_BELOW`
    groups."""
    from ..kernels import numba_runtime

    out = np.empty((sources.shape[0], sources.shape[1], targets.shape[1]), dtype=np.float64)
    blocks = numba_runtime.blocks_for(threads or None, sources.shape[0])
    sink = np.zeros(blocks, dtype=np.int64)
    numba_runtime.call(grid, grid_serial, (sources, targets, indptr, neighbors, distances, float(maximum), out, sink),
                       blocks)
    return out
