"""Conversational sessions over any retriever (docs/spec.md section 6).

:class:`MapMatchedRetriever` holds the configuration (graph, provider, decoder,
weights, normalization, lag, context); :meth:`MapMatchedRetriever.session` opens one
conversation. Each turn is transactional: the candidates are normalized and appended
to the trellis, the whole trellis is decoded, and if anything raises the turn is
removed again, leaving the session exactly as it was.
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

from ..core.checks import (
    check_decode_options,
    check_positive_int,
    check_sequence,
    check_turn,
    check_weight,
    describe,
    empty_turn_error,
)
from ..core.errors import MapMatchedRuntimeError, MapMatchedTypeError, MapMatchedValueError
from ..core.models import (
    CandidateScore,
    DecodedPath,
    DecoderCandidate,
    RetrievalResult,
    RetrievalTrace,
    ScoredCandidate,
)
from ..core.protocols import CandidateProvider, CorpusGraph, Decoder, missing_members
from ..core.scoring import check_score_normalization, normalize_candidates
from ..core.trace import build_trace

__all__ = [
    "MapMatchedRetriever",
    "MapMatchedSession",
    "as_scored_candidates",
    "as_turn_candidates",
    "provider_answer_name",
    "context_chunk_ids",
    "finish_turn",
    "revised_indices",
    "revised_turns",
    "turn_result",
    "turn_trace",
]


def as_scored_candidates(candidates: Iterable[Any], what: str = "candidates") -> Tuple[ScoredCandidate, ...]:
    """Accept :class:`ScoredCandidate` objects or ``(chunk_id, score)`` pairs.

    Args:
        candidates: one turn's candidates, in provider order.
        what: names them in error messages (``"candidates"``, or
            :func:`provider_answer_name`'s ``"candidates from P.retrieve(query, limit)"``).

    Returns:
        The candidates as a tuple of :class:`ScoredCandidate`.

    Raises:
        MapMatchedTypeError: (a ValueError and a TypeError) ``candidates`` is not a
            sequence (None, a number, a string), or an entry is neither a
            ScoredCandidate nor a pair; the message names ``what`` and the position.
        MapMatchedValueError: a pair with a bad chunk ID or score (naming the position).
    """
    if isinstance(candidates, (list, tuple)) and set(map(type, candidates)) == {ScoredCandidate}:
        return tuple(candidates)  # the common case, checked in C
    result = []
    for position, candidate in enumerate(
        check_sequence(candidates, what, "a sequence of ScoredCandidate or (chunk_id, score) pairs")
    ):
        if isinstance(candidate, ScoredCandidate):
            result.append(candidate)
        elif isinstance(candidate, tuple) and len(candidate) == 2:
            try:
                result.append(ScoredCandidate(*candidate))
            except MapMatchedValueError as error:
                raise MapMatchedValueError(f"{what}: candidate {position}: {error}") from None
        else:
            raise MapMatchedTypeError(
                f"{what}: candidate {position} must be a ScoredCandidate or a (chunk_id, score) pair, "
                f"got {describe(candidate)}"
            )
    return tuple(result)


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
    """How error messages name the candidates ``provider.retrieve`` returned (the
    ``what`` of :func:`as_scored_candidates`, after the turn)."""
    return f"candidates from {type(provider).__name__}.retrieve(query, limit)"


def context_chunk_ids(
    chunk_id: str,
    neighborhood: Iterable[Tuple[str, float]],
    candidates: Sequence[Any],
    context_limit: Optional[int],
) -> Tuple[str, ...]:
    """The context of one turn: the decoded chunk, its neighbourhood, then the turn's
    candidates (objects with ``chunk_id``, or chunk IDs) in provider order; duplicates
    dropped keeping the first; cut at ``context_limit`` (None: no cut)."""
    candidate_ids = (c if isinstance(c, str) else c.chunk_id for c in candidates)
    ordered = [chunk_id, *(neighbor for neighbor, _ in neighborhood), *candidate_ids]
    unique = tuple(dict.fromkeys(ordered))
    return unique if context_limit is None else unique[:context_limit]


def _check_graph(graph: object) -> CorpusGraph:
    missing = missing_members(graph, CorpusGraph)
    if missing:
        raise MapMatchedValueError(
            f"graph must implement the CorpusGraph protocol; {type(graph).__name__} lacks {', '.join(missing)}"
        )
    return graph


class MapMatchedRetriever:
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
    ) -> None:
        self.graph = _check_graph(graph)
        self.provider = provider
        if decoder is None:
            from ..standalone.decoder import StandaloneDecoder

            decoder = StandaloneDecoder()
        self.decoder = decoder
        self.candidate_limit = check_positive_int(candidate_limit, "candidate_limit")
        self.emission_weight, self.transition_weight, self.fixed_lag = check_decode_options(
            emission_weight, transition_weight, fixed_lag
        )
        self.score_normalization = check_score_normalization(score_normalization)
        self.context_radius = check_weight(context_radius, "context_radius")
        self.context_limit = None if context_limit is None else check_positive_int(context_limit, "context_limit")

    def session(self) -> "MapMatchedSession":
        """Open a new conversation."""
        return MapMatchedSession(self)


class MapMatchedSession:
    """One conversation: a growing trellis, re-decoded after every turn."""

    def __init__(self, retriever: MapMatchedRetriever) -> None:
        self._retriever = retriever
        self._trellis: List[Tuple[DecoderCandidate, ...]] = []
        self._path: Optional[DecodedPath] = None
        self._trace: Optional[RetrievalTrace] = None
        # A decoder that can stream (TorchDecoder) decodes each turn incrementally.
        factory = getattr(retriever.decoder, "stream", None)
        self._stream = (
            factory(
                retriever.graph,
                retriever.candidate_limit,
                emission_weight=retriever.emission_weight,
                transition_weight=retriever.transition_weight,
                fixed_lag=retriever.fixed_lag,
            )
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
        """Ask the provider for ``candidate_limit`` candidates and decode a new turn."""
        if not isinstance(query, str) or not query.strip():
            raise MapMatchedValueError("query must be a non-empty string")
        provider = self._retriever.provider
        if provider is None:
            raise MapMatchedRuntimeError(
                "retrieve(query) needs a CandidateProvider: pass provider= to MapMatchedRetriever, "
                "or call retrieve_candidates(candidates)"
            )
        answer = provider.retrieve(query, self._retriever.candidate_limit)
        return self._retrieve_turn(answer, provider_answer_name(provider))

    def retrieve_candidates(self, candidates: Iterable[Any]) -> RetrievalResult:
        """Decode a new turn from candidates given directly (provider order).

        The first ``candidate_limit`` candidates are kept and normalized; the whole
        trellis is re-decoded. If anything raises, the turn is removed again.

        Raises:
            MapMatchedTypeError: (a ValueError and a TypeError) ``candidates`` is not a
                sequence of ScoredCandidate or ``(chunk_id, score)`` pairs; the message
                names the turn and the position.
            MapMatchedValueError: empty candidates, a bad chunk ID or score, repeated IDs.
        """
        return self._retrieve_turn(candidates, "candidates")

    def _retrieve_turn(self, candidates: Iterable[Any], what: str) -> RetrievalResult:
        """:meth:`retrieve_candidates`; ``what`` names the candidates in error messages."""
        retriever = self._retriever
        turn_index = len(self._trellis)
        kept = as_turn_candidates(candidates, turn_index, what)[: retriever.candidate_limit]
        if not kept:
            raise empty_turn_error(turn_index)
        normalized = check_turn(normalize_candidates(kept, retriever.score_normalization), turn_index)
        self._trellis.append(normalized)
        pushed = False
        try:
            if self._stream is not None:
                path, ranking = self._stream.push(normalized)
                pushed = True
            else:
                path, ranking = retriever.decoder.decode_ranked(
                    self._trellis,
                    retriever.graph,
                    emission_weight=retriever.emission_weight,
                    transition_weight=retriever.transition_weight,
                    fixed_lag=retriever.fixed_lag,
                )
            result = finish_turn(retriever, self._trellis, path, ranking, self._path, self._trace)
        except BaseException:
            self._trellis.pop()
            if pushed:
                self._stream.rollback()
            raise
        self._path = result.path
        self._trace = result.trace
        return result



def revised_indices(previous: Optional[DecodedPath], path: DecodedPath) -> Tuple[int, ...]:
    """Earlier turns whose decoded chunk changed; RuntimeError if a committed one did."""
    if previous is None:
        return ()
    return revised_turns(previous.chunk_ids, previous.committed_through_index, path.chunk_ids)


def revised_turns(
    previous_chunk_ids: Sequence[str], committed: Optional[int], chunk_ids: Sequence[str]
) -> Tuple[int, ...]:
    """:func:`revised_indices` from the previous path's chunk IDs and committed index."""
    revised = tuple(index for index, (old, new) in enumerate(zip(previous_chunk_ids, chunk_ids)) if old != new)
    if committed is not None and any(index <= committed for index in revised):
        raise MapMatchedRuntimeError(
            f"fixed-lag decoder revised a committed turn (committed through {committed}, revised {list(revised)})"
        )
    return revised


def finish_turn(
    retriever: MapMatchedRetriever,
    trellis: Sequence[Tuple[DecoderCandidate, ...]],
    path: DecodedPath,
    ranking: Tuple[CandidateScore, ...],
    previous_path: Optional[DecodedPath],
    previous_trace: Optional[RetrievalTrace],
) -> RetrievalResult:
    """Everything after decoding a turn: revision check, trace, context, the result.

    Shared by the session and the batched server (whose results are built lazily from
    :func:`turn_trace` and :func:`turn_result`, the two halves of this), so both report
    identically.
    """
    trace = turn_trace(retriever, trellis, path, revised_indices(previous_path, path), previous_trace)
    return turn_result(retriever, trellis, path, ranking, trace)


def turn_trace(
    retriever: MapMatchedRetriever,
    trellis: Sequence[Tuple[DecoderCandidate, ...]],
    path: DecodedPath,
    revised: Sequence[int],
    previous_trace: Optional[RetrievalTrace] = None,
) -> RetrievalTrace:
    """The trace of a decoded turn (``revised``: earlier turns whose chunk changed;
    ``previous_trace``: the last turn's, whose unchanged steps are reused)."""
    if len(path.steps) != len(trellis):
        raise MapMatchedRuntimeError(f"decoder returned {len(path.steps)} steps for {len(trellis)} turns")
    return build_trace(
        path,
        trellis,
        emission_weight=retriever.emission_weight,
        maximum_distance=retriever.graph.maximum_distance,
        revised_prior_indices=revised,
        reuse=previous_trace.steps if previous_trace is not None else (),
    )


def turn_result(
    retriever: MapMatchedRetriever,
    trellis: Sequence[Tuple[DecoderCandidate, ...]],
    path: DecodedPath,
    ranking: Tuple[CandidateScore, ...],
    trace: RetrievalTrace,
    neighborhood: Optional[Sequence[Tuple[str, float]]] = None,
) -> RetrievalResult:
    """The :class:`RetrievalResult` of a decoded turn: its context and everything else."""
    chunk_id = path.steps[-1].chunk_id
    if neighborhood is None:
        neighborhood = retriever.graph.neighborhood(chunk_id, retriever.context_radius)
    context = context_chunk_ids(chunk_id, neighborhood, trellis[-1], retriever.context_limit)
    return RetrievalResult(
        chunk_id=chunk_id,
        context_chunk_ids=context,
        candidates=trellis[-1],
        path=path,
        trace=trace,
        candidate_ranking=ranking,
    )
