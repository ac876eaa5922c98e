"""numba kernel of one incremental max-plus step (imported only when numba is installed).

See :mod:`.fused_step` for the contract: the arithmetic of
:func:`~mapmatched_torch.kernels.chain.chain_step` (max-plus) for S conversations in one
pass, in the same order (predecessor plus transition, the first maximum, plus the
emission), with additions, comparisons and selects only, so the results are the torch
path's bit for bit.
"""

from __future__ import annotations

import math

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _row(s, previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
         links, nonfinite, constants, from_distances, negative_beta, factors):
    """With ``from_distances`` the transitions are ``distances * negative_beta`` rounded to
    the table's dtype (``weighted_transitions``), made here (``transitions`` unread); with
    ``from_distances`` and a non-empty ``factors`` (S, M) (a learned model's per-move
    factor ``-(beta * gate)``), they are ``transitions[s, j, i] * factors[s, j]`` rounded
    likewise, ``transitions`` then holding the (calibrated) float64 distances the moves
    weigh (``distances`` stay the raw ones, for the links).

    The predecessor loop is the outer one, so the inner loop runs along a row of the
    transitions and vectorizes; ``alpha[s]`` and ``backpointers[s]`` hold the running
    maximum and its first index until the emissions are added. A NaN sum wins over
    any number and stays, as in ``torch.max`` (the first NaN and its index). The
    update is written out in each of the three loops: as a called function (even
    inlined) it costs each element an array-argument call, 20x the step's time.
    """
    width = emissions.shape[1]
    zero, negative = constants[0], constants[1]  # 0 and -inf in the table's dtype: no float64 promotion
    cast = constants.dtype.type  # rounds a float64 as torch's cast to the table's dtype
    best = alpha[s]
    best_j = backpointers[s]
    real = mask[s]
    first = started[s]
    for j in range(width):
        allowed = previous_allowed[s, j]
        if first:
            before = previous[s, j] if allowed else negative
        else:
            before = zero
        if not allowed:
            value = before + zero  # every move from j is 0
            for i in range(width):
                if j == 0 or value > best[i] or (value != value and best[i] == best[i]):
                    best[i] = value
                    best_j[i] = j
        elif from_distances and factors.shape[0] > 0:
            row = transitions[s, j]
            factor = factors[s, j]
            for i in range(width):
                value = before + (cast(row[i] * factor) if real[i] else zero)
                if j == 0 or value > best[i] or (value != value and best[i] == best[i]):
                    best[i] = value
                    best_j[i] = j
        elif from_distances:
            row = distances[s, j]
            for i in range(width):
                value = before + (cast(row[i] * negative_beta) if real[i] else zero)
                if j == 0 or value > best[i] or (value != value and best[i] == best[i]):
                    best[i] = value
                    best_j[i] = j
        else:
            row = transitions[s, j]
            for i in range(width):
                value = before + (row[i] if real[i] else zero)
                if j == 0 or value > best[i] or (value != value and best[i] == best[i]):
                    best[i] = value
                    best_j[i] = j
    bad = False
    for i in range(width):
        stepped = (best[i] + emissions[s, i]) if first else emissions[s, i]
        if real[i]:
            alpha[s, i] = stepped
            if not math.isfinite(stepped):
                bad = True
        else:
            alpha[s, i] = negative
        links[s, i] = distances[s, best_j[i], i]
    nonfinite[s] = bad


@numba.njit(cache=True, nogil=True)
def step_serial(previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
                links, nonfinite, constants, from_distances, negative_beta, factors):
    for s in range(emissions.shape[0]):
        _row(s, previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
             links, nonfinite, constants, from_distances, negative_beta, factors)


