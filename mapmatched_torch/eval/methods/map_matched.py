"""The pointwise and map-matched methods: online forward-score rankings of a settings grid."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ...core.errors import MapMatchedValueError
from ...kernels.online import online_forward_scores, rank_slots
from ...kernels.transitions import decode_weighted, weighted_transitions
from .registry import MethodBatch, MethodOptions, MethodOutput, Setting, _ranked

__all__ = ["weighted_trellis", "map_matched_orders", "pointwise_order", "decode_setting"]


def weighted_trellis(
    normalized: Tensor, distances: Tensor, setting: Setting
) -> Tuple[Tensor, Tensor]:
    """Emissions ``lambda * s`` (B, T, M) and transitions ``-(beta * d)`` (B, T-1, M, M) [b, t, from, to]."""
    return setting.emission_weight * normalized, weighted_transitions(distances, setting.transition_weight)


def map_matched_orders(
    normalized: Tensor, distances: Optional[Tensor], mask: Tensor, settings: Sequence[Setting]
) -> Tensor:
    """Online rankings of every setting (see the module docstring), distances reused.

    Args:
        normalized: (B, T, M) float64 normalized scores.
        distances: (B, T-1, M, M) float64 raw graph distances ``[b, t, from, to]``,
            computed once for all settings (None only if every beta is 0).
        mask: (B, T, M) bool.
        settings: S settings.

    Returns:
        (S, B, T, M) long slot orders, in ``settings`` order.

    Cost: the settings sharing a lag are decoded as one stacked batch of S_g * B
    conversations: O(S B T M^2) time (times 2 L + 2 with a lag), O(S_g B T M^2)
    memory for the stacked transitions.
    """
    batch, turns, width = mask.shape
    out = torch.empty((len(settings), batch, turns, width), dtype=torch.long, device=mask.device)
    groups: Dict[Optional[int], List[int]] = {}
    for position, setting in enumerate(settings):
        if not setting.mode.uses_distances:
            out[position] = pointwise_order(normalized, mask, setting)
        else:
            groups.setdefault(setting.fixed_lag, []).append(position)
    if groups and distances is None:
        raise MapMatchedValueError("map-matched settings with beta > 0 need the (B, T-1, M, M) distances")
    for lag, members in groups.items():
        count = len(members)
        # shape: (S_g, 1, 1, 1)
        lambdas = torch.tensor([settings[p].emission_weight for p in members], dtype=normalized.dtype,
                               device=normalized.device).view(count, 1, 1, 1)
        betas = lambdas.new_tensor([settings[p].transition_weight for p in members]).view(count, 1, 1, 1, 1)
        # shape: (S_g * B, T, M) and (S_g * B, T-1, M, M): the same arithmetic as weighted_trellis
        emissions = (lambdas * normalized.unsqueeze(0)).reshape(count * batch, turns, width)
        transitions = weighted_transitions(distances.unsqueeze(0), betas).reshape(
            count * batch, max(turns - 1, 0), width, width
        )
        stacked = mask.unsqueeze(0).expand(count, -1, -1, -1).reshape(count * batch, turns, width)
        scores = online_forward_scores(emissions, transitions, stacked, lag)
        out[members] = rank_slots(scores, stacked).view(count, batch, turns, width)
    return out


def pointwise_order(normalized: Tensor, mask: Tensor, setting: Optional[Setting] = None) -> Tensor:
    """The beta = 0 ranking: ``lambda * s`` decreasing, ties by slot (``pointwise_decode``'s argmax first).

    Without a setting lambda is 1 (the retriever's own order: normalization is monotone).
    """
    weight = 1.0 if setting is None else setting.emission_weight
    return rank_slots(weight * normalized, mask)


def decode_setting(normalized: Tensor, distances: Optional[Tensor], mask: Tensor, setting: Setting) -> Tensor:
    """The whole-conversation decoded path of one setting (what the session's trace ends with).

    Args:
        normalized: (B, T, M) float64 normalized scores. mask: (B, T, M) bool.
        distances: (B, T-1, M, M) raw graph distances ``[b, t, from, to]``; None only
            when the setting's beta is 0 (pointwise; MapMatchedValueError otherwise).
        setting: lambda, beta and lag, dispatched by
            :func:`~mapmatched_torch.kernels.transitions.decode_weighted`.

    Returns:
        (B, T) long candidate slots, -1 after each conversation's end.
    """
    emissions = setting.emission_weight * normalized
    return decode_weighted(emissions, distances, mask, setting.transition_weight, setting.fixed_lag).paths


def _run_pointwise(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    order = pointwise_order(batch.normalized, batch.candidates.mask)
    return [MethodOutput("pointwise", "pointwise", {}, _ranked(batch, order))]


def _run_map_matched(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    orders = map_matched_orders(batch.normalized, batch.distances, batch.candidates.mask, options.settings)
    return [
        MethodOutput(f"map-matched {setting.label}", "map-matched", setting.to_dict(), _ranked(batch, order))
        for setting, order in zip(options.settings, orders)
    ]
