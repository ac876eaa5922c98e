"""Triton kernels of the fused log-semiring passes: log Z, marginals, pair marginals.

Imported only when triton is installed (through :mod:`.triton_runtime`); see
:mod:`.fused` for the contract, which the numba kernels of :mod:`.fused_log_kernels`
implement on the CPU. One program is one conversation, as in
:mod:`._triton_max_plus`. The forward kernel runs the recursion of :mod:`.chain` in
the log semiring over each turn's ``(BLOCK_M, BLOCK_M)`` tile of transitions,

    vals[j, i]   = alpha[t-1, j] + tr[t-1, j, i]          (masked j: -inf)
    top[i]       = max_j vals[j, i]
    moved[t, i]  = top[i] + log(sum_j exp(vals[j, i] - top[i]))
    alpha[t, i]  = moved[t, i] + e[t, i]

(the torch path's ``logsumexp``: the column's own maximum shifted out, so nothing
overflows), and keeps ``alpha`` and ``moved`` for the backward kernel, which computes
the marginals as reverse-mode differentiation does, one local share per move:

    p[L-1, i]      = exp(alpha[L-1, i] - log Z)
    share[t, j, i] = p[t+1, i] * exp((alpha[t, j] + tr[t, j, i]) - moved[t+1, i])
    p[t, j]        = sum_i share[t, j, i]

Accuracy: the sums run in a tree order and ``exp`` / ``log`` are the device's
(numpy's under the interpreter; libdevice in float64 and the hardware approximations
in float32 when compiled), so results are not the torch path's bit for bit. The
tests hold them to the torch path within 1e-12 relative in float64 and 2e-5 in
float32 (log Z, marginals and pair marginals), and to brute-force enumeration.
Masked candidates, the moves that touch them and everything after a conversation's
end are exactly 0 in the marginals.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .backend import INVALID, OK
from ._triton_max_plus import _is_finite, _load_tile, _load_turn, launch_checks
from .triton_runtime import block_for, check_device, import_triton, warps_for

triton = import_triton()
tl = triton.language

__all__ = ["log_partition", "marginals"]


@triton.jit
def _forward_kernel(
    em_ptr, tr_ptr, mask_ptr, length_ptr, log_z_ptr, status_ptr, alpha_ptr, moved_ptr,
    T, M,
    BLOCK_M: tl.constexpr, KEEP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_M)
    inside = offs < M
    length = tl.load(length_ptr + b)
    row = b * T * M
    moves = b * (T - 1) * M * M
    bad = tl.zeros((BLOCK_M,), dtype=tl.int1)
    over = tl.zeros((BLOCK_M,), dtype=tl.int1)
    real, emission = _load_turn(mask_ptr, em_ptr, row, offs, inside)
    bad = bad | (real & (_is_finite(emission) == 0))
    alpha = tl.where(real, emission, float("-inf"))
    if KEEP:
        tl.store(alpha_ptr + row + offs, alpha, mask=inside)
    for t in range(1, length):
        real_prev = real
        real, emission = _load_turn(mask_ptr, em_ptr, row + t * M, offs, inside)
        tile = _load_tile(tr_ptr + moves + (t - 1) * M * M, offs, inside, M)
        vals = tl.where(real_prev[:, None], alpha[:, None] + tile, float("-inf"))
        top = tl.max(vals, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        total = tl.sum(tl.exp(vals - shift[None, :]), axis=0)
        moved = shift + tl.log(total)
        bad_columns = tl.max(tl.where(real_prev[:, None] & (_is_finite(tile) == 0), 1, 0), axis=0) > 0
        bad = bad | (real & ((_is_finite(emission) == 0) | bad_columns))
        value = moved + emission
        alpha = tl.where(real, value, float("-inf"))
        over = over | (real & (_is_finite(value) == 0))
        if KEEP:
            tl.store(alpha_ptr + row + t * M + offs, alpha, mask=inside)
            tl.store(moved_ptr + row + t * M + offs, moved, mask=inside)
    top = tl.max(alpha, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    log_z = shift + tl.log(tl.sum(tl.exp(alpha - shift), axis=0))
    flagged = tl.max(bad.to(tl.int32), axis=0)
    overflowed = tl.max(over.to(tl.int32), axis=0) + tl.where(_is_finite(log_z), 0, 1)
    tl.store(log_z_ptr + b, log_z)
    tl.store(status_ptr + b, tl.where(flagged > 0, 1, tl.where(overflowed > 0, 2, 0)).to(tl.int8))


@triton.jit
def _backward_kernel(
    tr_ptr, mask_ptr, length_ptr, log_z_ptr, status_ptr, alpha_ptr, moved_ptr, out_ptr, pairs_ptr,
    T, M,
    BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_M)
    inside = offs < M
    tile_mask = inside[:, None] & inside[None, :]
    length = tl.load(length_ptr + b)
    status = tl.load(status_ptr + b)
    if (length > 0) & (status == 0):
        row = b * T * M
        moves = b * (T - 1) * M * M
        last = length - 1
        log_z = tl.load(log_z_ptr + b)
        real = (tl.load(mask_ptr + row + last * M + offs, mask=inside, other=0) != 0) & inside
        alpha = tl.load(alpha_ptr + row + last * M + offs, mask=inside, other=float("-inf"))
        into = tl.where(real, tl.exp(alpha - log_z), 0.0)
        tl.store(out_ptr + row + last * M + offs, into, mask=inside)
        for k in range(0, last):
            t = last - 1 - k
            real_next = real
            real = (tl.load(mask_ptr + row + t * M + offs, mask=inside, other=0) != 0) & inside
            alpha = tl.load(alpha_ptr + row + t * M + offs, mask=inside, other=float("-inf"))
            moved = tl.load(moved_ptr + row + (t + 1) * M + offs, mask=inside, other=0.0)
            tile = _load_tile(tr_ptr + moves + t * M * M, offs, inside, M)
            share = into[None, :] * tl.exp((alpha[:, None] + tile) - moved[None, :])
            share = tl.where(real[:, None] & real_next[None, :], share, 0.0)
            if PAIRS:
                tl.store(pairs_ptr + moves + t * M * M + offs[:, None] * M + offs[None, :], share, mask=tile_mask)
            into = tl.sum(share, axis=1)
            tl.store(out_ptr + row + t * M + offs, into, mask=inside)


def _prepared(emissions: Tensor, transitions: Tensor, mask: Tensor):
    check_device(emissions)
    lengths, rows_ok = launch_checks(mask)
    emissions = emissions.detach().contiguous()
    transitions = transitions.detach().contiguous() if transitions.numel() else emissions
    return emissions, transitions, mask.contiguous().view(torch.uint8), lengths, rows_ok


def log_partition(emissions: Tensor, transitions: Tensor, mask: Tensor, log_z: Tensor, status: Tensor,
                  scores: Tensor, sums: Tensor) -> None:
    """log Z of every row into ``log_z`` (B,) and ``status`` (B,) int8; the forward
    scores and sums kept in ``scores``, ``sums`` (B, T, M) unless they are empty, as
    the numba ``log_partition`` writes them (garbage after a row's end)."""
    batch, turns, candidates = emissions.shape
    status.fill_(OK)
    if batch == 0:
        return
    emissions, transitions, mask_bytes, lengths, rows_ok = _prepared(emissions, transitions, mask)
    keep = scores.numel() > 0
    block = block_for(candidates)
    _forward_kernel[(batch,)](
        emissions, transitions, mask_bytes, lengths, log_z, status,
        scores if keep else log_z, sums if keep else log_z,
        turns, candidates,
        BLOCK_M=block, KEEP=keep, num_warps=warps_for(block),
    )
    status.copy_(torch.where(rows_ok, status, torch.full_like(status, INVALID)))


def marginals(emissions: Tensor, transitions: Tensor, mask: Tensor, log_z: Tensor, status: Tensor,
              posteriors: Tensor, pairs: Tensor, scores: Tensor, sums: Tensor, reuse: bool) -> None:
    """log Z, the marginals ``posteriors`` (B, T, M) and, unless ``pairs`` is empty, the
    pair marginals (B, T-1, M, M), as the numba ``marginals`` writes them; with
    ``reuse``, from the forward pass kept in ``log_z``, ``status``, ``scores``, ``sums``.
    Without ``reuse``, ``scores`` and ``sums`` may be empty (workspaces are made)."""
    batch, turns, candidates = emissions.shape
    posteriors.zero_()
    pairs.zero_()
    if batch == 0:
        return
    if not reuse:
        if scores.numel() == 0:
            scores = torch.empty(emissions.shape, dtype=emissions.dtype, device=emissions.device)
            sums = torch.empty(emissions.shape, dtype=emissions.dtype, device=emissions.device)
        log_partition(emissions, transitions, mask, log_z, status, scores, sums)
    _, transitions, mask_bytes, lengths, _ = _prepared(emissions, transitions, mask)
    with_pairs = pairs.numel() > 0
    block = block_for(candidates)
    _backward_kernel[(batch,)](
        transitions, mask_bytes, lengths, log_z, status, scores, sums, posteriors,
        pairs if with_pairs else posteriors,
        turns, candidates,
        BLOCK_M=block, PAIRS=with_pairs, num_warps=warps_for(block),
    )
