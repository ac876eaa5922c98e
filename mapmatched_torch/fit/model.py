"""The nn.Module holding lambda and beta: decode, partition function, NLL.

:class:`MapMatchedModel` is a thin wrapper around the functions of
:mod:`mapmatched_torch.kernels.decode`: it turns normalized scores and raw graph distances into
weighted emissions ``lambda * s`` and transitions ``-(beta * d)`` (exactly the standalone
decoder's arithmetic) and hands them to the batched dynamic programs. The weights are
parameters, so :meth:`MapMatchedModel.nll` can fit them by gradient descent.

Shapes: ``scores`` ``(B, T, M)`` normalized emission scores, ``distances``
``(B, T-1, M, M)`` raw graph distances ``[b, t, from, to]``, ``mask`` ``(B, T, M)`` bool.
Values at padding (even NaN) are ignored, in results and in gradients.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ..core.checks import check_optional_lag, check_weight
from ..core.errors import MapMatchedValueError
from ..kernels import decode
from ..kernels.checks import check_emissions, check_mask, check_pairwise, first_true_index, pair_mask
from ..kernels.decode import Decoded, FixedLagDecoded
from ..kernels.transitions import GatedTransitions, decode_weighted, decoding_mode, weighted_transitions

__all__ = ["MapMatchedModel"]


def _check_distances(distances: Tensor, mask: Optional[Tensor] = None) -> None:
    """Refuse graph distances that are negative or NaN where they are used.

    Args:
        distances: ``(B, T-1, M, M)`` raw graph distances ``[b, t, from, to]``.
        mask: ``(B, T, M)`` bool or None; with it only moves between real candidates are
            checked (padding may hold anything, even NaN).

    A negative distance would reward a jump (``-(beta * d) > 0``), and NaN would poison
    the partition function. ``+inf`` is not refused here: the decoders refuse the
    ``-inf`` transition it makes (an unreachable pair costs the graph's
    ``maximum_distance``, never inf). One pass and one synchronization.

    Raises:
        MapMatchedValueError: naming the first bad entry ``[b, t, from, to]`` and its value.
    """
    # shape: (B, T-1, M, M); NaN compares False
    bad = ~(distances >= 0)
    if mask is not None:
        bad = bad & pair_mask(mask)
    if bool(bad.any()):
        index = first_true_index(bad)
        where = ", ".join(f"{name}={value}" for name, value in zip(("b", "t", "from", "to"), index))
        raise MapMatchedValueError(
            f"distances must be nonnegative graph distances (not NaN) between real candidates: "
            f"distances[{where}] = {distances[tuple(index)].item()!r}"
            + (f" (the move from turn {index[1]} to turn {index[1] + 1})" if len(index) == 4 else "")
        )


class MapMatchedModel(nn.Module):
    """Map-matched decoding with learnable emission and transition weights.

    The objective of a path is ``sum_t lambda * s_t(x_t) - sum_{t>=1} beta * d(x_{t-1}, x_t)``
    (docs/spec.md section 1). The effective weights are ``param.clamp_min(0)``: the identity on
    valid values (exact), and still >= 0 after an unconstrained optimizer step; call
    :meth:`project_` after the step to clamp the stored values too.

    Args:
        emission_weight: initial lambda, finite and >= 0.
        transition_weight: initial beta, finite and >= 0.
        dtype: of the parameters (float64 by default, for exact parity with the
            standalone decoder).
        device: of the parameters.
        transition_model: a learned :class:`~mapmatched_torch.kernels.transitions.GatedTransitions`
            (a gate on beta from per-move features, a learned distance saturation);
            its beta is this model's ``transition_weight`` (one parameter), and every
            method then takes the per-move ``features`` (``(B, T-1, M, K)`` or
            ``(B, T-1, 1, K)``). None (default): the fixed model ``-(beta * d)``.

    Example:
        >>> model = MapMatchedModel(1.0, 0.5)
        >>> scores = torch.tensor([[[1.0, 0.0], [0.0, 0.2]]], dtype=torch.float64)
        >>> distances = torch.tensor([[[[0.0, 2.0], [2.0, 0.0]]]], dtype=torch.float64)
        >>> model.decode(scores, distances, torch.ones(1, 2, 2, dtype=torch.bool)).paths
        tensor([[0, 0]])
    """

    def __init__(
        self,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        *,
        dtype: torch.dtype = torch.float64,
        device: Optional[Union[str, torch.device]] = None,
        transition_model: Optional[GatedTransitions] = None,
    ) -> None:
        super().__init__()
        lam = check_weight(emission_weight, "emission_weight")
        beta = check_weight(transition_weight, "transition_weight")
        self.emission_weight = nn.Parameter(torch.tensor(lam, dtype=dtype, device=device))
        if transition_model is None:
            self.transition_weight = nn.Parameter(torch.tensor(beta, dtype=dtype, device=device))
        else:
            if not isinstance(transition_model, GatedTransitions):
                raise MapMatchedValueError(
                    f"transition_model must be a GatedTransitions, got {type(transition_model).__name__}"
                )
            self.transition_weight = transition_model.transition_weight  # one beta, shared
        self.transition_model = transition_model

    def extra_repr(self) -> str:
        return f"emission_weight={self.emission_weight.item():g}, transition_weight={self.transition_weight.item():g}"

    @property
    def effective_emission_weight(self) -> Tensor:
        """lambda as used: ``emission_weight.clamp_min(0)`` (0-dim, differentiable)."""
        return self.emission_weight.clamp_min(0.0)

    @property
    def effective_transition_weight(self) -> Tensor:
        """beta as used: ``transition_weight.clamp_min(0)`` (0-dim, differentiable)."""
        return self.transition_weight.clamp_min(0.0)

    @torch.no_grad()
    def project_(self) -> "MapMatchedModel":
        """Clamp the stored weights to >= 0 in place (call after an optimizer step)."""
        self.emission_weight.clamp_(min=0.0)
        self.transition_weight.clamp_(min=0.0)
        return self

    def emissions(self, scores: Tensor, mask: Optional[Tensor] = None) -> Tensor:
        """Weighted emissions ``lambda * scores`` ``(B, T, M)``.

        With ``mask``, masked entries become 0 first, so that padding garbage cannot
        reach the gradient of lambda (``0 * nan`` is nan).
        """
        if mask is not None:
            scores = torch.where(mask, scores, 0.0)
        return self.effective_emission_weight * scores

    def transitions(
        self, distances: Tensor, mask: Optional[Tensor] = None, features: Optional[Tensor] = None
    ) -> Tensor:
        """Weighted transitions ``(B, T-1, M, M)`` ``[b, t, from, to]``: ``-(beta * distances)``,
        or the learned ``transition_model``'s with its per-move ``features``.

        With ``mask`` ``(B, T, M)``, moves touching a masked candidate become 0 first (and
        features of masked source candidates 0, so padding reaches no gradient).
        Raises ValueError for a negative or NaN distance between real candidates
        (see :func:`_check_distances`).
        """
        _check_distances(distances, mask)
        if mask is not None:
            distances = torch.where(pair_mask(mask), distances, 0.0)
        if self.transition_model is None:
            return weighted_transitions(distances, self.effective_transition_weight)
        if features is not None and mask is not None:
            # shape: (B, T-1, M or 1): a real source candidate with a real next turn
            onward = mask[:, 1:].any(-1, keepdim=True)
            per_candidate = features.shape[-2] == mask.shape[-1]
            sources = (mask[:, :-1] if per_candidate else mask[:, :-1].any(-1, keepdim=True)) & onward
            features = torch.where(sources.unsqueeze(-1), features, 0.0)
        return self.transition_model(distances, features)

    def _weighted(
        self, scores: Tensor, distances: Tensor, mask: Tensor, features: Optional[Tensor] = None
    ) -> Tuple[Tensor, Tensor]:
        """Validate the shapes, then weight (padding zeroed)."""
        scores = check_emissions(scores, "scores")
        mask = check_mask(mask, scores, "scores")
        distances = check_pairwise(distances, scores, "distances", "scores")
        return self.emissions(scores, mask), self.transitions(distances, mask, features)

    @torch.no_grad()
    def decode(
        self,
        scores: Tensor,
        distances: Optional[Tensor],
        mask: Tensor,
        fixed_lag: Optional[int] = None,
        *,
        features: Optional[Tensor] = None,
    ) -> Union[Decoded, FixedLagDecoded]:
        """Decode the best paths (full Viterbi, or fixed-lag with ``fixed_lag``).

        The decoder is chosen by :func:`~mapmatched_torch.kernels.transitions.decode_weighted`:
        when beta == 0 it is :func:`~mapmatched_torch.kernels.decode.pointwise_decode` (the
        exact per-turn argmax, as in the standalone decoder) and ``distances`` may be
        None. Reads beta once (one synchronization).

        Args:
            scores: ``(B, T, M)`` normalized scores. distances: ``(B, T-1, M, M)`` raw
                distances (or None when beta == 0). mask: ``(B, T, M)`` bool.
            fixed_lag: None or L >= 0.

        Returns:
            :class:`~mapmatched_torch.kernels.decode.Decoded`, or
            :class:`~mapmatched_torch.kernels.decode.FixedLagDecoded` with a lag.
        """
        lag = check_optional_lag(fixed_lag)
        beta = float(self.effective_transition_weight)  # the one synchronization
        scores = check_emissions(scores, "scores")
        mask = check_mask(mask, scores, "scores")
        transitions = None  # decode_weighted refuses None when beta > 0
        if distances is not None and decoding_mode(beta, lag).uses_distances:
            transitions = self.transitions(check_pairwise(distances, scores, "distances", "scores"), mask, features)
        return decode_weighted(self.emissions(scores, mask), None, mask, beta, lag, transitions=transitions)

    def log_partition(
        self, scores: Tensor, distances: Tensor, mask: Tensor, *, features: Optional[Tensor] = None
    ) -> Tensor:
        """``(B,)`` log Z over all paths (differentiable in every weight)."""
        return decode.log_partition(*self._weighted(scores, distances, mask, features), mask)

    def marginals(
        self, scores: Tensor, distances: Tensor, mask: Tensor, *, features: Optional[Tensor] = None
    ) -> Tensor:
        """``(B, T, M)`` posterior marginals (0 at padding; each real turn sums to 1)."""
        return decode.marginals(*self._weighted(scores, distances, mask, features), mask)

    def nll(
        self, scores: Tensor, distances: Tensor, mask: Tensor, gold: Tensor, *, features: Optional[Tensor] = None
    ) -> Tensor:
        """Negative log-likelihood of gold labels: ``log Z - log Z(gold)`` per conversation.

        Args:
            scores, distances, mask: the batch.
            gold: ``(B, T)`` long, the gold candidate index of each turn, -1 where
                unlabelled (marginalized); entries after a conversation's end are ignored.

        Returns:
            ``(B,)`` nonnegative losses (up to rounding); gradients reach both weights.
        """
        return -decode.log_likelihood(*self._weighted(scores, distances, mask, features), mask, gold)

    def forward(
        self, scores: Tensor, distances: Tensor, mask: Tensor, gold: Tensor, *, features: Optional[Tensor] = None
    ) -> Tensor:
        """The training loss: mean :meth:`nll` over the batch (a loss, >= 0; minimize it)."""
        return self.nll(scores, distances, mask, gold, features=features).mean()
