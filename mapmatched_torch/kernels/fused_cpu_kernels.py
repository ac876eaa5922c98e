"""numba kernels of the fused CPU decoders (imported only when numba is installed).

See :mod:`.fused` for the contract. One conversation is one unit of work: its whole
trellis is decoded by one thread, reading each transition once, with the recursion of
:mod:`.chain` evaluated in the same order (predecessor plus transition, then the
first maximum, then the emission), so results equal the torch path bit for bit. The
kernels only add, compare and select: there is no multiply that could be contracted
into an FMA, and numba's default (no fastmath) keeps IEEE semantics.

Two entry points share one forward pass (:func:`_forward_row`): :func:`decode`
(Viterbi or fixed-lag paths, scores and locks) and :func:`forward_scores` (the
forward scores themselves, under given locks or, online, under the fixed-lag
commitments as they stand after each turn).

Row status codes written to ``status``: :data:`OK`, :data:`INVALID` (the trellis
breaks a rule of :func:`~mapmatched_torch.kernels.checks.prepare`: an empty first
turn, a real turn after an empty one, a non-finite emission at a real candidate or a
non-finite transition between real candidates, or a given lock that is neither -1
nor a real candidate; the caller re-runs the torch checks to raise their exact
message) and :data:`OVERFLOW` (a forward score at a real
candidate is not finite).
"""

from __future__ import annotations

import numba
import numpy as np

OK = 0
INVALID = 1
OVERFLOW = 2

_NEG_INF = -np.inf


@numba.njit(cache=True, nogil=True)
def _length(mask, b):
    """Leading real turns of row b, or -1 when the first turn is empty or a real turn
    follows an empty one."""
    turns, candidates = mask.shape[1], mask.shape[2]
    length = 0
    ended = False
    for t in range(turns):
        real = False
        for i in range(candidates):
            if mask[b, t, i]:
                real = True
                break
        if real:
            if ended:
                return -1
            length += 1
        else:
            ended = True
    return length if length > 0 else -1


@numba.njit(cache=True, nogil=True)
def _start(emissions, mask, b, alpha):
    """Turn 0: alpha[0] = e[0] at real candidates, -inf elsewhere. False on a
    non-finite emission."""
    for i in range(alpha.shape[1]):
        if mask[b, 0, i]:
            value = emissions[b, 0, i]
            if not np.isfinite(value):
                return False
            alpha[0, i] = value
        else:
            alpha[0, i] = _NEG_INF
    return True


@numba.njit(cache=True, nogil=True)
def _advance(emissions, transitions, mask, b, t, alpha, backpointers, best, check, lock):
    """alpha[t, i] = max_j (alpha[t-1, j] + tr[t-1, j, i]) + e[t, i] (first maximum).

    ``lock`` >= 0 allows only that candidate at turn t (the others get -inf and are
    not checked for overflow, as the torch path restricts the mask to the lock); -1
    allows every real one. Returns OK, INVALID (a non-finite transition between real
    candidates, or a non-finite emission at a real one, locked out or not) or
    OVERFLOW (a non-finite score at an allowed candidate).
    """
    candidates = alpha.shape[1]
    for i in range(candidates):
        best[i] = _NEG_INF
        backpointers[t, i] = 0
        check[i] = 0.0
    for j in range(candidates):
        if not mask[b, t - 1, j]:
            continue  # -inf plus anything never wins a max (and garbage may be NaN)
        previous = alpha[t - 1, j]
        row = transitions[b, t - 1, j]
        for i in range(candidates):
            weight = row[i]
            check[i] += weight - weight  # NaN iff some weight into i is not finite
            value = previous + weight
            if value > best[i]:
                best[i] = value
                backpointers[t, i] = j
    status = OK
    for i in range(candidates):
        if mask[b, t, i]:
            emission = emissions[b, t, i]
            if not (np.isfinite(emission) and check[i] == 0.0):
                return INVALID
            if lock >= 0 and i != lock:
                alpha[t, i] = _NEG_INF
                continue
            value = best[i] + emission
            alpha[t, i] = value
            if not np.isfinite(value):
                status = OVERFLOW
        else:
            alpha[t, i] = _NEG_INF
    return status


@numba.njit(cache=True, nogil=True)
def _first_max(alpha, t):
    """(value, index) of the first maximum of alpha[t]."""
    top = alpha[t, 0]
    index = 0
    for i in range(1, alpha.shape[1]):
        if alpha[t, i] > top:
            top = alpha[t, i]
            index = i
    return top, index


