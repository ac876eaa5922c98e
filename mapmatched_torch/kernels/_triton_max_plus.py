"""Triton kernels of the fused max-plus decoders (Viterbi, fixed lag, forward scores).

Imported only when triton is installed (through :mod:`.triton_runtime`); see
:mod:`.fused` for the contract, which the numba kernels of :mod:`.fused_cpu_kernels`
implement on the CPU. One program decodes one conversation: its forward scores live
in registers as one ``BLOCK_M`` vector, each turn's ``(BLOCK_M, BLOCK_M)`` tile of
transitions is read once, and the step is

    vals[j, i] = alpha[t-1, j] + tr[t-1, j, i]     (masked j: -inf)
    bp[t, i]   = the first j with the largest vals[j, i]
    alpha[t, i] = vals[bp[t, i], i] + e[t, i]

evaluated in exactly the torch path's order (predecessor plus transition, then the
maximum, then the emission): additions, comparisons and selects only, so the results
equal the torch path bit for bit in float32 and float64, ties to the first index and
signs of zero included (the maximum is read back at its first index, not taken from a
reduction that may return either zero). Backpointers, and for the fixed lag the
forward scores, are kept in ``(B, T, M)`` workspaces in global memory; the program
reads back what it wrote only after ``tl.debug_barrier()``.

The row structure (real turns first, at least one) and given locks are checked on
the device by :func:`launch_checks` before the launch, with tensor operations (no host
read); a row that breaks them is not decoded and gets status INVALID, as do rows with a
non-finite emission at a real candidate or a non-finite transition between real
candidates (flagged by the kernel). The caller then re-runs the torch checks to raise
their exact message.

Cost: O(B T M^2) time (times L + 1 with a lag), one read of each transition; the
workspaces take 8 or 12 bytes per (b, t, m).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .backend import INVALID, OK
from .triton_runtime import block_for, check_device, import_triton, warps_for

triton = import_triton()
tl = triton.language

__all__ = ["decode", "forward_scores", "launch_checks"]


@triton.jit
def _is_finite(x):
    # x - x is 0 for a finite x and NaN for +-inf and NaN (NaN != 0 holds)
    return (x - x) == 0


@triton.jit
def _load_tile(ptr, offs, inside, M):
    """The ``(BLOCK_M, BLOCK_M)`` tile of an ``(M, M)`` block ``[from, to]`` at ``ptr`` (0 outside it)."""
    return tl.load(ptr + offs[:, None] * M + offs[None, :], mask=inside[:, None] & inside[None, :], other=0.0)


@triton.jit
def _first_max_index(values, offs, BLOCK_M: tl.constexpr):
    """The first index of the largest entry of a (BLOCK_M,) vector, as an int32 scalar.
    Written out rather than ``tl.argmax``: its ``tie_break_left`` is ignored by the
    interpreter (numpy's argmax is always leftmost), so only an explicit rule is
    proven the same in both modes."""
    top = tl.max(values, axis=0)
    return tl.min(tl.where(values == top, offs, BLOCK_M), axis=0).to(tl.int32)


@triton.jit
def _step(alpha_prev, real_prev, tr_ptr, offs, inside, M, BLOCK_M: tl.constexpr):
    """One max-plus step over a (BLOCK_M, BLOCK_M) tile: (best, bp, bad columns)."""
    tile = _load_tile(tr_ptr, offs, inside, M)
    vals = alpha_prev[:, None] + tile
    vals = tl.where(real_prev[:, None], vals, float("-inf"))
    # the first j with the largest value of each column (see _first_max_index)
    top = tl.max(vals, axis=0)
    bp = tl.min(tl.where(vals == top[None, :], offs[:, None], BLOCK_M), axis=0)
    # the maximum read back at its first index (keeps the sign of a zero as the torch path does)
    best = tl.max(tl.where(offs[:, None] == bp[None, :], vals, float("-inf")), axis=0)
    bad = tl.max(tl.where(real_prev[:, None] & (_is_finite(tile) == 0), 1, 0), axis=0) > 0
    return best, bp.to(tl.int32), bad


@triton.jit
def _load_turn(mask_ptr, em_ptr, at, offs, inside):
    """``(real, emission)``: one turn's mask and emissions, its row starting at ``at``."""
    real = (tl.load(mask_ptr + at + offs, mask=inside, other=0) != 0) & inside
    emission = tl.load(em_ptr + at + offs, mask=inside, other=0.0)
    return real, emission


@triton.jit
def _advance(alpha, real_prev, lock, mask_ptr, em_ptr, tr_ptr, alpha_ptr, bp_ptr, row, moves, t, offs, inside, M,
             BLOCK_M: tl.constexpr):
    """Turn t from turn t-1's scores ``alpha``, only ``lock`` allowed when it is >= 0:
    ``(real, alpha, invalid, overflowed)`` vectors, the scores and back-pointers stored
    in the workspaces."""
    real, emission = _load_turn(mask_ptr, em_ptr, row + t * M, offs, inside)
    best, bp, bad_columns = _step(alpha, real_prev, tr_ptr + moves + (t - 1) * M * M, offs, inside, M, BLOCK_M)
    invalid = real & ((_is_finite(emission) == 0) | bad_columns)
    allowed = real & ((lock < 0) | (offs == lock))
    value = best + emission
    alpha = tl.where(allowed, value, float("-inf"))
    overflowed = allowed & (_is_finite(value) == 0)
    tl.store(alpha_ptr + row + t * M + offs, alpha, mask=inside)
    tl.store(bp_ptr + row + t * M + offs, bp, mask=inside)
    return real, alpha, invalid, overflowed


@triton.jit
def _max_plus_kernel(
    em_ptr, tr_ptr, mask_ptr, length_ptr, given_ptr,
    paths_ptr, scores_ptr, locks_ptr, status_ptr, out_ptr,
    alpha_ptr, bp_ptr,
    T, M, lag,
    BLOCK_M: tl.constexpr, GIVEN: tl.constexpr, LAGGED: tl.constexpr, WRITES: tl.constexpr, DECODES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_M)
    inside = offs < M
    length = tl.load(length_ptr + b)
    row = b * T * M
    moves = b * (T - 1) * M * M
    bad = tl.zeros((BLOCK_M,), dtype=tl.int1)
    over = tl.zeros((BLOCK_M,), dtype=tl.int1)
    if length > 0:
        # turn 0
        real, emission = _load_turn(mask_ptr, em_ptr, row, offs, inside)
        bad = bad | (real & (_is_finite(emission) == 0))
        alpha = tl.where(real, emission, float("-inf"))
        if GIVEN:
            lock = tl.load(given_ptr + b * T)
            alpha = tl.where((lock < 0) | (offs == lock), alpha, float("-inf"))
        tl.store(alpha_ptr + row + offs, alpha, mask=inside)
        tl.store(bp_ptr + row + offs, tl.zeros((BLOCK_M,), dtype=tl.int32), mask=inside)
        if LAGGED:
            if lag == 0:
                chosen = _first_max_index(alpha, offs, BLOCK_M)
                tl.store(locks_ptr + b * T, chosen.to(tl.int64))
                alpha = tl.where(offs == chosen, alpha, float("-inf"))
                tl.store(alpha_ptr + row + offs, alpha, mask=inside)
        if WRITES:
            tl.store(out_ptr + row + offs, alpha, mask=inside)
        for t in range(1, length):
            if GIVEN:
                lock = tl.load(given_ptr + b * T + t)
            else:
                lock = -1
            real, alpha, invalid, overflowed = _advance(
                alpha, real, lock, mask_ptr, em_ptr, tr_ptr, alpha_ptr, bp_ptr, row, moves, t, offs, inside, M, BLOCK_M
            )
            bad = bad | invalid
            over = over | overflowed
            if LAGGED:
                if t >= lag:
                    # commit turn t - lag to the prefix decode's choice, recompute the tail
                    first = t - lag
                    tl.debug_barrier()
                    chosen = _first_max_index(alpha, offs, BLOCK_M)
                    for k in range(0, lag):
                        chosen = tl.load(bp_ptr + row + (t - k) * M + chosen)
                    tl.store(locks_ptr + b * T + first, chosen.to(tl.int64))
                    alpha = tl.load(alpha_ptr + row + first * M + offs, mask=inside, other=float("-inf"))
                    alpha = tl.where(offs == chosen, alpha, float("-inf"))
                    tl.store(alpha_ptr + row + first * M + offs, alpha, mask=inside)
                    real, _ = _load_turn(mask_ptr, em_ptr, row + first * M, offs, inside)
                    for s in range(first + 1, t + 1):
                        real, alpha, _, overflowed = _advance(
                            alpha, real, -1, mask_ptr, em_ptr, tr_ptr, alpha_ptr, bp_ptr, row, moves, s, offs, inside,
                            M, BLOCK_M
                        )
                        over = over | overflowed
            if WRITES:
                tl.store(out_ptr + row + t * M + offs, alpha, mask=inside)
        if DECODES:
            tl.debug_barrier()
            chosen = _first_max_index(alpha, offs, BLOCK_M)
            top = tl.max(tl.where(offs == chosen, alpha, float("-inf")), axis=0)
            tl.store(scores_ptr + b, top)
            for k in range(0, length):
                t = length - 1 - k
                tl.store(paths_ptr + b * T + t, chosen.to(tl.int64))
                chosen = tl.load(bp_ptr + row + t * M + chosen)
    flagged = tl.max(bad.to(tl.int32), axis=0)
    overflowed = tl.max(over.to(tl.int32), axis=0)
    tl.store(status_ptr + b, tl.where(flagged > 0, 1, tl.where(overflowed > 0, 2, 0)).to(tl.int8))


def launch_checks(mask: Tensor, given: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(lengths (B,) int32, rows_ok (B,) bool)`` on the mask's device, no host read.

    A row is decodable when its first turn has a real candidate, its real turns come
    first, and each given lock of a real turn is -1 or a real candidate. ``lengths``
    is the row's number of real turns where it is decodable, 0 elsewhere (the kernel
    skips it).
    """
    batch, turns, candidates = mask.shape
    # shape: (B, T)
    real = mask.any(dim=-1)
    lengths = real.sum(dim=1)
    leading = torch.arange(turns, device=mask.device) < lengths.unsqueeze(1)
    rows_ok = (lengths > 0) & (real == leading).all(dim=1)
    if given is not None:
        within = (given >= 0) & (given < candidates)
        hit = mask.gather(2, given.clamp(0, max(candidates - 1, 0)).unsqueeze(2)).squeeze(2)
        rows_ok &= ((given == -1) | (within & hit) | ~leading).all(dim=1)
    return torch.where(rows_ok, lengths, 0).to(torch.int32), rows_ok


def _launch(
    emissions: Tensor, transitions: Tensor, mask: Tensor, given: Optional[Tensor], lag: int,
    paths: Tensor, scores: Tensor, locks: Tensor, status: Tensor, out: Optional[Tensor], decodes: bool,
) -> None:
    check_device(emissions)
    batch, turns, candidates = emissions.shape
    if batch == 0:
        return
    lengths, rows_ok = launch_checks(mask, given)
    emissions = emissions.contiguous()
    # a T = 1 trellis has no moves: any pointer will do, it is never read
    transitions = transitions.contiguous() if transitions.numel() else emissions
    mask_bytes = mask.contiguous().view(torch.uint8)
    alpha = torch.empty(emissions.shape, dtype=emissions.dtype, device=emissions.device)
    backpointers = torch.empty(emissions.shape, dtype=torch.int32, device=emissions.device)
    block = block_for(candidates)
    _max_plus_kernel[(batch,)](
        emissions, transitions, mask_bytes, lengths, given if given is not None else lengths,
        paths, scores, locks, status, out if out is not None else alpha,
        alpha, backpointers,
        turns, candidates, lag,
        BLOCK_M=block, GIVEN=given is not None, LAGGED=lag >= 0, WRITES=out is not None, DECODES=decodes,
        num_warps=warps_for(block),
    )
    status.copy_(torch.where(rows_ok, status, torch.full_like(status, INVALID)))


def decode(emissions: Tensor, transitions: Tensor, mask: Tensor, lag: int,
           paths: Tensor, scores: Tensor, locks: Tensor, status: Tensor) -> None:
    """Viterbi (``lag`` -1) or fixed-lag decoding of every row into the outputs, as the
    numba ``decode`` writes them: ``paths`` (B, T) long (-1 after the end), ``scores``
    (B,), ``locks`` (B, T) long (-1 uncommitted), ``status`` (B,) int8."""
    paths.fill_(-1)
    locks.fill_(-1)
    scores.fill_(float("-inf"))
    status.fill_(OK)
    _launch(emissions, transitions, mask, None, lag, paths, scores, locks, status, None, True)


def forward_scores(emissions: Tensor, transitions: Tensor, mask: Tensor, given: Optional[Tensor], lag: int,
                   out: Tensor, status: Tensor) -> None:
    """Forward scores of every row into ``out`` (B, T, M) (-inf where not reached),
    under the given ``(B, T)`` long locks or, with ``lag`` >= 0, online under the
    fixed-lag commitments, as the numba ``forward_scores`` writes them."""
    out.fill_(float("-inf"))
    status.fill_(OK)
    batch, turns = mask.shape[:2]
    unused = torch.empty((batch, turns), dtype=torch.long, device=mask.device)
    given = given.contiguous() if given is not None else None
    _launch(emissions, transitions, mask, given, lag, unused, out, unused, status, out, False)
