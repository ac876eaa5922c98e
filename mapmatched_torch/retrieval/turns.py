"""The per-turn work that sessions and the server share (docs/spec.md sections 6 and 7).

A session (:mod:`.session`) decodes one conversation at a time and the server
(:mod:`mapmatched_torch.serving.server`) many at once, but a turn means the same to
both, so the same functions do it for both:

- the options: :func:`check_retriever_options` (in upstream mapmatched's order),
  :func:`learned_transitions` (``transitions=``), :class:`TurnOptions` (what the
  helpers read of their owner);
- a turn's candidates in: :func:`as_turn_candidates`, :func:`provider_answer_name`
  (how errors name the provider's answer), :func:`normalize_turn`;
- a decoded turn out: :func:`revised_indices` / :func:`revised_turns` /
  :func:`check_revisions` (no committed turn revised), :func:`turn_trace`,
  :func:`turn_result` (with its context, :func:`context_chunk_ids`) and
  :func:`finish_turn`, the three in order.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Protocol, Sequence, Tuple

from ..core.checks import check_positive_int, check_turn, check_weight
from ..core.errors import MapMatchedRuntimeError, MapMatchedTypeError, MapMatchedValueError
from ..core.models import (
    CandidateScore,
    DecodedPath,
    DecoderCandidate,
    RetrievalResult,
    RetrievalTrace,
    ScoredCandidate,
)
from ..core.path_reports import committed_through
from ..core.protocols import CorpusGraph, as_scored_candidates, missing_members, provider_answer
from ..core.scoring import normalize_candidates
from ..core.settings import DecodeSettings
from ..core.trace_build import build_trace

if TYPE_CHECKING:
    from .learned import LearnedTransitions

__all__ = [
    "TurnOptions",
    "check_retriever_options",
    "learned_transitions",
    "as_turn_candidates",
    "provider_answer_name",
    "normalize_turn",
    "context_chunk_ids",
    "revised_indices",
    "revised_turns",
    "check_revisions",
    "finish_turn",
    "turn_trace",
    "turn_result",
]


def as_turn_candidates(
    candidates: Iterable[Any], turn_index: int, what: str = "candidates"
) -> Tuple[ScoredCandidate, ...]:
    """:func:`as_scored_candidates` for trellis turn ``turn_index``: its errors begin
    ``"trellis turn {turn_index} {what}"`` (what a session and the server both say)."""
    try:
        return as_scored_candidates(candidates, what)
    except MapMatchedValueError as error:
        raise type(error)(f"trellis turn {turn_index} {error}") from None


def provider_answer_name(provider: Any) -> str:
    """How error messages name the candidates the provider's answer method
    (:func:`~mapmatched_torch.core.protocols.provider_answer`) returned: the ``what``
    of :func:`as_scored_candidates`, after the turn, e.g. ``"candidates from
    P.candidates(query, limit)"``."""
    try:
        name = provider_answer(provider)[0]
    except MapMatchedTypeError:  # no answer method: the call raises, naming the type
        name = "candidates"
    return f"candidates from {type(provider).__name__}.{name}(query, limit)"


def normalize_turn(candidates: Sequence[ScoredCandidate], method: str, turn_index: int) -> Tuple[DecoderCandidate, ...]:
    """One turn's kept candidates as checked trellis states, or the error a session
    (and the server, for the same turn) raises for them: upstream mapmatched's message
    (``"candidate set must not be empty"``, ``"candidate chunk_ids must be unique
    within a turn"``, from :func:`~mapmatched_torch.core.scoring.normalize_candidates`)
    naming the turn after it, e.g. ``"candidate set must not be empty (turn 0)"``."""
    return check_turn(normalize_candidates(candidates, method, turn_index=turn_index), turn_index)


