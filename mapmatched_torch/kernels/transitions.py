"""Transitions: the one place where graph distances and weights become the DP's moves.

The dynamic program (:mod:`mapmatched_torch.kernels.chain`) scores a move from candidate
``from`` of turn t to candidate ``to`` of turn t+1 by one number,
``transitions[b, t, from, to]``: a ``(B, T-1, M, M)`` tensor for whole trellises, or
``(S, M, M)`` for one step of S conversations. This module is the only code that makes
those numbers out of raw graph distances, and the only code that chooses a decoder:

- :func:`weighted_transitions`: the fixed model of docs/spec.md section 1,
  ``-(beta * d)``. The reference decoder computes ``beta * d`` and subtracts it;
  ``x + (-(beta * d))`` is ``x - beta * d`` bit for bit, so every tensor path that adds
  these transitions stays exact.
- :class:`TransitionModel`: the seam of docs/spec.md section 11 (a learned model: a
  gate on beta from per-turn features, a learned distance calibration, ...). A model
  maps distances to ONE transition tensor of the same shape, so every decoder runs the
  one dynamic program unchanged; :class:`FixedWeight` is the fixed model behind it.
- :func:`decoding_mode` and :func:`decode_weighted`: the one choice "beta = 0 ->
  pointwise, a lag -> fixed lag, else full Viterbi", and the one dispatch on it.
"""

from __future__ import annotations

import enum
import numbers
from typing import Optional, Protocol, Union

import torch
from torch import Tensor

from ..core.checks import check_optional_lag
from ..core.errors import MapMatchedValueError
from .decode import Decoded, FixedLagDecoded, fixed_lag_viterbi, pointwise_decode, viterbi

__all__ = [
    "DecodingMode",
    "TransitionModel",
    "FixedWeight",
    "Weight",
    "as_transition_model",
    "weighted_transitions",
    "decoding_mode",
    "decode_weighted",
]


class DecodingMode(enum.Enum):
    """Which decoder a (beta, lag) setting runs (chosen by :func:`decoding_mode`).

    - ``POINTWISE``: beta = 0, every transition is 0: each turn's first best candidate
      (:func:`~mapmatched_torch.kernels.decode.pointwise_decode`, as the reference does;
      the max-plus recursion could see rounding ties the emissions do not have).
    - ``VITERBI``: full decoding (:func:`~mapmatched_torch.kernels.decode.viterbi`).
    - ``FIXED_LAG``: fixed-lag decoding
      (:func:`~mapmatched_torch.kernels.decode.fixed_lag_viterbi`).
    """

    POINTWISE = "pointwise"
    VITERBI = "viterbi"
    FIXED_LAG = "fixed_lag"

    @property
    def uses_distances(self) -> bool:
        """Whether this mode reads the distances (not in ``POINTWISE``: the graph need
        not be asked)."""
        return self is not DecodingMode.POINTWISE


