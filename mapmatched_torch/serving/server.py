"""Serving many conversations at once: one batched decoding step for every new turn.

:class:`MapMatchedServer` keeps every open session in one
:class:`~mapmatched_torch.serving.session_store.SessionStore` on one device (the decoder
state and every turn's candidates, in tensors). :meth:`MapMatchedServer.step_slots` is
the tensor step: slots, candidate codes and raw scores in, a
:class:`~mapmatched_torch.serving.session_store.TensorStep` out, with no Python object
per session. ``step(turns)`` takes the new turn of any subset of sessions as candidate
lists or queries, and ``step_indexed`` as tensors of graph node indices; both return a
:class:`~mapmatched_torch.serving.step_results.StepResults` mapping whose
:class:`~mapmatched_torch.core.models.RetrievalResult` values, built when read, equal what
an independent :class:`MapMatchedSession` gives.

A bad request (unknown session, empty candidates, NaN scores, duplicate IDs, an
overflowing score, a failing provider query) fails for that session alone: it is
reported in ``errors`` and leaves that session exactly as it was.

Saving and loading are :mod:`.persistence` (mixed in); session IDs :mod:`.session_ids`.
This module stays above the project's ~700 lines on purpose: it is one class, the
server's whole public surface of sessions and steps, about a third of it docstrings.
"""

from __future__ import annotations

import math
import threading
import weakref
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import (check_chunk_id, check_finite, check_nonnegative_int, check_positive_int, check_sequence,
                           describe)
from ..core.errors import MapMatchedRuntimeError, MapMatchedTypeError, MapMatchedValueError
from ..core.signals import deferred_sigint
from ..core.models import DecodedPath, RetrievalTrace, ScoredCandidate
from ..core.path_reports import NONFINITE_MESSAGE
from ..core.protocols import (CorpusGraph, contextual_batch_call, contextual_call, implements, provider_answer,
                              searched_query)
from ..graph.protocols import TensorGraph
from ..core.settings import DecodeSettings
from ..retrieval.session import MapMatchedRetriever
from ..retrieval.turns import (
    as_turn_candidates,
    check_retriever_options,
    learned_transitions,
    normalize_turn,
    provider_answer_name,
)
from ..retrieval.trellis import packed_rows
from .contexts import warn_unread_context_table
from .locking import serialized
from .persistence import ServerPersistence
from .session_ids import SessionId, session_id_error, session_key
from .session_store import SessionStore, StepCode, TensorStep, refuse_rows
from .step_results import BuiltPaths, StepResults

if TYPE_CHECKING:  # the capture module loads on first use
    from .capture import CapturedStep  # noqa: F401

__all__ = ["MapMatchedServer"]


_CHUNK_ID, _SCORE = attrgetter("chunk_id"), attrgetter("score")


_LARGE_SCORE = 2.0**990


