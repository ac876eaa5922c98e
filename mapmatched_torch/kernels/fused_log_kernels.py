"""numba kernels of the fused log-semiring forward and forward-backward passes.

Imported only when numba is installed; see :mod:`.fused` for the contract. One
conversation is one unit of work, as in :mod:`.fused_cpu_kernels` (whose row status
codes and turn-structure rule this module shares): the forward recursion of
:mod:`.chain` in the log semiring,

    alpha[t, i] = logsumexp_j (alpha[t-1, j] + tr[t-1, j, i]) + e[t, i]
    logsumexp_j x_j = m + log(sum_j exp(x_j - m)),  m = max_j x_j,

over the real candidates only (masked ones are skipped, not added as -inf), then the
backward pass for the posterior marginals and pair marginals, one local share per move
as reverse-mode differentiation computes them (:func:`_backward_row`):

    p[T-1, i] = exp(alpha[T-1, i] - log Z)
    share[t, j, i] = p[t+1, i] * exp((alpha[t, j] + tr[t, j, i]) - moved[t+1, i]),
    p[t, j] = sum_i share[t, j, i],

with ``moved[t+1, i]`` the forward pass's own sum into i (``alpha - e``).

Nearly all the time goes to one ``exp`` per move and turn, so the ``exp`` here is a
vectorizable one written out (:func:`exp_shifted`): Cody-Waite reduction by ln 2, a
Taylor polynomial in Estrin's form, the power of two built in the exponent bits. It is
within 2 ulps of the exact value over [-708, 0] in float64 and over [-87, 0] in float32
(computed in float32); :func:`log_positive`, the same way, within 4 ulps (both tested).
Below -708 (float64) or -87 (float32) ``exp_shifted`` returns 0
exactly, where the true value is below the smallest normal number: a sum that holds
its maximum's ``exp(0) = 1`` cannot see it. Fused multiply-adds are allowed inside the
``exp`` and ``log`` only (``fastmath={"contract"}``); every other operation keeps IEEE
semantics.

These results are *not* bit-equal to the torch path: torch's vectorized ``exp`` and its
reduction order differ from these. They are deterministic, and each conversation's
result depends on its own real candidates only (not on the batch, the padding or the
thread count), which the torch path does not guarantee.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .fused_cpu_kernels import INVALID, OK, OVERFLOW, _length

__all__ = ["OK", "INVALID", "OVERFLOW", "exp_shifted", "log_positive", "log_partition", "log_partition_serial",
           "marginals", "marginals_serial"]

_NEG_INF = -np.inf


def _bitcast(source, target, llvm_target):
    """An intrinsic reinterpreting a ``source`` scalar's bits as ``target`` (no conversion)."""

    @intrinsic
    def bitcast(typingctx, value):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_target)

        return target(source), codegen

    return bitcast


_bits64 = _bitcast(types.float64, types.int64, ir.IntType(64))
_float64 = _bitcast(types.int64, types.float64, ir.DoubleType())
_bits32 = _bitcast(types.float32, types.int32, ir.IntType(32))
_float32 = _bitcast(types.int32, types.float32, ir.FloatType())


# float64: 1.5 * 2**52 rounds x * log2(e) to an integer k held in the low mantissa bits;
# ln 2 split so that k * _LN2_HI_64 is exact; |r| <= ln(2) / 2 after the reduction, where
# the degree-13 Taylor remainder is below 5e-18.
_SHIFT_64 = 6755399441055744.0
_LOG2E_64 = 1.4426950408889634
_LN2_HI_64 = 6.93147180369123816490e-01
_LN2_LO_64 = 1.90821492927058770002e-10
_LOW_64 = -708.0
_HIGH_64 = 700.0
_WINDOW_64 = (math.exp(-600.0), math.exp(600.0))
_C64 = tuple(1.0 / math.factorial(n) for n in range(14))