class TransitionModel(Protocol):
    """Turns raw graph distances into weighted transitions (docs/spec.md section 11).

    A model must return a tensor of the distances' shape (``(B, T-1, M, M)`` or
    ``(S, M, M)``, indexed ``[..., from, to]``), differentiable in its parameters, and
    say when it is identically zero (then decoders take the exact pointwise path and the
    distances are never computed).
    """

    @property
    def is_zero(self) -> bool:
        """Every transition is exactly 0 (may synchronize once to read a parameter)."""
        ...

    def __call__(self, distances: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Weighted transitions of ``distances`` (cast to ``dtype`` when given)."""
        ...


#: A transition weight as the functions here take it: beta (a float, or a tensor that
#: broadcasts against the distances, kept in autograd), or a :class:`TransitionModel`.
Weight = Union[float, Tensor, TransitionModel]


def weighted_transitions(distances: Tensor, beta: Union[float, Tensor], dtype: Optional[torch.dtype] = None) -> Tensor:
    """The fixed model's transitions ``-(beta * distances)``, bit for bit.

    Computed in one pass as ``distances * (-beta)``: IEEE multiplication is symmetric in
    sign, so this equals ``-(beta * distances)`` exactly (signed zeros included), and a
    decoder adding it reproduces the reference's ``score - beta * d``.

    Args:
        distances: raw graph distances, ``(B, T-1, M, M)`` ``[b, t, from, to]``, or
            ``(S, M, M)`` ``[s, from, to]`` for one step (any shape works).
        beta: the transition weight: a Python float, or a tensor broadcastable against
            ``distances`` (a 0-d parameter keeps autograd; ``(S, 1, 1, 1, 1)`` weighs a
            stack of S settings at once).
        dtype: cast the result to this dtype (after the float64 arithmetic of float64
            distances, as the reference does), or None to keep the computed dtype.

    Returns:
        The transitions, the broadcast shape of ``distances`` and ``beta``.

    Example:
        >>> weighted_transitions(torch.tensor([[0.0, 2.0], [3.0, 0.0]]), 0.5)
        tensor([[-0.0000, -1.0000],
                [-1.5000, -0.0000]])
    """
    transitions = distances * (-beta)
    return transitions if dtype is None else transitions.to(dtype)


class FixedWeight:
    """The fixed model ``-(beta * d)`` as a :class:`TransitionModel`.

    Args:
        beta: a float >= 0 or a tensor (e.g. a 0-d parameter; gradients flow through).
    """

    __slots__ = ("beta",)

    def __init__(self, beta: Union[float, Tensor]) -> None:
        self.beta = beta

    @property
    def is_zero(self) -> bool:
        """beta == 0 (one synchronization for a tensor beta)."""
        beta = self.beta
        if isinstance(beta, Tensor):
            return not bool((beta != 0).any())
        return float(beta) == 0.0

    def __call__(self, distances: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
        return weighted_transitions(distances, self.beta, dtype)

    def __repr__(self) -> str:
        return f"FixedWeight(beta={self.beta!r})"


def as_transition_model(weight: Weight) -> TransitionModel:
    """A :class:`TransitionModel` for ``weight``: itself if it is one, else :class:`FixedWeight`."""
    if isinstance(weight, (Tensor, numbers.Real)) and not isinstance(weight, bool):
        return FixedWeight(weight)
    if callable(weight) and hasattr(weight, "is_zero"):
        return weight  # type: ignore[return-value]
    raise MapMatchedValueError(
        f"a transition weight must be a number, a tensor or a TransitionModel, got {type(weight).__name__}"
    )


def decoding_mode(weight: Weight, lag: Optional[int] = None) -> DecodingMode:
    """The one choice of decoder for a transition weight and a lag.

    Args:
        weight: beta (float or tensor; a tensor is read once, one synchronization) or a
            :class:`TransitionModel`.
        lag: None (full decoding) or L >= 0.

    Returns:
        ``POINTWISE`` when every transition is zero (beta = 0; the lag then only
        decides which turns count as committed), else ``VITERBI`` without a lag and
        ``FIXED_LAG`` with one.
    """
    lag = check_optional_lag(lag)
    if as_transition_model(weight).is_zero:
        return DecodingMode.POINTWISE
    return DecodingMode.VITERBI if lag is None else DecodingMode.FIXED_LAG


def decode_weighted(
    emissions: Tensor,
    distances: Optional[Tensor],
    mask: Tensor,
    weight: Weight,
    lag: Optional[int] = None,
    *,
    transitions: Optional[Tensor] = None,
) -> Union[Decoded, FixedLagDecoded]:
    """Decode a batch with the transitions of ``distances``: the one dispatch.

    ``POINTWISE`` (beta = 0) runs :func:`~mapmatched_torch.kernels.decode.pointwise_decode`
    and never reads ``distances``; otherwise the transitions ``weight(distances)`` (in the
    emissions' dtype) go to :func:`~mapmatched_torch.kernels.decode.viterbi` or
    :func:`~mapmatched_torch.kernels.decode.fixed_lag_viterbi`.

    Args:
        emissions: ``(B, T, M)`` float weighted emissions (``lambda * s``).
        distances: ``(B, T-1, M, M)`` raw graph distances ``[b, t, from, to]``, or None
            when the mode is pointwise (or ``transitions`` is given).
        mask: ``(B, T, M)`` bool real candidates.
        weight: beta (float or tensor) or a :class:`TransitionModel`.
        lag: None or the fixed lag L >= 0.
        transitions: the weighted transitions when the caller already holds them (e.g. to
            rank final candidates with the same tensor); they must be
            ``weight(distances, emissions.dtype)``.

    Returns:
        :class:`~mapmatched_torch.kernels.decode.Decoded`, or
        :class:`~mapmatched_torch.kernels.decode.FixedLagDecoded` with a lag.

    Raises:
        MapMatchedValueError: the mode needs distances and neither ``distances`` nor
            ``transitions`` were given, or the decoders' input checks fail.
    """
    model = as_transition_model(weight)
    mode = decoding_mode(model, lag)
    if mode is DecodingMode.POINTWISE:
        return pointwise_decode(emissions, mask, fixed_lag=lag)
    if transitions is None:
        if distances is None:
            raise MapMatchedValueError(
                "distances are required when transition_weight > 0: pass the (B, T-1, M, M) graph distances"
            )
        transitions = model(distances, emissions.dtype if isinstance(emissions, Tensor) else None)
    if mode is DecodingMode.VITERBI:
        return viterbi(emissions, transitions, mask)
    assert lag is not None
    return fixed_lag_viterbi(emissions, transitions, mask, lag)
