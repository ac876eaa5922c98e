"""The frozen value types of docs/spec.md (sections 5-7).

Every type is a frozen, slotted dataclass that validates itself in ``__post_init__``
and raises ``ValueError`` (:class:`~mapmatched_torch.core.errors.MapMatchedValueError`)
naming the bad field. Sequences are stored as tuples. Plain Python: no torch needed.

Data flow: a provider returns :class:`ScoredCandidate` (raw scores) ->
:func:`~mapmatched_torch.core.scoring.normalize_candidates` gives
:class:`DecoderCandidate` (raw + normalized) -> a decoder returns a
:class:`DecodedPath` of :class:`DecodedStep` (+ a ranking of :class:`CandidateScore`)
-> the session wraps it into :class:`TraceStep` / :class:`RetrievalTrace` /
:class:`RetrievalResult`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Optional, Tuple, Type, TypeVar

from .checks import check_choice, check_chunk_id, check_finite, check_nonnegative_int, describe
from .errors import MapMatchedTypeError, MapMatchedValueError

__all__ = [
    "ScoredCandidate",
    "DecoderCandidate",
    "CandidateScore",
    "DecodedStep",
    "DecodedPath",
    "TraceStep",
    "RetrievalTrace",
    "RetrievalResult",
    "MOVES",
]

#: The values of :attr:`TraceStep.move`.
MOVES = ("start", "stay", "drill", "jump")

_T = TypeVar("_T")


def trusted_constructor(cls: Type[_T]) -> Callable[..., _T]:
    """A function building instances of ``cls`` (one of these types) from field values
    that are already valid, as that type's checks would leave them (``float`` scores,
    ``str`` IDs), without running the checks again: about half the cost.

    For hot loops that rebuild objects from state validated when it came in (a served
    session's candidates, a ranking of finite scores); anything else should call the
    type. The instance equals ``cls(*values)`` whenever that succeeds.
    """
    names = tuple(item.name for item in fields(cls))  # type: ignore[arg-type]
    if getattr(cls, "__slots__", None) != names:
        raise TypeError(f"trusted_constructor needs a slotted dataclass, got {cls.__name__}")
    setters = tuple(cls.__dict__[name].__set__ for name in names)
    new = object.__new__

    def build(*values: Any) -> _T:
        instance = new(cls)
        for setter, value in zip(setters, values):
            setter(instance, value)
        return instance

    build.__name__ = build.__qualname__ = f"trusted_{cls.__name__}"
    return build


def _check_candidate_id(value: Any, what: str) -> str:
    """A candidate's chunk ID: a non-empty ``str`` (mapmatched 0.1.0's ``"{what} must not
    be empty"``)."""
    if isinstance(value, str) and not value:
        raise MapMatchedValueError(f"{what} must not be empty")
    return check_chunk_id(value, what)


def _check_score(value: Any, what: str, chunk_id: str) -> float:
    """A candidate's score as a finite ``float``, with mapmatched 0.1.0's message first
    (``"{what} must be finite"``), then the value and the candidate. Not a real number
    (a string, None, a bool): :class:`MapMatchedTypeError`, since upstream's
    ``math.isfinite`` raised a TypeError there; NaN or infinite: a ValueError."""
    if type(value) is float and math.isfinite(value):  # the common case, fast
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MapMatchedTypeError(
            f"{what} must be finite, got {value!r} (candidate {chunk_id!r}): a real number is required"
        )
    number = float(value)
    if not math.isfinite(number):
        raise MapMatchedValueError(f"{what} must be finite, got {number!r} (candidate {chunk_id!r})")
    return number


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    """One retrieval candidate as a provider returns it.

    Attributes:
        chunk_id: non-empty chunk ID.
        score: raw retriever score, finite, higher is better.
    """

    chunk_id: str
    score: float

    def __post_init__(self) -> None:
        _check_candidate_id(self.chunk_id, "candidate chunk_id")
        object.__setattr__(self, "score", _check_score(self.score, "candidate score", self.chunk_id))


@dataclass(frozen=True, slots=True)
class DecoderCandidate:
    """One state of the trellis: a candidate with its raw and normalized score.

    The decoder's emission is ``emission_weight * normalized_score``.
    """

    chunk_id: str
    raw_score: float
    normalized_score: float

    def __post_init__(self) -> None:
        _check_candidate_id(self.chunk_id, "decoder candidate chunk_id")
        object.__setattr__(self, "raw_score", _check_score(self.raw_score, "raw score", self.chunk_id))
        object.__setattr__(
            self, "normalized_score", _check_score(self.normalized_score, "normalized score", self.chunk_id)
        )


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """A final-turn candidate ranked by its trajectory score (best path ending there).

    Upstream mapmatched's fields and messages: an empty ``chunk_id`` gives ``"candidate
    score chunk_id must not be empty"``, a non-finite score ``"trajectory score must be
    finite, got nan"`` (what follows upstream's text names the value).
    """

    chunk_id: str
    trajectory_score: float

    def __post_init__(self) -> None:
        if self.chunk_id == "":
            raise MapMatchedValueError("candidate score chunk_id must not be empty")
        check_chunk_id(self.chunk_id, "candidate score chunk_id")
        object.__setattr__(self, "trajectory_score", check_finite(self.trajectory_score, "trajectory score"))


def _check_step_fields(step: Any) -> None:
    check_nonnegative_int(step.turn_index, "turn_index")
    check_chunk_id(step.chunk_id, "step chunk ID")
    for name in (
        "raw_emission_score",
        "normalized_emission_score",
        "weighted_emission_score",
        "graph_distance",
        "weighted_transition_cost",
        "cumulative_score",
    ):
        object.__setattr__(step, name, check_finite(getattr(step, name), f"step {step.turn_index} {name}"))
    if step.graph_distance < 0.0:
        raise MapMatchedValueError(f"step {step.turn_index} graph_distance must be nonnegative, got {step.graph_distance}")


@dataclass(frozen=True, slots=True)
class DecodedStep:
    """One turn of a decoded path (docs/spec.md section 5, "Reported path").

    ``graph_distance`` is 0.0 at turn 0 (and everywhere when ``transition_weight`` is
    0, since distances are then never computed); ``cumulative_score`` is the running
    sum of weighted emissions minus weighted transitions, accumulated in the decoder's
    order: ``(previous - weighted_transition_cost) + weighted_emission_score``.
    """

    turn_index: int
    chunk_id: str
    raw_emission_score: float
    normalized_emission_score: float
    weighted_emission_score: float
    graph_distance: float
    weighted_transition_cost: float
    cumulative_score: float

    def __post_init__(self) -> None:
        _check_step_fields(self)


@dataclass(frozen=True, slots=True)
class DecodedPath:
    """A decoded trajectory.

    The first three fields are those of ``mapmatched.DecodedPath`` (same order, same
    names), so ``DecodedPath(steps, chunk_ids, total_score)`` written for mapmatched
    0.1.0 builds the same path here.

    Attributes:
        steps: one :class:`DecodedStep` per turn, in turn order.
        chunk_ids: the decoded chunk ID of every turn; must equal the steps' IDs (a
            tuple of ``str``, one per step).
        total_score: the last step's cumulative score (the objective of docs/spec.md 1).
        fixed_lag: the lag used, or None for full decoding.
        committed_through_index: last committed turn (``T - lag - 1`` when >= 0),
            None without a lag or before anything is committed.

    Raises:
        ValueError: no steps (``decoded path must contain at least one step``),
            ``chunk_ids`` that differ from the steps' (``decoded path chunk_ids must
            match its steps``), a non-finite total (``decoded path total score must be
            finite``).
    """

    steps: Tuple[DecodedStep, ...]
    chunk_ids: Tuple[str, ...]
    total_score: float
    fixed_lag: Optional[int] = None
    committed_through_index: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps:
            raise MapMatchedValueError("decoded path must contain at least one step")
        step_ids = tuple(step.chunk_id for step in self.steps)
        if not isinstance(self.chunk_ids, (tuple, list)) or tuple(self.chunk_ids) != step_ids:
            raise MapMatchedValueError(
                f"decoded path chunk_ids must match its steps: got {describe(self.chunk_ids)}, "
                f"the steps decode {step_ids!r}"
            )
        object.__setattr__(self, "chunk_ids", step_ids)
        object.__setattr__(self, "total_score", check_finite(self.total_score, "decoded path total score"))

    def __len__(self) -> int:
        return len(self.steps)


@dataclass(frozen=True, slots=True)
class TraceStep:
    """A :class:`DecodedStep` plus the diagnostics of docs/spec.md section 3.

    Attributes (beyond DecodedStep's):
        emission_entropy: entropy (nats) of softmax(lambda * normalized scores) of the
            turn's candidates; measures candidate ambiguity, not path uncertainty.
        normalized_emission_margin: decoded normalized score minus the best other
            candidate's (0.0 when alone); negative when the graph overruled the
            pointwise winner.
        runner_up_chunk_id: the best other candidate by normalized score (ties to the
            earlier one), None when the turn had one candidate.
        move: "start" (turn 0), "stay" (same chunk as the previous turn), "jump" (the
            transition was clamped at maximum_distance) or "drill" (any other move).
    """

    turn_index: int
    chunk_id: str
    raw_emission_score: float
    normalized_emission_score: float
    weighted_emission_score: float
    graph_distance: float
    weighted_transition_cost: float
    cumulative_score: float
    emission_entropy: float
    normalized_emission_margin: float
    runner_up_chunk_id: Optional[str] = None
    move: str = "drill"

    def __post_init__(self) -> None:
        _check_step_fields(self)
        object.__setattr__(self, "emission_entropy", check_finite(self.emission_entropy, "emission_entropy"))
        object.__setattr__(
            self, "normalized_emission_margin", check_finite(self.normalized_emission_margin, "normalized_emission_margin")
        )
        if self.runner_up_chunk_id is not None:
            check_chunk_id(self.runner_up_chunk_id, "runner_up_chunk_id")
        check_choice("move", self.move, MOVES)

    def to_dict(self, *, extended: bool = False) -> Dict[str, Any]:
        """The step as a dict: mapmatched 0.1.0's ten keys (every field but the last
        two), plus ``runner_up_chunk_id`` and ``move`` when ``extended``."""
        from .trace import step_to_dict

        return step_to_dict(self, extended=extended)


@dataclass(frozen=True, slots=True)
class RetrievalTrace:
    """Why the session chose what it chose: one :class:`TraceStep` per turn.

    Attributes:
        steps: per-turn trace steps.
        path_chunk_ids: the decoded chunk of every turn.
        revised_prior_indices: earlier turns whose decoded chunk changed with this turn.
        fixed_lag: the lag, or None for full decoding.
        committed_through_index: the last committed turn, or None.
    """

    steps: Tuple[TraceStep, ...]
    path_chunk_ids: Tuple[str, ...]
    revised_prior_indices: Tuple[int, ...] = ()
    fixed_lag: Optional[int] = None
    committed_through_index: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "path_chunk_ids", tuple(self.path_chunk_ids))
        object.__setattr__(self, "revised_prior_indices", tuple(int(i) for i in self.revised_prior_indices))
        if len(self.path_chunk_ids) != len(self.steps):
            raise MapMatchedValueError(
                f"path_chunk_ids has {len(self.path_chunk_ids)} entries for {len(self.steps)} steps"
            )

    def to_dict(self, *, extended: bool = False) -> Dict[str, Any]:
        """A JSON-ready dict of every field, steps as :meth:`TraceStep.to_dict` dicts
        (mapmatched 0.1.0's; ``extended``: with ``runner_up_chunk_id`` and ``move``)."""
        from .trace import trace_to_dict

        return trace_to_dict(self, extended=extended)

    def to_json(self, *, indent: Optional[int] = None, extended: bool = True) -> str:
        """JSON with sorted keys; NaN and infinities are refused. The steps keep
        ``runner_up_chunk_id`` and ``move`` unless ``extended=False`` (mapmatched
        0.1.0's JSON exactly)."""
        from .trace import trace_to_json

        return trace_to_json(self, indent=indent, extended=extended)

    def render(self, *, detail: bool = False) -> str:
        """A plain-text header and table: mapmatched 0.1.0's format, or with
        ``detail=True`` also the runner-up and move columns (see
        :func:`~mapmatched_torch.core.trace.render_trace`)."""
        from .trace import render_trace

        return render_trace(self, detail=detail)


