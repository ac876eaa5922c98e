"""The streaming states: the functional API, one turn at a time, as views of the slot decoder.

:class:`ViterbiState` and :class:`FixedLagState` decode B conversations one turn per
:meth:`~ViterbiState.step` and give exactly what :func:`~mapmatched_torch.kernels.decode.viterbi`
and :func:`~mapmatched_torch.kernels.decode.fixed_lag_viterbi` give for the turns so far.
They hold no recursion of their own: conversation b is slot b of a
:class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder` fed with weighted inputs
(:meth:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder.advance`). A state adds the
functional API's conventions on top:

- inputs are checked like the batch functions' (shapes, dtype, device, finite values at
  real candidates and between them, non-finite padding cleaned), one synchronization
  per step when the values are finite;
- a row whose ``mask_t`` is all False does not advance at that step; turn indices are per
  conversation, and paths are ``(B, steps)`` with turn t of conversation b at column t;
- a conversation without turns has score -inf and an all -1 path;
- an overflowing forward score is reported at :meth:`~ViterbiState.backtrack` (the
  nonfinite-score ValueError naming the conversations), not at the step.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..core.checks import check_nonnegative_int, check_positive_int
from ..core.errors import MapMatchedValueError
from .checks import first_problem, first_true_index, raise_if_nonfinite, require_tensor, shape_tuple
from .decode import Decoded, FixedLagDecoded, _locked_to_path
from .semiring import MAX_PLUS
from .slot_decoder import SlotDecoder, SlotStep

__all__ = ["ViterbiState", "FixedLagState"]

_INF = float("inf")


class _SlotView:
    """B conversations as slots 0..B-1 of one slot decoder, with the states' input checks."""

    def __init__(
        self,
        batch_size: int,
        num_candidates: int,
        lag: Optional[int],
        dtype: torch.dtype,
        device: Optional[Union[str, torch.device]],
    ) -> None:
        batch_size = check_nonnegative_int(batch_size, "batch_size")
        num_candidates = check_positive_int(num_candidates, "num_candidates")
        if not dtype.is_floating_point:
            raise MapMatchedValueError(f"dtype must be a floating-point dtype, got {dtype}")
        # the table's weights stay 1: a state's inputs come weighted (advance applies none)
        self._decoder = SlotDecoder(num_candidates, fixed_lag=lag, capacity=max(batch_size, 1), dtype=dtype, device=device)
        self._dtype, self._device = dtype, self._decoder.device
        self._shape = (batch_size, num_candidates)
        self._slots = torch.tensor(
            [self._decoder.allocate() for _ in range(batch_size)], dtype=torch.long, device=self._device
        )
        #: (B, M) bool: the real candidates of each conversation's last turn (for the checks).
        self._last_mask = torch.zeros(self._shape, dtype=torch.bool, device=self._device)
        #: (B,) bool: a forward score overflowed (raised at backtrack).
        self._nonfinite = torch.zeros(batch_size, dtype=torch.bool, device=self._device)
        self._steps = 0

    @property
    def lengths(self) -> Tensor:
        """``(B,)`` long: number of turns of each conversation so far."""
        return self._decoder.lengths(self._slots)

    @property
    def steps(self) -> int:
        """Number of :meth:`step` calls so far (the width of the returned paths)."""
        return self._steps

    def step(self, emissions_t: Tensor, transitions_t: Optional[Tensor], mask_t: Tensor) -> None:
        """Add one turn (one M x M step per conversation).

        Args:
            emissions_t: ``(B, M)`` weighted emissions of the new turn.
            transitions_t: ``(B, M, M)`` weighted transitions ``[b, from, to]`` from each
                conversation's previous turn (ignored for a conversation's first turn),
                or None when no advancing conversation has a previous turn.
            mask_t: ``(B, M)`` bool; an all-False row means "no new turn".
        """
        emissions, transitions, mask = self._checked(emissions_t, transitions_t, mask_t)
        # shape: (B,)
        advanced = mask.any(dim=1)
        rows = advanced.nonzero().flatten()
        if rows.numel():
            ok = self._decoder.advance(
                self._slots[rows], emissions[rows], mask[rows], transitions[rows], transactional=False
            )
            self._nonfinite[rows] = self._nonfinite[rows] | ~ok
        self._last_mask = torch.where(advanced.unsqueeze(1), mask, self._last_mask)
        self._steps += 1

    def _checked(self, emissions_t: object, transitions_t: object, mask_t: object) -> Tuple[Tensor, Tensor, Tensor]:
        """Validate one turn (one synchronization when all values are finite); return
        (emissions, transitions cleaned of non-finite padding, mask)."""
        emissions = require_tensor(emissions_t, "emissions_t", "(B, M)")
        mask = require_tensor(mask_t, "mask_t", "(B, M)")
        pairwise_shape = self._shape + self._shape[1:]
        pairwise = (
            torch.zeros(pairwise_shape, dtype=self._dtype, device=self._device)
            if transitions_t is None
            else require_tensor(transitions_t, "transitions_t", "(B, M, M)")
        )
        for name, tensor, shape, dtype in (
            ("emissions_t", emissions, self._shape, self._dtype),
            ("mask_t", mask, self._shape, torch.bool),
            ("transitions_t", pairwise, pairwise_shape, self._dtype),
        ):
            if shape_tuple(tensor) != shape or tensor.dtype != dtype or tensor.device != self._device:
                raise MapMatchedValueError(
                    f"{name} must be {dtype} of shape {shape} on {self._device}, got {tensor.dtype} of shape "
                    f"{shape_tuple(tensor)} on {tensor.device}"
                )
        # shape: (B,)
        advanced = mask.any(dim=1)
        problems = {
            "emission": mask & ~torch.isfinite(emissions),
            "missing": (self.lengths > 0) & advanced if transitions_t is None else torch.zeros_like(advanced),
        }
        problem, (nonfinite_sum,) = first_problem(problems, ~torch.isfinite(pairwise.sum()))
        if problem is not None:
            kind, where = problem
            if kind == "emission":
                raise MapMatchedValueError(
                    f"emissions_t must be finite at real candidates: emissions_t[b={where[0]}, m={where[1]}] = "
                    f"{emissions[tuple(where)].item()} (emissions_t shape {shape_tuple(emissions)})"
                )
            raise MapMatchedValueError(
                f"transitions_t is None but conversation b={where[0]} already has a turn "
                f"(transitions_t shape must be {pairwise_shape})"
            )
        if nonfinite_sum:  # max-plus: only non-finite garbage needs cleaning (see checks.prepare)
            # shape: (B, M, M)
            pairs = self._last_mask.unsqueeze(2) & mask.unsqueeze(1)
            bad = pairs & ~torch.isfinite(pairwise)
            if bad.any():
                b, j, i = first_true_index(bad)
                raise MapMatchedValueError(
                    f"transitions_t must be finite between real candidates: transitions_t[b={b}, from={j}, "
                    f"to={i}] = {pairwise[b, j, i].item()} (transitions_t shape {shape_tuple(pairwise)})"
                )
            pairwise = torch.where(pairs, pairwise, 0.0)
        return emissions, pairwise, mask

    def _current(self) -> Tuple[SlotStep, Tensor, Tensor]:
        """(the slots' decode, scores (B,) with -inf without turns, paths (B, steps));
        raises the nonfinite-score ValueError if a forward score overflowed."""
        raise_if_nonfinite(self._nonfinite)
        current = self._decoder.current(self._slots)
        scores = torch.where(current.lengths > 0, MAX_PLUS.sum(current.final_scores, dim=1)[0], -_INF)
        paths = current.paths[:, : self._steps]
        if paths.shape[1] < self._steps:  # the table grows by doubling, the state by one column a step
            paths = torch.cat((paths, paths.new_full((paths.shape[0], self._steps - paths.shape[1]), -1)), dim=1)
        return current, scores, paths