@numba.njit(cache=True, nogil=True, parallel=True)
def step_parallel(previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
                  links, nonfinite, constants, from_distances, negative_beta, factors, blocks):
    rows = emissions.shape[0]
    for block in numba.prange(blocks):
        for s in range(block * rows // blocks, (block + 1) * rows // blocks):
            _row(s, previous, previous_allowed, started, emissions, mask, transitions, distances, alpha,
                 backpointers, links, nonfinite, constants, from_distances, negative_beta, factors)


#: Slots whose back-pointer chains one backtrack group follows side by side.
_GROUP = 8


@numba.njit(cache=True, nogil=True)
def backtrack_serial(backpointers, link_distances, slots, lengths, last, paths, distances):
    """Each slot's path from its chosen last candidate back to turn 0 (``paths`` and
    ``distances`` (S, T), -1 and 0.0 after the slot's length).

    A chain is one dependent load per turn, each likely a cache miss in a large table;
    following :data:`_GROUP` slots' chains a turn at a time keeps that many loads in
    flight instead of one.
    """
    turns = paths.shape[1]
    count = slots.shape[0]
    chosen = np.empty(_GROUP, np.int64)
    for first in range(0, count, _GROUP):
        group = min(_GROUP, count - first)
        for k in range(group):
            chosen[k] = last[first + k]
        for t in range(turns - 1, -1, -1):
            for k in range(group):
                s = first + k
                if t >= lengths[s]:
                    paths[s, t] = -1
                    distances[s, t] = 0.0
                    continue
                paths[s, t] = chosen[k]
                if t > 0:
                    slot = slots[s]
                    distances[s, t] = link_distances[slot, t, chosen[k]]
                    chosen[k] = backpointers[slot, t, chosen[k]]
                else:
                    distances[s, t] = 0.0


@numba.njit(cache=True, nogil=True)
def first_occurrences(listed, seen, base, out, kept):
    """Each row's codes >= 0 in order, each code's first occurrence only, into
    ``out[s, :kept[s]]`` (``out`` pre-filled with -1). ``seen`` (one entry per code,
    every entry below ``base``) is scratch: row s stamps a code it keeps ``base + s``."""
    for s in range(listed.shape[0]):
        count = 0
        stamp = base + s
        for k in range(listed.shape[1]):
            code = listed[s, k]
            if code < 0 or seen[code] == stamp:
                continue
            seen[code] = stamp
            out[s, count] = code
            count += 1
        kept[s] = count


@numba.njit(cache=True, nogil=True)
def check_rows(slots, live, codes, raw, code_count, flags, slot_uses, seen, base, status, kept, kept_raw, counts):
    """The row checks of a serving step in one pass (see :func:`.fused_step.checked_rows`).

    ``flags`` holds the status codes in check order: unknown slot, repeated slot, code
    out of range, gapped, non-finite score, duplicate, empty. ``slot_uses`` (one entry
    per slot, zeros) and ``seen`` (one per code, every entry below ``base``; row s
    stamps its codes ``base + s``) are scratch.
    """
    rows, columns = codes.shape
    width = kept.shape[1]
    capacity = live.shape[0]
    for s in range(rows):
        slot = slots[s]
        if 0 <= slot < capacity and live[slot]:
            slot_uses[slot] += 1
    for s in range(rows):
        for i in range(width):
            code = codes[s, i] if i < columns else -1
            kept[s, i] = code
            kept_raw[s, i] = raw[s, i] if code >= 0 else 0.0
        slot = slots[s]
        if not (0 <= slot < capacity and live[slot]):
            status[s] = flags[0]
            continue
        if slot_uses[slot] > 1:
            status[s] = flags[1]
            continue
        out_of_range = False
        gapped = False
        nonfinite = False
        ended = False
        for i in range(columns):
            code = codes[s, i]
            if code < -1 or code >= code_count:
                out_of_range = True
            if code >= 0:
                if ended:
                    gapped = True
                if not math.isfinite(raw[s, i]):
                    nonfinite = True
            else:
                ended = True
        if out_of_range:
            status[s] = flags[2]
            continue
        if gapped:
            status[s] = flags[3]
            continue
        if nonfinite:
            status[s] = flags[4]
            continue
        count = 0
        duplicate = False
        for i in range(width):
            code = kept[s, i]
            if code >= 0:
                if seen[code] == base + s:
                    duplicate = True
                seen[code] = base + s
                count += 1
        if duplicate:
            status[s] = flags[5]
        elif count == 0:
            status[s] = flags[6]
        else:
            status[s] = 0
            counts[s] = count
