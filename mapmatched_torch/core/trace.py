"""Serializing and rendering retrieval traces (docs/spec.md section 7).

A trace explains a decoded path turn by turn: the decoder's scores
(:class:`~mapmatched_torch.core.models.DecodedStep`) plus the candidate diagnostics of
docs/spec.md section 3 (emission entropy, margin), the runner-up and the kind of move.
This module turns one into dicts, JSON and mapmatched 0.1.0's text table; it reads the
trace's attributes and imports none of the model types, so
:class:`~mapmatched_torch.core.models.RetrievalTrace`'s methods can call it without a
circle. Building a trace from a decoded path is :mod:`.trace_build`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

if TYPE_CHECKING:  # annotations only: the model types import this module's functions lazily
    from .models import RetrievalTrace, TraceStep

__all__ = [
    "step_to_dict",
    "trace_to_dict",
    "trace_to_json",
    "render_trace",
    "TRACE_COLUMNS",
    "DETAIL_COLUMNS",
    "STEP_KEYS",
    "DETAIL_STEP_KEYS",
]

#: Column headers of :func:`render_trace`, in order (mapmatched 0.1.0's table).
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
)

#: The two more columns of ``render_trace(trace, detail=True)``.
DETAIL_COLUMNS = ("runner-up", "move")

#: The keys of :meth:`TraceStep.to_dict() <mapmatched_torch.core.models.TraceStep.to_dict>`
#: (mapmatched 0.1.0's ten, in field order).
STEP_KEYS = (
    "turn_index",
    "chunk_id",
    "raw_emission_score",
    "normalized_emission_score",
    "weighted_emission_score",
    "graph_distance",
    "weighted_transition_cost",
    "cumulative_score",
    "emission_entropy",
    "normalized_emission_margin",
)

#: The keys ``to_dict(extended=True)`` adds to a step (and the trace JSON carries).
DETAIL_STEP_KEYS = ("runner_up_chunk_id", "move")


def step_to_dict(step: TraceStep, *, extended: bool = False) -> Dict[str, Any]:
    """One trace step as a plain dict.

    Args:
        step: a :class:`~mapmatched_torch.core.models.TraceStep`.
        extended: also give :data:`DETAIL_STEP_KEYS` (``runner_up_chunk_id``, ``move``).

    Returns:
        ``{key: value}`` for the keys of :data:`STEP_KEYS` (mapmatched 0.1.0's ten, in
        field order), then the detail keys when ``extended``.
    """
    keys = STEP_KEYS + DETAIL_STEP_KEYS if extended else STEP_KEYS
    return {key: getattr(step, key) for key in keys}


def trace_to_dict(trace: RetrievalTrace, *, extended: bool = False) -> Dict[str, Any]:
    """A trace as plain dicts, lists and scalars.

    Returns:
        ``{"steps": [step dict, ...], "path_chunk_ids": [...], "revised_prior_indices":
        [...], "fixed_lag": int | None, "committed_through_index": int | None}``; the
        steps as :func:`step_to_dict` gives them (``extended``: with the detail keys).
    """
    return {
        "steps": [step_to_dict(step, extended=extended) for step in trace.steps],
        "path_chunk_ids": list(trace.path_chunk_ids),
        "revised_prior_indices": list(trace.revised_prior_indices),
        "fixed_lag": trace.fixed_lag,
        "committed_through_index": trace.committed_through_index,
    }


def trace_to_json(trace: RetrievalTrace, *, indent: Optional[int] = None, extended: bool = True) -> str:
    """JSON of :func:`trace_to_dict` with sorted keys; NaN/inf raise ValueError.

    ``extended`` (default True) keeps the detail keys (``runner_up_chunk_id``, ``move``)
    in every step; ``extended=False`` gives mapmatched 0.1.0's JSON exactly.
    """
    return json.dumps(trace_to_dict(trace, extended=extended), sort_keys=True, allow_nan=False, indent=indent)


#: The step fields of the numeric columns of :data:`TRACE_COLUMNS`, in column order.
_NUMBER_COLUMNS = (
    "raw_emission_score",
    "normalized_emission_score",
    "weighted_emission_score",
    "graph_distance",
    "weighted_transition_cost",
    "emission_entropy",
    "normalized_emission_margin",
    "cumulative_score",
)


def _number(value: float) -> str:
    return "%.6g" % value


def render_trace(trace: RetrievalTrace, *, detail: bool = False) -> str:
    """A plain-text report: a header, then one table row per turn.

    The header has four lines: the path (``path: a -> b``, ``path: (empty)`` for no
    steps), the mode (``full`` or ``fixed-lag L``), the revised prior turns (``1, 3`` or
    ``none``) and the committed boundary (always ``none`` in full mode). A trace without
    steps is the header alone; otherwise an empty line and the table follow. Numbers use
    ``%.6g``; lines are joined by ``\n`` with no trailing newline.

    Args:
        trace: the trace to render.
        detail: False (default): mapmatched 0.1.0's table, byte for byte: the columns of
            :data:`TRACE_COLUMNS`, headers left-aligned, a divider row of dashes, the
            chunk column left-aligned and every other cell right-aligned. True: also the
            :data:`DETAIL_COLUMNS` (runner-up, ``-`` when alone; move), no divider,
            numeric headers right-aligned, every line right-stripped.
    """
    mode = "full" if trace.fixed_lag is None else f"fixed-lag {trace.fixed_lag}"
    revised = ", ".join(str(index) for index in trace.revised_prior_indices) or "none"
    committed = (
        "none" if trace.fixed_lag is None or trace.committed_through_index is None
        else str(trace.committed_through_index)
    )
    header = [
        f"path: {' -> '.join(trace.path_chunk_ids) or '(empty)'}",
        f"mode: {mode}",
        f"revised prior turns: {revised}",
        f"committed through turn: {committed}",
    ]
    if not trace.steps:
        return "\n".join(header)
    columns = TRACE_COLUMNS + DETAIL_COLUMNS if detail else TRACE_COLUMNS
    body = []
    for step in trace.steps:
        row = [str(step.turn_index), step.chunk_id]
        row += [_number(getattr(step, key)) for key in _NUMBER_COLUMNS]
        if detail:
            row += [step.runner_up_chunk_id or "-", step.move]
        body.append(row)
    widths = [max(len(cell) for cell in column) for column in zip(columns, *body)]
    text_columns = {1, 10, 11} if detail else {1}

    def line(cells: Sequence[str], left: Any) -> str:
        return "  ".join(
            cell.ljust(width) if left(column) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(cells, widths))
        )

    if detail:
        table = [line(row, text_columns.__contains__).rstrip() for row in [list(columns), *body]]
    else:
        table = [
            line(columns, lambda column: True),
            line(["-" * width for width in widths], lambda column: True),
            *(line(row, text_columns.__contains__) for row in body),
        ]
    return "\n".join(header + [""] + table)
