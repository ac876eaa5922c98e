"""numba kernel of the per-turn score normalization (imported only when numba is installed).

See :mod:`.normalization` for the contract: each row's ``math.fsum`` sum is certified
first by a compensated sum (:func:`certified_sum`, about ten times cheaper), and only a
row it cannot certify is summed by fsum's own exact algorithm (Shewchuk's
non-overlapping partials, then the correctly rounded total, ties to even). Every other
step is one IEEE-754 operation (numba's default keeps them: no fastmath, no
contraction), so the results equal :func:`~mapmatched_torch.core.scoring.normalize_scores`
bit for bit.
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


#: float64's unit roundoff and smallest subnormal; rows whose largest |value| times their
#: count reaches _HOST_MAGNITUDE take the exact algorithm (no partial sum can overflow below it)
_UNIT = 2.0**-53
_TINY = 2.0**-1074
_HOST_MAGNITUDE = 2.0**1020


@numba.njit(cache=True, nogil=True)
def certified_sum(values, count):
    """``(total, certain)``: a compensated sum of ``values[:count]`` and whether it is
    certainly ``math.fsum``'s correctly rounded sum (finite values only).

    Each addition ``s + x`` keeps its exact rounding error ``e`` (TwoSum), so the exact
    sum is ``s + sum(e)``; the errors are summed by TwoSum again, so ``sum(e) = c +
    sum(f)`` exactly. Where every ``f`` is 0 (nearly every row) the exact sum is ``s +
    c``, two floats, which one IEEE addition rounds correctly (ties to even, as fsum).
    Otherwise the rounding is certain when the rest (``residual + sum(f)``, bounded
    with its own rounding and underflow covered twice over) stays inside half the gap
    to the neighbouring floats; the rare rows it does not, or whose magnitude nears the
    float range's end, are not certain (the caller sums them exactly).
    """
    s = 0.0
    c = 0.0
    rest = 0.0
    largest = 0.0
    settled = True
    for k in range(count):
        x = values[k]
        magnitude = abs(x)
        if magnitude > largest:
            largest = magnitude
        t = s + x
        virtual = t - s
        e = (s - (t - virtual)) + (x - virtual)
        s = t
        u = c + e
        virtual = u - c
        f = (c - (u - virtual)) + (e - virtual)
        c = u
        if f != 0.0:
            settled = False
            rest += abs(f)
    if not largest * max(count, 1) < _HOST_MAGNITUDE:
        return math.nan, False
    total = s + c
    if settled:
        return total + 0.0, True  # fsum never returns -0.0
    virtual = total - s
    residual = (s - (total - virtual)) + (c - virtual)
    bound = rest * (1.0 + 4.0 * count * _UNIT) + (2.0 * count) * _TINY
    if total == 0.0:
        return total + 0.0, False
    mantissa, exponent = math.frexp(abs(total))
    gap = max(math.ldexp(1.0, exponent - 53), _TINY)
    if mantissa == 0.5:  # a power of two: the gap below is half the gap above
        gap = max(gap * 0.5, _TINY)
    certain = abs(residual) + 2.0 * bound < 0.5 * gap * (1.0 - 2.0**-40)
    return total + 0.0, certain


@numba.njit(cache=True, nogil=True)
def _row_sum(values, count, partials):
    """``math.fsum(values[:count])`` (NaN where fsum overflows or a value is not finite):
    certified when it can be, else exact."""
    for k in range(count):
        if not math.isfinite(values[k]):
            return math.nan
    total, certain = certified_sum(values, count)
    if certain:
        return total
    return _fsum(values, count, partials)


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
        total = _row_sum(raw[r], count, partials)
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
        spread = _row_sum(squares, count, partials)
        if math.isnan(spread):
            for k in range(count):
                out[r, k] = math.nan
            continue
        std = math.sqrt(spread / count)
        for k in range(count):
            out[r, k] = 0.0 if std == 0.0 else out[r, k] / std