@dataclass(frozen=True, slots=True)
class RetrievalResult:
    """What one session turn returns.

    Attributes:
        chunk_id: the decoded chunk of the current turn.
        context_chunk_ids: decoded chunk, its graph neighbourhood, then this turn's
            candidates in provider order, de-duplicated and cut at context_limit.
        candidates: this turn's candidates as the provider gave them
            (:class:`ScoredCandidate`, raw scores), in provider order, after the cut at
            candidate_limit, as upstream mapmatched; the normalized turn is the
            session's ``trellis[-1]``.
        path: the decoded path of the whole conversation so far.
        trace: the trace of the whole conversation so far.
        candidate_ranking: this turn's candidates ranked by trajectory score (``()``
            when the decoder has no ``decode_ranked``).
    """

    chunk_id: str
    context_chunk_ids: Tuple[str, ...]
    candidates: Tuple[ScoredCandidate, ...]
    path: DecodedPath
    trace: RetrievalTrace
    candidate_ranking: Tuple[CandidateScore, ...] = field(default=())

    def __post_init__(self) -> None:
        check_chunk_id(self.chunk_id, "result chunk ID")
        object.__setattr__(self, "context_chunk_ids", tuple(self.context_chunk_ids))
        object.__setattr__(self, "candidates", tuple(self.candidates))
        object.__setattr__(self, "candidate_ranking", tuple(self.candidate_ranking))
