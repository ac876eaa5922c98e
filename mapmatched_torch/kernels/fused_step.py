"""The fused incremental max-plus step: the default for :class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder`.

:meth:`SlotDecoder.advance <mapmatched_torch.kernels.slot_decoder.SlotDecoder.advance>`
asks :func:`max_plus_step` first; it returns None where the fused kernel does not
apply, and the decoder runs :func:`~mapmatched_torch.kernels.chain.chain_step` (the
reference and the fallback). It applies under the same rules as the fused decoders
(:func:`~mapmatched_torch.kernels.fused.which`: float32/float64, no gradient, and a
kernel backend for the device: numba on the CPU, Triton (:mod:`._triton_step`) on
CUDA tensors, or on CPU tensors under the interpreter when chosen). One pass per conversation replaces the torch step's
(S, M, M) temporaries: the masked transitions, the predecessor sums, the maximum and
argmax, the masking of the result and the gather of each back-pointer's distance.
Results equal the torch path bit for bit (``tests/kernels/test_fused_step.py``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from . import fused, numba_runtime
from .transitions import move_factor

__all__ = ["FusedStep", "max_plus_step", "backtrack_slots", "first_occurrences", "checked_rows"]


class FusedStep(NamedTuple):
    """One step of S conversations (see :func:`max_plus_step`)."""

    alpha: Tensor  #: (S, M) forward scores of the new turn (-inf at padding)
    backpointers: Tensor  #: (S, M) long best predecessor of every candidate
    links: Tensor  #: (S, M) float64 distance from that predecessor
    nonfinite: Tensor  #: (S,) bool a real candidate's score is not finite


class _Stamps:
    """One scratch entry per chunk code, kept across calls (a corpus of N chunks would
    otherwise cost an (N,) allocation and fill per step). A call's rows stamp codes with
    numbers no earlier call used, so the array is never cleared. Use with
    :data:`~.numba_runtime.KERNEL_LOCK` held."""

    def __init__(self) -> None:
        self.array = np.full(0, -1, dtype=np.int64)
        self.next = 0

    def take(self, size: int, rows: int) -> Tuple[np.ndarray, int]:
        """``(array of at least size entries, each below base; base)``: the caller's rows
        may stamp ``base .. base + rows - 1``."""
        if self.array.shape[0] < size:
            self.array = np.full(max(size, 2 * self.array.shape[0]), -1, dtype=np.int64)
        base = self.next
        self.next += rows
        return self.array, base


_STAMPS = _Stamps()

#: The numba step's ``factors`` of the fixed model: none (an empty (0, 0) array).
_NO_FACTORS = torch.zeros((0, 0), dtype=torch.float64)


def max_plus_step(
    previous: Tensor,
    previous_allowed: Tensor,
    started: Tensor,
    emissions: Tensor,
    mask: Tensor,
    transitions: Optional[Tensor],
    distances: Tensor,
    transition_weight: Optional[float] = None,
    factors: Optional[Tensor] = None,
) -> Optional[FusedStep]:
    """The fused step, or None where it does not apply.

    Args:
        previous: (S, M) the previous turn's forward scores (read only where
            ``previous_allowed`` and ``started``).
        previous_allowed: (S, M) bool the previous turn's allowed candidates.
        started: (S,) bool the conversation has a previous turn.
        emissions: (S, M) weighted emissions of the new turn (0 at padding).
        mask: (S, M) bool the new turn's real candidates (at least one per row).
        transitions: (S, M, M) weighted transitions ``[s, from, to]`` (read only between
            allowed and real candidates), or None with ``transition_weight``.
        distances: (S, M, M) float64 the distances they came from.
        transition_weight: beta, when ``transitions`` is None: the transitions are then
            :func:`~mapmatched_torch.kernels.transitions.weighted_transitions` of the
            distances, made in the kernel (no (S, M, M) temporary).
        factors: (S, M) float64 a learned model's per-move factor ``-(beta * gate)`` of
            each source candidate (:meth:`~.transitions.GatedTransitions.move_factors`):
            ``transitions`` are then the float64 distances the moves weigh (the
            calibrated ones, or ``distances`` themselves) and the kernel makes
            ``transitions[s, j, i] * factors[s, j]`` rounded to the table's dtype, what
            the model's ``forward`` makes, bit for bit.

    Returns:
        A :class:`FusedStep` equal to the torch step's values bit for bit, or None.
    """
    given = [previous, emissions, distances] + ([transitions] if transitions is not None else [])
    chosen = fused.which(*given)
    if chosen is None or emissions.dtype != previous.dtype:
        return None
    count, width = emissions.shape
    dtype = emissions.dtype
    if chosen == "triton":
        from . import _triton_step

        device = emissions.device
        step = FusedStep(
            torch.empty((count, width), dtype=dtype, device=device),
            torch.empty((count, width), dtype=torch.long, device=device),
            torch.empty((count, width), dtype=torch.float64, device=device),
            torch.empty(count, dtype=torch.bool, device=device),
        )
        if factors is not None:
            _triton_step.step(previous, previous_allowed, started, emissions, mask, transitions.to(torch.float64),
                              distances, 0.0, *step, factors=factors)
            return step
        _triton_step.step(previous, previous_allowed, started, emissions, mask,
                          None if transitions is None else transitions.to(dtype), distances,
                          move_factor(float(transition_weight)) if transitions is None else 0.0, *step)
        return step
    from . import fused_step_kernels as kernels

    alpha = torch.empty((count, width), dtype=dtype)
    backpointers = torch.empty((count, width), dtype=torch.long)
    links = torch.empty((count, width), dtype=torch.float64)
    nonfinite = torch.empty(count, dtype=torch.bool)
    constants = torch.tensor([0.0, -float("inf")], dtype=dtype)
    from_distances = transitions is None or factors is not None
    if factors is not None:  # (calibrated) float64 distances, weighed per source candidate in the kernel
        moves, per_move = transitions.to(torch.float64), factors.to(torch.float64)
    else:
        moves = torch.zeros((1, 1, 1), dtype=dtype) if from_distances else transitions.to(dtype)
        per_move = _NO_FACTORS
    negative_beta = move_factor(float(transition_weight)) if transitions is None else 0.0
    arrays = tuple(
        tensor.contiguous().numpy()
        for tensor in (previous, previous_allowed, started, emissions, mask, moves, distances.double())
    ) + (alpha.numpy(), backpointers.numpy(), links.numpy(), nonfinite.numpy(), constants.numpy(),
         from_distances, negative_beta, per_move.contiguous().numpy())
    blocks = numba_runtime.blocks_for(torch.get_num_threads(), count)
    numba_runtime.call(kernels.step_parallel, kernels.step_serial, arrays, blocks)
    return FusedStep(alpha, backpointers, links, nonfinite)


def backtrack_slots(
    backpointers: Tensor, link_distances: Tensor, slots: Tensor, lengths: Tensor, last: Tensor, turns: int
) -> Optional[Tuple[Tensor, Tensor]]:
    """Each slot's decoded path and the distances along it, read from the slot table in
    one pass, or None where the fused kernel does not apply.

    Args:
        backpointers: (C, T_cap, M) long, link_distances: (C, T_cap, M) float64: the
            table's state. slots, lengths, last: (S,) long: the slots, their turns and
            their chosen final candidate. turns: T, the output width (>= every length).

    Returns:
        ``(paths (S, T) long, distances (S, T) float64)``: -1 and 0.0 after each length,
        0.0 at turn 0; what :func:`~mapmatched_torch.kernels.chain.backtrack` and the
        gather of the links give, exactly.
    """
    chosen = fused.which(link_distances)
    if chosen is None:
        return None
    count = slots.shape[0]
    if chosen == "triton":
        from . import _triton_step

        device = link_distances.device
        paths = torch.empty((count, turns), dtype=torch.long, device=device)
        distances = torch.empty((count, turns), dtype=torch.float64, device=device)
        _triton_step.backtrack(backpointers, link_distances, slots, lengths, last, paths, distances)
        return paths, distances
    from . import fused_step_kernels as kernels

    paths = torch.empty((count, turns), dtype=torch.long)
    distances = torch.empty((count, turns), dtype=torch.float64)
    arrays = tuple(tensor.contiguous().numpy() for tensor in (backpointers, link_distances, slots, lengths, last))
    with numba_runtime.KERNEL_LOCK:
        kernels.backtrack_serial(*arrays, paths.numpy(), distances.numpy())
    return paths, distances


def first_occurrences(listed: Tensor, limit: Optional[int]) -> Optional[Tensor]:
    """The codes >= 0 of each row of ``listed`` in order, first occurrences only, in one
    pass, or None where the kernel does not apply (numba missing or disabled, not on
    the CPU).

    Args:
        listed: (S, L) long codes, -1 for nothing.
        limit: the most codes kept per row (None: every one).

    Returns:
        (S, C) long, -1 padded, C the most codes any row kept (at most ``limit``):
        what the torch path of :func:`mapmatched_torch.serving.session_store.context_codes`
        gives, exactly.
    """
    if not fused.kernels_on(listed.device):
        return None
    from . import fused_step_kernels as kernels

    listed = listed.to(torch.long).contiguous()
    count, length = listed.shape
    out = torch.full((count, length), -1, dtype=torch.long)
    kept = torch.zeros(count, dtype=torch.long)
    codes = int(listed.max()) + 1 if listed.numel() else 0
    with numba_runtime.KERNEL_LOCK:
        seen, base = _STAMPS.take(codes, count)
        kernels.first_occurrences(listed.numpy(), seen, base, out.numpy(), kept.numpy())
    width = int(kept.max()) if count else 0
    if limit is not None:
        width = min(width, limit)
    return out[:, :width]


def checked_rows(
    slots: Tensor, live: Tensor, codes: Tensor, raw: Tensor, code_count: int, width: int, flags: Tuple[int, ...]
) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """A serving step's row checks and kept columns in one pass, or None where the
    kernel does not apply (numba missing or disabled, not on the CPU).

    Args:
        slots: (S,) long requested slots. live: (C,) bool open slots.
        codes: (S, K) long chunk codes, -1 padding. raw: (S, K) float64 scores.
        code_count: the number of chunk codes. width: M, the columns kept.
        flags: the seven status codes, in check order: unknown slot, repeated slot,
            code out of range, gapped, non-finite score, duplicate, empty.

    Returns:
        ``(status (S,) long, kept (S, M) long, kept_raw (S, M) float64, counts (S,) long)``:
        the first failed check's code (0: none), the first M codes (-1 past K), their
        raw scores (0.0 at padding) and the kept candidates per row (0 for a failed row),
        as the torch checks of :meth:`mapmatched_torch.serving.session_store.SessionStore.step`.
    """
    if not fused.kernels_on(slots.device):
        return None
    from . import fused_step_kernels as kernels

    count = slots.shape[0]
    status = torch.zeros(count, dtype=torch.long)
    kept = torch.empty((count, width), dtype=torch.long)
    kept_raw = torch.empty((count, width), dtype=torch.float64)
    counts = torch.zeros(count, dtype=torch.long)
    arrays = (
        slots.to(torch.long).contiguous().numpy(), live.contiguous().numpy(), codes.to(torch.long).contiguous().numpy(),
        raw.to(torch.float64).contiguous().numpy(), int(code_count), np.asarray(flags, dtype=np.int64),
        np.zeros(live.shape[0], dtype=np.int64),
    )
    outputs = (status.numpy(), kept.numpy(), kept_raw.numpy(), counts.numpy())
    with numba_runtime.KERNEL_LOCK:
        seen, base = _STAMPS.take(int(code_count), count)
        kernels.check_rows(*arrays, seen, base, *outputs)
    return status, kept, kept_raw, counts
