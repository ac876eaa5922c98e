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
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import threading
import weakref
from functools import wraps
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import (check_chunk_id, check_finite, check_nonnegative_int, check_positive_int, check_sequence,
                           describe)
from ..core.errors import (MapMatchedResourceError, MapMatchedRuntimeError, MapMatchedTypeError, MapMatchedValueError,
                           out_of_memory)
from ..core.files import atomic_path
from ..core.signals import deferred_sigint
from ..core.models import DecodedPath, RetrievalTrace, ScoredCandidate
from ..core.path_reports import NONFINITE_MESSAGE
from ..core.protocols import (CorpusGraph, contextual_batch_call, contextual_call, implements, provider_answer,
                              searched_query)
from ..graph.protocols import TensorGraph
from ..providers.query_mixing import previous_query_entry, previous_query_of_entry
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
from ..kernels.slot_persistence import state_checksum as decoder_checksum
from ._state import STATE_FORMAT, content_digest, fingerprint_differences, graph_fingerprint, same_but_order
from .session_store import SessionStore, StepCode, TensorStep, refuse_rows
from .step_results import BuiltPaths, StepResults

if TYPE_CHECKING:  # the capture module loads on first use
    from .capture import CapturedStep  # noqa: F401

__all__ = ["MapMatchedServer"]

SessionId = Hashable

_CHUNK_ID, _SCORE = attrgetter("chunk_id"), attrgetter("score")


def _serialized(method):
    """Run ``method`` holding the server's lock: one call at a time (see the class docstring)."""

    @wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


#: Above this |normalized score| (times lambda when lambda > 1) a trace's margin or
#: entropy could overflow, so the session's results are built during the step.
_LARGE_SCORE = 2.0**990


