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
- :class:`GatedTransitions`: the learned model, an ``nn.Module``: a gate on beta per
  move from per-move features (e.g. :func:`query_source_cosine`, the new query's cosine
  to each candidate of the previous turn) and an optional learned saturation of the
  distance, so that a jump between far-apart regions (an article change on a section
  graph) stops costing beta times the full bound. Still one transition tensor.
- :func:`decoding_mode` and :func:`decode_weighted`: the one choice "beta = 0 ->
  pointwise, a lag -> fixed lag, else full Viterbi" for a tensor beta or a model
  (:meth:`DecodingMode.choose <mapmatched_torch.core.settings.DecodingMode.choose>`, as
  :attr:`DecodeSettings.mode <mapmatched_torch.core.settings.DecodeSettings.mode>` makes
  it for plain settings), and the one dispatch on it.
- :func:`move_factor`: ``-beta``, the one place beta's sign meets the distances (also
  for the fused incremental step's kernel).
"""

from __future__ import annotations

import hashlib
import math
import numbers
from typing import Dict, Optional, Protocol, Union

import torch
from torch import Tensor, nn

from ..core.checks import check_nonnegative_int, check_optional_lag, check_weight
from ..core.errors import MapMatchedValueError
from ..core.settings import DecodingMode
from .decode import Decoded, FixedLagDecoded, fixed_lag_viterbi, pointwise_decode, viterbi

__all__ = [
    "DecodingMode",
    "TransitionModel",
    "FixedWeight",
    "Weight",
    "as_transition_model",
    "GatedTransitions",
    "BoundTransitions",
    "check_learned_transitions",
    "transitions_fingerprint",
    "query_source_cosine",
    "weighted_transitions",
    "move_factor",
    "decoding_mode",
    "decode_weighted",
]


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
    transitions = distances * move_factor(beta)
    return transitions if dtype is None else transitions.to(dtype)


def move_factor(beta: Union[float, Tensor]) -> Union[float, Tensor]:
    """``-beta``: what a raw distance is multiplied by to give the fixed model's move.

    The one place the sign meets beta: :func:`weighted_transitions` multiplies the
    distances by it in one pass, and the fused incremental step
    (:func:`~mapmatched_torch.kernels.fused_step.max_plus_step`) hands it to its numba
    kernel, which multiplies each distance by it (then rounds to the table's dtype), so
    both make ``-(beta * d)`` bit for bit.
    """
    return -beta


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
    if isinstance(weight, GatedTransitions):
        return weight.bind(None)
    if callable(weight) and hasattr(weight, "is_zero"):
        return weight  # type: ignore[return-value]
    raise MapMatchedValueError(
        f"a transition weight must be a number, a tensor or a TransitionModel, got {type(weight).__name__}"
    )


class GatedTransitions(nn.Module):
    """A learned transition model: beta gated per move, the distance optionally saturated.

    For the move from candidate ``j`` of turn t to candidate ``i`` of turn t+1::

        gate[b, t, j]   = 2 / (1 + exp(-(gate_bias + sum_k gate_weights[k] * z[b, t, j, k])))
        d'              = cap * (1 - exp(-d / cap))        (calibrate=True; else d' = d)
        trans[b,t,j,i]  = -((beta * gate[b, t, j]) * d'[b, t, j, i])

    where ``z = (features - feature_mean) / feature_std`` are standardized per-move
    features (statistics from training data only: :meth:`standardize_`), ``beta`` is
    ``transition_weight.clamp_min(0)`` and ``cap = softplus(cap_parameter)``. At the
    initial values (gate parameters 0, no calibration) the gate is exactly 1 and the
    transitions are ``-(beta * d)`` bit for bit, the fixed model. The saturation is
    monotone, 0 at d = 0, ``~ d`` for ``d << cap`` and bounded by ``cap``: a far jump
    costs at most ``beta * gate * cap``. Gradients reach every parameter; padding
    features are never read where the caller masks moves (as
    :meth:`~mapmatched_torch.fit.model.MapMatchedModel.transitions` does).

    Args:
        transition_weight: initial beta, finite and >= 0.
        num_features: K, features per move (0: no gate).
        calibrate: learn the saturation ``cap``.
        cap: its initial value (> 0; default 10, the default distance bound).
        dtype, device: of the parameters.

    Shapes: ``distances`` ``(B, T-1, M, M)`` ``[b, t, from, to]``; ``features``
    ``(B, T-1, M, K)`` per source candidate, or ``(B, T-1, 1, K)`` per turn.

    Example:
        >>> model = GatedTransitions(0.5, num_features=1)
        >>> d = torch.tensor([[[[0.0, 2.0], [2.0, 0.0]]]], dtype=torch.float64)
        >>> model(d, torch.zeros(1, 1, 2, 1, dtype=torch.float64))
        tensor([[[[-0., -1.],
                  [-1., -0.]]]], dtype=torch.float64, grad_fn=<MulBackward0>)
    """

    def __init__(
        self,
        transition_weight: float = 1.0,
        *,
        num_features: int = 0,
        calibrate: bool = False,
        cap: float = 10.0,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
    ) -> None:
        super().__init__()
        beta = check_weight(transition_weight, "transition_weight")
        features = check_nonnegative_int(num_features, "num_features")
        cap = check_weight(cap, "cap")
        if cap == 0.0:
            raise MapMatchedValueError("cap must be > 0 (the distance a far jump saturates at)")
        factory = {"dtype": dtype, "device": device}
        self.transition_weight = nn.Parameter(torch.tensor(beta, **factory))
        self.num_features = features
        self.calibrate = bool(calibrate)
        if features:
            self.gate_bias = nn.Parameter(torch.zeros((), **factory))
            self.gate_weights = nn.Parameter(torch.zeros(features, **factory))
            self.register_buffer("feature_mean", torch.zeros(features, **factory))
            self.register_buffer("feature_std", torch.ones(features, **factory))
        if self.calibrate:
            # softplus^-1(cap), so that softplus(parameter) == cap to rounding
            self.cap_parameter = nn.Parameter(torch.tensor(cap, **factory).expm1().log())

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, calibrate={self.calibrate}"

    @property
    def effective_transition_weight(self) -> Tensor:
        """beta as used: ``transition_weight.clamp_min(0)`` (0-dim, differentiable)."""
        return self.transition_weight.clamp_min(0.0)

    @property
    def is_zero(self) -> bool:
        """beta == 0: every transition is 0 (one synchronization)."""
        return float(self.effective_transition_weight.detach()) == 0.0

    @torch.no_grad()
    def standardize_(self, features: Tensor, mask: Optional[Tensor] = None) -> "GatedTransitions":
        """Set ``feature_mean`` / ``feature_std`` from training features (never test data).

        Args:
            features: ``(B, T-1, M or 1, K)``.
            mask: ``(B, T-1, M or 1)`` bool, the entries to use (default all).
        """
        features = self._checked_features(features)
        flat = features.reshape(-1, self.num_features)
        if mask is not None:
            flat = flat[mask.expand(features.shape[:-1]).reshape(-1)]
        if flat.shape[0] == 0:
            raise MapMatchedValueError("standardize_ needs at least one feature row")
        self.feature_mean.copy_(flat.mean(dim=0))
        self.feature_std.copy_(flat.std(dim=0, unbiased=False).clamp_min(1e-12))
        return self

    def _checked_features(self, features: Optional[Tensor]) -> Tensor:
        if features is None:
            raise MapMatchedValueError(
                f"this transition model gates on {self.num_features} feature(s) per move: pass features "
                f"of shape (B, T-1, M, {self.num_features}) (or (B, T-1, 1, {self.num_features}))"
            )
        if not isinstance(features, Tensor) or features.dim() < 2 or features.shape[-1] != self.num_features:
            shape = tuple(features.shape) if isinstance(features, Tensor) else type(features).__name__
            raise MapMatchedValueError(
                f"features must be a tensor whose last dimension is num_features={self.num_features}, got {shape}"
            )
        return features

    def gate(self, features: Optional[Tensor]) -> Optional[Tensor]:
        """``(B, T-1, M or 1)`` gate multipliers in (0, 2), or None without features."""
        if not self.num_features:
            return None
        features = self._checked_features(features)
        standardized = (features - self.feature_mean) / self.feature_std
        # 2 sigmoid(z) as 2 / (1 + exp(-z)): torch's sigmoid rounds differently in its
        # vectorized and scalar loops (so a move's gate would depend on its position in
        # the batch); exp, + and / do not, so eval, sessions and the server agree bit for
        # bit. The clamp keeps exp finite (a gate of 0 or 2 to rounding either way).
        logit = self.gate_bias + (standardized * self.gate_weights).sum(dim=-1)
        return 2.0 / (1.0 + torch.exp(-logit.clamp(-700.0, 700.0)))

    def calibrated(self, distances: Tensor) -> Tensor:
        """The distances the transitions use (saturated when ``calibrate``)."""
        if not self.calibrate:
            return distances
        cap = nn.functional.softplus(self.cap_parameter)
        return cap * -torch.expm1(-distances / cap)

    def forward(
        self, distances: Tensor, features: Optional[Tensor] = None, dtype: Optional[torch.dtype] = None
    ) -> Tensor:
        """Transitions ``(B, T-1, M, M)`` (or the distances' shape) for ``distances``.

        Args:
            distances: raw graph distances ``[..., from, to]``.
            features: per-move features ``(..., M or 1, K)`` (required when K > 0).
            dtype: cast the result to this dtype.
        """
        factors = self.move_factors(features)
        # shape: (..., M, 1) per source candidate, or 0-d without a gate
        transitions = self.calibrated(distances) * (factors.unsqueeze(-1) if factors.dim() else factors)
        return transitions if dtype is None else transitions.to(dtype)

    def move_factors(self, features: Optional[Tensor] = None) -> Tensor:
        """``-(beta * gate)``: what each (calibrated) distance out of a source candidate is
        multiplied by, ``(..., M or 1)`` (0-d ``-beta`` without a gate). :meth:`forward` is
        ``calibrated(d) * move_factors(features)[..., None]`` (the fixed model's
        ``d * -beta`` when the gate is 1), and the fused serving step multiplies by the
        same factors in its kernel, so both make the same bits."""
        beta = self.effective_transition_weight
        gate = self.gate(features)
        return move_factor(beta if gate is None else beta * gate)

    def bind(self, features: Optional[Tensor]) -> "BoundTransitions":
        """A :class:`TransitionModel` (for :func:`decode_weighted`, sessions, the server)
        that applies this model with these features."""
        return BoundTransitions(self, features)


def check_learned_transitions(model: object, what: str = "transitions") -> "GatedTransitions":
    """A learned transition model as sessions and the server take it (``transitions=``), checked.

    The contract: a :class:`GatedTransitions`, or any object with the same surface:
    ``num_features`` (K, 0 or 1: the gate feature of
    :mod:`~mapmatched_torch.kernels.gate_features` is one number per move),
    ``is_zero``, ``effective_transition_weight`` (beta, a 0-d tensor) and
    ``model(distances, features, dtype)`` returning transitions of the distances' shape.

    Raises:
        MapMatchedValueError: another type, K outside {0, 1}, or a negative or non-finite beta.
    """
    surface = ("num_features", "is_zero", "effective_transition_weight")
    if isinstance(model, (Tensor, numbers.Real)) or not callable(model) or any(
        not hasattr(model, name) for name in surface
    ):
        raise MapMatchedValueError(
            f"{what} must be a GatedTransitions (or an object with num_features, is_zero, "
            f"effective_transition_weight and model(distances, features, dtype)), got {type(model).__name__}; "
            "a fixed beta is transition_weight="
        )
    features = getattr(model, "num_features")
    if isinstance(features, bool) or not isinstance(features, int) or features not in (0, 1):
        raise MapMatchedValueError(
            f"{what} has num_features={features!r}, but sessions and the server compute one gate feature per move "
            "(kernels/gate_features.py): it must be 0 or 1"
        )
    raw = getattr(model, "transition_weight", None)
    value = raw if isinstance(raw, Tensor) else model.effective_transition_weight
    beta = float(value.detach()) if isinstance(value, Tensor) else float(value)
    if not math.isfinite(beta) or beta < 0.0:
        raise MapMatchedValueError(f"{what} has transition_weight {beta!r}: it must be finite and nonnegative")
    return model  # type: ignore[return-value]


def transitions_fingerprint(model: object) -> Dict[str, object]:
    """What identifies a learned transition model in a saved state: its type, K, whether it
    calibrates, and a SHA-256 over its ``state_dict`` (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    state = model.state_dict() if hasattr(model, "state_dict") else {}
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return {
        "type": type(model).__name__,
        "num_features": int(getattr(model, "num_features")),
        "calibrate": bool(getattr(model, "calibrate", False)),
        "sha256": digest.hexdigest(),
    }


class BoundTransitions:
    """A :class:`GatedTransitions` with its features: a :class:`TransitionModel`."""

    __slots__ = ("model", "features")

    def __init__(self, model: GatedTransitions, features: Optional[Tensor]) -> None:
        self.model = model
        self.features = features

    @property
    def is_zero(self) -> bool:
        return self.model.is_zero

    def __call__(self, distances: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
        return self.model(distances, self.features, dtype)


def query_source_cosine(queries: Tensor, candidates: Tensor) -> Tensor:
    """The gate feature "how close is the new query to where the conversation was".

    Args:
        queries: ``(B, T, D)`` query embeddings per turn.
        candidates: ``(B, T, M, D)`` candidate chunk embeddings per turn.

    Returns:
        ``(B, T-1, M, 1)``: ``cos(queries[b, t+1], candidates[b, t, j])``, the feature of
        every move out of candidate j of turn t (0 for zero vectors).
    """
    unit_queries = nn.functional.normalize(queries[:, 1:], dim=-1)
    unit_candidates = nn.functional.normalize(candidates[:, :-1], dim=-1)
    return (unit_candidates * unit_queries.unsqueeze(2)).sum(dim=-1, keepdim=True)


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
    return DecodingMode.choose(as_transition_model(weight).is_zero, lag)


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
