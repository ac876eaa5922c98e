"""numba kernel of the ball-table lookup (imported only when numba is installed)."""

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


def lookup(sources: np.ndarray, targets: np.ndarray, indptr: np.ndarray, neighbors: np.ndarray,
           distances: np.ndarray, maximum: float) -> np.ndarray:
    out = np.empty(sources.size, dtype=np.float64)
    ball_lookup(sources, targets, indptr, neighbors, distances, float(maximum), out)
    return out