class MapMatchedServer(ServerPersistence):
    """Batched map-matched retrieval for many concurrent sessions on one device.
    Args:
        graph: the corpus graph (any ``CorpusGraph``; a tensor graph fills a batch's
            distances in one call, and :meth:`step_indexed` needs one).
        provider: optional ``CandidateProvider``; with one, :meth:`step` also accepts
            query strings (``retrieve_batch`` is used when the provider has it).
        device: where the decoder state lives (default CPU).
        dtype: of the dynamic program (float64: identical to the standalone decoder).
        capacity: initial number of session slots (grows by doubling).
        candidate_limit, emission_weight, transition_weight, score_normalization,
        fixed_lag, context_radius, context_limit: as for
            :class:`~mapmatched_torch.MapMatchedRetriever` (validated the same way; a
            graph's stored context table of another limit warns, ``ContextTableWarning``).
        settings: emission_weight, transition_weight, score_normalization and
            fixed_lag as one :class:`~mapmatched_torch.core.settings.DecodeSettings`
            (then leave those four at their defaults).
        neighborhood_cache: context neighbourhoods kept (an LRU, for tensor graphs).
        turn_capacity: turns per session the tables start with (default 8; they double
            when a session outgrows them, a step that pays a copy of the whole table,
            and shrink back when long sessions close): a server that knows its
            conversations' lengths sets it so no live step pays the growth.
        extra_codes: chunk codes of IDs outside a tensor graph's nodes (every ID of
            another graph) kept before a compaction drops those no open session holds
            (default 65536; see :mod:`mapmatched_torch.serving.codes` and "What is
            bounded" in docs/serving-guarantees.md).
    Every session lives in the server's
    :class:`~mapmatched_torch.serving.session_store.SessionStore` (tensors on ``device``);
    a step is tensor work with no Python object per session
    (:meth:`step_slots`: tensors in, a
    :class:`~mapmatched_torch.serving.session_store.TensorStep` out). :meth:`step` and
    :meth:`step_indexed` wrap it: their results come back as
    :class:`~mapmatched_torch.serving.step_results.StepResults`, a mapping whose
    :class:`~mapmatched_torch.core.models.RetrievalResult` values are built when read.
    Concurrency: every public method holds one lock of the server (a ``threading.RLock``),
    so calls from several threads are serialized: one batch steps at a time, and a step
    is all or nothing for every session in it (a failure after the decoding step, even
    KeyboardInterrupt or an out-of-memory error, takes the whole step back with
    :meth:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder.undo_last`). Batch the
    sessions of one tick into one :meth:`step` rather than stepping from many threads.
    Results (:class:`StepResults`) are built lazily, holding the server's lock while
    they read the store (a session's turns are copied out before another thread can
    close it and reuse its slot), so reading them from another thread is safe. The
    graph's distance cache is safe under concurrent readers.
    Session IDs are str, int or (nested) tuples of them: what a saved state restores
    with ``torch.load(weights_only=True)``.
    Latency: see ``benchmarks/serving.py``, docs/serving.md and docs/performance.md. A
    long-running server calls ``gc.freeze()`` once after start-up, and reads only what it needs
    (:meth:`~mapmatched_torch.serving.step_results.StepResults.contexts`: no result objects).
    Example:
        >>> from mapmatched_torch import InMemoryCorpusGraph, ScoredCandidate
        >>> server = MapMatchedServer(InMemoryCorpusGraph.from_edges([("a", "b")]))
        >>> server.open("alice"), server.open("bob")  # their slots
        (0, 1)
        >>> results, errors = server.step({"alice": [ScoredCandidate("a", 1.0)], "bob": []})
        >>> results["alice"].chunk_id, type(errors["bob"]).__name__
        ('a', 'MapMatchedValueError')
    """
    def __init__(
        self,
        graph: CorpusGraph,
        *,
        provider: Any = None,
        device: Optional[Union[str, torch.device]] = None,
        dtype: torch.dtype = torch.float64,
        capacity: int = 64,
        candidate_limit: int = 20,
        emission_weight: float = 1.0,
        transition_weight: float = 1.0,
        score_normalization: str = "zscore",
        fixed_lag: Optional[int] = None,
        context_radius: float = 1.0,
        context_limit: Optional[int] = None,
        neighborhood_cache: int = 65536,
        turn_capacity: int = 8,
        settings: Optional[DecodeSettings] = None,
        transitions: Any = None,
        passage_embeddings: Optional[torch.Tensor] = None,
        passage_ids: Optional[Sequence[str]] = None,
        extra_codes: int = 65536,
    ) -> None:
        self.graph, self.candidate_limit, self.settings, self.context_radius, self.context_limit = (
            check_retriever_options(
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
        )
        # a learned transition model (checked; its beta becomes the settings' transition_weight)
        self.learned = learned_transitions(transitions, self.graph, passage_embeddings, passage_ids)
        self.transitions = None if self.learned is None else self.learned.model
        if self.learned is not None:
            self.settings = self.learned.settings(self.settings)
        self.provider = provider
        self._retriever: Optional[MapMatchedRetriever] = None
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._store = SessionStore(
            self.graph,
            self.candidate_limit,
            self.settings,
            context_radius=self.context_radius,
            context_limit=self.context_limit,
            capacity=check_positive_int(capacity, "capacity"),
            dtype=dtype,
            device=self.device,
            neighborhood_cache=check_positive_int(neighborhood_cache, "neighborhood_cache"),
            turn_capacity=check_positive_int(turn_capacity, "turn_capacity"),
            learned=self.learned,
            extra_codes=check_positive_int(extra_codes, "extra_codes"),
        )
        warn_unread_context_table(self.graph, self.context_radius)  # a stored table these contexts do not read
        self._sessions: Dict[SessionId, int] = {}  # session ID -> slot
        # slot -> (the text of a query it stepped, its turn count right after): that query
        # is the slot's previous query while the count still matches, i.e. while no turn
        # given as candidates came after it (derived on read, so candidate steps touch nothing)
        self._previous_queries: Dict[int, Tuple[str, int]] = {}
        self._built = BuiltPaths()
        # the results handed out, to copy a closing session's turns into (weak: dropped results go)
        self._live_results: List["weakref.ref[StepResults]"] = []
        self._lock = threading.RLock()  # one call at a time: see "Concurrency" above
        self._fingerprint: Optional[Dict[str, Any]] = None  # the graph's, made on first save or load
    @classmethod
    def from_pretrained(
        cls, path: Any, *, graph: CorpusGraph, provider: Any = None, embedder: Any = None, strict: bool = True,
        **options: Any,
    ) -> "MapMatchedServer":
        """A server that applies a fitted model directory as the evaluation's method applied it:
        :meth:`MapMatchedRetriever.from_pretrained <mapmatched_torch.MapMatchedRetriever.from_pretrained>`'s
        arguments, ``**options`` this class's (``device``, ``capacity``, ...)."""
        from ..retrieval.pretrained import pretrained_options
        _, kwargs = pretrained_options(cls, path, graph=graph, provider=provider, embedder=embedder, strict=strict,
                                       options=options)
        return cls(graph, **kwargs)
    @property
    def retriever(self) -> MapMatchedRetriever:
        """A :class:`~mapmatched_torch.MapMatchedRetriever` with this server's graph,
        provider and options (made on first read): for a plain session that decodes as
        this server's sessions do."""
        if self._retriever is None:
            self._retriever = MapMatchedRetriever(
                self.graph,
                provider=self.provider,
                candidate_limit=self.candidate_limit,
                settings=self.settings,
                context_radius=self.context_radius,
                context_limit=self.context_limit,
                **self._learned_options(),
            )
        return self._retriever
    def _learned_options(self) -> Dict[str, Any]:
        """The ``transitions=`` keywords of this server's learned model (empty without one)."""
        learned = self.learned
        if learned is None:
            return {}
        ids = None
        if learned.passage_embeddings is not None:
            ids = sorted(learned.rows, key=learned.rows.__getitem__)
        return {"transitions": learned.model, "passage_embeddings": learned.passage_embeddings, "passage_ids": ids}
    @property
    def store(self) -> SessionStore:
        """The session store (its tensors, chunk codes and contexts)."""
        return self._store
    @serialized
    def precompute_contexts(
        self, chunk_ids: Optional[Sequence[str]] = None, *, batch_size: int = 4096, progress: Optional[bool] = None
    ) -> int:
        """Search the context neighbourhoods of every chunk now (a warm-up before serving).
        A step's contexts read each decoded chunk's neighbourhood from a table of chunk
        codes on the device, searched the first time the chunk is decoded
        (:class:`~mapmatched_torch.serving.contexts.ContextTable`); after this call no
        step pays that first visit. Results do not change, only when the searching is done.
        Args:
            chunk_ids: the chunks to prepare (default: every node of a tensor graph;
                required for any other graph).
            batch_size: neighbourhoods searched per batched call.
            progress: a tqdm bar (None: only when stderr is a terminal).
        Returns:
            W, the widest neighbourhood kept: the table takes ``V x W`` int32 (V chunk codes).
        Raises:
            ValueError: rows of this graph are never kept (it is not an immutable
                ``NeighborhoodGraph``, one that answers many neighbourhoods at once, e.g. a
                ``TensorCorpusGraph``); ``chunk_ids`` is None for a graph that does not
                list its nodes; or a chunk ID is not a non-empty str.
        """
        store = self._store
        store.contexts.check_keepable()  # before any chunk ID is numbered
        if chunk_ids is None:
            if not implements(store.graph, TensorGraph):
                raise MapMatchedValueError(
                    "precompute_contexts needs chunk_ids for a graph that is not a tensor graph "
                    "(only a tensor graph lists its nodes)"
                )
            codes = torch.arange(store.codes.graph_nodes, dtype=torch.long)
        else:
            if isinstance(chunk_ids, str):
                raise MapMatchedTypeError("chunk_ids must be a sequence of chunk IDs, not one str")
            ids = [check_chunk_id(chunk_id, "chunk_ids entry") for chunk_id in chunk_ids]
            codes = torch.tensor(store.codes.codes(ids), dtype=torch.long)
        return store.contexts.precompute(codes, batch_size=batch_size, progress=progress)
    # ------------------------------------------------------------- sessions
    @serialized
    def open(self, session_id: SessionId) -> int:
        """Open a new, empty session and return its slot (the lowest free one; ValueError if the ID is already
        open; MapMatchedTypeError if it is not a str, an int, a float, None or a tuple of
        them). A numpy integer is taken as the int it equals: ``np.int64(3)`` is session ``3``."""
        session_id = session_key(session_id)
        if self._is_open(session_id):
            raise MapMatchedValueError(f"session {session_id!r} is already open")
        with deferred_sigint():  # the store's open is all or nothing; then one assignment
            slot = self._store.open()
            self._sessions[session_id] = slot
        return slot
    @serialized
    def close(self, session_id: SessionId) -> None:
        """Close a session and free its slot (ValueError if it is not open). Results
        already returned for it stay readable. The slot table may shrink, and the chunk
        codes are compacted first when due (:mod:`mapmatched_torch.serving.codes`)."""
        session_id = self._known(session_id)
        self._store.compact_codes()  # when due: all or nothing, and no session's content changes
        slot = self._sessions[session_id]
        # prepared: the results handed out copy the slot's turns (idempotent), the built
        # paths of the slot (a cache) go
        for reference in self._live_results:
            results = reference()
            if results is not None:
                results.detach(slot)
        self._built.drop(slot)
        with deferred_sigint():  # the store's close is all or nothing; then dict operations
            self._store.close(slot)
            del self._sessions[session_id]
            self._previous_queries.pop(slot, None)
    def __contains__(self, session_id: object) -> bool:
        try:
            return session_id in self._sessions
        except TypeError:
            return False
    def __len__(self) -> int:
        return len(self._sessions)
    @property
    def session_ids(self) -> Tuple[SessionId, ...]:
        return tuple(self._sessions)
    @serialized
    def slot(self, session_id: SessionId) -> int:
        """The session's slot in the store (for :meth:`step_slots`)."""
        return self._sessions[self._known(session_id)]
    @serialized
    def slots(self, session_ids: Sequence[SessionId]) -> torch.Tensor:
        """``(S,)`` long slots of these sessions (-1 for one that is not open)."""
        get = self._sessions.get
        return torch.tensor([get(key, -1) for key in session_ids], dtype=torch.long, device=self.device)
    @serialized
    def path(self, session_id: SessionId) -> Optional[DecodedPath]:
        """The session's latest decoded path (None before its first turn)."""
        results = self._latest(session_id)
        return results.record(session_id).decoded(self)[1] if results is not None else None
    @serialized
    def trace(self, session_id: SessionId) -> Optional[RetrievalTrace]:
        """The session's latest trace (None before its first turn)."""
        results = self._latest(session_id)
        return results.record(session_id).decoded(self)[3] if results is not None else None
    @serialized
    def turn_count(self, session_id: SessionId) -> int:
        return self._store.decoder.length(self._sessions[self._known(session_id)])
    def _latest(self, session_id: SessionId) -> Optional[StepResults]:
        """A one-session :class:`StepResults` of the session's latest step (None before its first turn)."""
        slot = self._sessions[self._known(session_id)]
        if self._store.decoder.length(slot) == 0:
            return None
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        return StepResults(self, self._store, self._store.current(slots), {session_id: 0}, slots, self._built,
                           self._lock)
    def _known(self, session_id: SessionId) -> SessionId:
        if not self._is_open(session_id):
            raise MapMatchedValueError(f"unknown session {session_id!r} (open it first)")
        return session_id
    def _is_open(self, session_id: Any) -> bool:
        """Whether ``session_id`` is open; MapMatchedTypeError (a ValueError and a
        TypeError) if it cannot be one (unhashable)."""
        try:
            return session_id in self._sessions  # np.int64(3) == 3 and hashes alike: found as session 3
        except TypeError:
            raise session_id_error(session_id, session_id, unhashable=True) from None
    # ----------------------------------------------------------------- a step
    @serialized
    def step_slots(
        self, slots: torch.Tensor, codes: torch.Tensor, scores: torch.Tensor, *, contexts: bool = True,
        synchronize: bool = True, query_embeddings: Optional[torch.Tensor] = None,
    ) -> TensorStep:
        """The tensor step: one new turn for each of S sessions given by slot, nothing
        made per session.
        Args:
            slots: ``(S,)`` long slots (:meth:`slot`, :meth:`slots`, or what :meth:`open`
                returned).
            codes: ``(S, K)`` long chunk codes in provider order, ``-1`` padding after
                each row's candidates. With a tensor graph its node indices are the codes
                (``graph.index(chunk_ids)``); ``server.store.codes.codes(chunk_ids)``
                numbers any chunk ID (a code beyond a tensor graph's nodes is valid until
                the next :meth:`step` or :meth:`close`, which may compact the codes: see
                :mod:`mapmatched_torch.serving.codes`). Columns past ``candidate_limit``
                are cut (but checked).
            scores: ``(S, K)`` floating raw scores (padding ignored).
            contexts: also compute the ``(S, C)`` context codes.
            synchronize: False: the device step. Nothing in it reads a value back to
                the host, so a GPU runs it ahead of the host and it can be captured
                (:meth:`capture`); tensors on the server's device are expected. Every
                row goes through one batched step (failed rows on a spare slot, written
                nowhere); the outputs have fixed shapes (paths as wide as the turn
                capacity, contexts :meth:`~mapmatched_torch.serving.session_store.SessionStore.context_width`
                wide); the rows' values equal the synchronizing step's. It needs a tensor
                graph with a dense table (:meth:`~mapmatched_torch.graph.TensorCorpusGraph.precompute_dense`)
                and, with contexts, :meth:`precompute_contexts` (otherwise the distance
                cache and first-visit searches read the host), and z-scores or no
                normalization of large scores (the trace-overflow check reads the host).
                A row whose normalization the device cannot certify gets
                ``StepCode.EXACT_SUM_ON_HOST`` (never in ordinary data): step it again
                with ``synchronize=True``. The table grows outside the step: the step
                reads the lengths back only when the table may be full
                (``turn_capacity`` sizes it ahead).
            query_embeddings: ``(S, D)`` the new turns' query embeddings, needed when the
                server's learned transition model gates on the query-source cosine
                (``passage_embeddings=``; its look-up of the previous candidates' rows
                reads the host).
        Returns:
            A :class:`~mapmatched_torch.serving.session_store.TensorStep` on the server's
            device. A row whose ``status`` is not 0
            (:class:`~mapmatched_torch.serving.session_store.StepCode`) left its session
            untouched; the others are committed. Chunk IDs:
            ``server.store.codes.names(step.path[s].tolist())``, before the next
            :meth:`step` or :meth:`close`.
        Raises:
            ValueError: the arguments' types or shapes do not match (nothing is changed).
        """
        slots, codes, scores = _check_step_tensors(slots, codes, scores)
        decoder = self._store.decoder
        written = decoder.steps_written
        with deferred_sigint():  # SIGINT arrives once the step is committed or taken back
            try:  # all or nothing, as in step()
                step = self._store.step(slots, codes, scores, contexts=contexts, synchronize=synchronize,
                                        query_embeddings=query_embeddings)
                self._refuse_overflowing_traces(step, slots.to(self.device), None, range(slots.shape[0]))
            except BaseException:
                if decoder.steps_written != written and decoder.can_undo:  # (no host read)
                    decoder.undo_last()
                raise
        return step
    @serialized
    def capture(
        self, batch_size: int, *, candidates: Optional[int] = None, turns: int = 64, contexts: bool = True,
        warmup: int = 3,
    ) -> "CapturedStep":
        """Capture the device step (:meth:`step_slots` with ``synchronize=False``) for
        batches of exactly ``batch_size`` rows in a CUDA graph (see
        :mod:`mapmatched_torch.serving.capture`): each later step is one replay.
        Args:
            batch_size: S, the rows of every replayed step (unused rows: slot -1).
            candidates: K, the candidate columns (default: ``candidate_limit``).
            turns: turns per session reserved in the slot table (it cannot grow in a replay).
            contexts: also compute the contexts (needs :meth:`precompute_contexts`).
            warmup: device steps run on a side stream before the capture (every row
                inactive: nothing is written).
        Returns:
            A :class:`~mapmatched_torch.serving.capture.CapturedStep`.
        Raises:
            ValueError: the server is not on a CUDA device, its graph has no dense table,
                contexts are asked without :meth:`precompute_contexts`, or the
                normalization is not z-scores.
        """
        from .capture import capture_step
        batch_size = check_positive_int(batch_size, "batch_size")
        candidates = self.candidate_limit if candidates is None else check_positive_int(candidates, "candidates")
        return capture_step(self, batch_size, candidates, check_positive_int(turns, "turns"), contexts,
                            check_nonnegative_int(warmup, "warmup"))
    @serialized
    def step(
        self, turns: Mapping[SessionId, Any], *, query_embeddings: Optional[Mapping[SessionId, Any]] = None
    ) -> Tuple[StepResults, Dict[SessionId, Exception]]:
        """Decode one new turn for every session in ``turns``, in one batched pass.
        Args:
            turns: session ID -> that session's new candidates (``ScoredCandidate``
                objects or ``(chunk_id, score)`` pairs, provider order), or a query
                string when the server has a provider.
            query_embeddings: session ID -> the new turn's query embedding ``(D,)``, for
                a learned transition model that gates on the query-source cosine (a
                query string's default: the provider's ``embed_query``); a session past
                its first turn without one fails alone.
        Returns:
            ``(results, errors)``: each successful session's
            :class:`~mapmatched_torch.core.models.RetrievalResult` (a
            :class:`~mapmatched_torch.serving.step_results.StepResults` mapping, built on
            read), and each failed session's exception (its state is unchanged); a
            request of the wrong type (None, a number, a list of non-candidates) is a
            :class:`~mapmatched_torch.core.errors.MapMatchedTypeError` naming the turn
            and position, worded as an independent session words it.
        Raises:
            MapMatchedTypeError: (a ValueError and a TypeError) ``turns`` is not a
                mapping (nor pairs) of session IDs; no session is touched.
        """
        errors: Dict[SessionId, Exception] = {}
        requests = _as_requests(turns)
        self._store.compact_codes()  # when due, before any chunk ID is numbered (all or nothing)
        queries = {key: value for key, value in requests.items() if isinstance(value, str)}
        if queries:
            requests.update(self._retrieve(queries, errors))
            # kept as each session's previous query: with a recurrent mix, the text and the vector it searched
            queries = {key: searched_query(requests.get(key), text) for key, text in queries.items()}
        answer = ""
        if queries:
            contextual = callable(getattr(self.provider, "retrieve_in_context", None))
            answer = (f"candidates from {type(self.provider).__name__}.retrieve_in_context" if contextual
                      else provider_answer_name(self.provider))
        ids: List[SessionId] = []
        kept_rows: List[Tuple[ScoredCandidate, ...]] = []
        for session_id, request in requests.items():
            if session_id in errors:
                continue
            try:
                slot = self._sessions[self._known(session_id)]
                what = answer if session_id in queries else "candidates"
                kept = as_turn_candidates(request, self._store.decoder.length(slot), what)[: self.candidate_limit]
            except Exception as error:  # isolate the bad request
                errors[session_id] = error
                continue
            ids.append(session_id)
            kept_rows.append(kept)
        embeddings = None
        if self.learned is not None and self.learned.needs_query:
            ids, kept_rows, embeddings = self._query_rows(ids, kept_rows, queries, query_embeddings or {}, errors)
        if not ids:
            return self._results([], None, None, {}), errors
        width = self.candidate_limit
        coded = self._store.codes.codes
        codes = packed_rows([coded(map(_CHUNK_ID, kept)) for kept in kept_rows], width, -1, torch.long)
        raw = packed_rows([list(map(_SCORE, kept)) for kept in kept_rows], width, 0.0, torch.float64)
        candidates = dict(zip(ids, kept_rows))
        return self._run(ids, codes, raw, errors, lambda key, code, turn: _candidate_error(
            code, candidates[key], self.settings.score_normalization, turn), queries, embeddings), errors
    def _query_rows(self, ids, kept_rows, queries, given, errors):
        """``(ids, kept_rows, (S, D) query embeddings)`` of a step whose learned model reads
        the query embeddings: a session past its first turn without one fails alone."""
        learned = self.learned
        embed = getattr(self.provider, "embed_query", None)
        rows, kept, vectors = [], [], []
        for session_id, row in zip(ids, kept_rows):
            vector = given.get(session_id)
            if vector is None and session_id in queries and callable(embed):
                vector = embed(queries[session_id])
            try:
                if vector is None and self._store.decoder.length(self._sessions[self._known(session_id)]) == 0:
                    vector = torch.zeros(learned.passage_embeddings.shape[1])  # (a first turn's is not read)
                vectors.append(learned.check_query(vector).reshape(-1))
            except MapMatchedValueError as error:
                errors[session_id] = error
                continue
            rows.append(session_id)
            kept.append(row)
        return rows, kept, torch.stack(vectors) if vectors else None
    @serialized
    def step_indexed(
        self, session_ids: Sequence[SessionId], candidates: torch.Tensor, scores: torch.Tensor, *,
        query_embeddings: Optional[torch.Tensor] = None,
    ) -> Tuple[StepResults, Dict[SessionId, Exception]]:
        """:meth:`step` for candidates given as tensors of graph node indices (no Python
        object per candidate): what a dense provider on the device returns.
        Args:
            session_ids: S distinct open sessions, one per row.
            candidates: ``(S, K)`` int64 node indices of the tensor graph (e.g.
                ``graph.index(provider.chunk_ids)[provider_rows]``), in provider order,
                ``-1`` padding after each row's candidates; columns past
                ``candidate_limit`` are cut.
            scores: ``(S, K)`` floating raw scores (padding entries are ignored).
            query_embeddings: ``(S, D)`` the new turns' query embeddings, needed when a
                learned transition model gates on the query-source cosine.
        Returns:
            As :meth:`step`; the results equal :meth:`step` with the same candidates as
            ``(graph.nodes[i], score)`` pairs. A row fails alone (in ``errors``) for an
            unknown or repeated session, no candidates, an index outside ``[-1, N)``,
            padding before a candidate, a non-finite score (every column is checked,
            as a session checks every candidate before the cut), a repeated index
            among the kept columns, or normalized scores that overflow.
        Raises:
            ValueError: the graph is not a tensor graph, or the arguments' types or
                shapes do not match (nothing is changed).
        Cost: tensor operations, one dictionary look-up per session ID, and Python only
        for the rows that fail; results are built when read.
        """
        graph = self.graph
        if not implements(graph, TensorGraph):
            raise MapMatchedValueError(
                f"step_indexed needs a tensor corpus graph (node indices); this server's graph is {type(graph).__name__}"
            )
        ids = list(check_sequence(session_ids, "step_indexed session_ids", "a sequence of session IDs (one per row)"))
        for session_id in ids:
            self._is_open(session_id)  # hashable, or MapMatchedTypeError
        _, candidates, scores = _check_step_tensors(torch.zeros(len(ids), dtype=torch.long), candidates, scores)
        nodes, names = graph.num_nodes, graph.nodes
        given = candidates
        # a code past the graph's nodes (another chunk the server has seen) is out of range here
        candidates = torch.where(candidates >= nodes, -2, candidates)
        errors: Dict[SessionId, Exception] = {}
        def row_error(key: SessionId, code: StepCode, turn: int) -> Exception:
            row = ids.index(key)  # (failed rows only)
            listed, raw = given[row].tolist(), scores[row].double().tolist()
            kept = min(sum(node >= 0 for node in listed), self.candidate_limit)
            if code in _INDEX_CODES:
                try:
                    _raise_row_error(listed, raw, kept, nodes, names, turn)
                except Exception as error:
                    return error
            pairs = [ScoredCandidate(names[node], score) for node, score in zip(listed[:kept], raw[:kept])]
            return _candidate_error(code, pairs, self.settings.score_normalization, turn)
        return self._run(ids, candidates, scores, errors, row_error, None, query_embeddings), errors
    def _run(
        self,
        ids: List[SessionId],
        codes: torch.Tensor,
        raw: torch.Tensor,
        errors: Dict[SessionId, Exception],
        row_error: Callable[[SessionId, StepCode, int], Exception],
        queries: Optional[Mapping[SessionId, str]] = None,
        embeddings: Optional[torch.Tensor] = None,
    ) -> StepResults:
        """The tensor step of ``ids`` (one row each), their failures into ``errors`` (made
        by ``row_error(session ID, code, turn index)``), the successes as StepResults;
        ``queries``: the query text of the rows that came as queries (kept as each
        session's previous query)."""
        get = self._sessions.get
        slots = torch.tensor([get(key, -1) for key in ids], dtype=torch.long, device=self.device)
        decoder = self._store.decoder
        before = decoder.lengths(slots.clamp_min(0))
        written = decoder.steps_written
        with deferred_sigint():  # SIGINT arrives once the step is committed or taken back
            try:  # all or nothing: anything raised below (even KeyboardInterrupt) takes the step back
                results, updates = self._run_step(ids, slots, codes, raw, before, errors, row_error, queries,
                                                  embeddings)
            except BaseException:
                if decoder.steps_written != written and decoder.can_undo:  # (not taken back already)
                    decoder.undo_last()
                raise
            self._previous_queries.update(updates)
        return results
    def _run_step(self, ids, slots, codes, raw, before, errors, row_error, queries, embeddings=None):
        """The body of :meth:`_run`: ``(results, the previous queries to record)``."""
        step = self._store.step(slots, codes, raw, query_embeddings=embeddings)
        status = step.status.tolist()
        failed = [row for row, code in enumerate(status) if code]
        rows = {key: row for row, key in enumerate(ids)}
        if failed:
            lengths = before.tolist()
            for row in failed:
                errors[ids[row]] = self._error(ids[row], StepCode(status[row]), lengths[row], row_error)
            rows = {key: row for key, row in rows.items() if not status[row]}
        results = self._results(ids, step, slots, rows)
        for row, error in self._refuse_overflowing_traces(step, slots, results, ids):
            errors[ids[row]] = error
            del rows[ids[row]]
        updates: Dict[int, Tuple[str, int]] = {}
        if queries:
            turns = before.tolist()
            for key, row in rows.items():
                if key in queries:
                    updates[self._sessions[key]] = (queries[key], turns[row] + 1)
        return results, updates
    def _previous_query(self, slot: int) -> Optional[str]:
        """The query text of the slot's latest turn, or None (that turn came as candidates,
        or the slot has stepped no query)."""
        entry = self._previous_queries.get(slot)
        return entry[0] if entry is not None and self._store.decoder.length(slot) == entry[1] else None
    def _error(self, session_id: SessionId, code: StepCode, turn: int, row_error) -> Exception:
        if code is StepCode.UNKNOWN_SLOT:
            return MapMatchedValueError(f"unknown session {session_id!r} (open it first)")
        if code is StepCode.REPEATED_SLOT:
            return MapMatchedValueError(f"session {session_id!r} is listed more than once in one step")
        if code is StepCode.DECODE_OVERFLOW:
            return MapMatchedValueError(f"{NONFINITE_MESSAGE} at turn {turn}")
        return row_error(session_id, code, turn)
    def _results(self, ids, step, slots, rows) -> StepResults:
        if step is None:
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            step = self._store.current(empty)
            slots = empty
        results = StepResults(self, self._store, step, rows, slots, self._built, self._lock)
        self._live_results = [reference for reference in self._live_results if reference() is not None]
        self._live_results.append(weakref.ref(results))
        return results
    def _refuse_overflowing_traces(
        self, step: TensorStep, slots: torch.Tensor, results: Optional[StepResults], keys: Sequence[Any]
    ) -> List[Tuple[int, Exception]]:
        """Sessions whose scores are so large that a trace margin or entropy may overflow
        (never with z-scores: no work then) have their path and trace built now, as a
        session would; a turn that fails there is taken back for that session alone.
        Args:
            step: the tensor step (its rows of refused turns are reset to a failed row's
                values, status :attr:`StepCode.TRACE_OVERFLOW`).
            slots: ``(S,)`` its slots. results: its StepResults (None: made here for the
                rows checked). keys: each row's key in ``results``.
        Returns:
            ``(row, the session's error)`` of every refused row.
        """
        settings = self.settings
        if settings.score_normalization == "zscore" and math.sqrt(self.candidate_limit) * max(
            1.0, settings.emission_weight
        ) <= _LARGE_SCORE:  # |z| <= sqrt(M): never large
            return []
        normalized = self._store.decoder.payload("normalized")
        turns = step.path.shape[1]
        magnitude = normalized[slots.clamp(0, normalized.shape[0] - 1), :turns].abs().amax((1, 2))
        large = (magnitude * max(1.0, self.settings.emission_weight) > _LARGE_SCORE) & (step.status == 0)
        if not bool(large.any()):
            return []
        rows = large.nonzero().view(-1).tolist()
        if results is None:
            results = StepResults(self, self._store, step, {keys[row]: row for row in rows}, slots, self._built,
                                  self._lock)
        refused = []
        for row in rows:
            try:
                results.build(keys[row])
            except Exception as error:  # the turn a session would refuse
                refused.append((row, error))
        if refused:
            picked = torch.tensor([row for row, _ in refused], dtype=torch.long, device=self.device)
            self._store.decoder.undo_slots(slots[picked])
            for slot in slots[picked].tolist():
                self._built.drop(slot)
            refuse_rows(step, picked, StepCode.TRACE_OVERFLOW)
        return refused
    def _retrieve(self, queries: Dict[SessionId, str], errors: Dict[SessionId, Exception]) -> Dict[SessionId, Any]:
        provider, limit = self.provider, self.candidate_limit
        answers: Dict[SessionId, Any] = {}
        for session_id, query in queries.items():
            if provider is None:  # SPEC section 6: a RuntimeError, as in a session
                errors[session_id] = MapMatchedRuntimeError(
                    "a query needs a CandidateProvider: pass provider= to MapMatchedServer, or send candidates"
                )
            elif not query:  # as a session: a whitespace query goes to the provider
                errors[session_id] = MapMatchedValueError("query must not be empty")
        pending = [key for key in queries if key not in errors]
        batch = getattr(provider, "retrieve_batch", None)
        asks = lambda key: provider_answer(provider)[1](queries[key], limit)  # noqa: E731
        contextual = contextual_call(provider)
        if pending and contextual is not None:
            # e.g. QueryMixingProvider: each session's previous decoded chunk (and query) goes into its query
            context = dict(zip(pending, self._current_chunk_ids(pending)))
            previous = {key: self._previous_query(self._sessions[key]) if key in self._sessions else None
                        for key in pending}
            asks = lambda key: contextual(queries[key], limit, context[key], previous[key])  # noqa: E731
            batch_in_context = contextual_batch_call(provider)
            batch = (lambda texts, size: batch_in_context(
                texts, size, [context[key] for key in pending], [previous[key] for key in pending])
            ) if batch_in_context is not None else None
        if pending and callable(batch):
            try:
                found = list(batch([queries[key] for key in pending], limit))
                if len(found) != len(pending):
                    raise MapMatchedRuntimeError(f"retrieve_batch answered {len(found)} of {len(pending)} queries")
                answers.update(zip(pending, found))
                return answers
            except Exception:  # fall back to one query at a time to isolate the failure
                answers.clear()
        for key in pending:
            try:
                answers[key] = asks(key)
            except Exception as error:
                errors[key] = error
        return answers
    def _current_chunk_ids(self, session_ids: Sequence[SessionId]) -> List[Optional[str]]:
        """Each session's decoded chunk of its latest turn (None before its first turn, or
        for a session that is not open), from the store's tensors."""
        get = self._sessions.get
        slots = torch.tensor([get(key, -1) for key in session_ids], dtype=torch.long, device=self.device)
        known = slots >= 0
        chunks = torch.full(slots.shape, -1, dtype=torch.long, device=self.device)
        if bool(known.any()):
            chunks[known] = self._store.current(slots[known]).chunks
        return self._store.codes.names(chunks.tolist())


_INDEX_CODES = (StepCode.OUT_OF_RANGE, StepCode.GAPPED, StepCode.NONFINITE_SCORE, StepCode.DUPLICATE)


def _candidate_error(code: StepCode, candidates: Sequence[ScoredCandidate], method: str, turn: int) -> Exception:
    """The error a session raises for a turn of these kept candidates (that the tensor
    step refused with ``code``)."""
    try:
        normalize_turn(candidates, method, turn)
    except Exception as error:
        return error
    return MapMatchedRuntimeError(f"the server refused turn {turn} ({code.name}) but a session accepts it")


def _check_step_tensors(slots: Any, codes: Any, scores: Any) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensor step's arguments, checked: (S,) long slots, (S, K) long codes and
    (S, K) floating scores; MapMatchedTypeError / MapMatchedValueError otherwise."""
    if not all(isinstance(value, torch.Tensor) for value in (slots, codes, scores)):
        raise MapMatchedTypeError(
            f"the step takes session slots or IDs and two (S, K) tensors; got candidates "
            f"{describe(codes)} and scores {describe(scores)}"
        )
    if codes.dim() != 2 or codes.dtype != torch.long or scores.shape != codes.shape:
        raise MapMatchedValueError(
            f"candidates must be an (S, K) int64 tensor and scores a float tensor of its shape; got "
            f"{codes.dtype} {tuple(codes.shape)} and {scores.dtype} {tuple(scores.shape)}"
        )
    if not scores.is_floating_point() or codes.shape[0] != slots.shape[0] or slots.dim() != 1 or slots.dtype != torch.long:
        raise MapMatchedValueError(
            f"scores must be floating ({scores.dtype}) and there must be one row per session "
            f"({codes.shape[0]} rows, {slots.shape[0]} sessions)"
        )
    return slots, codes, scores


def _as_requests(turns: Any) -> Dict[SessionId, Any]:
    """:meth:`MapMatchedServer.step`'s ``turns`` as a dict (a copy): a mapping, or an
    iterable of ``(session ID, request)`` pairs; else MapMatchedTypeError (a ValueError
    and a TypeError), raised before any session is touched."""
    expected = "a mapping of session ID -> candidates (or a query string)"
    if isinstance(turns, Mapping):
        return dict(turns)
    pairs = check_sequence(turns, "step(turns)", expected)
    for position, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise MapMatchedTypeError(
                f"step(turns) must be {expected}; entry {position} is not a (session ID, candidates) pair: "
                f"{describe(pair)}"
            )
    try:
        return dict(pairs)
    except TypeError:  # an unhashable session ID
        raise MapMatchedTypeError(f"step(turns) must be {expected}, with hashable session IDs") from None


def _raise_row_error(
    nodes: List[int], raw: List[float], kept: int, limit: int, names: Sequence[str], turn_index: int
) -> None:
    """Raise the first problem of a flagged :meth:`MapMatchedServer.step_indexed` row
    (``nodes``, ``raw``: the whole row; ``kept``: its candidates within candidate_limit)."""
    if any(node < -1 or node >= limit for node in nodes):
        raise MapMatchedValueError(
            f"trellis turn {turn_index}: candidate node indices must be -1 (padding) or in [0, {limit}), got {nodes}"
        )
    count = sum(node >= 0 for node in nodes)
    if any(node < 0 for node in nodes[:count]):
        raise MapMatchedValueError(f"trellis turn {turn_index}: padding (-1) must come after every candidate, got {nodes}")
    for node, score in zip(nodes[:count], raw):
        check_finite(score, f"trellis turn {turn_index} candidate {names[node]!r} raw_score")
    if len(set(nodes[:kept])) != kept:  # a repeated chunk: the session's error
        normalize_turn([ScoredCandidate(names[node], score) for node, score in zip(nodes[:kept], raw)], "none", turn_index)


