"""Serving many conversations at once: one batched decoding step for every new turn.

:class:`MapMatchedServer` keeps every open session's decoder state in one
:class:`~mapmatched_torch.streaming.SlotDecoder` on one device. ``step(turns)`` takes
the new turn of any subset of sessions (sessions of different lengths share the batch),
fills the distances from each session's previous turn in one call to the graph, runs
one batched M x M step (plus the uncommitted tail with a fixed lag), backtracks every
session on the device, and returns one :class:`~mapmatched_torch.models.RetrievalResult`
per session -- the same result an independent :class:`MapMatchedSession` gives.

A bad request (unknown session, empty candidates, NaN scores, duplicate IDs, an
overflowing score, a failing provider query) fails for that session alone: it is
reported in ``errors`` and leaves that session exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, List, Mapping, Optional, Tuple, Union

import torch

from ._validation import check_turn
from .errors import MapMatchedValueError
from .models import DecodedPath, DecodedStep, DecoderCandidate, RetrievalResult, RetrievalTrace, TraceStep
from .reporting import NONFINITE_MESSAGE
from .retrieval import MapMatchedRetriever, as_scored_candidates, finish_turn
from .scoring import normalize_candidates
from .streaming import SlotDecoder, report_step, step_distances, turn_tensors

__all__ = ["MapMatchedServer"]

SessionId = Hashable


@dataclass
class _Session:
    slot: int
    trellis: List[Tuple[DecoderCandidate, ...]] = field(default_factory=list)
    path: Optional[DecodedPath] = None
    trace: Optional[RetrievalTrace] = None


class MapMatchedServer:
    """Batched map-matched retrieval for many concurrent sessions on one device.

    Args:
        graph: the corpus graph (any ``CorpusGraph``; a tensor graph fills a batch's
            distances in one call).
        provider: optional ``CandidateProvider``; with one, :meth:`step` also accepts
            query strings (``retrieve_batch`` is used when the provider has it).
        device: where the decoder state lives (default CPU).
        dtype: of the dynamic program (float64: identical to the standalone decoder).
        capacity: initial number of session slots (grows by doubling).
        candidate_limit, emission_weight, transition_weight, score_normalization,
        fixed_lag, context_radius, context_limit: as for
            :class:`~mapmatched_torch.MapMatchedRetriever` (validated the same way).

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
        graph: Any,
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
        self._sessions: Dict[SessionId, _Session] = {}

    # ------------------------------------------------------------- sessions

    def open(self, session_id: SessionId) -> None:
        """Open a new, empty session (ValueError if the ID is already open)."""
        if session_id in self._sessions:
            raise MapMatchedValueError(f"session {session_id!r} is already open")
        hash(session_id)
        self._sessions[session_id] = _Session(self._decoder.allocate())

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

    def path(self, session_id: SessionId) -> Optional[DecodedPath]:
        """The session's latest decoded path (None before its first turn)."""
        return self._sessions[self._known(session_id)].path

    def trace(self, session_id: SessionId) -> Optional[RetrievalTrace]:
        """The session's latest trace (None before its first turn)."""
        return self._sessions[self._known(session_id)].trace

    def turn_count(self, session_id: SessionId) -> int:
        return len(self._sessions[self._known(session_id)].trellis)

    def _known(self, session_id: SessionId) -> SessionId:
        if session_id not in self._sessions:
            raise MapMatchedValueError(f"unknown session {session_id!r} (open it first)")
        return session_id

    # ----------------------------------------------------------------- a step

    def step(
        self, turns: Mapping[SessionId, Any]
    ) -> Tuple[Dict[SessionId, RetrievalResult], Dict[SessionId, Exception]]:
        """Decode one new turn for every session in ``turns``, in one batched pass.

        Args:
            turns: session ID -> that session's new candidates (``ScoredCandidate``
                objects or ``(chunk_id, score)`` pairs, provider order), or a query
                string when the server has a provider.

        Returns:
            ``(results, errors)``: each successful session's
            :class:`~mapmatched_torch.models.RetrievalResult`, and each failed
            session's exception (its state is unchanged).
        """
        errors: Dict[SessionId, Exception] = {}
        prepared = self._prepare(turns, errors)
        if not prepared:
            return {}, errors
        ids = list(prepared)
        sessions = [self._sessions[session_id] for session_id in ids]
        new_turns = [prepared[session_id] for session_id in ids]
        decoder = self._decoder
        scores, mask = turn_tensors(new_turns, decoder.width, self.device)
        distances = None
        if decoder.transition_weight != 0.0 and any(session.trellis for session in sessions):
            distances = step_distances(
                self.retriever.graph,
                [[c.chunk_id for c in session.trellis[-1]] if session.trellis else None for session in sessions],
                [[c.chunk_id for c in turn] for turn in new_turns],
                decoder.width,
                self.device,
            )
        slots = torch.tensor([session.slot for session in sessions], dtype=torch.long, device=self.device)
        out = decoder.step(slots, scores, mask, distances)
        ok_rows = out.ok.tolist()
        paths, path_distances = out.paths.tolist(), out.path_distances.tolist()
        finals = out.final_scores.double().tolist()
        reported = []  # (session ID, session, trellis, path, ranking) of the rows that decoded
        for row, (session_id, session, turn) in enumerate(zip(ids, sessions, new_turns)):
            if not ok_rows[row]:
                errors[session_id] = MapMatchedValueError(f"{NONFINITE_MESSAGE} at turn {len(session.trellis)}")
                continue
            trellis = session.trellis + [turn]
            path, ranking = report_step(
                trellis,
                paths[row],
                path_distances[row],
                finals[row],
                emission_weight=decoder.emission_weight,
                transition_weight=decoder.transition_weight,
                fixed_lag=decoder.fixed_lag,
                reuse=session.path.steps if session.path is not None else (),
            )
            reported.append((session_id, session, trellis, path, ranking))
        neighborhoods = self._neighborhoods([path.steps[-1].chunk_id for _, _, _, path, _ in reported])
        results: Dict[SessionId, RetrievalResult] = {}
        for (session_id, session, trellis, path, ranking), neighborhood in zip(reported, neighborhoods):
            result = finish_turn(
                self.retriever, trellis, path, ranking, session.path, session.trace, neighborhood=neighborhood
            )
            session.trellis, session.path, session.trace = trellis, path, result.trace
            results[session_id] = result
        return results, errors

    def _neighborhoods(self, chunk_ids: List[str]) -> List[Any]:
        """Every decoded chunk's context neighbourhood: one batched call when the graph
        has ``neighborhoods`` (a tensor graph), else None each (asked one at a time)."""
        batched = getattr(self.retriever.graph, "neighborhoods", None)
        if not chunk_ids or not callable(batched):
            return [None] * len(chunk_ids)
        return list(batched(chunk_ids, self.retriever.context_radius))

    def _prepare(self, turns: Mapping[SessionId, Any], errors: Dict[SessionId, Exception]) -> Dict[SessionId, tuple]:
        """Validate and normalize each session's request; failures go to ``errors``."""
        retriever = self.retriever
        requests = dict(turns)
        queries = {key: value for key, value in requests.items() if isinstance(value, str)}
        if queries:
            requests.update(self._retrieve(queries, errors))
        prepared: Dict[SessionId, tuple] = {}
        for session_id, request in requests.items():
            if session_id in errors:
                continue
            try:
                session = self._sessions[self._known(session_id)]
                kept = as_scored_candidates(request)[: retriever.candidate_limit]
                if not kept:
                    raise MapMatchedValueError(f"trellis turn {len(session.trellis)} must contain candidates")
                normalized = normalize_candidates(kept, retriever.score_normalization)
                prepared[session_id] = check_turn(normalized, len(session.trellis))
            except Exception as error:  # isolate the bad request
                errors[session_id] = error
        return prepared

    def _retrieve(self, queries: Dict[SessionId, str], errors: Dict[SessionId, Exception]) -> Dict[SessionId, Any]:
        provider, limit = self.retriever.provider, self.retriever.candidate_limit
        answers: Dict[SessionId, Any] = {}
        for session_id, query in queries.items():
            if provider is None:
                errors[session_id] = MapMatchedValueError(
                    "a query needs a CandidateProvider: pass provider= to MapMatchedServer, or send candidates"
                )
            elif not query.strip():
                errors[session_id] = MapMatchedValueError("query must be a non-empty string")
        pending = [key for key in queries if key not in errors]
        batch = getattr(provider, "retrieve_batch", None)
        if pending and callable(batch):
            try:
                for key, candidates in zip(pending, batch([queries[key] for key in pending], limit)):
                    answers[key] = candidates
                return answers
            except Exception:  # fall back to one query at a time to isolate the failure
                answers.clear()
        for key in pending:
            try:
                answers[key] = provider.retrieve(queries[key], limit)
            except Exception as error:
                errors[key] = error
        return answers

    # ------------------------------------------------------------ persistence

    def state_dict(self) -> Dict[str, Any]:
        """Every session's trellis, decoded path, trace and decoder state, and the
        options: plain tensors and Python values, loadable with
        ``torch.load(..., weights_only=True)``."""
        retriever = self.retriever
        return {
            "version": 1,
            "options": {
                "candidate_limit": retriever.candidate_limit,
                "emission_weight": retriever.emission_weight,
                "transition_weight": retriever.transition_weight,
                "score_normalization": retriever.score_normalization,
                "fixed_lag": retriever.fixed_lag,
                "context_radius": retriever.context_radius,
                "context_limit": retriever.context_limit,
            },
            "decoder": self._decoder.state_dict(),
            "sessions": [
                [
                    session_id,
                    session.slot,
                    [[[c.chunk_id, c.raw_score, c.normalized_score] for c in turn] for turn in session.trellis],
                    _path_state(session.path),
                    _trace_state(session.trace),
                ]
                for session_id, session in self._sessions.items()
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into a server built with the same options."""
        options = self.state_dict()["options"]
        if state.get("version") != 1 or state.get("options") != options:
            raise MapMatchedValueError(
                f"server state does not match this server: saved options {state.get('options')}, these {options}"
            )
        self._decoder.load_state_dict(state["decoder"])
        sessions: Dict[SessionId, _Session] = {}
        for session_id, slot, trellis, path, trace in state["sessions"]:
            session_id = tuple(session_id) if isinstance(session_id, list) else session_id
            sessions[session_id] = _Session(
                slot=int(slot),
                trellis=[tuple(DecoderCandidate(*candidate) for candidate in turn) for turn in trellis],
                path=_path_from_state(path),
                trace=_trace_from_state(trace),
            )
        self._sessions = sessions


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
    return DecodedPath(tuple(DecodedStep(*step) for step in steps), total, lag, committed)


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
