"""Building a retrieval trace from a decoded path (docs/spec.md section 7).

:func:`build_trace` adds, to every decoded step, the candidate diagnostics of
docs/spec.md section 3 (emission entropy, margin), the runner-up and the kind of move
(:func:`classify_move`). Serializing and rendering a trace is :mod:`.trace`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Sequence

from .models import DecodedPath, DecodedStep, DecoderCandidate, RetrievalTrace, TraceStep
from .scoring import normalized_margin, runner_up_index, softmax_entropy

__all__ = ["classify_move", "build_trace"]


def classify_move(turn_index: int, chunk_id: str, previous_chunk_id: Optional[str], graph_distance: float,
                  maximum_distance: float) -> str:
    """The kind of move a decoded step made.

    Returns:
        ``"start"`` at turn 0; ``"stay"`` when the chunk equals the previous turn's;
        ``"jump"`` when the transition was clamped at ``maximum_distance`` (the emission
        gain paid the full penalty); otherwise ``"drill"``. With ``transition_weight``
        = 0 the decoder never computes distances (they are reported as 0.0), so every
        change of chunk is then a ``"drill"``.
    """
    if turn_index == 0 or previous_chunk_id is None:
        return "start"
    if chunk_id == previous_chunk_id:
        return "stay"
    if graph_distance >= maximum_distance:
        return "jump"
    return "drill"


def build_trace(
    path: DecodedPath,
    trellis: Sequence[Sequence[DecoderCandidate]],
    *,
    emission_weight: float,
    maximum_distance: float,
    revised_prior_indices: Sequence[int] = (),
    reuse: Sequence[TraceStep] = (),
) -> RetrievalTrace:
    """Combine a decoded path with its trellis into a :class:`RetrievalTrace`.

    Args:
        path: the decoder's output for ``trellis`` (one step per turn).
        trellis: the candidates of every turn, as decoded.
        emission_weight: lambda, for the emission entropy softmax(lambda * s).
        maximum_distance: the graph's bound, to tell a "jump" from a "drill".
        revised_prior_indices: earlier turns whose decoded chunk changed.
        reuse: trace steps of an earlier call on a prefix of the same trellis (with the
            same weights): kept as long as their decoded steps are unchanged.
    """
    steps: List[TraceStep] = []
    for old, step in zip(reuse, path.steps):
        if _decoded_fields(old) != _decoded_fields(step):
            break
        steps.append(old)
    previous: Optional[str] = steps[-1].chunk_id if steps else None
    for step, turn in zip(path.steps[len(steps):], trellis[len(steps):]):
        normalized = [candidate.normalized_score for candidate in turn]
        chosen = next(index for index, candidate in enumerate(turn) if candidate.chunk_id == step.chunk_id)
        runner_up = runner_up_index(normalized, chosen)
        steps.append(
            TraceStep(
                **dict(zip(_DECODED_FIELDS, _decoded_fields(step))),
                emission_entropy=softmax_entropy([emission_weight * value for value in normalized]),
                normalized_emission_margin=normalized_margin(normalized, chosen),
                runner_up_chunk_id=None if runner_up is None else turn[runner_up].chunk_id,
                move=classify_move(step.turn_index, step.chunk_id, previous, step.graph_distance, maximum_distance),
            )
        )
        previous = step.chunk_id
    return RetrievalTrace(
        steps=tuple(steps),
        path_chunk_ids=path.chunk_ids,
        revised_prior_indices=tuple(revised_prior_indices),
        fixed_lag=path.fixed_lag,
        committed_through_index=path.committed_through_index,
    )


_DECODED_FIELDS = tuple(field.name for field in dataclasses.fields(DecodedStep))


def _decoded_fields(step: Any) -> tuple:
    return tuple(getattr(step, name) for name in _DECODED_FIELDS)
