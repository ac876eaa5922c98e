"""Serving many conversations at once: one batched decoding step for every new turn.

:class:`MapMatchedServer` keeps every open session's decoder state in one
:class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder` on one device. ``step(turns)`` takes
the new turn of any subset of sessions (sessions of different lengths share the batch),
fills the distances from each session's previous turn in one call to the graph, runs
one batched M x M step (plus the uncommitted tail with a fixed lag) and backtracks
every session on the device. ``step_indexed`` does the same for candidates given as
tensors of graph node indices (no Python object per candidate). Both return a
:class:`~mapmatched_torch.serving.step_results.StepResults` mapping whose
:class:`~mapmatched_torch.core.models.RetrievalResult` values, built when read, equal what
an independent :class:`MapMatchedSession` gives.

A bad request (unknown session, empty candidates, NaN scores, duplicate IDs, an
overflowing score, a failing provider query) fails for that session alone: it is
reported in ``errors`` and leaves that session exactly as it was.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from functools import wraps
from operator import attrgetter
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import (
    check_finite,
    check_positive_int,
    check_sequence,
    describe,
)
from ..core.errors import MapMatchedRuntimeError, MapMatchedTypeError, MapMatchedValueError
from ..core.models import DecodedPath, DecodedStep, DecoderCandidate, RetrievalTrace, ScoredCandidate, TraceStep
from ..core.path_reports import NONFINITE_MESSAGE
from ..core.protocols import CorpusGraph, implements, provider_answer
from ..graph.protocols import TensorGraph
from ..kernels.normalization import normalize_score_rows
from ..kernels.slot_decoder import SlotDecoder
from ..retrieval.session import MapMatchedRetriever, as_turn_candidates, normalize_turn, provider_answer_name
from ..retrieval.streaming import step_distances
from ..retrieval.trellis import packed_rows
from .step_results import NeighborhoodCache, ServedTurn, StepRecord, StepResults

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


def _large_scores(scores: torch.Tensor, emission_weight: float) -> torch.Tensor:
    """``(R,)`` bool: rows of ``(R, M)`` normalized scores beyond :data:`_LARGE_SCORE`."""
    return scores.abs().amax(1) * max(1.0, emission_weight) > _LARGE_SCORE


@dataclass
class _Session:
    slot: int
    turns: List[ServedTurn] = field(default_factory=list)
    record: Optional[StepRecord] = None  # the latest step's
    extreme: bool = False  # some turn's scores exceed _LARGE_SCORE


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
        neighborhood_cache: context neighbourhoods kept (an LRU, for tensor graphs).

    Results come back as :class:`~mapmatched_torch.serving.step_results.StepResults`: a mapping
    whose :class:`~mapmatched_torch.core.models.RetrievalResult` values are built when read
    (see :mod:`~mapmatched_torch.serving.step_results`).

    Concurrency: every public method holds one lock of the server (a ``threading.RLock``),
    so calls from several threads are serialized: one batch steps at a time, and a step
    is all or nothing for every session in it (a failure after the decoding step, even
    KeyboardInterrupt or an out-of-memory error, takes the whole step back with
    :meth:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder.undo_last`). Batch the
    sessions of one tick into one :meth:`step` rather than stepping from many threads.
    Results (:class:`StepResults`) are built lazily from immutable records, so reading
    them from another thread is safe. The graph's distance cache is safe under
    concurrent readers.

    Latency (``benchmarks/serving.py``, 2 CPU cores): a 1024-session step takes about
    40 ms with tensors in (:meth:`step_indexed`) and a warm distance cache, 50 ms with
    ``ScoredCandidate`` lists. Full garbage collections (150-300 ms: torch, numba and
    scipy hold ~345k tracked objects) are what a p99 sees; a long-running server calls
    ``gc.freeze()`` once after start-up, and reads only what it needs
    (:meth:`~mapmatched_torch.serving.step_results.StepResults.contexts`: no result objects).

    Example:
        >>> from mapmatched_torch import InMemoryCorpusGraph, ScoredCandidate
        >>> server = MapMatchedServer(InMemoryCorpusGraph.from_edges([("a", "b")]))
        >>> server.open("alice"); server.open("bob")
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
    ) -> None:
        self.retriever = MapMatchedRetriever(
            graph,
            provider=provider,
            candidate_limit=candidate_limit,
            emission_weight=emission_weight,
            transition_weight=transition_weight,
            score_normalization=score_normalization,
            fixed_lag=fixed_lag,
            context_radius=context_radius,
            context_limit=context_limit,
        )
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._decoder = SlotDecoder(
            candidate_limit,
            emission_weight=self.retriever.emission_weight,
            transition_weight=self.retriever.transition_weight,
            fixed_lag=self.retriever.fixed_lag,
            capacity=capacity,
            dtype=dtype,
            device=self.device,
        )
        self._neighborhoods = NeighborhoodCache(
            graph, self.retriever.context_radius, check_positive_int(neighborhood_cache, "neighborhood_cache")
        )
        self._sessions: Dict[SessionId, _Session] = {}
        self._lock = threading.RLock()  # one call at a time: see "Concurrency" above
        # (chunk IDs -> node indices, node names) of a tensor graph, for _served_turn
        self._node_lookup = (graph.vocabulary.indices_of, graph.nodes) if implements(graph, TensorGraph) else None

    # ------------------------------------------------------------- sessions

    @_serialized
    def open(self, session_id: SessionId) -> None:
        """Open a new, empty session (ValueError if the ID is already open)."""
        if self._is_open(session_id):
            raise MapMatchedValueError(f"session {session_id!r} is already open")
        self._sessions[session_id] = _Session(self._decoder.allocate())

    @_serialized
    def close(self, session_id: SessionId) -> None:
        """Close a session and free its slot (ValueError if it is not open)."""
        session = self._sessions.pop(self._known(session_id), None)
        self._decoder.release(session.slot)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def session_ids(self) -> Tuple[SessionId, ...]:
        return tuple(self._sessions)

    @_serialized
    def path(self, session_id: SessionId) -> Optional[DecodedPath]:
        """The session's latest decoded path (None before its first turn)."""
        record = self._sessions[self._known(session_id)].record
        return record.decoded(self.retriever)[1] if record is not None else None

    @_serialized
    def trace(self, session_id: SessionId) -> Optional[RetrievalTrace]:
        """The session's latest trace (None before its first turn)."""
        record = self._sessions[self._known(session_id)].record
        return record.decoded(self.retriever)[3] if record is not None else None

    @_serialized
    def turn_count(self, session_id: SessionId) -> int:
        return len(self._sessions[self._known(session_id)].turns)

    def _known(self, session_id: SessionId) -> SessionId:
        if not self._is_open(session_id):
            raise MapMatchedValueError(f"unknown session {session_id!r} (open it first)")
        return session_id

    def _is_open(self, session_id: Any) -> bool:
        """Whether ``session_id`` is open; MapMatchedTypeError (a ValueError and a
        TypeError) if it cannot be one (unhashable)."""
        try:
            return session_id in self._sessions
        except TypeError:
            raise MapMatchedTypeError(
                f"a session ID must be hashable (a str, an int or a tuple of them), got {describe(session_id)}"
            ) from None

    # ----------------------------------------------------------------- a step

    @_serialized
    def step(self, turns: Mapping[SessionId, Any]) -> Tuple[StepResults, Dict[SessionId, Exception]]:
        """Decode one new turn for every session in ``turns``, in one batched pass.

        Args:
            turns: session ID -> that session's new candidates (``ScoredCandidate``
                objects or ``(chunk_id, score)`` pairs, provider order), or a query
                string when the server has a provider.

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
        prepared, codes, normalized = self._prepare(turns, errors)
        return self._decode(prepared, codes, errors, normalized), errors

    @_serialized
    def step_indexed(
        self, session_ids: Sequence[SessionId], candidates: torch.Tensor, scores: torch.Tensor
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

        Cost: the checks and the decoding are tensor operations; per session there
        remain two ``math.fsum`` sums (exact normalization) and a few small Python
        objects, about 10 microseconds; results are built when read.
        """
        errors: Dict[SessionId, Exception] = {}
        prepared, codes, normalized = self._prepare_indexed(session_ids, candidates, scores, errors)
        return self._decode(prepared, codes, errors, normalized), errors

    def _decode(
        self,
        prepared: Dict[SessionId, ServedTurn],
        codes: Optional[torch.Tensor],
        errors: Dict[SessionId, Exception],
        scores: Optional[torch.Tensor],
    ) -> StepResults:
        """One batched decoding step of the prepared sessions; commits the rows that decode
        (failures go to ``errors``). ``codes``: (S, M) node indices of the new turns
        (padding -1) or None (distances by chunk ID); ``scores``: (S, M) their
        normalized scores (padding 0.0), or None when no session is prepared."""
        records: Dict[SessionId, StepRecord] = {}
        if prepared:
            ids = list(prepared)
            sessions = [self._sessions[session_id] for session_id in ids]
            new_turns = [prepared[session_id] for session_id in ids]
            decoder = self._decoder
            lengths = torch.tensor([len(turn) for turn in new_turns], dtype=torch.long)
            mask = (torch.arange(decoder.width).unsqueeze(0) < lengths.unsqueeze(1)).to(self.device)
            scores = scores.to(self.device)
            distances = None
            if decoder.mode.uses_distances and any(session.turns for session in sessions):
                distances = self._distances(sessions, new_turns, codes)
            # A session with scores so large that a trace margin or entropy may overflow
            # (never with z-scores) has its path and trace built now, as a session
            # would: a turn that fails there is rolled back.
            large = _large_scores(scores, decoder.emission_weight).tolist()
            eager = [session.extreme or extreme for session, extreme in zip(sessions, large)]
            snapshots = {session.slot: decoder.snapshot(session.slot) for session, now in zip(sessions, eager) if now}
            slots = torch.tensor([session.slot for session in sessions], dtype=torch.long, device=self.device)
            out = decoder.step(slots, scores, mask, distances)
            touched: List[Tuple[_Session, int, Optional[StepRecord], bool]] = []
            try:  # all or nothing: anything raised below (even KeyboardInterrupt) takes the step back
                ok_rows = out.ok.tolist()
                # flat lists, sliced per row: a nested tolist() would leave S lists alive
                # through the step, promoting them into the collector's oldest generation
                turns_wide, width = out.paths.shape[1], out.final_scores.shape[1]
                paths, path_distances = out.paths.reshape(-1).tolist(), out.path_distances.reshape(-1).tolist()
                finals = out.final_scores.double().reshape(-1).tolist()
                for row, (session_id, session, turn) in enumerate(zip(ids, sessions, new_turns)):
                    touched.append((session, len(session.turns), session.record, session.extreme))
                    length = len(session.turns) + 1
                    if ok_rows[row]:
                        previous = session.record
                        session.turns.append(turn)
                        session.record = StepRecord(
                            session.turns, length, tuple(paths[row * turns_wide:row * turns_wide + length]),
                            tuple(path_distances[row * turns_wide:row * turns_wide + length]),
                            tuple(finals[row * width:row * width + len(turn)]),
                            previous.row if previous is not None else None,
                            previous.successor_reuse() if previous is not None else None,
                        )
                        try:
                            if eager[row]:
                                session.record.decoded(self.retriever)
                        except Exception as error:  # the turn a session would refuse
                            session.turns.pop()
                            session.record = previous
                            errors[session_id] = error
                        else:
                            session.extreme = eager[row]
                            records[session_id] = session.record
                            continue
                    else:
                        errors[session_id] = MapMatchedValueError(f"{NONFINITE_MESSAGE} at turn {length - 1}")
                    if session.slot in snapshots:
                        decoder.restore(session.slot, snapshots[session.slot])
            except BaseException:
                decoder.undo_last()
                for session, count, record, extreme in touched:
                    del session.turns[count:]
                    session.record, session.extreme = record, extreme
                raise
        return StepResults(self.retriever, records, self._neighborhoods)

    def _distances(
        self, sessions: List[_Session], new_turns: List[ServedTurn], codes: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """(S, M, M) distances from each session's last turn to its new one: by node
        index in one graph call when every turn has them, else by chunk ID."""
        graph, width = self.retriever.graph, self._decoder.width
        previous = [session.turns[-1] if session.turns else None for session in sessions]
        if codes is not None and all(turn is None or turn.nodes is not None for turn in previous):
            rows = packed_rows([turn.nodes if turn is not None else () for turn in previous], width, -1, torch.long)
            # shape: (S, 2, M) each session's last and new turn -> (S, M, M)
            chunk_index = torch.stack([rows.to(codes.device), codes], 1)
            return graph.trellis_distances(chunk_index)[:, 0].to(self.device)
        return step_distances(
            graph,
            [turn.chunk_ids if turn is not None else None for turn in previous],
            [turn.chunk_ids for turn in new_turns],
            width,
            self.device,
        )

    def _prepare(
        self, turns: Mapping[SessionId, Any], errors: Dict[SessionId, Exception]
    ) -> Tuple[Dict[SessionId, ServedTurn], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Validate and normalize each session's request (failures go to ``errors``);
        returns the turns, their (S', M) node indices when every candidate is a node of
        a tensor graph (else None; padding -1) and their (S', M) normalized scores.

        Clean turns are normalized together (:func:`normalize_score_rows`, bit for bit
        :func:`normalize_scores`); a turn with a repeated chunk ID or a non-finite
        normalized score is re-run through the session's own functions, which raise
        the error a session would."""
        retriever, width = self.retriever, self._decoder.width
        requests = _as_requests(turns)
        queries = {key: value for key, value in requests.items() if isinstance(value, str)}
        if queries:
            requests.update(self._retrieve(queries, errors))
        listed: List[Tuple[SessionId, int, Tuple[ScoredCandidate, ...]]] = []
        answer = provider_answer_name(retriever.provider) if queries else ""
        for session_id, request in requests.items():
            if session_id in errors:
                continue
            try:
                session = self._sessions[self._known(session_id)]
                what = answer if session_id in queries else "candidates"
                kept = as_turn_candidates(request, len(session.turns), what)[: retriever.candidate_limit]
                if not kept:
                    normalize_turn(kept, retriever.score_normalization, len(session.turns))  # the session's error
                listed.append((session_id, len(session.turns), kept))
            except Exception as error:  # isolate the bad request
                errors[session_id] = error
        if not listed:
            return {}, None, None
        # shape: (S, M) raw scores, zero-padded, normalized at once
        ids = [list(map(_CHUNK_ID, kept)) for _, _, kept in listed]
        raw_rows = [list(map(_SCORE, kept)) for _, _, kept in listed]
        counts = [len(row) for row in raw_rows]
        raw = packed_rows(raw_rows, width, 0.0, torch.float64)
        normalized = normalize_score_rows(raw, counts, retriever.score_normalization)
        clean = torch.isfinite(normalized).all(1).tolist()  # padding is 0.0
        normalized_rows = normalized.tolist()
        prepared: Dict[SessionId, ServedTurn] = {}
        kept_rows: List[int] = []
        all_nodes = True
        for row, (session_id, turn_index, kept) in enumerate(listed):
            count = counts[row]
            try:
                row_raw, row_normalized = raw_rows[row], normalized_rows[row][:count]
                if not clean[row] or len(set(ids[row])) != count:
                    # the session's own functions: they raise its error for this turn
                    checked = ServedTurn.from_candidates(
                        normalize_turn(kept, retriever.score_normalization, turn_index)
                    )
                    row_raw, row_normalized = checked.raw, checked.normalized
                    normalized[row, :count] = torch.tensor(row_normalized, dtype=torch.float64)
                turn = prepared[session_id] = self._served_turn(tuple(row_raw), tuple(row_normalized), tuple(ids[row]))
                all_nodes = all_nodes and turn.nodes is not None
                kept_rows.append(row)
            except Exception as error:  # isolate the bad request
                errors[session_id] = error
        codes = None
        if all_nodes and kept_rows:  # shape: (S', M), -1 padding
            codes = packed_rows([prepared[listed[row][0]].nodes for row in kept_rows], width, -1, torch.long)
            codes = codes.to(retriever.graph.device)
        return prepared, codes, normalized[kept_rows]

    def _served_turn(self, raw: Tuple[float, ...], normalized: Tuple[float, ...], ids: Tuple[str, ...]) -> ServedTurn:
        """A checked turn, with its node indices when every ID is a node of a tensor graph
        (its distances then take the node-index path)."""
        if self._node_lookup is not None:
            indices_of, names = self._node_lookup
            nodes = indices_of(ids)
            if min(nodes) >= 0:
                return ServedTurn(raw, normalized, ids=ids, nodes=tuple(nodes), names=names)
        return ServedTurn(raw, normalized, ids=ids)

    def _prepare_indexed(
        self,
        session_ids: Sequence[SessionId],
        candidates: torch.Tensor,
        scores: torch.Tensor,
        errors: Dict[SessionId, Exception],
    ) -> Tuple[Dict[SessionId, ServedTurn], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """:meth:`_prepare` for :meth:`step_indexed`: the checks and the normalization on
        tensors; returns the turns, their (S', M) codes and normalized scores."""
        graph, retriever, width = self.retriever.graph, self.retriever, self._decoder.width
        if not implements(graph, TensorGraph):
            raise MapMatchedValueError(
                f"step_indexed needs a tensor corpus graph (node indices); this server's graph is {type(graph).__name__}"
            )
        names, nodes = graph.nodes, graph.num_nodes
        ids = list(check_sequence(session_ids, "step_indexed session_ids", "a sequence of session IDs (one per row)"))
        for session_id in ids:
            self._is_open(session_id)  # hashable, or MapMatchedTypeError
        if not isinstance(candidates, torch.Tensor) or not isinstance(scores, torch.Tensor):
            raise MapMatchedTypeError(
                f"step_indexed takes a sequence of session IDs and two (S, K) tensors; got candidates "
                f"{describe(candidates)} and scores {describe(scores)}"
            )
        if candidates.dim() != 2 or candidates.dtype != torch.long or scores.shape != candidates.shape:
            raise MapMatchedValueError(
                f"candidates must be an (S, K) int64 tensor and scores a float tensor of its shape; got "
                f"{candidates.dtype} {tuple(candidates.shape)} and {scores.dtype} {tuple(scores.shape)}"
            )
        if not scores.is_floating_point() or candidates.shape[0] != len(ids):
            raise MapMatchedValueError(
                f"scores must be floating ({scores.dtype}) and there must be one row per session "
                f"({candidates.shape[0]} rows, {len(ids)} sessions)"
            )
        # shape: (S, K) on the CPU for the row checks; as in a session, every candidate is
        # checked (range, padding, finite score) before the cut at candidate_limit
        every, every_raw = candidates.cpu(), scores.cpu().double()
        listed_real = every >= 0
        listed_count = listed_real.sum(1)
        out_of_range = ((every < -1) | (every >= nodes)).any(1)
        gapped = (listed_real != (torch.arange(every.shape[1]).unsqueeze(0) < listed_count.unsqueeze(1))).any(1)
        nonfinite = (listed_real & ~torch.isfinite(every_raw)).any(1)
        # shape: (S, K') the kept columns; a repeated index among them is an error
        index, raw = every[:, :width], every_raw[:, :width]
        real = index >= 0
        counts = real.sum(1)
        ordered = index.sort(1).values
        repeated = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(1)
        flagged = (out_of_range | gapped | repeated | nonfinite).tolist()
        count_list = counts.tolist()
        # shape: (S, K') every clean row normalized at once (a flagged row as empty)
        normalized = normalize_score_rows(
            raw, [0 if bad else count for bad, count in zip(flagged, count_list)], retriever.score_normalization
        )
        overflowed = (~torch.isfinite(normalized)).any(1).tolist()  # padding is 0.0
        # flat lists sliced per row (see _decode)
        columns = index.shape[1]
        index_flat, raw_flat = index.reshape(-1).tolist(), raw.reshape(-1).tolist()
        normalized_flat = normalized.reshape(-1).tolist()
        listed = Counter(ids)
        prepared: Dict[SessionId, ServedTurn] = {}
        kept_rows: List[int] = []
        for row, session_id in enumerate(ids):
            try:
                if listed[session_id] > 1:
                    raise MapMatchedValueError(f"session {session_id!r} is listed more than once in one step")
                turn_index = len(self._sessions[self._known(session_id)].turns)
                count = count_list[row]
                if flagged[row]:
                    _raise_row_error(every[row].tolist(), every_raw[row].tolist(), count, nodes, names, turn_index)
                if not count:
                    normalize_turn((), retriever.score_normalization, turn_index)  # the session's error
                first = row * columns
                turn_nodes, turn_normalized = index_flat[first:first + count], normalized_flat[first:first + count]
                if overflowed[row]:
                    position = next(i for i, value in enumerate(turn_normalized) if not math.isfinite(value))
                    check_finite(
                        turn_normalized[position],
                        f"trellis turn {turn_index} candidate {names[turn_nodes[position]]!r} normalized_score",
                    )
                prepared[session_id] = ServedTurn(
                    tuple(raw_flat[first:first + count]), tuple(turn_normalized), nodes=tuple(turn_nodes), names=names
                )
                kept_rows.append(row)
            except Exception as error:  # isolate the bad row
                errors[session_id] = error
        if not kept_rows:
            return prepared, None, None
        # shape: (S', M) the kept rows' codes (-1 padding) and normalized scores (0.0 padding)
        codes = torch.full((len(kept_rows), width), -1, dtype=torch.long)
        codes[:, : index.shape[1]] = index[kept_rows]
        scores = torch.zeros((len(kept_rows), width), dtype=torch.float64)
        scores[:, : index.shape[1]] = normalized[kept_rows]
        return prepared, codes.to(graph.device), scores

    def _retrieve(self, queries: Dict[SessionId, str], errors: Dict[SessionId, Exception]) -> Dict[SessionId, Any]:
        provider, limit = self.retriever.provider, self.retriever.candidate_limit
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
                answers[key] = provider_answer(provider)[1](queries[key], limit)
            except Exception as error:
                errors[key] = error
        return answers

    # ------------------------------------------------------------ persistence

    @_serialized
    def state_dict(self) -> Dict[str, Any]:
        """Every session's trellis, decoded path, trace and decoder state, and the
        options: plain tensors and Python values, loadable with
        ``torch.load(..., weights_only=True)``."""
        return {
            "version": 1,
            "options": self._options(),
            "decoder": self._decoder.state_dict(),
            "sessions": [
                [
                    session_id,
                    session.slot,
                    [[list(candidate) for candidate in zip(turn.chunk_ids, turn.raw, turn.normalized)]
                     for turn in session.turns],
                    _path_state(self.path(session_id)),
                    _trace_state(self.trace(session_id)),
                ]
                for session_id, session in self._sessions.items()
            ],
        }

    def _options(self) -> Dict[str, Any]:
        """The options a saved state must match (what :meth:`state_dict` records)."""
        retriever = self.retriever
        return {
            "candidate_limit": retriever.candidate_limit,
            "emission_weight": retriever.emission_weight,
            "transition_weight": retriever.transition_weight,
            "score_normalization": retriever.score_normalization,
            "fixed_lag": retriever.fixed_lag,
            "context_radius": retriever.context_radius,
            "context_limit": retriever.context_limit,
        }

    @_serialized
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into a server built with the same options.

        Everything is validated before anything changes (the options, each session's
        record, the decoder's tensors and checksum, and that every session owns a
        distinct live slot whose turn count matches its trellis): a refused state
        raises :class:`~mapmatched_torch.core.errors.MapMatchedValueError` and leaves the
        running server exactly as it was.
        """
        options = self._options()
        if not isinstance(state, Mapping) or state.get("version") != 1 or state.get("options") != options:
            saved = state.get("options") if isinstance(state, Mapping) else type(state).__name__
            raise MapMatchedValueError(f"server state does not match this server: saved options {saved}, these {options}")
        try:
            sessions = self._parsed_sessions(state["sessions"])
        except MapMatchedValueError:
            raise
        except Exception as error:  # a malformed entry: say so, change nothing
            raise MapMatchedValueError(f"refusing the server state: malformed sessions ({error!r}); nothing was changed") from error
        self._decoder.load_state_dict(state.get("decoder"), also_check=lambda checked: _check_slots(sessions, checked))
        self._sessions = sessions

    def _parsed_sessions(self, entries: Any) -> Dict[SessionId, _Session]:
        """The saved sessions as :class:`_Session` objects (nothing is changed here)."""
        sessions: Dict[SessionId, _Session] = {}
        for session_id, slot, trellis, path, trace in entries:
            session_id = tuple(session_id) if isinstance(session_id, list) else session_id
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise MapMatchedValueError(f"refusing the server state: session {session_id!r} has slot {slot!r}")
            turns = []
            for turn in trellis:
                checked = ServedTurn.from_candidates(tuple(DecoderCandidate(*candidate) for candidate in turn))
                turns.append(self._served_turn(checked.raw, checked.normalized, checked.chunk_ids))
            path, trace = _path_from_state(path), _trace_from_state(trace)
            record = StepRecord.restored(turns, path, trace) if path is not None else None
            magnitudes = torch.tensor([[max(map(abs, turn.normalized))] for turn in turns], dtype=torch.float64)
            extreme = bool(_large_scores(magnitudes.view(-1, 1), self.retriever.emission_weight).any())
            if session_id in sessions:
                raise MapMatchedValueError(f"refusing the server state: session {session_id!r} appears twice")
            sessions[session_id] = _Session(slot=slot, turns=turns, record=record, extreme=extreme)
        return sessions

    @_serialized
    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write :meth:`state_dict` to ``path`` atomically: into a temporary file beside it,
        flushed to disk, then renamed over ``path``, so a crash leaves the old file or the
        new one, never a torn one."""
        target = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(target))
        handle, temporary = tempfile.mkstemp(prefix=".mapmatched-server-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(handle, "wb") as stream:
                torch.save(self.state_dict(), stream)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    @_serialized
    def load(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Restore a file written by :meth:`save` (``torch.load(weights_only=True)``, then
        :meth:`load_state_dict`). A torn, truncated or edited file is refused with a
        MapMatchedValueError naming it, and the running server is untouched."""
        try:
            state = torch.load(os.fspath(path), weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as error:
            raise MapMatchedValueError(
                f"cannot read the server state file {os.fspath(path)!r}: {error.__class__.__name__}: {error} "
                "(a torn, truncated or foreign file?); nothing was changed"
            ) from error
        try:
            self.load_state_dict(state)
        except MapMatchedValueError as error:
            raise MapMatchedValueError(f"{os.fspath(path)!r}: {error}") from error


def _check_slots(sessions: Dict[SessionId, _Session], decoder_state: Mapping[str, Any]) -> None:
    """Every session owns a distinct live slot of a (validated) decoder state, whose
    length is the session's turn count; else MapMatchedValueError."""
    free, allocated = set(decoder_state["free"]), decoder_state["allocated"]
    lengths = decoder_state["tensors"]["lengths"]
    seen: Dict[int, SessionId] = {}
    for session_id, session in sessions.items():
        slot = session.slot
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
        if int(lengths[slot]) != len(session.turns):
            raise MapMatchedValueError(
                f"refusing the server state: session {session_id!r} has {len(session.turns)} turns but its "
                f"slot {slot} holds {int(lengths[slot])}; nothing was changed"
            )


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


_STEP_FIELDS = tuple(DecodedStep.__dataclass_fields__)
_TRACE_FIELDS = tuple(TraceStep.__dataclass_fields__)


def _path_state(path: Optional[DecodedPath]) -> Optional[list]:
    if path is None:
        return None
    steps = [[getattr(step, name) for name in _STEP_FIELDS] for step in path.steps]
    return [steps, path.total_score, path.fixed_lag, path.committed_through_index]


def _path_from_state(state: Optional[list]) -> Optional[DecodedPath]:
    if state is None:
        return None
    steps, total, lag, committed = state
    decoded = tuple(DecodedStep(*step) for step in steps)
    return DecodedPath(decoded, tuple(step.chunk_id for step in decoded), total, lag, committed)


def _trace_state(trace: Optional[RetrievalTrace]) -> Optional[list]:
    if trace is None:
        return None
    steps = [[getattr(step, name) for name in _TRACE_FIELDS] for step in trace.steps]
    return [steps, list(trace.path_chunk_ids), list(trace.revised_prior_indices), trace.fixed_lag, trace.committed_through_index]


def _trace_from_state(state: Optional[list]) -> Optional[RetrievalTrace]:
    if state is None:
        return None
    steps, chunk_ids, revised, lag, committed = state
    return RetrievalTrace(tuple(TraceStep(*step) for step in steps), tuple(chunk_ids), tuple(revised), lag, committed)