def context_chunk_ids(
    chunk_id: str,
    neighborhood: Iterable[str],
    candidates: Sequence[Any],
    context_limit: Optional[int],
) -> Tuple[str, ...]:
    """The context of one turn: the decoded chunk, its neighbourhood (the chunk IDs
    ``graph.neighborhood`` returns, by distance), then the turn's candidates (objects
    with ``chunk_id``, or chunk IDs) in provider order; duplicates dropped keeping the
    first; cut at ``context_limit`` (None: no cut)."""
    candidate_ids = (c if isinstance(c, str) else c.chunk_id for c in candidates)
    ordered = [chunk_id, *neighborhood, *candidate_ids]
    unique = tuple(dict.fromkeys(ordered))
    return unique if context_limit is None else unique[:context_limit]


def check_retriever_options(
    graph: Any,
    candidate_limit: Any,
    settings: Optional[DecodeSettings],
    options: Dict[str, Any],
    context_radius: Any,
    context_limit: Any,
) -> Tuple[CorpusGraph, int, DecodeSettings, float, Optional[int]]:
    """The options of a retriever (and of a server), checked in upstream mapmatched's
    order so that the first bad option is the one named: the graph,
    ``candidate_limit``, the weights and the lag, ``context_radius``,
    ``context_limit``, the normalization.

    Args:
        settings: the caller's ``settings=`` (or None), and ``options`` its loose
            ``emission_weight``, ``transition_weight``, ``fixed_lag`` and
            ``score_normalization`` (see :meth:`DecodeSettings.resolve`).

    Returns:
        ``(graph, candidate_limit, settings, context_radius, context_limit)``, validated.
    """
    graph = _check_graph(graph)
    limit = check_positive_int(candidate_limit, "candidate_limit")
    if settings is None:
        loose = dict(options)
        normalization = loose.pop("score_normalization")
        decode = DecodeSettings(**loose)  # the normalization is upstream's last check
    else:
        decode = DecodeSettings.resolve(settings, **options)
    radius = check_weight(context_radius, "context_radius")
    kept = None if context_limit is None else check_positive_int(context_limit, "context_limit")
    if settings is None:
        decode = dataclasses.replace(decode, score_normalization=normalization)
    return graph, limit, decode, radius, kept


class TurnOptions(Protocol):
    """What the per-turn helpers (:func:`finish_turn`, :func:`turn_trace`,
    :func:`turn_result`) read of their owner: a :class:`MapMatchedRetriever` or a
    :class:`~mapmatched_torch.serving.server.MapMatchedServer`."""

    graph: CorpusGraph
    settings: DecodeSettings
    context_radius: float
    context_limit: Optional[int]


def _check_graph(graph: object) -> CorpusGraph:
    missing = missing_members(graph, CorpusGraph)
    if missing:
        raise MapMatchedValueError(
            f"graph must implement the CorpusGraph protocol; {type(graph).__name__} lacks {', '.join(missing)}"
        )
    return graph


def learned_transitions(
    transitions: Optional[Any], graph: Any, passage_embeddings: Optional[Any], passage_ids: Optional[Sequence[str]]
) -> Optional["LearnedTransitions"]:
    """The ``transitions=`` of a retriever or a server, checked
    (:class:`~mapmatched_torch.retrieval.learned.LearnedTransitions`), or None."""
    from .learned import LearnedTransitions

    if transitions is None:
        if passage_embeddings is not None or passage_ids is not None:
            raise MapMatchedValueError("passage_embeddings= and passage_ids= go with transitions= (a learned model)")
        return None
    return LearnedTransitions(transitions, graph, passage_embeddings, passage_ids)


def revised_indices(
    previous: Optional[DecodedPath], path: DecodedPath, fixed_lag: Optional[int] = None
) -> Tuple[int, ...]:
    """Earlier turns whose decoded chunk changed; RuntimeError if a committed one did
    (committed: the turns through ``T - L - 1`` of the previous path, by the session's
    ``fixed_lag``, whatever the decoder's path says)."""
    if previous is None:
        return ()
    committed = committed_through(len(previous.chunk_ids), fixed_lag)
    return revised_turns(previous.chunk_ids, committed, path.chunk_ids)