class MapMatchedServer:
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
            :class:`~mapmatched_torch.MapMatchedRetriever` (validated the same way).
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

    @_serialized
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

    @_serialized
    def open(self, session_id: SessionId) -> int:
        """Open a new, empty session and return its slot (the lowest free one; ValueError if the ID is already
        open; MapMatchedTypeError if it is not a str, an int, a float, None or a tuple of
        them). A numpy integer is taken as the int it equals: ``np.int64(3)`` is session ``3``."""
        session_id = _session_key(session_id)
        if self._is_open(session_id):
            raise MapMatchedValueError(f"session {session_id!r} is already open")
        with deferred_sigint():  # the store's open is all or nothing; then one assignment
            slot = self._store.open()
            self._sessions[session_id] = slot
        return slot

    @_serialized
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

    @_serialized
    def slot(self, session_id: SessionId) -> int:
        """The session's slot in the store (for :meth:`step_slots`)."""
        return self._sessions[self._known(session_id)]

    @_serialized
    def slots(self, session_ids: Sequence[SessionId]) -> torch.Tensor:
        """``(S,)`` long slots of these sessions (-1 for one that is not open)."""
        get = self._sessions.get
        return torch.tensor([get(key, -1) for key in session_ids], dtype=torch.long, device=self.device)

    @_serialized
    def path(self, session_id: SessionId) -> Optional[DecodedPath]:
        """The session's latest decoded path (None before its first turn)."""
        results = self._latest(session_id)
        return results.record(session_id).decoded(self)[1] if results is not None else None

    @_serialized
    def trace(self, session_id: SessionId) -> Optional[RetrievalTrace]:
        """The session's latest trace (None before its first turn)."""
        results = self._latest(session_id)
        return results.record(session_id).decoded(self)[3] if results is not None else None

    @_serialized
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
            raise _session_id_error(session_id, session_id, unhashable=True) from None

    # ----------------------------------------------------------------- a step

    @_serialized
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

    @_serialized
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

    @_serialized
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

    @_serialized
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

    # ------------------------------------------------------------ persistence

    @_serialized
    def state_dict(self) -> Dict[str, Any]:
        """The session store (every session's turns and decoder state), the session IDs by
        slot, the previous queries, the options and the graph's fingerprint, sealed by one
        SHA-256 ``checksum`` over all of it (format 3, see
        ``docs/serving-guarantees.md``): plain tensors and Python values, loadable with
        ``torch.load(..., weights_only=True)``."""
        sessions = [[_plain_id(session_id), slot] for session_id, slot in self._sessions.items()]
        previous_queries = [[slot, *previous_query_entry(text)] for slot in sorted(self._previous_queries)
                            for text in [self._previous_query(slot)] if text is not None]
        store = self._store.state_dict()
        state: Dict[str, Any] = {
            "version": STATE_FORMAT,
            "options": self._options(),
            "graph": self._graph_fingerprint(),
            "store": store,
            "sessions": sessions,
            "previous_queries": previous_queries,
            "graph_codes": self._graph_codes_used(store["decoder"]["tensors"]["payload.codes"]),
        }
        state["checksum"] = content_digest(state)
        return state

    def _graph_fingerprint(self) -> Dict[str, Any]:
        """The graph's :func:`~mapmatched_torch.serving._state.graph_fingerprint` (made once:
        the graph is immutable)."""
        if self._fingerprint is None:
            self._fingerprint = graph_fingerprint(self.graph)
        return dict(self._fingerprint)

    def _graph_codes_used(self, codes: torch.Tensor) -> List[List[Any]]:
        """``[[code, node ID], ...]`` of every graph node code in the saved ``(C, T, M)``
        codes (O(C T M)): what ``migrate=True`` renumbers by."""
        nodes = self._store.codes.graph_nodes
        if nodes == 0:
            return []
        present = torch.zeros(nodes, dtype=torch.bool)
        present[codes[(codes >= 0) & (codes < nodes)]] = True
        used = present.nonzero().view(-1).tolist()
        return [[code, name] for code, name in zip(used, self._store.codes.names(used))]

    def _options(self) -> Dict[str, Any]:
        """The options a saved state must match (what :meth:`state_dict` records)."""
        settings = self.settings
        return {
            "candidate_limit": self.candidate_limit,
            "emission_weight": settings.emission_weight,
            "transition_weight": settings.transition_weight,
            "score_normalization": settings.score_normalization,
            "fixed_lag": settings.fixed_lag,
            "context_radius": self.context_radius,
            "context_limit": self.context_limit,
            # a learned transition model's fingerprint (only with one: fixed-beta states are unchanged)
            **({"transitions": self.learned.fingerprint()} if self.learned is not None else {}),
        }

    @_serialized
    def load_state_dict(self, state: Mapping[str, Any], *, migrate: bool = False, legacy: bool = False) -> None:
        """Restore :meth:`state_dict` into a server built with the same options over the same graph.

        Everything is verified before anything changes: the checksum over the whole state,
        the graph's fingerprint (node IDs in order, maximum distance, directedness,
        edges), the options (candidate limit, lambda, beta, normalization, lag, context
        options), the store's tensors and chunk codes, and that every session owns a
        distinct live slot. A refused state raises
        :class:`~mapmatched_torch.core.errors.MapMatchedValueError` naming what differs
        or is damaged, and leaves the running server exactly as it was.

        Args:
            state: what :meth:`state_dict` returned (after ``torch.load``).
            migrate: also load a state saved over a tensor graph with the same node IDs
                (and edges and distance settings) in another order: its chunk codes are
                renumbered to this graph's node indices. Nothing else is migrated.
            legacy: also load a state without the whole-state checksum (saved before
                format 3, or with the checksum removed): only its parts' own checks run,
                so an edit of its session IDs or options may go unseen. Off by default.
        """
        if not isinstance(state, Mapping):
            raise MapMatchedValueError(f"refusing the server state: expected a mapping, got {type(state).__name__}; "
                                       "nothing was changed")
        version = state.get("version")
        if version == 1:
            raise MapMatchedValueError(
                "refusing the server state: it was saved by an older version of the server (state version 1); "
                "nothing was changed"
            )
        if version == 2 or (version == STATE_FORMAT and "checksum" not in state):
            if not legacy:
                raise MapMatchedValueError(
                    "refusing the server state: it has no whole-state checksum (saved before state format 3, or the "
                    "checksum was removed), so a damaged or edited state could not be told apart; "
                    "load_state_dict(state, legacy=True) loads it with only its parts' own checks; nothing was changed")
            if version == 2:
                return self._load_legacy(state)
        elif version != STATE_FORMAT:
            raise MapMatchedValueError(f"refusing the server state: unknown state version {version!r} (this server "
                                       f"reads {STATE_FORMAT}); nothing was changed")
        if set(state) - {"checksum"} != _STATE_KEYS:
            raise MapMatchedValueError(
                f"refusing the server state: expected the entries {sorted(_STATE_KEYS | {'checksum'})}, got "
                f"{sorted(map(str, state))}; nothing was changed")
        if "checksum" in state:
            content = {key: value for key, value in state.items() if key != "checksum"}
            if state["checksum"] != content_digest(content):
                raise MapMatchedValueError(
                    "refusing the server state: its content does not match its checksum (a damaged or edited "
                    "state); nothing was changed")
        mine = self._graph_fingerprint()
        differing = fingerprint_differences(state["graph"], mine)
        store = state["store"]
        if differing:
            movable = isinstance(state["graph"], dict) and same_but_order(state["graph"], mine)
            if not (migrate and movable):
                hint = (" It holds the same node IDs in another order: load_state_dict(state, migrate=True) (or "
                        "load(path, migrate=True)) renumbers its chunk codes." if movable else "")
                raise MapMatchedValueError(
                    "refusing the server state: it was saved over another graph (its chunk codes and distances "
                    f"belong to that graph): {'; '.join(differing)}; nothing was changed.{hint}")
            store = self._renumbered(store, state["graph_codes"])
        options = self._options()
        if state["options"] != options:
            saved = state["options"] if isinstance(state["options"], dict) else {}
            keys = [*options, *(key for key in saved if key not in options)]  # (a learned model's, saved or here)
            named = [f"{key} (saved {saved.get(key, 'absent')!r}, this {options.get(key, 'absent')!r})" for key in keys
                     if saved.get(key, "absent") != options.get(key, "absent")] or [f"saved {state['options']!r}"]
            raise MapMatchedValueError("refusing the server state: it was saved with other options: "
                                       f"{'; '.join(named)}; nothing was changed")
        self._restore(lambda: (state["sessions"], state["previous_queries"], store))

    def _load_legacy(self, state: Mapping[str, Any]) -> None:
        """A format-2 state (``legacy=True``): its options, its entries checksum where it
        has one, and its parts' own checks."""
        options = self._options()
        if state.get("options") != options:
            raise MapMatchedValueError(f"server state does not match this server: saved options {state.get('options')}, "
                                       f"these {options}")
        try:
            if "entries_checksum" in state and state["entries_checksum"] != _entries_checksum(
                    state["sessions"], state.get("previous_queries", [])):
                raise MapMatchedValueError(
                    "refusing the server state: the session IDs or previous queries do not match their checksum "
                    "(a damaged file?); nothing was changed")
        except MapMatchedValueError:
            raise
        except Exception as error:
            raise MapMatchedValueError(f"refusing the server state: malformed sessions ({error!r}); nothing was "
                                       "changed") from error
        self._restore(lambda: (state["sessions"], state.get("previous_queries", []), state["store"]))

    def _renumbered(self, store: Any, graph_codes: Any) -> Dict[str, Any]:
        """``store`` (a saved store state) with its graph node codes renumbered to this
        graph's node indices by ``graph_codes`` (``[[saved code, node ID], ...]``), its
        decoder checksum renewed; MapMatchedValueError when they do not cover the codes."""
        nodes = self._store.codes.graph_nodes
        try:
            decoder = dict(store["decoder"])
            tensors = dict(decoder["tensors"])
            codes = tensors["payload.codes"]
            old = [int(code) for code, _ in graph_codes]
            new = self.graph.vocabulary.indices_of([str(name) for _, name in graph_codes])
            mapping = torch.full((nodes,), -1, dtype=torch.long)
            if old:
                if len(set(old)) != len(old) or min(old) < 0 or max(old) >= nodes or min(new) < 0:
                    raise MapMatchedValueError("graph_codes must name distinct saved codes of this graph's node IDs")
                mapping[torch.tensor(old)] = torch.tensor(new, dtype=torch.long)
            graph = (codes >= 0) & (codes < nodes)
            moved = torch.where(graph, mapping[codes.clamp(0, max(nodes - 1, 0))] if nodes else codes, codes)
            if bool((graph & (moved < 0)).any()):
                raise MapMatchedValueError("a saved code is missing from graph_codes")
        except MapMatchedValueError as error:
            raise MapMatchedValueError(f"refusing to migrate the server state: {error}; nothing was changed") from error
        except Exception as error:
            raise MapMatchedValueError(f"refusing to migrate the server state: malformed ({error!r}); nothing was "
                                       "changed") from error
        tensors["payload.codes"] = moved
        decoder["tensors"] = tensors
        decoder["checksum"] = decoder_checksum(decoder)
        return dict(store, decoder=decoder)

    def _restore(self, parts: Callable[[], Tuple[Any, Any, Any]]) -> None:
        """Check the sessions and previous queries, load the store (checked), then commit
        (``parts``: the saved sessions, previous queries and store)."""
        try:
            saved_sessions, saved_previous, store = parts()
            sessions = _parsed_sessions(saved_sessions)
            previous_queries = _parsed_previous_queries(saved_previous, sessions)
        except MapMatchedValueError:
            raise
        except Exception as error:  # a malformed entry: say so, change nothing
            if out_of_memory(error):
                raise MapMatchedResourceError(f"out of memory while restoring the server state ({error!r}): a "
                                              "resource failure, not a malformed state; nothing was changed") from error
            raise MapMatchedValueError(f"refusing the server state: malformed sessions ({error!r}); nothing was changed") from error
        restored: Dict[int, Tuple[str, int]] = {}

        def check(checked: Mapping[str, Any]) -> None:
            _check_slots(sessions, checked)
            lengths = checked["tensors"]["lengths"]
            restored.update((slot, (text, int(lengths[slot]))) for slot, text in previous_queries.items())

        built = BuiltPaths()  # results handed out before keep their own tensors, codes and built paths
        with deferred_sigint():  # the store's load is all or nothing; then assignments
            self._store.load_state_dict(store, also_check=check)
            self._sessions, self._previous_queries, self._built, self._live_results = sessions, restored, built, []

    @_serialized
    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write :meth:`state_dict` to ``path`` atomically: into a temporary file beside it,
        flushed to disk, then renamed over ``path``, so a crash leaves the old file or the
        new one, never a torn one."""
        with atomic_path(path) as temporary:  # mapmatched_torch.core.files
            torch.save(self.state_dict(), temporary)

    @_serialized
    def load(self, path: Union[str, "os.PathLike[str]"], *, migrate: bool = False, legacy: bool = False) -> None:
        """Restore a file written by :meth:`save` (``torch.load(weights_only=True)``, then
        :meth:`load_state_dict`). A torn, truncated or edited file is refused with a
        MapMatchedValueError naming it, and the running server is untouched. Running out
        of memory while reading it raises MapMatchedResourceError (a ``MemoryError``),
        not the malformed-file error; the server is untouched then too. ``migrate`` and
        ``legacy``: as for :meth:`load_state_dict`."""
        try:
            state = torch.load(os.fspath(path), weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as error:
            if out_of_memory(error):
                raise MapMatchedResourceError(
                    f"out of memory while reading the server state file {os.fspath(path)!r} "
                    f"({os.path.getsize(path)} bytes): {error.__class__.__name__}: {error}; a resource failure, not a "
                    "damaged file: free memory and load it again; nothing was changed"
                ) from error
            raise MapMatchedValueError(
                f"cannot read the server state file {os.fspath(path)!r}: {error.__class__.__name__}: {error} "
                "(a torn, truncated or foreign file?); nothing was changed"
            ) from error
        try:
            self.load_state_dict(state, migrate=migrate, legacy=legacy)
        except MapMatchedValueError as error:
            raise MapMatchedValueError(f"{os.fspath(path)!r}: {error}") from error


def _check_slots(sessions: Dict[SessionId, int], decoder_state: Mapping[str, Any]) -> None:
    """Every session owns a distinct live slot of a (validated) decoder state, and every
    live slot has a session; else MapMatchedValueError."""
    free, allocated = set(decoder_state["free"]), decoder_state["allocated"]
    seen: Dict[int, SessionId] = {}
    for session_id, slot in sessions.items():
        if not 0 <= slot < allocated or slot in free:
            raise MapMatchedValueError(
                f"refusing the server state: session {session_id!r} holds slot {slot}, which the decoder "
                f"state does not have live (allocated {allocated}, free {sorted(free)}); nothing was changed"
            )
        if slot in seen:
            raise MapMatchedValueError(
                f"refusing the server state: sessions {seen[slot]!r} and {session_id!r} share slot {slot}; "
                "nothing was changed"
            )
        seen[slot] = session_id
    if len(seen) != allocated - len(free):
        raise MapMatchedValueError(
            f"refusing the server state: {allocated - len(free)} live slots but {len(seen)} sessions; nothing was changed"
        )


def _parsed_sessions(entries: Any) -> Dict[SessionId, int]:
    """The saved ``[session ID, slot]`` pairs as a dict (lists back to tuples)."""
    sessions: Dict[SessionId, int] = {}
    for session_id, slot in entries:
        session_id = _restored_id(session_id)
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise MapMatchedValueError(f"refusing the server state: session {session_id!r} has slot {slot!r}")
        if session_id in sessions:
            raise MapMatchedValueError(f"refusing the server state: session {session_id!r} appears twice")
        sessions[session_id] = slot
    return sessions


#: The entries of a format-3 state besides its checksum.
_STATE_KEYS = frozenset({"version", "options", "graph", "store", "sessions", "previous_queries", "graph_codes"})


def _entries_checksum(sessions: Any, previous_queries: Any) -> str:
    """SHA-256 of the saved session IDs by slot and previous queries of a format-2 state
    (``legacy=True``; format 3 has one checksum over everything)."""
    text = json.dumps([sessions, previous_queries], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _parsed_previous_queries(entries: Any, sessions: Dict[SessionId, int]) -> Dict[int, str]:
    """The saved ``[[slot, query text], ...]`` (absent in states saved before it existed):
    each slot a live session's, once, each text a non-empty string."""
    live = set(sessions.values())
    if not isinstance(entries, (list, tuple)):
        raise MapMatchedValueError(f"refusing the server state: previous_queries must be a list, got "
                                   f"{type(entries).__name__}; nothing was changed")
    parsed: Dict[int, str] = {}
    for entry in entries:
        previous = previous_query_of_entry(entry[1:]) if isinstance(entry, (list, tuple)) else None
        if not (previous is not None and type(entry[0]) is int and entry[0] in live and entry[0] not in parsed):
            raise MapMatchedValueError(f"refusing the server state: bad previous_queries entry {entry!r} (a live "
                                       f"session's slot, once, its query text and the vector searched for it, if "
                                       f"any); nothing was changed")
        parsed[entry[0]] = previous
    return parsed


