"""docs/spec.md section 2's per-turn score normalization for many turns at once, bit for bit.

:func:`~mapmatched_torch.core.scoring.normalize_scores` normalizes one turn in plain Python
with ``math.fsum`` sums: exactly rounded, so independent of order. Here every step is a
tensor operation on the rows' device, and the two sums per turn are exactly rounded
too, without a host ``fsum`` per row:

- :func:`exact_row_sums` adds each row by a pairwise tree of error-free additions
  (TwoSum: ``a + b = s + e`` exactly), so the exact sum is the tree's top value plus the
  sum of every error term; the error terms are added by a second such tree. When that
  second tree makes no error (nearly every row), the exact sum is the sum of two floats,
  which one IEEE addition rounds correctly (ties to even included). Otherwise a bound on
  the remaining errors decides whether the rounding is still certain; only the rare
  rows where it is not (an exact sum a hair from a rounding midpoint, or magnitudes
  near the float range's end) are summed again with ``math.fsum`` on the host.
- The elementwise steps (``r - mean``, ``c * c``, ``c / std``) are single IEEE-754
  operations, rounded the same way in torch as in Python.
- ``sqrt`` is not: torch's CPU ``sqrt`` (MKL's vector math) is off by one ulp on about
  1% of float64 inputs, where ``math.sqrt`` is correctly rounded. :func:`exact_sqrt`
  corrects it: the correctly rounded root is the float whose two rounding midpoints
  bracket the input, and ``v - midpoint**2`` is a sum of five exact floats (Dekker's
  error-free square), whose sign :func:`exact_row_sums` gives exactly.

So every value equals :func:`~mapmatched_torch.core.scoring.normalize_scores`'s exactly
(tested bit for bit, on adversarial rows), on CPU and CUDA alike. On the CPU with numba
installed (and the fused kernels enabled, :func:`~mapmatched_torch.kernels.fused.use_fused_kernels`),
:func:`normalize_score_rows` runs one compiled pass instead (:mod:`.normalization_kernels`:
the same exact sums, a hundred tensor operations fewer); the tensor path is the
fallback and the device path.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import torch
from torch import Tensor

from ..core.scoring import check_score_normalization
from . import fused, numba_runtime

__all__ = ["exact_row_sums", "certified_row_sums", "exact_sqrt", "certified_sqrt", "normalize_score_rows",
           "normalize_score_rows_on_device"]

#: The unit roundoff of float64 and its smallest subnormal.
_UNIT = 2.0**-53
_TINY = 2.0**-1074
#: Rows whose largest |value| times their width reaches this are summed on the host:
#: no partial sum of the tree can overflow below it (and ``fsum``'s own intermediate
#: overflow rule decides the rest).
_HOST_MAGNITUDE = 2.0**1020


def exact_row_sums(values: Tensor, real: Tensor) -> Tensor:
    """The exactly rounded sum of each row's real entries (``math.fsum``, row by row).

    Args:
        values: ``(R, K)`` float64, on any device; entries where ``real`` is False are
            ignored (they may hold anything, NaN included).
        real: ``(R, K)`` bool.

    Returns:
        ``(R,)`` float64 on ``values``' device: ``math.fsum`` of each row's real
        entries (0.0 for none), NaN where ``math.fsum`` overflows or the sum is
        infinite (an infinite entry, e.g. a square that overflowed).

    Cost: ``ceil(log2 K)`` levels of ``(R, K)`` tensor operations, one reduction, and one
    host synchronization (whether any row needs the host); ``math.fsum`` only for the
    rows whose rounding the bound cannot certify (none in typical data).
    """
    total, host = certified_row_sums(values, real)
    if bool(host.any()):
        rows = host.nonzero().view(-1)
        picked = torch.where(real, values, values.new_zeros(()))[rows].tolist()
        kept = real[rows].tolist()
        sums = [_fsum_or_nan([value for value, keep in zip(row, mask) if keep]) for row, mask in zip(picked, kept)]
        total = total.index_put((rows,), torch.tensor(sums, dtype=total.dtype).to(total.device))
    return total + 0.0  # fsum never returns -0.0: an exact zero sum is +0.0


def certified_row_sums(values: Tensor, real: Tensor) -> "tuple[Tensor, Tensor]":
    """:func:`exact_row_sums` on the device alone: ``(sums (R,), host (R,) bool)``, each
    row's sum exactly as ``math.fsum`` rounds it where ``host`` is False, and a row the
    device cannot certify (heavy cancellation near a rounding midpoint, or magnitudes near
    overflow) flagged for the host instead. No host read: nothing here waits for the device.
    """
    zero = values.new_zeros(())
    x = torch.where(real, values, zero)
    width = x.shape[1]
    # exact: sum(x) == top + sum(first) == top + middle + sum(second)
    top, first = _tree_sum(x)
    middle, second = _tree_sum(first)
    total = top + middle
    residual = _two_sum_error(top, middle, total)  # sum(x) == total + residual + sum(second)
    # sum(second) is exactly 0 in nearly every row; else a bound on it (its terms' magnitudes,
    # with their own rounding and underflow covered twice over)
    terms = second.shape[1]
    rest = second.abs().sum(1) * (1.0 + 4.0 * terms * _UNIT) + (2.0 * terms) * _TINY
    settled = (second == 0).all(1)
    # the half gaps to the neighbouring floats (the smaller one: below a power of two it halves)
    half_gap = 0.5 * torch.minimum(
        (total - torch.nextafter(total, torch.zeros_like(total))).abs(),
        (torch.nextafter(total, total.sign() * math.inf + (total == 0)) - total).abs(),
    )
    # settled: total is the correctly rounded top + middle, which is the exact sum
    certain = settled | (residual.abs() + 2.0 * rest < half_gap * (1.0 - 2.0**-40))
    largest = x.abs().amax(1) if width else torch.zeros_like(top)
    host = ~certain | ~torch.isfinite(total) | ~(largest * max(width, 1) < _HOST_MAGNITUDE)
    return total + 0.0, host  # fsum never returns -0.0: an exact zero sum is +0.0


def _tree_sum(values: Tensor) -> "tuple[Tensor, Tensor]":
    """``(top, errors)``: ``(R,)`` pairwise-tree sums of ``(R, K)`` finite values and the
    ``(R, E)`` rounding errors of its additions, so ``values.sum(1) == top + errors.sum(1)``
    exactly (each addition is an error-free TwoSum; no overflow below
    :data:`_HOST_MAGNITUDE`)."""
    top, errors = values, []
    while top.shape[1] > 1:
        if top.shape[1] % 2:
            top = torch.cat([top, top.new_zeros((top.shape[0], 1))], 1)
        a, b = top[:, 0::2], top[:, 1::2]
        top = a + b
        errors.append(_two_sum_error(a, b, top))
    if not errors:
        return (top[:, 0] if top.shape[1] else top.new_zeros(top.shape[0])), top.new_zeros((top.shape[0], 0))
    return top[:, 0], torch.cat(errors, 1)


def _two_sum_error(a: Tensor, b: Tensor, total: Tensor) -> Tensor:
    """The rounding error of ``total = a + b`` (Knuth's TwoSum: ``a + b == total + error``
    exactly, for any finite operands whose sum does not overflow)."""
    b_virtual = total - a
    a_virtual = total - b_virtual
    return (a - a_virtual) + (b - b_virtual)


def _fsum_or_nan(values: Sequence[float]) -> float:
    """``math.fsum``; NaN where it overflows or is infinite (the rows ``normalize_scores`` refuses)."""
    try:
        total = math.fsum(values)
    except (OverflowError, ValueError):
        return math.nan
    return total if math.isfinite(total) else math.nan


def exact_sqrt(values: Tensor) -> Tensor:
    """The correctly rounded square root of every float64 value (``math.sqrt``, elementwise).

    Args:
        values: any shape, float64, on any device (negative values give NaN, as
            ``torch.sqrt``; ``math.sqrt`` would raise).


    Returns:
        The same shape: ``math.sqrt`` of each value, bit for bit. ``torch.sqrt`` is
        within one ulp of it; each element is moved to its neighbour when the input lies
        beyond the rounding midpoint between them (decided exactly; at most two passes).
    """
    root = torch.sqrt(values)
    # inputs below 2**-900 are scaled by 2**1000 (their roots by 2**500: exact) so the
    # error-free square below never underflows
    small = values < 2.0**-900
    scaled = torch.where(small, values * 2.0**1000, values)
    root = torch.where(small, torch.sqrt(scaled), root)
    work = (torch.isfinite(scaled) & (scaled > 0)).reshape(-1).nonzero().view(-1)
    flat_root, flat_scaled = root.reshape(-1).clone(), scaled.reshape(-1)
    for _ in range(4):  # torch's root is one ulp off at most: a second pass only confirms
        moved = _nudge_root(flat_root[work], flat_scaled[work])
        changed = moved != flat_root[work]
        if not bool(changed.any()):
            break
        work = work[changed]
        flat_root[work] = moved[changed]
    root = flat_root.view(root.shape)
    return torch.where(small, root * 2.0**-500, root)


def certified_sqrt(values: Tensor) -> "tuple[Tensor, Tensor]":
    """:func:`exact_sqrt` on the device alone: ``(roots, host)`` of ``values``' shape, each
    root ``math.sqrt``'s bit for bit where ``host`` is False. Two passes over every
    element (torch's root is one ulp off at most, so the second only confirms), the
    signs decided by :func:`certified_row_sums`; an element whose sign sum the device
    cannot certify is flagged for the host. No host read."""
    root = torch.sqrt(values)
    small = values < 2.0**-900
    scaled = torch.where(small, values * 2.0**1000, values)
    root = torch.where(small, torch.sqrt(scaled), root)
    positive = (torch.isfinite(scaled) & (scaled > 0)).reshape(-1)
    flat_root, flat_scaled = root.reshape(-1), scaled.reshape(-1)
    host = torch.zeros_like(positive)
    for _ in range(2):
        moved, unsure = _nudge_root(flat_root, flat_scaled, certified=True)
        flat_root = torch.where(positive, moved, flat_root)
        host = host | (positive & unsure)
    root = flat_root.view(root.shape)
    return torch.where(small, root * 2.0**-500, root), host.view(values.shape)


def _nudge_root(root: Tensor, value: Tensor, *, certified: bool = False):
    """``(N,)`` positive ``root``, within one ulp of ``sqrt(value)``, moved to the neighbour
    whose rounding interval holds ``sqrt(value)``, decided exactly. ``certified``: on the
    device alone, ``(moved, host (N,) bool)`` (:func:`certified_row_sums`)."""
    up, down = torch.nextafter(root, torch.full_like(root, math.inf)), torch.nextafter(root, torch.zeros_like(root))
    gap_up, gap_down = up - root, root - down  # powers of two: every product below is exact
    square, square_error = _exact_square(root)
    base = value - square  # exact (Sterbenz: the square is within a factor 2 of value)
    # shape: (2N, 4) value - (root + gap_up / 2)**2, then value - (root - gap_down / 2)**2, term by term
    terms = torch.cat([
        torch.stack([base, -square_error, -root * gap_up, -(gap_up * gap_up) * 0.25], 1),
        torch.stack([base, -square_error, root * gap_down, -(gap_down * gap_down) * 0.25], 1),
    ])
    every = torch.ones_like(terms, dtype=torch.bool)
    if certified:
        signs, unsure = certified_row_sums(terms, every)
    else:
        signs = exact_row_sums(terms, every)
    above, below = signs[: root.shape[0]], signs[root.shape[0]:]
    moved = torch.where(above > 0, up, torch.where(below < 0, down, root))
    if certified:
        return moved, unsure[: root.shape[0]] | unsure[root.shape[0]:]
    return moved


def _exact_square(value: Tensor) -> "tuple[Tensor, Tensor]":
    """``(p, e)`` with ``p = fl(value * value)`` and ``value**2 == p + e`` exactly (Dekker's
    product without FMA; |value| below 2**990 and its square not underflowing)."""
    spread = value * 134217729.0  # 2**27 + 1
    high = spread - (spread - value)
    low = value - high
    square = value * value
    error = ((high * high - square) + 2.0 * high * low) + low * low
    return square, error


def normalize_score_rows(raw: Tensor, counts: Union[Sequence[int], Tensor], method: str = "zscore") -> Tensor:
    """Normalize every row's leading scores, as :func:`~mapmatched_torch.core.scoring.normalize_scores`.

    Args:
        raw: ``(R, K)`` float64 raw scores, on any device; row ``r``'s turn is
            ``raw[r, :counts[r]]`` (finite values; the rest is ignored).
        counts: ``(R,)`` ints in ``[0, K]`` (a sequence or an int tensor).
        method: ``"zscore"`` (default), ``"center"`` or ``"none"``.

    Returns:
        ``(R, K)`` float64 on ``raw``'s device: ``normalize_scores(raw[r, :counts[r]],
        method)`` in each row's first ``counts[r]`` entries, bit for bit, 0.0 after them.
        A row where ``normalize_scores`` raises ValueError (an exact sum overflows: of
        the scores, or of their squared deviations, a square overflowing included) is
        NaN: callers report it as a non-finite normalized score.
    """
    method = check_score_normalization(method)
    lengths = torch.as_tensor(counts, dtype=torch.long).to(raw.device).view(-1, 1)
    if raw.dtype == torch.float64 and fused.kernels_on(raw.device):
        from . import normalization_kernels as kernels

        out = torch.empty_like(raw)
        code = {"none": kernels.NONE, "center": kernels.CENTER, "zscore": kernels.ZSCORE}[method]
        with numba_runtime.KERNEL_LOCK:
            kernels.normalize_rows(raw.contiguous().numpy(), lengths.view(-1).contiguous().numpy(), code, out.numpy())
        return out
    return _normalized(raw, lengths, method, exact_row_sums, exact_sqrt)


def normalize_score_rows_on_device(
    raw: Tensor, counts: Tensor, method: str = "zscore"
) -> "tuple[Tensor, Tensor]":
    """:func:`normalize_score_rows` with no host read: ``(normalized (R, K), host (R,) bool)``.

    Every row not flagged in ``host`` is :func:`normalize_score_rows`'s, bit for bit (the
    same certified sums and roots, computed on the device). A flagged row's exact sum
    needs the host (:func:`certified_row_sums`: heavy cancellation at a rounding
    midpoint, or magnitudes near overflow; never in the tests' typical data): its values
    are meaningless, and the caller normalizes it with :func:`normalize_score_rows`.

    Args:
        raw: ``(R, K)`` float64. counts: ``(R,)`` int tensor on ``raw``'s device.
        method: ``"zscore"``, ``"center"`` or ``"none"``.
    """
    method = check_score_normalization(method)
    lengths = counts.to(raw.device, torch.long).view(-1, 1)
    flagged = [torch.zeros(raw.shape[0], dtype=torch.bool, device=raw.device)]

    def sums(values: Tensor, real: Tensor) -> Tensor:
        total, host = certified_row_sums(values, real)
        flagged.append(host)
        return total

    def sqrt(values: Tensor) -> Tensor:
        root, host = certified_sqrt(values)
        flagged.append(host.view(-1))
        return root

    normalized = _normalized(raw, lengths, method, sums, sqrt)
    return normalized, torch.stack(flagged).any(0)


def _normalized(raw: Tensor, lengths: Tensor, method: str, sums, sqrt) -> Tensor:
    """The tensor path of the normalizations, with ``sums`` / ``sqrt`` the exact row sums
    and square roots to use."""
    # shape: (R, K) the real entries of each row
    real = torch.arange(raw.shape[1], device=raw.device).unsqueeze(0) < lengths
    zero = raw.new_zeros(())
    if method == "none":
        return torch.where(real, raw, zero)
    # shape: (R, 1); an empty row divides 0 by 1 (it has no entry to fill)
    sizes = lengths.clamp(min=1).to(raw.dtype)
    mean = sums(raw, real).view(-1, 1) / sizes
    centered = torch.where(real, raw - mean, zero)
    if method == "center":
        return centered
    std = sqrt(sums(centered * centered, real).view(-1, 1) / sizes)
    # a row whose std is exactly 0 is all 0.0 (NaN std: the overflowed rows stay NaN)
    return torch.where(real & (std != 0.0), centered / std, zero)
