"""The loss of a fit: the negative log-likelihood of the gold labels.

The model is the Gibbs distribution of the decoder's objective (docs/spec.md section 1)::

    p(x) ∝ exp( sum_t lambda * s_t(x_t) - sum_{t>=1} beta * d(x_{t-1}, x_t) )

over the paths x of a conversation's trellis. The loss is the negative log-likelihood
of the labels, marginalizing what they do not say::

    nll = log Z - log Z(relevant)

where ``Z(relevant)`` sums ``exp(score)`` over the paths that, at every *usable* turn,
pass through one of that turn's relevant candidates (several relevant candidates are
alternatives: their paths are summed, not multiplied). Gold-missing and unlabelled
turns (see :mod:`~mapmatched_torch.fit.packing`) constrain nothing: every path through
them counts, so they are marginalized out. :func:`set_log_likelihood` is that
log-likelihood on tensors; :func:`batch_nll` is the loss of a packed
:class:`~mapmatched_torch.fit.packing.LabelledBatch` under a model's weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..kernels import decode
from .model import MapMatchedModel
from .packing import LabelledBatch

__all__ = ["set_log_likelihood", "batch_nll"]


def set_log_likelihood(emissions: Tensor, transitions: Tensor, mask: Tensor, relevant: Tensor) -> Tensor:
    """Log-probability that the path meets a relevant candidate at every usable turn.

    ``log Z(allowed) - log Z`` with ``allowed = mask`` narrowed, at every turn that has
    a relevant real candidate, to its relevant candidates (the set-valued form of
    :func:`~mapmatched_torch.kernels.decode.log_likelihood`). Turns without a relevant real
    candidate (unlabelled, or gold not among the candidates) keep their whole mask, so
    the narrowed mask still has every real turn non-empty, as
    :func:`~mapmatched_torch.kernels.decode.log_partition` requires.

    Args:
        emissions: ``(B, T, M)`` float weighted emissions.
        transitions: ``(B, T-1, M, M)`` weighted transitions ``[b, t, from, to]``.
        mask: ``(B, T, M)`` bool real candidates.
        relevant: ``(B, T, M)`` bool relevant candidates (ignored at padding).

    Returns:
        ``(B,)`` log-likelihoods, <= 0 up to rounding (exactly 0 for a conversation
        without a usable turn); differentiable in emissions and transitions.

    Cost: two :func:`~mapmatched_torch.kernels.decode.log_partition` passes, O(B T M^2).

    Example:
        >>> e = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
        >>> tr = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
        >>> mask = torch.ones(1, 2, 2, dtype=torch.bool)
        >>> relevant = torch.tensor([[[True, False], [False, False]]])
        >>> set_log_likelihood(e, tr, mask, relevant).exp()  # turn 1 is marginalized
        tensor([0.5000], dtype=torch.float64)
    """
    if not isinstance(relevant, Tensor) or relevant.dtype != torch.bool or relevant.shape != getattr(mask, "shape", None):
        raise MapMatchedValueError(
            f"relevant must be a bool tensor of the mask's shape {tuple(getattr(mask, 'shape', ()))}, got "
            f"{getattr(relevant, 'dtype', type(relevant).__name__)} of shape {tuple(getattr(relevant, 'shape', ()))}"
        )
    return decode.log_likelihood(emissions, transitions, mask, relevant)


def batch_nll(model: MapMatchedModel, batch: LabelledBatch) -> Tensor:
    """``(B,)`` negative log-likelihoods ``log Z - log Z(relevant)`` under ``model``'s weights.

    Differentiable in ``model.emission_weight`` and ``model.transition_weight``.
    Cost: two log-partition passes, O(B T M^2).
    """
    emissions = model.emissions(batch.scores, batch.mask)
    transitions = model.transitions(batch.distances, batch.mask)
    return -set_log_likelihood(emissions, transitions, batch.mask, batch.relevant)