#: What a session ID may be, for error messages.
_SESSION_ID_TYPES = ("a str, an int (numpy integers are taken as ints), a float, None, or a tuple of them (what a "
                     "saved server state restores with torch.load(weights_only=True))")


def _session_id_error(session_id: Any, part: Any, unhashable: bool = False) -> MapMatchedTypeError:
    """The MapMatchedTypeError of a refused session ID (``part``: the refused piece of it)."""
    inside = "" if part is session_id else f" inside {describe(session_id)}"
    why = ", which is unhashable" if unhashable else ""
    return MapMatchedTypeError(f"a session ID must be {_SESSION_ID_TYPES}; got {describe(part)}{inside}{why}")


def _session_key(session_id: Any, whole: Any = None) -> SessionId:
    """``session_id`` as the server keeps it: numpy (and other ``numbers.Integral``)
    integers as ``int``, so ``np.int64(3)`` opens session ``3``; else it must be a str, an
    int, a float, None or a (nested) tuple of them: what ``torch.load(...,
    weights_only=True)`` restores. Anything else is a MapMatchedTypeError (a ValueError
    and a TypeError) naming what is accepted and what was given."""
    whole = session_id if whole is None else whole
    if isinstance(session_id, tuple):
        return tuple(_session_key(part, whole) for part in session_id)
    if session_id is None or isinstance(session_id, (str, int, float)):
        return session_id
    if isinstance(session_id, numbers.Integral):
        return int(session_id)
    try:
        hash(session_id)
    except TypeError:
        raise _session_id_error(whole, session_id, unhashable=True) from None
    raise _session_id_error(whole, session_id)


def _plain_id(session_id: SessionId) -> Any:
    """A session ID as saved: tuples as lists."""
    return [_plain_id(part) for part in session_id] if isinstance(session_id, tuple) else session_id


def _restored_id(saved: Any) -> SessionId:
    """:func:`_plain_id` undone."""
    return tuple(_restored_id(part) for part in saved) if isinstance(saved, list) else saved


#: Row failures that :func:`_raise_row_error` words from the whole row (step_indexed).
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