class ViterbiState(_SlotView):
    """Incremental full Viterbi over B conversations: one M x M step per new turn.

    A view of a :class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder` (conversation
    b is slot b); :meth:`backtrack` gives exactly :func:`~mapmatched_torch.kernels.decode.viterbi`
    of the turns so far.

    Args:
        batch_size: B. num_candidates: M (every turn is padded to M).
        dtype, device: of the scores (inputs must match).

    Example:
        >>> state = ViterbiState(1, 2)
        >>> state.step(torch.tensor([[1.0, 0.0]], dtype=torch.float64), None, torch.tensor([[True, True]]))
        >>> state.backtrack().paths
        tensor([[0]])

    Cost: O(B M^2) per step; memory O(B S M) for S turns.
    """

    def __init__(
        self,
        batch_size: int,
        num_candidates: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__(batch_size, num_candidates, None, dtype, device)

    def backtrack(self) -> Decoded:
        """The best path of every conversation so far.

        Returns:
            :class:`~mapmatched_torch.kernels.decode.Decoded` with paths ``(B, steps)``
            (turn t of conversation b at column t, -1 after its length) and scores
            ``(B,)`` (-inf without turns). Raises the nonfinite-score ValueError if a
            forward score overflowed. Cost: O(B S) on the device.
        """
        _, scores, paths = self._current()
        return Decoded(paths, scores)


class FixedLagState(_SlotView):
    """Incremental fixed-lag Viterbi: identical to :func:`~mapmatched_torch.kernels.decode.fixed_lag_viterbi`.

    A view of a fixed-lag :class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder`: a
    step costs one M x M step for the new turn plus, when it commits a turn, ``lag``
    M x M steps to recompute the uncommitted tail under the new lock.

    Args:
        batch_size: B. num_candidates: M. lag: L >= 0.
        dtype, device: of the scores.

    Cost: O(B (L+1) M^2) per step; memory O(B S M + B (L+1) M^2).
    """

    def __init__(
        self,
        batch_size: int,
        num_candidates: int,
        lag: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        self._lag = check_nonnegative_int(lag, "fixed_lag")
        super().__init__(batch_size, num_candidates, self._lag, dtype, device)

    @property
    def lag(self) -> int:
        """The fixed lag L."""
        return self._lag

    def backtrack(self) -> FixedLagDecoded:
        """The fixed-lag path of every conversation so far (committed turns never change).

        Returns:
            :class:`~mapmatched_torch.kernels.decode.FixedLagDecoded` with ``(B, steps)``
            paths and locks (turn t of conversation b at column t), scores (-inf without
            turns) and committed_through. The path passes through every committed
            candidate, so the locks are read off it.
        """
        current, scores, paths = self._current()
        return _locked_to_path(paths, scores, current.lengths, self._lag)
