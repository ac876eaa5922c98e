"""Exact sampling of paths from the map-matching model.

The decoder's objective defines a Gibbs distribution over the paths of a trellis::

    p(x) = exp(score(x)) / Z,   score(x) = sum_t e[t, x_t] + sum_{t>=1} trans[t-1, x_{t-1}, x_t]

:func:`sample_paths` draws exact samples from it by *forward filtering, backward
sampling*: the log-semiring forward pass of :mod:`mapmatched_torch.kernels.chain` gives
``alpha[t, i] = log sum over prefixes ending at (t, i)``; the last turn is drawn from
``softmax(alpha[T-1])`` and each earlier turn from
``p(x_t = j | x_{t+1} = i) ∝ exp(alpha[t, j] + trans[t, j, i])``. Categorical draws use
the Gumbel-max trick (``argmax(logits + Gumbel noise)``), so one ``torch.rand`` call per
turn serves every sample and conversation at once.

Synthetic labelled conversations drawn with it (the data a fit should recover its
weights from) are :func:`mapmatched_torch.fit.sampling.sample_conversations`.

Shapes follow :mod:`mapmatched_torch.kernels.decode`: emissions ``(B, T, M)``, transitions
``(B, T-1, M, M)`` indexed ``[b, t, from, to]``, mask ``(B, T, M)`` bool.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..core.checks import check_positive_int
from . import chain
from .checks import prepare, raise_if_nonfinite
from .semiring import LOG

__all__ = ["sample_paths"]


def _uniform(shape: Tuple[int, ...], generator: Optional[torch.Generator], like: Tensor) -> Tensor:
    """Uniform [0, 1) float64 draws of ``shape`` on ``like``'s device.

    With a generator, the draws are made on the generator's device and moved, so a CPU
    generator gives the same samples on every device.
    """
    if generator is None:
        return torch.rand(shape, dtype=torch.float64, device=like.device)
    draws = torch.rand(shape, dtype=torch.float64, device=generator.device, generator=generator)
    return draws.to(like.device)


def _gumbel_argmax(logits: Tensor, uniform: Tensor) -> Tensor:
    """Index of ``argmax(logits + Gumbel(uniform))`` over the last dimension.

    ``-log(-log(u))`` is a standard Gumbel draw for ``u`` uniform in (0, 1); a -inf
    logit (a masked candidate) never wins against a finite one.
    """
    noise = -torch.log(-torch.log(uniform))
    return (logits.to(torch.float64) + noise).argmax(dim=-1)


def _column(transitions_t: Tensor, targets: Tensor) -> Tensor:
    """``(S, B, M_from)``: ``transitions_t[b, :, targets[s, b]]`` for every sample s.

    Args:
        transitions_t: ``(B, M_from, M_to)``. targets: ``(S, B)`` long.
    """
    samples = targets.shape[0]
    batch, width, _ = transitions_t.shape
    # shape: (S, B, M_to, M_from)
    rows = transitions_t.transpose(1, 2).unsqueeze(0).expand(samples, batch, width, width)
    return rows.gather(2, targets[:, :, None, None].expand(samples, batch, 1, width)).squeeze(2)


def sample_paths(
    emissions: Tensor,
    transitions: Tensor,
    mask: Tensor,
    num_samples: int = 1,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Exact samples from ``p(path) ∝ exp(path score)`` (forward filtering, backward sampling).

    Args:
        emissions: ``(B, T, M)`` float weighted emissions (``lambda * s``).
        transitions: ``(B, T-1, M, M)`` weighted transitions ``[b, t, from, to]``
            (``-(beta * d)``, from
            :func:`~mapmatched_torch.kernels.transitions.weighted_transitions`).
        mask: ``(B, T, M)`` bool real candidates (real turns first, each non-empty).
        num_samples: S >= 1 independent paths per conversation.
        generator: a ``torch.Generator`` for reproducible draws (on any device; the
            uniforms are drawn on its device and moved to the inputs'), or None for the
            global generator of the inputs' device.

    Returns:
        ``(S, B, T)`` long candidate indices, -1 after each conversation's end, on the
        inputs' device. Padding is never sampled.

    Raises:
        MapMatchedValueError: invalid input (as :func:`~mapmatched_torch.kernels.decode.log_partition`)
            or a forward score that overflowed.

    Cost: one log-semiring forward pass, O(B T M^2), plus O(S B T M) for the backward
    draws; memory O(B T M + S B T M).

    Example:
        >>> e = torch.tensor([[[0.0, -50.0], [-50.0, 0.0]]], dtype=torch.float64)
        >>> tr = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
        >>> sample_paths(e, tr, torch.ones(1, 2, 2, dtype=torch.bool), 2, torch.Generator().manual_seed(0))
        tensor([[[0, 1]],
        <BLANKLINE>
                [[0, 1]]])
    """
    samples = check_positive_int(num_samples, "num_samples")
    prepared = prepare(emissions, transitions, mask)
    forward = chain.forward(LOG, prepared.emissions, prepared.pairwise, mask)
    raise_if_nonfinite(forward.nonfinite)
    batch, turns, width = prepared.emissions.shape
    # shape: (B, T, M): -inf at masked candidates (carried final scores at inactive turns)
    alphas = forward.alphas
    active = prepared.active
    draws = _uniform((turns, samples, batch, width), generator, alphas)
    # shape: (S, B): each conversation's last real turn, drawn from its final forward scores
    state = _gumbel_argmax(alphas[:, -1].expand(samples, batch, width), draws[turns - 1])
    columns: List[Tensor] = [torch.where(active[:, turns - 1], state, -1)]
    for t in range(turns - 2, -1, -1):
        # shape: (S, B, M): log p(x_t = j, x_{t+1} = state) up to a constant
        logits = alphas[:, t].unsqueeze(0) + _column(prepared.pairwise[:, t], state)
        conditional = _gumbel_argmax(logits, draws[t])
        state = torch.where(active[:, t + 1], conditional, state)
        columns.append(torch.where(active[:, t], state, -1))
    columns.reverse()
    return torch.stack(columns, dim=2)