# float32: the same construction, 1.5 * 2**23, a degree-7 polynomial (remainder 1.3e-8).
_SHIFT_32 = np.float32(12582912.0)
_LOG2E_32 = np.float32(1.4426950408889634)
_LN2_HI_32 = np.float32(0.693145751953125)
_LN2_LO_32 = np.float32(1.428606765330187045e-06)
_LOW_32 = np.float32(-87.0)
_HIGH_32 = np.float32(80.0)
_WINDOW_32 = (math.exp(-40.0), math.exp(40.0))
_ZERO_32 = np.float32(0.0)
_C32 = tuple(np.float32(1.0 / math.factorial(n)) for n in range(8))


@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def _exp64(x):
    c = _C64
    x = x if x < _HIGH_64 else _HIGH_64  # NaN too: the sum leaves the window, or is discarded
    kd = x * _LOG2E_64 + _SHIFT_64
    k = kd - _SHIFT_64
    r = (x - k * _LN2_HI_64) - k * _LN2_LO_64
    r2 = r * r
    r4 = r2 * r2
    low = ((c[0] + c[1] * r) + (c[2] + c[3] * r) * r2) + ((c[4] + c[5] * r) + (c[6] + c[7] * r) * r2) * r4
    high = ((c[8] + c[9] * r) + (c[10] + c[11] * r) * r2) + (c[12] + c[13] * r) * r4
    value = (low + high * (r4 * r4)) * _float64((_bits64(kd) + 1023) << 52)
    return value if x >= _LOW_64 else 0.0


@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def _exp32(x):
    c = _C32
    x = x if x < _HIGH_32 else _HIGH_32
    kd = x * _LOG2E_32 + _SHIFT_32
    k = kd - _SHIFT_32
    r = (x - k * _LN2_HI_32) - k * _LN2_LO_32
    r2 = r * r
    value = ((c[0] + c[1] * r) + (c[2] + c[3] * r) * r2) + ((c[4] + c[5] * r) + (c[6] + c[7] * r) * r2) * (r2 * r2)
    value = value * _float32(np.int32((_bits32(kd) + 127) << 23))
    return value if x >= _LOW_32 else _ZERO_32


def exp_shifted(x):
    """``exp(x)`` for x <= ~0 (the shifted terms of a log-sum-exp), in x's dtype.

    Exactly 0 below -708 (float64) / -87 (float32); within 2 ulps above.
    Python-level stub: the kernels use the numba overload.
    """
    return math.exp(x) if x >= (-708.0 if isinstance(x, float) else -87.0) else 0.0


# log of a positive normal number: s = 2**k * m with m in [sqrt(1/2), sqrt(2)),
# log m = 2 atanh(z) = 2 (z + z**3 / 3 + ...), z = (m - 1) / (m + 1), |z| <= 0.1716.
_SQRT2_64 = math.sqrt(2.0)
_ODD_64 = tuple(2.0 / (2 * n + 1) for n in range(10))  # 2 / (2n + 1): remainder below 1e-17
_SQRT2_32 = np.float32(math.sqrt(2.0))
_ODD_32 = tuple(np.float32(2.0 / (2 * n + 1)) for n in range(5))
_HALF_32 = np.float32(0.5)
_ONE_32 = np.float32(1.0)


