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


@numba.njit(cache=True, nogil=True)
def _row(s, previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
         links, nonfinite, constants, from_distances, negative_beta):
    """With ``from_distances`` the transitions are ``distances * negative_beta`` rounded to
    the table's dtype (``weighted_transitions``), made here (``transitions`` unread)."""
    width = emissions.shape[1]
    zero, negative = constants[0], constants[1]  # 0 and -inf in the table's dtype: no float64 promotion
    rounded = constants[2:3]  # a cell of the table's dtype: storing into it rounds as torch's cast
    bad = False
    for i in range(width):
        best = negative
        best_j = 0
        for j in range(width):
            if started[s]:
                before = previous[s, j] if previous_allowed[s, j] else negative
            else:
                before = zero
            if previous_allowed[s, j] and mask[s, i]:
                if from_distances:
                    rounded[0] = distances[s, j, i] * negative_beta
                    move = rounded[0]
                else:
                    move = transitions[s, j, i]
            else:
                move = zero
            value = before + move
            if j == 0 or value > best:
                best = value
                best_j = j
        stepped = (best + emissions[s, i]) if started[s] else emissions[s, i]
        if mask[s, i]:
            alpha[s, i] = stepped
            if not math.isfinite(stepped):
                bad = True
        else:
            alpha[s, i] = negative
        backpointers[s, i] = best_j
        links[s, i] = distances[s, best_j, i]
    nonfinite[s] = bad


@numba.njit(cache=True, nogil=True)
def step_serial(previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
                links, nonfinite, constants, from_distances, negative_beta):
    for s in range(emissions.shape[0]):
        _row(s, previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
             links, nonfinite, constants, from_distances, negative_beta)


@numba.njit(cache=True, nogil=True, parallel=True)
def step_parallel(previous, previous_allowed, started, emissions, mask, transitions, distances, alpha, backpointers,
                  links, nonfinite, constants, from_distances, negative_beta, blocks):
    rows = emissions.shape[0]
    for block in numba.prange(blocks):
        for s in range(block * rows // blocks, (block + 1) * rows // blocks):
            _row(s, previous, previous_allowed, started, emissions, mask, transitions, distances, alpha,
                 backpointers, links, nonfinite, constants, from_distances, negative_beta)


@numba.njit(cache=True, nogil=True)
def backtrack_serial(backpointers, link_distances, slots, lengths, last, paths, distances):
    """Each slot's path from its chosen last candidate back to turn 0 (``paths`` and
    ``distances`` (S, T), -1 and 0.0 after the slot's length)."""
    turns = paths.shape[1]
    for s in range(slots.shape[0]):
        slot, length = slots[s], lengths[s]
        chosen = last[s]
        for t in range(turns - 1, -1, -1):
            if t >= length:
                paths[s, t] = -1
                distances[s, t] = 0.0
                continue
            paths[s, t] = chosen
            if t > 0:
                distances[s, t] = link_distances[slot, t, chosen]
                chosen = backpointers[slot, t, chosen]
            else:
                distances[s, t] = 0.0
