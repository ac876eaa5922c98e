"""numba kernel of the per-turn score normalization (imported only when numba is installed).

See :mod:`.normalization` for the contract: each row's ``math.fsum`` sums are computed
here by the same exact algorithm (Shewchuk's non-overlapping partials, then the
correctly rounded total, ties to even), and every other step is one IEEE-754 operation
(numba's default keeps them: no fastmath, no contraction), so the results equal
:func:`~mapmatched_torch.core.scoring.normalize_scores` bit for bit.
"""

from __future__ import annotations

import math

import numba
import numpy as np

#: method codes of :func:`normalize_rows`
NONE, CENTER, ZSCORE = 0, 1, 2


@numba.njit(cache=True, nogil=True)
def _fsum(values, count, partials):
    """``math.fsum(values[:count])``, NaN where fsum overflows or the sum is not finite."""
    used = 0
    for k in range(count):
        x = values[k]
        if not math.isfinite(x):
            return math.nan
        kept = 0
        for j in range(used):
            y = partials[j]
            if abs(x) < abs(y):
                x, y = y, x
            high = x + y
            low = y - (high - x)
            if low != 0.0:
                partials[kept] = low
                kept += 1
            x = high
        used = kept
        if x != 0.0:
            if not math.isfinite(x):  # an intermediate overflow: fsum raises
                return math.nan
            partials[used] = x
            used += 1
    high = 0.0
    if used > 0:
        used -= 1
        high = partials[used]
        low = 0.0
        while used > 0:
            x = high
            used -= 1
            y = partials[used]
            high = x + y
            low = y - (high - x)
            if low != 0.0:
                break
        # round half to even: a low part exactly at half an ulp, with more beyond it
        if used > 0 and ((low < 0.0 and partials[used - 1] < 0.0) or (low > 0.0 and partials[used - 1] > 0.0)):
            y = low * 2.0
            x = high + y
            if y == x - high:
                high = x
    return high


@numba.njit(cache=True, nogil=True)
def normalize_rows(raw, counts, method, out):
    """``out[r, :counts[r]] = normalize_scores(raw[r, :counts[r]], method)`` (NaN rows where
    it raises), 0.0 after; float64 ``(R, K)`` arrays, ``counts`` int64 ``(R,)``."""
    rows, width = raw.shape
    partials = np.empty(width + 1, dtype=np.float64)
    squares = np.empty(width, dtype=np.float64)
    for r in range(rows):
        count = counts[r]
        for k in range(width):
            out[r, k] = 0.0
        if method == NONE:
            for k in range(count):
                out[r, k] = raw[r, k]
            continue
        if count == 0:
            continue
        total = _fsum(raw[r], count, partials)
        if math.isnan(total):
            for k in range(count):
                out[r, k] = math.nan
            continue
        mean = total / count
        for k in range(count):
            out[r, k] = raw[r, k] - mean
        if method == CENTER:
            continue
        for k in range(count):
            squares[k] = out[r, k] * out[r, k]
        spread = _fsum(squares, count, partials)
        if math.isnan(spread):
            for k in range(count):
                out[r, k] = math.nan
            continue
        std = math.sqrt(spread / count)
        for k in range(count):
            out[r, k] = 0.0 if std == 0.0 else out[r, k] / std
