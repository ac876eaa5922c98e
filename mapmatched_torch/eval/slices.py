"""Turn slices: follow-up vs standalone (by emission entropy) and topic switch vs same topic.

Map-matching should lift the *follow-up* turns (ambiguous candidates: high emission
entropy) without hurting the *standalone* ones. A turn's emission entropy is the
Shannon entropy (nats) of ``softmax(lambda * normalized scores)`` over its candidates
(docs/spec.md section 3); :func:`emission_entropy` computes it in a batch.

Rules of :func:`entropy_slices`:

- a turn at position 0 (the first turn of its conversation) is always standalone;
- among later turns, a turn whose entropy is strictly above the threshold is a
  follow-up, the others are standalone;
- the threshold is the configured one, or else the median of the later turns'
  entropies (those inside ``eligible``): the mean of the two middle values for an
  even count; NaN when there is no later eligible turn (then nothing is a follow-up);
- turns outside ``eligible`` (e.g. unlabelled ones) are in neither slice.

Shapes are generic: any tensor shape works as long as the arguments broadcast, e.g.
flat (N,) turn tables or padded (B, T) batches.

Example:
    >>> import torch
    >>> entropy = torch.tensor([2.0, 0.1, 1.5, 0.2], dtype=torch.float64)
    >>> position = torch.tensor([0, 1, 2, 3])
    >>> s = entropy_slices(entropy, position)
    >>> s.followup.tolist(), s.standalone.tolist(), s.threshold
    ([False, False, True, False], [True, True, False, True], 0.2)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ..core.errors import MapMatchedValueError

__all__ = [
    "EntropySlices",
    "TopicSlices",
    "emission_entropy",
    "median",
    "entropy_slices",
    "topic_slices",
]


class EntropySlices(NamedTuple):
    """Follow-up / standalone masks and the threshold that made them.

    Attributes:
        followup: bool mask, later turns with entropy > threshold.
        standalone: bool mask, first turns and later turns with entropy <= threshold.
        threshold: the entropy threshold used (nats); NaN when the median had no
            turn to take it from.
        configured: True when the threshold was given, False when it is the median.
    """

    followup: torch.Tensor
    standalone: torch.Tensor
    threshold: float
    configured: bool


class TopicSlices(NamedTuple):
    """Topic-switch / same-topic masks; both False where the label is unknown.

    Attributes:
        switch: bool mask, turns labelled as a topic switch.
        same: bool mask, turns labelled as staying on the topic.
    """

    switch: torch.Tensor
    same: torch.Tensor


def emission_entropy(
    normalized_scores: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    emission_weight: Union[float, torch.Tensor] = 1.0,
) -> torch.Tensor:
    """Entropy (nats) of ``softmax(emission_weight * scores)`` over the last dimension.

    Args:
        normalized_scores: (..., M) float, each turn's normalized candidate scores.
        mask: (..., M) bool, real candidates; None = all real. Padding is excluded.
        emission_weight: lambda >= 0 (a float or a tensor broadcasting to (...)).

    Returns:
        (...) float64 entropies, >= 0; 0.0 for a turn with at most one real candidate.
    """
    if not isinstance(normalized_scores, torch.Tensor) or normalized_scores.dim() < 1:
        raise MapMatchedValueError("normalized_scores must be a tensor with a candidate dimension")
    logits = normalized_scores.to(torch.float64)
    if isinstance(emission_weight, torch.Tensor):
        logits = logits * emission_weight.to(torch.float64).unsqueeze(-1)
    else:
        logits = logits * float(emission_weight)
    if mask is None:
        mask = torch.ones_like(logits, dtype=torch.bool)
    elif mask.shape != normalized_scores.shape:
        raise MapMatchedValueError(f"mask shape {tuple(mask.shape)} differs from scores shape {tuple(normalized_scores.shape)}")
    floor = torch.finfo(torch.float64).min
    # shape: (..., M), padding pushed to the dtype's lowest finite value
    logits = torch.where(mask, logits, torch.full_like(logits, floor))
    top = logits.max(dim=-1, keepdim=True).values
    shifted = torch.where(mask, logits - top, torch.zeros_like(logits))
    weights = torch.where(mask, torch.exp(shifted), torch.zeros_like(logits))
    total = weights.sum(dim=-1)
    expected = (weights * shifted).sum(dim=-1) / total.clamp(min=1.0)
    entropy = (torch.log(total.clamp(min=1.0)) - expected).clamp(min=0.0)
    return torch.where(mask.sum(dim=-1) > 1, entropy, torch.zeros_like(entropy))


def median(values: torch.Tensor) -> float:
    """The median of a 1-D tensor (mean of the two middle values for an even count; NaN if empty)."""
    flat = values.reshape(-1).to(torch.float64)
    count = flat.numel()
    if count == 0:
        return math.nan
    ordered = torch.sort(flat).values
    middle = count // 2
    if count % 2:
        return float(ordered[middle])
    return float((ordered[middle - 1] + ordered[middle]) / 2.0)


def entropy_slices(
    entropy: torch.Tensor,
    position: torch.Tensor,
    threshold: Optional[float] = None,
    eligible: Optional[torch.Tensor] = None,
) -> EntropySlices:
    """Split turns into follow-up and standalone by emission entropy (rules in the module docstring).

    Args:
        entropy: emission entropy of each turn (any shape, float).
        position: turn position within its conversation (0 = first), broadcasting to
            ``entropy``'s shape (e.g. ``torch.arange(T)`` for a (B, T) batch).
        threshold: a fixed threshold in nats, or None for the median of the later
            eligible turns.
        eligible: bool mask of the turns to slice (e.g. labelled real turns); None =
            all. Ineligible turns are in neither slice and do not enter the median.

    Returns:
        :class:`EntropySlices` with masks of ``entropy``'s shape.
    """
    if not isinstance(entropy, torch.Tensor) or not entropy.is_floating_point():
        raise MapMatchedValueError("entropy must be a floating-point tensor")
    position = torch.as_tensor(position, device=entropy.device)
    try:
        position = position.expand_as(entropy)
    except RuntimeError:
        raise MapMatchedValueError(
            f"position shape {tuple(position.shape)} does not broadcast to entropy shape {tuple(entropy.shape)}"
        ) from None
    if eligible is None:
        eligible = torch.ones_like(entropy, dtype=torch.bool)
    elif eligible.shape != entropy.shape or eligible.dtype != torch.bool:
        raise MapMatchedValueError(f"eligible must be a bool tensor of shape {tuple(entropy.shape)}")
    if threshold is not None and (isinstance(threshold, bool) or not math.isfinite(float(threshold))):
        raise MapMatchedValueError(f"threshold must be a finite number or None, got {threshold!r}")
    later = eligible & (position > 0)
    configured = threshold is not None
    value = float(threshold) if configured else median(entropy[later])
    followup = later & (entropy > value) if not math.isnan(value) else torch.zeros_like(later)
    standalone = eligible & ~followup
    return EntropySlices(followup, standalone, value, configured)


def topic_slices(
    topic_switch: Union[torch.Tensor, Sequence[Optional[bool]]],
    position: Optional[torch.Tensor] = None,
    eligible: Optional[torch.Tensor] = None,
) -> TopicSlices:
    """Topic-switch vs same-topic masks, where the dataset labels them.

    Args:
        topic_switch: a bool tensor (every turn labelled), an integer tensor with 1
            switch / 0 same / -1 unknown (as in :class:`~mapmatched_torch.eval.data.TurnTable`),
            or a sequence of True/False/None.
        position: optional turn positions; when given, first turns (position 0) are
            in neither slice (they have no previous topic).
        eligible: optional bool mask of turns to keep (e.g. labelled turns).

    Returns:
        :class:`TopicSlices` with masks of ``topic_switch``'s shape.
    """
    if not isinstance(topic_switch, torch.Tensor):
        values = list(topic_switch)
        if any(value is not None and not isinstance(value, bool) for value in values):
            raise MapMatchedValueError("topic_switch entries must be True, False or None")
        topic_switch = torch.tensor([-1 if value is None else int(value) for value in values], dtype=torch.int8)
    if topic_switch.dtype == torch.bool:
        known = torch.ones_like(topic_switch)
        switch = topic_switch.clone()
    elif not topic_switch.is_floating_point():
        if bool(((topic_switch < -1) | (topic_switch > 1)).any()):
            raise MapMatchedValueError("integer topic_switch must hold 1 (switch), 0 (same) or -1 (unknown)")
        known = topic_switch >= 0
        switch = topic_switch == 1
    else:
        raise MapMatchedValueError(f"topic_switch must be bool or integer, got {topic_switch.dtype}")
    if position is not None:
        known = known & (torch.as_tensor(position, device=known.device).expand_as(known) > 0)
    if eligible is not None:
        known = known & eligible
    return TopicSlices(switch & known, ~switch & known)