@numba.njit(cache=True, nogil=True)
def _locks_valid(mask, locks, b, length):
    """Every given lock of row b's real turns is -1 or a real candidate (the torch check's rule)."""
    candidates = mask.shape[2]
    for t in range(length):
        lock = locks[b, t]
        if lock != -1 and (lock < 0 or lock >= candidates or not mask[b, t, lock]):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _forward_row(emissions, transitions, mask, locks, lag, b, committed, out, alpha, backpointers, best, check):
    """The forward pass of row b into ``alpha``; returns (length, status).

    Args (beyond the workspaces):
        locks: (B, T) given locks, -1 = unlocked (an empty array: none given).
        lag: >= 0: after each turn t >= lag, commit turn t - lag to the prefix
            decode's choice (written to ``committed[t - lag]``, a (T,) row) and
            recompute turns t - lag + 1..t under it; -1: no commitment.
        out: (T, M) row that gets alpha[t] as it stands at the end of turn t, or an
            empty array (nothing written).
    """
    candidates = alpha.shape[1]
    length = _length(mask, b)
    if length < 0 or not _start(emissions, mask, b, alpha):
        return length, INVALID
    given = locks.shape[0] > 0
    if given and not _locks_valid(mask, locks, b, length):
        return length, INVALID
    writes = out.shape[0] > 0
    row_status = OK
    for t in range(length):
        lock = locks[b, t] if given else -1
        if t:
            stepped = _advance(emissions, transitions, mask, b, t, alpha, backpointers, best, check, lock)
            if stepped == INVALID:
                return length, INVALID
            if stepped == OVERFLOW:
                row_status = OVERFLOW
        elif lock >= 0:
            for i in range(candidates):
                if i != lock:
                    alpha[0, i] = _NEG_INF
        if lag >= 0 and t >= lag:
            # commit turn t - lag to the prefix decode's choice, recompute the tail
            first = t - lag
            _, chosen = _first_max(alpha, t)
            for s in range(t, first, -1):
                chosen = backpointers[s, chosen]
            committed[first] = chosen
            for i in range(candidates):
                if i != chosen:
                    alpha[first, i] = _NEG_INF
            for s in range(first + 1, t + 1):
                if _advance(emissions, transitions, mask, b, s, alpha, backpointers, best, check, -1) == OVERFLOW:
                    row_status = OVERFLOW
        if writes:
            for i in range(candidates):
                out[t, i] = alpha[t, i]
    return length, row_status


@numba.njit(cache=True, nogil=True)
def _decode_row(emissions, transitions, mask, lag, b, paths, scores, locks, status, alpha, backpointers, best, check):
    """Decode row b (lag < 0: full Viterbi; else fixed lag ``lag``) into the outputs."""
    turns = mask.shape[1]
    for t in range(turns):
        paths[b, t] = -1
        locks[b, t] = -1
    scores[b] = _NEG_INF
    length, row_status = _forward_row(
        emissions, transitions, mask, np.empty((0, 0), np.int64), lag, b, locks[b],
        np.empty((0, 0), alpha.dtype), alpha, backpointers, best, check,
    )
    status[b] = row_status
    if row_status == INVALID:
        return
    top, chosen = _first_max(alpha, length - 1)
    scores[b] = top
    for t in range(length - 1, -1, -1):
        paths[b, t] = chosen
        chosen = backpointers[t, chosen]


@numba.njit(cache=True, nogil=True)
def _decode_block(emissions, transitions, mask, lag, paths, scores, locks, status, block, blocks):
    """Rows block, block + blocks, ... (one workspace per block)."""
    turns, candidates = mask.shape[1], mask.shape[2]
    alpha = np.empty((turns, candidates), emissions.dtype)
    backpointers = np.zeros((turns, candidates), np.int32)
    best = np.empty(candidates, emissions.dtype)
    check = np.empty(candidates, emissions.dtype)
    for b in range(block, mask.shape[0], blocks):
        _decode_row(emissions, transitions, mask, lag, b, paths, scores, locks, status, alpha, backpointers, best, check)


@numba.njit(cache=True, parallel=True)
def decode(emissions, transitions, mask, lag, paths, scores, locks, status, blocks):
    """Decode every row, ``blocks`` threads (see :mod:`.fused` for the arguments)."""
    for block in numba.prange(blocks):
        _decode_block(emissions, transitions, mask, lag, paths, scores, locks, status, block, blocks)


@numba.njit(cache=True, nogil=True)
def decode_serial(emissions, transitions, mask, lag, paths, scores, locks, status):
    """:func:`decode` on the calling thread."""
    _decode_block(emissions, transitions, mask, lag, paths, scores, locks, status, 0, 1)


@numba.njit(cache=True, nogil=True)
def _forward_block(emissions, transitions, mask, locks, lag, out, status, block, blocks):
    """Forward scores of rows block, block + blocks, ... (one workspace per block)."""
    turns, candidates = mask.shape[1], mask.shape[2]
    alpha = np.empty((turns, candidates), emissions.dtype)
    backpointers = np.zeros((turns, candidates), np.int32)
    best = np.empty(candidates, emissions.dtype)
    check = np.empty(candidates, emissions.dtype)
    committed = np.empty(turns, np.int64)
    for b in range(block, mask.shape[0], blocks):
        for t in range(turns):
            for i in range(candidates):
                out[b, t, i] = _NEG_INF
        _, status[b] = _forward_row(
            emissions, transitions, mask, locks, lag, b, committed, out[b], alpha, backpointers, best, check
        )


@numba.njit(cache=True, parallel=True)
def forward_scores(emissions, transitions, mask, locks, lag, out, status, blocks):
    """Forward scores of every row into ``out`` (B, T, M), ``blocks`` threads (see :mod:`.fused`)."""
    for block in numba.prange(blocks):
        _forward_block(emissions, transitions, mask, locks, lag, out, status, block, blocks)


@numba.njit(cache=True, nogil=True)
def forward_scores_serial(emissions, transitions, mask, locks, lag, out, status):
    """:func:`forward_scores` on the calling thread."""
    _forward_block(emissions, transitions, mask, locks, lag, out, status, 0, 1)