@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def _log64(s):
    c = _ODD_64
    bits = _bits64(s)
    k = ((bits >> 52) & 0x7FF) - 1023
    m = _float64((bits & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000)
    big = m > _SQRT2_64
    m = m * 0.5 if big else m
    k = k + 1 if big else k
    z = (m - 1.0) / (m + 1.0)
    w = z * z
    w2 = w * w
    w4 = w2 * w2
    low = ((c[0] + c[1] * w) + (c[2] + c[3] * w) * w2) + ((c[4] + c[5] * w) + (c[6] + c[7] * w) * w2) * w4
    series = z * (low + (c[8] + c[9] * w) * (w4 * w4))
    kf = np.float64(k)
    return kf * _LN2_HI_64 + (series + kf * _LN2_LO_64)


@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def _log32(s):
    c = _ODD_32
    bits = _bits32(s)
    k = np.int32(((bits >> 23) & 0xFF) - 127)
    m = _float32(np.int32((bits & 0x007FFFFF) | 0x3F800000))
    big = m > _SQRT2_32
    m = m * _HALF_32 if big else m
    k = k + np.int32(1) if big else k
    z = (m - _ONE_32) / (m + _ONE_32)
    w = z * z
    w2 = w * w
    series = z * (((c[0] + c[1] * w) + (c[2] + c[3] * w) * w2) + c[4] * (w2 * w2))
    kf = np.float32(k)
    return kf * _LN2_HI_32 + (series + kf * _LN2_LO_32)


def log_positive(s):
    """``log(s)`` for a positive normal ``s``, in s's dtype, within 4 ulps.

    Anything else (0, subnormal, inf, NaN, negative) gives an unspecified finite or
    non-finite number: callers use it only on sums inside the trusted window.
    Python-level stub: the kernels use the numba overload.
    """
    return math.log(s)


def _by_dtype(stub, float32_version, float64_version):
    """Give the Python-level ``stub`` its numba overload: ``float32_version`` for a
    float32 argument, ``float64_version`` for a float64 one."""

    @overload(stub, jit_options={"cache": True, "nogil": True})
    def _overload(x):
        if x == types.float32:
            return lambda x: float32_version(x)
        if x == types.float64:
            return lambda x: float64_version(x)
        return None


_by_dtype(exp_shifted, _exp32, _exp64)
_by_dtype(log_positive, _log32, _log64)


@numba.njit(cache=True, nogil=True)
def _constants(like):
    """0, -inf and the trusted window of a one-pass sum, in ``like``'s dtype."""
    constants = np.zeros(4, like.dtype)
    constants[1] = _NEG_INF
    window = _WINDOW_32 if like.itemsize == 4 else _WINDOW_64
    constants[2] = window[0]
    constants[3] = window[1]
    return constants


@numba.njit(cache=True, nogil=True)
def _in_window(total, constants):
    """Whether a sum of shifted terms can be trusted (see :func:`_forward_row`)."""
    return constants[2] <= total <= constants[3]


@numba.njit(cache=True, nogil=True)
def _move_sum_exact(values, weights, keep, count, constants):
    """logsumexp_k (values[k] + weights[k]) over the k < count with keep[k], two passes
    (the maximum, then the shifted sum): the fallback of the one-pass sums."""
    top = constants[1]
    for k in range(count):
        if keep[k]:
            value = values[k] + weights[k]
            top = value if value > top else top
    total = constants[0]
    for k in range(count):
        if keep[k]:
            total += exp_shifted((values[k] + weights[k]) - top)
    return top + log_positive(total)


@numba.njit(cache=True, nogil=True)
def _forward_row(emissions, transitions, mask, b, alpha, moved, work, constants):
    """The log-semiring forward pass of row b into ``alpha`` (T, M); returns
    (length, status, log Z).

    One pass over each turn's transitions: with A the largest forward score of the
    previous turn, ``total[i] = sum_j exp((alpha[j] - A) + tr[j, i])`` and
    ``alpha[i] = (A + log total[i]) + e[i]``. A is not column i's maximum, so a sum
    outside a window (``constants[2:4]``: its terms could have underflowed or been
    clamped) is recomputed exactly, two passes over the column
    (:func:`_move_sum_exact`); with scores and transitions of ordinary spread that
    never happens. ``check[i]`` sums ``w - w`` over the weights into i from real
    candidates: 0 iff they are all finite, NaN otherwise (it cannot overflow).
    ``moved`` (T, M) gets each turn's sums before the emission (``alpha - e``), which the
    backward pass divides by. ``constants`` holds 0, -inf and the window in the row's
    dtype; ``work`` is a (4, M) workspace.
    """
    candidates = alpha.shape[1]
    total, check, logs, column = work[0], work[1], work[2], work[3]
    length = _length(mask, b)
    if length < 0:
        return length, INVALID, constants[1]
    for i in range(candidates):
        if mask[b, 0, i]:
            value = emissions[b, 0, i]
            if not np.isfinite(value):
                return length, INVALID, constants[1]
            alpha[0, i] = value
        else:
            alpha[0, i] = constants[1]
    status = OK
    for t in range(1, length):
        anchor = constants[1]
        for j in range(candidates):
            anchor = alpha[t - 1, j] if alpha[t - 1, j] > anchor else anchor
        for i in range(candidates):
            total[i] = constants[0]
            check[i] = constants[0]
        for j in range(candidates):
            if not mask[b, t - 1, j]:
                continue
            shift = alpha[t - 1, j] - anchor
            row = transitions[b, t - 1, j]
            for i in range(candidates):
                weight = row[i]
                check[i] += weight - weight  # NaN iff some weight into i is not finite
                total[i] += exp_shifted(shift + weight)
        for i in range(candidates):
            logs[i] = log_positive(total[i])  # one vector loop; used only inside the window
        for i in range(candidates):
            if mask[b, t, i]:
                emission = emissions[b, t, i]
                if not (np.isfinite(emission) and np.isfinite(check[i])):
                    return length, INVALID, constants[1]
                if _in_window(total[i], constants):
                    sum_ = anchor + logs[i]
                else:
                    for j in range(candidates):
                        column[j] = transitions[b, t - 1, j, i]
                    sum_ = _move_sum_exact(alpha[t - 1], column, mask[b, t - 1], candidates, constants)
                moved[t, i] = sum_
                value = sum_ + emission
                alpha[t, i] = value
                if not np.isfinite(value):
                    status = OVERFLOW
            else:
                alpha[t, i] = constants[1]
    last = length - 1
    zeros = total
    for i in range(candidates):
        zeros[i] = constants[0]
    log_z = _move_sum_exact(alpha[last], zeros, mask[b, last], candidates, constants)
    if not np.isfinite(log_z):
        status = OVERFLOW
    return length, status, log_z


@numba.njit(cache=True, nogil=True)
def _backward_row(transitions, mask, b, length, log_z, alpha, moved, flipped, out, pairs, constants):
    """Posterior marginals of row b into ``out`` (T, M), and its pair marginals into
    ``pairs`` (T-1, M, M) unless that is empty, from its forward scores.

    As reverse-mode differentiation of log Z computes them, one local share at a time
    (so nothing grows with the scores' magnitude and nothing can overflow):
    ``p[L-1, i] = exp(alpha[L-1, i] - log Z)``, then for each move

        share[t, j, i] = p[t+1, i] * exp((alpha[t, j] + tr[t, j, i]) - moved[t+1, i])

    (the part of candidate i's weight that arrives from j, against the forward pass's
    own sum ``moved`` into i: the shares into i sum to ``p[t+1, i]``), and
    ``p[t, j] = sum_i share[t, j, i]``. The turn's transitions are
    transposed into ``flipped`` (0 where a move touches a masked candidate) so that the
    sum over i runs along contiguous memory for every j at once.
    """
    turns, candidates = out.shape
    zero = constants[0]
    writes_pairs = pairs.shape[0] > 0
    for t in range(turns):
        for i in range(candidates):
            out[t, i] = zero
    last = length - 1
    if writes_pairs:  # the moves after the conversation's end (the others are all written below)
        for t in range(max(last, 0), pairs.shape[0]):
            for j in range(candidates):
                for i in range(candidates):
                    pairs[t, j, i] = zero
    for i in range(candidates):
        if mask[b, last, i]:
            out[last, i] = exp_shifted(alpha[last, i] - log_z)
    for t in range(last - 1, -1, -1):
        for j in range(candidates):
            row = transitions[b, t, j]
            real = mask[b, t, j]
            for i in range(candidates):
                flipped[i, j] = row[i] if real and mask[b, t + 1, i] else zero
        for i in range(candidates):
            if not mask[b, t + 1, i]:
                continue
            into = out[t + 1, i]
            sum_ = moved[t + 1, i]
            moves = flipped[i]
            for j in range(candidates):  # alpha[t, j] = -inf at a masked j: its share is 0
                share = into * exp_shifted((alpha[t, j] + moves[j]) - sum_)
                moves[j] = share
                out[t, j] += share
        if writes_pairs:  # flipped[i] holds i's shares, or zeros for a masked i
            for j in range(candidates):
                for i in range(candidates):
                    pairs[t, j, i] = flipped[i, j]


@numba.njit(cache=True, nogil=True)
def _block(emissions, transitions, mask, log_z, status, posteriors, pairs, scores, sums, reuse, block, blocks):
    """Rows block, block + blocks, ...: log Z, the marginals when ``posteriors`` is not
    empty, the pair marginals when ``pairs`` is not empty (one workspace per block).

    ``scores`` and ``sums`` (B, T, M), unless empty, keep each row's forward scores and
    sums (``alpha`` and ``moved`` of :func:`_forward_row`; garbage after the row's
    end); with ``reuse`` they and ``log_z``, ``status`` are inputs, from an earlier
    forward pass, and only the backward pass runs.
    """
    turns, candidates = mask.shape[1], mask.shape[2]
    local_alpha = np.empty((turns, candidates), emissions.dtype)
    local_moved = np.empty((turns, candidates), emissions.dtype)
    work = np.empty((4, candidates), emissions.dtype)
    flipped = np.empty((candidates, candidates), emissions.dtype)
    constants = _constants(emissions)
    backward = posteriors.shape[0] > 0
    kept = scores.shape[0] > 0
    no_pairs = np.empty((0, 0, 0), emissions.dtype)
    for b in range(block, mask.shape[0], blocks):
        alpha = scores[b] if kept else local_alpha
        moved = sums[b] if kept else local_moved
        if reuse:
            length, row_status, value = _length(mask, b), status[b], log_z[b]
        else:
            length, row_status, value = _forward_row(emissions, transitions, mask, b, alpha, moved, work, constants)
            log_z[b] = value
            status[b] = row_status
        if backward and row_status == OK:
            _backward_row(
                transitions, mask, b, length, value, alpha, moved, flipped, posteriors[b],
                pairs[b] if pairs.shape[0] > 0 else no_pairs, constants,
            )


@numba.njit(cache=True, parallel=True)
def log_partition(emissions, transitions, mask, log_z, status, scores, sums, blocks):
    """log Z of every row into ``log_z`` (B,), ``blocks`` threads (see :mod:`.fused`);
    the forward scores and sums kept in ``scores``, ``sums`` unless they are empty."""
    for block in numba.prange(blocks):
        _block(emissions, transitions, mask, log_z, status, _no_posteriors(emissions), _no_pairs(emissions), scores,
               sums, False, block, blocks)


@numba.njit(cache=True, nogil=True)
def log_partition_serial(emissions, transitions, mask, log_z, status, scores, sums):
    """:func:`log_partition` on the calling thread."""
    _block(emissions, transitions, mask, log_z, status, _no_posteriors(emissions), _no_pairs(emissions), scores, sums,
           False, 0, 1)


@numba.njit(cache=True, parallel=True)
def marginals(emissions, transitions, mask, log_z, status, posteriors, pairs, scores, sums, reuse, blocks):
    """log Z (B,), the marginals (B, T, M) and, unless ``pairs`` is empty, the pair
    marginals (B, T-1, M, M) of every row, ``blocks`` threads; with ``reuse``, from the
    forward pass kept in ``log_z``, ``status``, ``scores`` and ``sums``."""
    for block in numba.prange(blocks):
        _block(emissions, transitions, mask, log_z, status, posteriors, pairs, scores, sums, reuse, block, blocks)


@numba.njit(cache=True, nogil=True)
def marginals_serial(emissions, transitions, mask, log_z, status, posteriors, pairs, scores, sums, reuse):
    """:func:`marginals` on the calling thread."""
    _block(emissions, transitions, mask, log_z, status, posteriors, pairs, scores, sums, reuse, 0, 1)


@numba.njit(cache=True, nogil=True)
def _no_posteriors(like):
    return np.empty((0, 0, 0), like.dtype)


@numba.njit(cache=True, nogil=True)
def _no_pairs(like):
    return np.empty((0, 0, 0, 0), like.dtype)
