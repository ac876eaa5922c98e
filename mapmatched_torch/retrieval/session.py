"""Conversational sessions over any retriever (docs/spec.md section 6).

:class:`MapMatchedRetriever` holds the configuration (graph, provider, decoder,
weights, normalization, lag, context); :meth:`MapMatchedRetriever.session` opens one
conversation. Each turn is transactional: the candidates are normalized and appended
to the trellis, the whole trellis is decoded, and if anything raises the turn is
removed again, leaving the session exactly as it was.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Tuple

from ..core.checks import describe
from ..core.errors import MapMatchedRuntimeError, MapMatchedTypeError, MapMatchedValueError
from ..core.models import CandidateScore, DecodedPath, DecoderCandidate, RetrievalResult, RetrievalTrace
from ..core.protocols import CandidateProvider, CorpusGraph, Decoder, contextual_call, provider_answer, searched_query
from ..core.settings import DecodeSettings, HoldsSettings
from .turns import (
    as_turn_candidates,
    provider_answer_name,
    normalize_turn,
    check_retriever_options,
    learned_transitions,
    finish_turn,
)

if TYPE_CHECKING:
    from .learned import LearnedTransitions  # noqa: F401  (named in docstrings and annotations)

__all__ = ["MapMatchedRetriever", "MapMatchedSession", "decode_turns"]


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
        transitions: a learned transition model (a
            :class:`~mapmatched_torch.kernels.transitions.GatedTransitions`, or any model
            with its contract) in place of ``-(beta * d)``: its beta replaces
            ``transition_weight``, and each move is ``model(distances, features)`` with
            the evaluation's gate feature (see :mod:`mapmatched_torch.retrieval.learned`).
            The decoder must be the standalone one or stream (``TorchDecoder``).
        passage_embeddings: ``(N, D)`` passage embeddings for the cosine gate feature
            (rows aligned with ``passage_ids``, by default a tensor graph's nodes); then
            every turn after the first needs its query embedding (``query_embedding=``,
            or the provider's ``embed_query``). None: the score-level feature.
        passage_ids: the chunk IDs of ``passage_embeddings``' rows.

    Attributes:
        settings: the :class:`~mapmatched_torch.core.settings.DecodeSettings` every
            session of this retriever decodes with (``emission_weight``,
            ``transition_weight``, ``fixed_lag`` and ``score_normalization`` read it).
        transitions: the learned transition model, or None.
        learned: its :class:`~mapmatched_torch.retrieval.learned.LearnedTransitions`, or None.
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
        transitions: Optional[Any] = None,
        passage_embeddings: Optional[Any] = None,
        passage_ids: Optional[Sequence[str]] = None,
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
        self.learned = learned_transitions(transitions, self.graph, passage_embeddings, passage_ids)
        self.transitions = None if self.learned is None else self.learned.model
        if self.learned is not None:
            self.settings = self.learned.settings(self.settings)
            if not callable(getattr(decoder, "stream", None)) and not _takes_costs(decoder):
                raise MapMatchedValueError(
                    f"transitions= needs a decoder that streams (TorchDecoder) or takes transition_costs= "
                    f"(StandaloneDecoder); {type(decoder).__name__} does neither"
                )

    @classmethod
    def from_pretrained(
        cls, path: Any, *, graph: CorpusGraph, provider: Optional[CandidateProvider] = None, embedder: Any = None,
        strict: bool = True, **options: Any,
    ) -> "MapMatchedRetriever":
        """A retriever that applies a fitted model directory (``mapmatched-torch fit --out DIR``) as
        the evaluation's method applied it (:func:`~mapmatched_torch.retrieval.pretrained.pretrained_options`).

        Args:
            path: the model directory.
            graph: the corpus graph; refused unless it has the fitted graph's node IDs
                and maximum distance.
            provider: the candidate provider (a mixed model wraps it in its
                ``QueryMixingProvider``; it must then search by vector).
            embedder: when given, refused unless it is the fit's embedder (fingerprint).
            strict: False warns about a differing graph or embedder instead.
            **options: the other keyword arguments (``decoder``, ``candidate_limit``,
                default the fit's, ``context_radius``, ...); the settings come from the model.

        Raises:
            MapMatchedValueError: a damaged or mismatched model directory.
            NotImplementedError: a gated model, while this class takes no ``transitions=``.
        """
        from .pretrained import pretrained_options

        _, kwargs = pretrained_options(cls, path, graph=graph, provider=provider, embedder=embedder, strict=strict,
                                       options=options)
        return cls(graph, **kwargs)

    def session(self) -> "MapMatchedSession":
        """Open a new conversation."""
        return MapMatchedSession(self)


def _takes_costs(decoder: Any) -> bool:
    """Whether ``decoder.decode_ranked`` takes ``transition_costs=`` (the standalone decoder's)."""
    import inspect

    ranked = getattr(decoder, "decode_ranked", None)
    try:
        return callable(ranked) and "transition_costs" in inspect.signature(ranked).parameters
    except (TypeError, ValueError):
        return False


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
        #: the learned model's gate features of each turn's incoming moves (None at turn 0)
        self._features: List[Optional[Any]] = []
        # A decoder that can stream (TorchDecoder) decodes each turn incrementally.
        factory = getattr(retriever.decoder, "stream", None)
        learned = {"transitions": retriever.transitions} if retriever.learned is not None else {}
        self._stream = (
            factory(retriever.graph, retriever.candidate_limit, settings=retriever.settings, **learned)
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

    def retrieve(self, query: str, *, query_embedding: Optional[Any] = None) -> RetrievalResult:
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

        ``query_embedding``: the query's embedding, for a retriever whose learned
        transition model gates on the query-source cosine (default: the provider's
        ``embed_query(query)`` when it has one).

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
        learned = self._retriever.learned
        if query_embedding is None and learned is not None and learned.needs_query and self.turn_count:
            embed = getattr(provider, "embed_query", None)
            query_embedding = embed(query) if callable(embed) else None
        contextual = contextual_call(provider)
        if contextual is not None:  # e.g. QueryMixingProvider: the previous decoded chunk goes into the query
            with self._lock:  # the context read and the turn it conditions are one step
                answer = contextual(query, self._retriever.candidate_limit, self.current_chunk_id,
                                    self._previous_query)
                return self._retrieve_turn(answer, f"candidates from {type(provider).__name__}.retrieve_in_context",
                                           query, query_embedding)
        answer = provider_answer(provider)[1](query, self._retriever.candidate_limit)
        return self._retrieve_turn(answer, provider_answer_name(provider), query, query_embedding)

    def retrieve_candidates(self, candidates: Iterable[Any], *, query_embedding: Optional[Any] = None) -> RetrievalResult:
        """Decode a new turn from candidates given directly (provider order).

        The first ``candidate_limit`` candidates are kept and normalized; the whole
        trellis is re-decoded. If anything raises, the turn is removed again. The
        result's ``candidates`` are the kept ones as :class:`ScoredCandidate` (raw
        scores); the normalized turn is ``session.trellis[-1]``. ``query_embedding``: the
        turn's query embedding, needed after the first turn when the retriever's learned
        transition model gates on the query-source cosine.

        Raises:
            MapMatchedTypeError: (a ValueError and a TypeError) ``candidates`` is not a
                sequence of ScoredCandidate, ``(chunk_id, score)`` pairs or objects with
                ``chunk_id`` and ``score``; the message names the turn and the position.
            MapMatchedValueError: a bad chunk ID or score; no candidates (``"candidate
                set must not be empty (turn 0)"``) or repeated IDs (``"candidate chunk_ids
                must be unique within a turn (turn 0)"``), upstream's messages first.
            MapMatchedRuntimeError: a fixed-lag decoder changed a committed turn.
        """
        return self._retrieve_turn(candidates, "candidates", query_embedding=query_embedding)

    def _retrieve_turn(
        self, candidates: Iterable[Any], what: str, query: Optional[str] = None, query_embedding: Optional[Any] = None
    ) -> RetrievalResult:
        """:meth:`retrieve_candidates`; ``what`` names the candidates in error messages;
        ``query`` is the turn's query text (None: given as candidates)."""
        with self._lock:
            result = self._locked_turn(candidates, what, query_embedding)
            # the text, or from a recurrent QueryMixingProvider the text with the vector it searched
            self._previous_query = searched_query(candidates, query)
            return result

    def _locked_turn(self, candidates: Iterable[Any], what: str, query_embedding: Optional[Any] = None) -> RetrievalResult:
        retriever = self._retriever
        turn_index = len(self._trellis)
        kept = as_turn_candidates(candidates, turn_index, what)[: retriever.candidate_limit]
        normalized = normalize_turn(kept, retriever.score_normalization, turn_index)
        features = None
        if retriever.learned is not None and turn_index:
            features = retriever.learned.turn_features(
                [c.chunk_id for c in self._trellis[-1]], [c.chunk_id for c in normalized],
                [c.normalized_score for c in normalized], retriever.candidate_limit, query_embedding,
            )
        self._trellis.append(normalized)
        self._features.append(features)
        pushed = False
        try:
            if self._stream is not None:
                path, ranking = self._stream.push(normalized, features)
                pushed = True
            else:
                costs = None
                if retriever.learned is not None and retriever.settings.mode.uses_distances:
                    costs = retriever.learned.cost_tables(self._features)
                path, ranking = decode_turns(retriever, self._trellis, costs)
            result = finish_turn(retriever, self._trellis, kept, path, ranking, self._path, self._trace)
        except BaseException:
            self._trellis.pop()
            self._features.pop()
            if pushed:
                self._stream.rollback()
            raise
        self._path = result.path
        self._trace = result.trace
        return result


def decode_turns(
    retriever: MapMatchedRetriever, trellis: Sequence[Sequence[DecoderCandidate]], transition_costs: Any = None
) -> Tuple[DecodedPath, Tuple[CandidateScore, ...]]:
    """Decode a session's trellis with the retriever's decoder and options, all passed
    by keyword (``graph=`` too, as upstream does): its ``decode_ranked`` when it has
    one, else its ``decode`` with an empty ranking (a decoder with only upstream's
    ``decode`` plugs in). ``transition_costs``: a learned model's (the standalone
    decoder's keyword), passed only when given."""
    decoder = retriever.decoder
    options = dict(graph=retriever.graph, **retriever.settings.decoder_options)
    if transition_costs is not None:
        options["transition_costs"] = transition_costs
    ranked = getattr(decoder, "decode_ranked", None)
    if callable(ranked):
        return ranked(trellis, **options)
    return decoder.decode(trellis, **options), ()


