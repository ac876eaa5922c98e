"""Conversational sessions over any retriever (docs/spec.md section 6).

:class:`MapMatchedRetriever` holds the configuration (graph, provider, decoder,
weights, normalization, lag, context); :meth:`MapMatchedRetriever.session` opens one
conversation. Each turn is transactional: the candidates are normalized and appended
to the trellis, the whole trellis is decoded, and if anything raises the turn is
removed again, leaving the session exactly as it was.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

from ..core.checks import check_positive_int, check_turn, check_weight, describe
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
from ..core.protocols import (
    CandidateProvider,
    CorpusGraph,
    Decoder,
    as_scored_candidates,
    contextual_call,
    missing_members,
    provider_answer,
)
from ..core.scoring import normalize_candidates
from ..core.settings import DecodeSettings, HoldsSettings
from ..core.trace_build import build_trace

__all__ = [
    "MapMatchedRetriever",
    "MapMatchedSession",
    "check_retriever_options",
    "TurnOptions",
    "as_turn_candidates",
    "provider_answer_name",
    "normalize_turn",
    "context_chunk_ids",
    "decode_turns",
    "finish_turn",
    "revised_indices",
    "revised_turns",
    "turn_result",
    "turn_trace",
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


class MapMatchedRetriever(HoldsSettings):
    """Map-matched retrieval over any candidate provider (docs/spec.md section 6).

    Args:
        graph: the corpus graph (``CorpusGraph`` protocol).
        provider: a ``CandidateProvider`` (needed by :meth:`MapMatchedSession.retrieve`
            only; :meth:`MapMatchedSession.retrieve_candidates` takes candidates directly).
        decoder: a ``Decoder`` (default :class:`~mapmatched_torch.StandaloneDecoder`;
            :class:`~mapmatched_torch.TorchDecoder` gives the same answers on tensors).
        candidate_limit: candidates kept per turn, in provider order (> 0).
        emission_weight: lambda (finite, >= 0). transition_weight: beta (finite, >= 0).
        score_normalization: "zscore" (default), "center" or "none".
        fixed_lag: None (full re-decoding every turn) or L >= 0.
        context_radius: graph radius of the context expansion (finite, >= 0).
        context_limit: maximum context length (> 0) or None.
        settings: emission_weight, transition_weight, score_normalization and
            fixed_lag as one :class:`~mapmatched_torch.core.settings.DecodeSettings`
            (then leave those four at their defaults).

    Attributes:
        settings: the :class:`~mapmatched_torch.core.settings.DecodeSettings` every
            session of this retriever decodes with (``emission_weight``,
            ``transition_weight``, ``fixed_lag`` and ``score_normalization`` read it).
    """

    def __init__(
        self,
        graph: CorpusGraph,
        *,
        provider: Optional[CandidateProvider] = None,
        decoder: Optional[Decoder] = None,
        candidate_limit: int = 20,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        score_normalization: str = "zscore",
        fixed_lag: Optional[int] = None,
        context_radius: float = 1.0,
        context_limit: Optional[int] = None,
        settings: Optional[DecodeSettings] = None,
    ) -> None:
        self.provider = provider
        if decoder is None:
            from ..standalone.decoder import StandaloneDecoder

            decoder = StandaloneDecoder()
        self.decoder = decoder
        (
            self.graph, self.candidate_limit, self.settings, self.context_radius, self.context_limit
        ) = check_retriever_options(
            graph,
            candidate_limit,
            settings,
            dict(
                emission_weight=emission_weight,
                transition_weight=transition_weight,
                fixed_lag=fixed_lag,
                score_normalization=score_normalization,
            ),
            context_radius,
            context_limit,
        )

    def session(self) -> "MapMatchedSession":
        """Open a new conversation."""
        return MapMatchedSession(self)


class MapMatchedSession:
    """One conversation: a growing trellis, re-decoded after every turn.

    Concurrency: a turn (:meth:`retrieve`, :meth:`retrieve_candidates`) holds the
    session's lock, so turns from several threads are serialized, and a turn is all
    or nothing (anything raised, even KeyboardInterrupt, removes it again).
    """

    def __init__(self, retriever: MapMatchedRetriever) -> None:
        self._retriever = retriever
        self._lock = threading.RLock()
        self._trellis: List[Tuple[DecoderCandidate, ...]] = []
        self._path: Optional[DecodedPath] = None
        self._trace: Optional[RetrievalTrace] = None
        self._previous_query: Optional[str] = None
        # A decoder that can stream (TorchDecoder) decodes each turn incrementally.
        factory = getattr(retriever.decoder, "stream", None)
        self._stream = (
            factory(retriever.graph, retriever.candidate_limit, settings=retriever.settings)
            if callable(factory)
            else None
        )

    @property
    def retriever(self) -> MapMatchedRetriever:
        return self._retriever

    @property
    def turn_count(self) -> int:
        """Number of turns decoded so far."""
        return len(self._trellis)

    @property
    def current_chunk_id(self) -> Optional[str]:
        """The decoded chunk of the latest turn (None before the first turn)."""
        return None if self._path is None else self._path.steps[-1].chunk_id

    @property
    def previous_query(self) -> Optional[str]:
        """The query text of the latest turn (None before the first turn, or when the
        latest turn was given as candidates): what a provider with
        ``uses_previous_query`` is passed at the next turn."""
        return self._previous_query

    @property
    def path(self) -> Optional[DecodedPath]:
        """The latest decoded path of the whole conversation."""
        return self._path

    @property
    def trace(self) -> Optional[RetrievalTrace]:
        """The latest trace of the whole conversation."""
        return self._trace

    @property
    def trellis(self) -> Tuple[Tuple[DecoderCandidate, ...], ...]:
        """The normalized candidates of every turn so far."""
        return tuple(self._trellis)

    def retrieve(self, query: str) -> RetrievalResult:
        """Ask the provider for ``candidate_limit`` candidates and decode a new turn.

        The provider is asked as :func:`~mapmatched_torch.core.protocols.provider_answer`
        says: ``provider.retrieve(query, candidate_limit)``, else
        ``provider.candidates(query, candidate_limit)`` (upstream's method). A provider
        with ``retrieve_in_context(query, limit, context_chunk_id)`` (a
        :class:`~mapmatched_torch.providers.query_mixing.ContextualProvider`, e.g.
        ``QueryMixingProvider``) is asked that instead, with :attr:`current_chunk_id`
        (the chunk decoded at the previous turn; None at the first), and with
        ``previous_query=`` :attr:`previous_query` when its ``uses_previous_query`` is
        true.

        Raises:
            MapMatchedValueError: an empty query (``"query must not be empty"``; a
                whitespace query is passed on, as upstream does), or a bad answer (see
                :meth:`retrieve_candidates`).
            MapMatchedTypeError: a query that is not a string.
            MapMatchedRuntimeError: (a RuntimeError) the retriever has no provider.
        """
        if not query:
            raise MapMatchedValueError("query must not be empty")
        if not isinstance(query, str):
            raise MapMatchedTypeError(f"query must be a string, got {describe(query)}")
        provider = self._retriever.provider
        if provider is None:
            raise MapMatchedRuntimeError(
                "retrieve(query) requires a CandidateProvider; use retrieve_candidates instead "
                "(or pass provider= to MapMatchedRetriever)"
            )
        contextual = contextual_call(provider)
        if contextual is not None:  # e.g. QueryMixingProvider: the previous decoded chunk goes into the query
            with self._lock:  # the context read and the turn it conditions are one step
                answer = contextual(query, self._retriever.candidate_limit, self.current_chunk_id,
                                    self._previous_query)
                return self._retrieve_turn(answer, f"candidates from {type(provider).__name__}.retrieve_in_context",
                                           query)
        answer = provider_answer(provider)[1](query, self._retriever.candidate_limit)
        return self._retrieve_turn(answer, provider_answer_name(provider), query)

    def retrieve_candidates(self, candidates: Iterable[Any]) -> RetrievalResult:
        """Decode a new turn from candidates given directly (provider order).

        The first ``candidate_limit`` candidates are kept and normalized; the whole
        trellis is re-decoded. If anything raises, the turn is removed again. The
        result's ``candidates`` are the kept ones as :class:`ScoredCandidate` (raw
        scores); the normalized turn is ``session.trellis[-1]``.

        Raises:
            MapMatchedTypeError: (a ValueError and a TypeError) ``candidates`` is not a
                sequence of ScoredCandidate, ``(chunk_id, score)`` pairs or objects with
                ``chunk_id`` and ``score``; the message names the turn and the position.
            MapMatchedValueError: a bad chunk ID or score; no candidates (``"candidate
                set must not be empty (turn 0)"``) or repeated IDs (``"candidate chunk_ids
                must be unique within a turn (turn 0)"``), upstream's messages first.
            MapMatchedRuntimeError: a fixed-lag decoder changed a committed turn.
        """
        return self._retrieve_turn(candidates, "candidates")

    def _retrieve_turn(self, candidates: Iterable[Any], what: str, query: Optional[str] = None) -> RetrievalResult:
        """:meth:`retrieve_candidates`; ``what`` names the candidates in error messages;
        ``query`` is the turn's query text (None: given as candidates)."""
        with self._lock:
            result = self._locked_turn(candidates, what)
            self._previous_query = query
            return result

    def _locked_turn(self, candidates: Iterable[Any], what: str) -> RetrievalResult:
        retriever = self._retriever
        turn_index = len(self._trellis)
        kept = as_turn_candidates(candidates, turn_index, what)[: retriever.candidate_limit]
        normalized = normalize_turn(kept, retriever.score_normalization, turn_index)
        self._trellis.append(normalized)
        pushed = False
        try:
            if self._stream is not None:
                path, ranking = self._stream.push(normalized)
                pushed = True
            else:
                path, ranking = decode_turns(retriever, self._trellis)
            result = finish_turn(retriever, self._trellis, kept, path, ranking, self._path, self._trace)
        except BaseException:
            self._trellis.pop()
            if pushed:
                self._stream.rollback()
            raise
        self._path = result.path
        self._trace = result.trace
        return result


def decode_turns(
    retriever: MapMatchedRetriever, trellis: Sequence[Sequence[DecoderCandidate]]
) -> Tuple[DecodedPath, Tuple[CandidateScore, ...]]:
    """Decode a session's trellis with the retriever's decoder and options, all passed
    by keyword (``graph=`` too, as upstream does): its ``decode_ranked`` when it has
    one, else its ``decode`` with an empty ranking (a decoder with only upstream's
    ``decode`` plugs in)."""
    decoder = retriever.decoder
    options = dict(graph=retriever.graph, **retriever.settings.decoder_options)
    ranked = getattr(decoder, "decode_ranked", None)
    if callable(ranked):
        return ranked(trellis, **options)
    return decoder.decode(trellis, **options), ()


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
