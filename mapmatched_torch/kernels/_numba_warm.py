"""The smallest cached numba function: calling it loads numba's CPU target (imported
only when numba is installed; see :func:`.numba_runtime.warm`)."""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def touch(values):  # pragma: no cover - compiled
    """The sum of a 1-D float64 array (the work is beside the point)."""
    total = 0.0
    for value in values:
        total += value
    return total
