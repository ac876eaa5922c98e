"""Building, serializing and rendering retrieval traces (docs/spec.md section 7).

A trace explains a decoded path turn by turn: the decoder's scores
(:class:`~mapmatched_torch.core.models.DecodedStep`) plus the candidate diagnostics of
docs/spec.md section 3 (emission entropy, margin), the runner-up and the kind of move.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Optional, Sequence

from .models import DecodedPath, DecodedStep, DecoderCandidate, RetrievalTrace, TraceStep
from .scoring import normalized_margin, runner_up_index, softmax_entropy

__all__ = ["classify_move", "build_trace", "trace_to_dict", "trace_to_json", "render_trace", "TRACE_COLUMNS"]

#: Column headers of :func:`render_trace`, in order.
TRACE_COLUMNS = (
    "turn",
    "chunk",
    "raw",
    "normalized",
    "emission",
    "distance",
    "transition",
    "entropy",
    "margin",
    "cumulative",
    "runner-up",
    "move",
)


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


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def trace_to_dict(trace: RetrievalTrace) -> Dict[str, Any]:
    """Every field of ``trace`` as plain dicts/lists/scalars (steps included)."""
    return _plain(trace)


def trace_to_json(trace: RetrievalTrace, indent: Optional[int] = None) -> str:
    """JSON of :func:`trace_to_dict` with sorted keys; NaN/inf raise ValueError."""
    return json.dumps(trace_to_dict(trace), sort_keys=True, allow_nan=False, indent=indent)


def _number(value: float) -> str:
    return "%.6g" % value


def render_trace(trace: RetrievalTrace) -> str:
    """A plain-text report: a header, then one table row per turn.

    The header gives the path (``a -> b``), the mode (``full`` or ``fixed-lag L``), the
    revised prior turns (or ``none``) and the committed boundary (or ``none``). The
    table has the columns of :data:`TRACE_COLUMNS`; numbers use ``%.6g``.
    """
    mode = "full" if trace.fixed_lag is None else f"fixed-lag {trace.fixed_lag}"
    revised = ", ".join(str(index) for index in trace.revised_prior_indices) or "none"
    committed = "none" if trace.committed_through_index is None else str(trace.committed_through_index)
    header = [
        f"path: {' -> '.join(trace.path_chunk_ids)}",
        f"mode: {mode}",
        f"revised prior turns: {revised}",
        f"committed through turn: {committed}",
    ]
    rows = [list(TRACE_COLUMNS)]
    for step in trace.steps:
        rows.append(
            [
                str(step.turn_index),
                step.chunk_id,
                _number(step.raw_emission_score),
                _number(step.normalized_emission_score),
                _number(step.weighted_emission_score),
                _number(step.graph_distance),
                _number(step.weighted_transition_cost),
                _number(step.emission_entropy),
                _number(step.normalized_emission_margin),
                _number(step.cumulative_score),
                step.runner_up_chunk_id or "-",
                step.move,
            ]
        )
    widths = [max(len(row[column]) for row in rows) for column in range(len(TRACE_COLUMNS))]
    text_columns = {1, 10, 11}
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if column in text_columns else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(header + [""] + lines)
