"""Triton kernels of the serving step: one incremental max-plus step of S slots, and the
backtrack of their paths from the slot table.

Imported only when triton is installed (through :mod:`.triton_runtime`); see
:mod:`.fused_step` for the contract, which the numba kernels of
:mod:`.fused_step_kernels` implement on the CPU. One program is one slot.

The step is :func:`~mapmatched_torch.kernels.chain.chain_step`'s arithmetic over a
``(BLOCK_M, BLOCK_M)`` tile, in the same order, so the results are the torch path's bit
for bit:

    before[j]  = alpha[j] if started and allowed[j], -inf if started, else 0
    vals[j, i] = before[j] + (tr[j, i] if allowed[j] and real[i] else 0)
    bp[i]      = the first NaN of column i if it has one (as ``torch.max``), else the
                 first j with the largest value
    alpha'[i]  = vals[bp[i], i] + e[i] if started else e[i]   (-inf where not real)

With ``FROM_DISTANCES`` the transitions are made from the distances in the kernel,
``(d * -beta)`` rounded to the table's dtype (:func:`~.transitions.weighted_transitions`),
with floating-point contraction off (``enable_fp_fusion=False``) so that no multiply
and add fuse into an FMA. The backtrack follows each slot's back-pointers from its
chosen last candidate, one dependent load per turn.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ._triton_max_plus import _load_tile
from .triton_runtime import block_for, check_device, import_triton, warps_for

triton = import_triton()
tl = triton.language

__all__ = ["step", "backtrack"]


@triton.jit
def _step_kernel(
    prev_ptr, prev_allowed_ptr, started_ptr, em_ptr, mask_ptr, tr_ptr, dist_ptr,
    alpha_ptr, bp_ptr, links_ptr, nonfinite_ptr,
    beta_ptr, factor_ptr, M,
    BLOCK_M: tl.constexpr, FROM_DISTANCES: tl.constexpr, PER_MOVE: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_M)
    inside = offs < M
    started = tl.load(started_ptr + s) != 0
    allowed = (tl.load(prev_allowed_ptr + s * M + offs, mask=inside, other=0) != 0) & inside
    real = (tl.load(mask_ptr + s * M + offs, mask=inside, other=0) != 0) & inside
    previous = tl.load(prev_ptr + s * M + offs, mask=inside, other=0.0)
    emission = tl.load(em_ptr + s * M + offs, mask=inside, other=0.0)
    before = tl.where(started, tl.where(allowed, previous, float("-inf")), 0.0)
    if PER_MOVE:
        # a learned model: (calibrated) float64 distances in tr_ptr times -(beta * gate) of each source j
        factor = tl.load(factor_ptr + s * M + offs, mask=inside, other=0.0)
        tile = (_load_tile(tr_ptr + s * M * M, offs, inside, M) * factor[:, None]).to(previous.dtype)
    elif FROM_DISTANCES:
        # -beta read as float64 from memory: a Python float argument would arrive as float32
        negative_beta = tl.load(beta_ptr)
        tile = (_load_tile(dist_ptr + s * M * M, offs, inside, M) * negative_beta).to(previous.dtype)
    else:
        tile = _load_tile(tr_ptr + s * M * M, offs, inside, M)
    moves = tl.where(allowed[:, None] & real[None, :], tile, 0.0)
    vals = before[:, None] + moves
    vals = tl.where(inside[:, None], vals, float("-inf"))  # lanes past M are never a predecessor
    isnan = vals != vals
    first_nan = tl.min(tl.where(isnan, offs[:, None], BLOCK_M), axis=0)
    clean = tl.where(isnan, float("-inf"), vals)
    top = tl.max(clean, axis=0)
    first_top = tl.min(tl.where(clean == top[None, :], offs[:, None], BLOCK_M), axis=0)
    has_nan = first_nan < BLOCK_M
    bp = tl.where(has_nan, first_nan, first_top)
    at_bp = offs[:, None] == bp[None, :]
    gathered = tl.max(tl.where(at_bp, clean, float("-inf")), axis=0)
    # a NaN is carried as the addition made it (its sign and payload are the hardware's, as on the torch path)
    carried = tl.sum(tl.where(at_bp, vals, 0.0), axis=0)
    best = tl.where(has_nan, carried, gathered)
    stepped = tl.where(started, best + emission, emission)
    alpha = tl.where(real, stepped, float("-inf"))
    bad = real & ((stepped - stepped) != 0)
    links = tl.load(dist_ptr + s * M * M + bp * M + offs, mask=inside, other=0.0)
    tl.store(alpha_ptr + s * M + offs, alpha, mask=inside)
    tl.store(bp_ptr + s * M + offs, bp.to(tl.int64), mask=inside)
    tl.store(links_ptr + s * M + offs, links, mask=inside)
    tl.store(nonfinite_ptr + s, (tl.max(bad.to(tl.int32), axis=0) > 0).to(tl.int8))


@triton.jit
def _backtrack_kernel(
    bp_ptr, link_ptr, slots_ptr, lengths_ptr, last_ptr, paths_ptr, out_ptr,
    T_CAP, M, T,
):
    s = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + s)
    length = tl.load(lengths_ptr + s)
    chosen = tl.load(last_ptr + s)
    base = slot * T_CAP * M
    for k in range(0, T):
        t = T - 1 - k
        if t >= length:
            tl.store(paths_ptr + s * T + t, -1)
            tl.store(out_ptr + s * T + t, 0.0)
        else:
            tl.store(paths_ptr + s * T + t, chosen)
            if t > 0:
                tl.store(out_ptr + s * T + t, tl.load(link_ptr + base + t * M + chosen))
                chosen = tl.load(bp_ptr + base + t * M + chosen)
            else:
                tl.store(out_ptr + s * T + t, 0.0)


_BETAS: Dict[Tuple[str, torch.device], Tensor] = {}


def _beta_on(value: float, device: torch.device) -> Tensor:
    """``(1,)`` float64 ``value`` on ``device``, made once: a step recorded in a CUDA graph
    must not copy a new one from the host. (Keyed by the value's bits: -0.0 is not 0.0.)"""
    key = (value.hex(), device)
    if key not in _BETAS:
        _BETAS[key] = torch.full((1,), value, dtype=torch.float64, device=device)
    return _BETAS[key]


def step(previous: Tensor, previous_allowed: Tensor, started: Tensor, emissions: Tensor, mask: Tensor,
         transitions: Optional[Tensor], distances: Tensor, negative_beta: float,
         alpha: Tensor, backpointers: Tensor, links: Tensor, nonfinite: Tensor,
         factors: Optional[Tensor] = None) -> None:
    """One step of S slots into ``alpha`` (S, M), ``backpointers`` (S, M) long, ``links``
    (S, M) float64 and ``nonfinite`` (S,) bool, as the numba step writes them;
    ``transitions`` None: made from ``distances`` times ``negative_beta``; ``factors``
    (S, M) float64 given: ``transitions`` are float64 (calibrated) distances, each row j
    weighed by ``factors[s, j]`` (a learned model's ``-(beta * gate)``)."""
    check_device(emissions)
    count, width = emissions.shape
    if count == 0:
        return
    distances = distances.to(torch.float64).contiguous()
    flags = torch.empty(count, dtype=torch.int8, device=emissions.device)
    block = block_for(width)
    _step_kernel[(count,)](
        previous.contiguous(), previous_allowed.contiguous().view(torch.uint8), started.contiguous().view(torch.uint8),
        emissions.contiguous(), mask.contiguous().view(torch.uint8),
        transitions.contiguous() if transitions is not None else distances, distances,
        alpha, backpointers, links, flags,
        _beta_on(float(negative_beta), emissions.device),
        factors.to(torch.float64).contiguous() if factors is not None else distances, width,
        BLOCK_M=block, FROM_DISTANCES=transitions is None, PER_MOVE=factors is not None,
        num_warps=warps_for(block), enable_fp_fusion=False,
    )
    nonfinite.copy_(flags != 0)


def backtrack(backpointers: Tensor, link_distances: Tensor, slots: Tensor, lengths: Tensor, last: Tensor,
              paths: Tensor, distances: Tensor) -> None:
    """Each slot's path and the distances along it into ``paths`` / ``distances`` (S, T),
    as the numba backtrack writes them (-1 and 0.0 after a slot's length, 0.0 at turn 0)."""
    check_device(backpointers)
    count, turns = paths.shape
    if count == 0 or turns == 0:
        return
    _, turn_capacity, width = backpointers.shape
    _backtrack_kernel[(count,)](
        backpointers.contiguous(), link_distances.contiguous(), slots.to(torch.long).contiguous(),
        lengths.to(torch.long).contiguous(), last.to(torch.long).contiguous(), paths, distances,
        turn_capacity, width, turns,
    )