def revised_turns(
    previous_chunk_ids: Sequence[str], committed: Optional[int], chunk_ids: Sequence[str]
) -> Tuple[int, ...]:
    """:func:`revised_indices` from the previous path's chunk IDs and committed index."""
    revised = tuple(index for index, (old, new) in enumerate(zip(previous_chunk_ids, chunk_ids)) if old != new)
    return check_revisions(revised, committed)


def check_revisions(revised: Tuple[int, ...], committed: Optional[int]) -> Tuple[int, ...]:
    """``revised`` (the earlier turns whose chunk changed), or MapMatchedRuntimeError when
    one of them is at or before the previous step's ``committed`` turn."""
    if committed is not None and any(index <= committed for index in revised):
        raise MapMatchedRuntimeError(
            f"fixed-lag decoder revised a committed turn (committed through {committed}, revised {list(revised)})"
        )
    return revised


def finish_turn(
    retriever: TurnOptions,
    trellis: Sequence[Tuple[DecoderCandidate, ...]],
    candidates: Sequence[ScoredCandidate],
    path: DecodedPath,
    ranking: Tuple[CandidateScore, ...],
    previous_path: Optional[DecodedPath],
    previous_trace: Optional[RetrievalTrace],
) -> RetrievalResult:
    """Everything after decoding a turn: revision check, trace, context, the result
    (``candidates``: the turn's kept candidates, raw, as the result holds them).

    Shared by the session and the batched server (whose results are built lazily from
    :func:`turn_trace` and :func:`turn_result`, the two halves of this), so both report
    identically.
    """
    revised = revised_indices(previous_path, path, retriever.settings.fixed_lag)
    trace = turn_trace(retriever, trellis, path, revised, previous_trace)
    return turn_result(retriever, candidates, path, ranking, trace)


def turn_trace(
    retriever: TurnOptions,
    trellis: Sequence[Tuple[DecoderCandidate, ...]],
    path: DecodedPath,
    revised: Sequence[int],
    previous_trace: Optional[RetrievalTrace] = None,
) -> RetrievalTrace:
    """The trace of a decoded turn (``revised``: earlier turns whose chunk changed;
    ``previous_trace``: the last turn's, whose unchanged steps are reused).

    Its ``fixed_lag`` and ``committed_through_index`` are the session's (the
    retriever's lag, ``T - L - 1``), as upstream reports them, whatever the decoder's
    path carries."""
    if len(path.steps) != len(trellis):
        raise MapMatchedRuntimeError(f"decoder returned {len(path.steps)} steps for {len(trellis)} turns")
    trace = build_trace(
        path,
        trellis,
        emission_weight=retriever.settings.emission_weight,
        maximum_distance=retriever.graph.maximum_distance,
        revised_prior_indices=revised,
        reuse=previous_trace.steps if previous_trace is not None else (),
    )
    lag = retriever.settings.fixed_lag
    committed = committed_through(len(trellis), lag)
    if trace.fixed_lag != lag or trace.committed_through_index != committed:
        trace = dataclasses.replace(trace, fixed_lag=lag, committed_through_index=committed)
    return trace


def turn_result(
    retriever: TurnOptions,
    candidates: Sequence[ScoredCandidate],
    path: DecodedPath,
    ranking: Tuple[CandidateScore, ...],
    trace: RetrievalTrace,
    neighborhood: Optional[Sequence[str]] = None,
) -> RetrievalResult:
    """The :class:`RetrievalResult` of a decoded turn: its context and everything else
    (``candidates``: the turn's kept candidates, raw, in provider order)."""
    chunk_id = path.steps[-1].chunk_id
    if neighborhood is None:
        neighborhood = retriever.graph.neighborhood(chunk_id, retriever.context_radius)
    context = context_chunk_ids(chunk_id, neighborhood, candidates, retriever.context_limit)
    return RetrievalResult(
        chunk_id=chunk_id,
        context_chunk_ids=context,
        candidates=candidates,
        path=path,
        trace=trace,
        candidate_ranking=ranking,
    )
