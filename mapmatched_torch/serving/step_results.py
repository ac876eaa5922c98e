"""What a :class:`~mapmatched_torch.serving.MapMatchedServer` step returns, built when it is read.

A step is tensor work (:meth:`~mapmatched_torch.serving.session_store.SessionStore.step`):
its outcome is one :class:`~mapmatched_torch.serving.session_store.TensorStep`, and every
session's turns live in the store's tensors. The Python objects of a
:class:`~mapmatched_torch.core.models.RetrievalResult` (candidates, decoded path, trace,
ranking, context) cost about 0.2 ms per session; :class:`StepResults` builds them on
first read, from the step's tensors and the store's turns (:class:`ServedTurn`, read
from the store when a result is built), with the same functions a
:class:`~mapmatched_torch.MapMatchedSession` uses, so a read result equals the
independent session's exactly. :meth:`StepResults.contexts` and
:meth:`StepResults.chunk_ids` read the tensors alone.

What is retained, and for how long: the server keeps a weak reference to each
:class:`StepResults` (pruned every step) and one :class:`BuiltPaths` entry per open
session (dropped when it closes). A :class:`StepResults` the caller holds keeps its
step's tensors, the chunk codes, context table and payload tensors of its step (a
compaction of the codes or a resize of the slot table installs new ones and leaves these
as they were, so a result read late names the right chunks), copies of the turns of its
sessions closed since (:meth:`StepResults.detach`) and the results it built: memory the
caller frees by dropping it.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core.models import (
    CandidateScore,
    DecodedPath,
    DecoderCandidate,
    RetrievalResult,
    RetrievalTrace,
    ScoredCandidate,
    trusted_constructor,
)
from ..core.path_reports import committed_through
from ..retrieval.turns import TurnOptions, check_revisions, turn_result, turn_trace
from ..retrieval.streaming import report_step
from .contexts import NeighborhoodCache
from .session_store import SessionStore, TensorStep, context_codes

__all__ = ["ServedTurn", "StoredTurns", "StepRecord", "BuiltPaths", "StepResults", "NeighborhoodCache"]

SessionId = Hashable

#: A turn's values were checked when it came in: its candidates are rebuilt unchecked.
_candidate = trusted_constructor(DecoderCandidate)
_scored = trusted_constructor(ScoredCandidate)


class ServedTurn(Sequence):
    """One turn of a served session: its candidates in provider order, as a sequence of
    :class:`DecoderCandidate` built when read.

    Args:
        raw, normalized: the candidates' raw and normalized scores (finite floats).
        ids: their chunk IDs, or None when ``nodes`` and ``names`` give them.
        nodes: their graph node indices (a tensor graph's), or None.
        names: the graph's chunk IDs by node index (``graph.nodes``), with ``nodes``.

    No :class:`DecoderCandidate` is kept: ``turn[i]`` and :attr:`candidates` build them
    anew. A served session keeps every turn for as long as it lives, and M candidate
    objects per turn would make each full garbage collection of a large server
    slower; results build only the candidates they read (the new turn's, and one per
    earlier turn along the path).
    """

    __slots__ = ("raw", "normalized", "nodes", "_ids", "_names")
    # Tuples of numbers, not lists: the collector stops tracking them, so a server's
    # long-lived state adds few objects to each full garbage collection.

    def __init__(
        self,
        raw: Tuple[float, ...],
        normalized: Tuple[float, ...],
        *,
        ids: Optional[Tuple[str, ...]] = None,
        nodes: Optional[Tuple[int, ...]] = None,
        names: Optional[Sequence[str]] = None,
    ) -> None:
        self.raw, self.normalized, self.nodes = raw, normalized, nodes
        self._ids, self._names = ids, names

    @classmethod
    def from_candidates(cls, candidates: Sequence[DecoderCandidate]) -> "ServedTurn":
        """A turn of validated candidates."""
        return cls(
            tuple(candidate.raw_score for candidate in candidates),
            tuple(candidate.normalized_score for candidate in candidates),
            ids=tuple(candidate.chunk_id for candidate in candidates),
        )

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: Union[int, slice]) -> Any:
        """Candidate ``index`` (built now), or a tuple of them for a slice."""
        if isinstance(index, slice):
            return self.candidates[index]
        return _candidate(self.chunk_id(index), self.raw[index], self.normalized[index])

    def __iter__(self) -> Iterator[DecoderCandidate]:
        return iter(self.candidates)

    def chunk_id(self, index: int) -> str:
        """The chunk ID of candidate ``index``."""
        return self._ids[index] if self._ids is not None else self._names[self.nodes[index]]

    @property
    def chunk_ids(self) -> Tuple[str, ...]:
        if self._ids is None:
            names = self._names
            self._ids = tuple(names[node] for node in self.nodes)
        return self._ids

    @property
    def candidates(self) -> Tuple[DecoderCandidate, ...]:
        """Every candidate, built now."""
        return tuple(map(_candidate, self.chunk_ids, self.raw, self.normalized))

    @property
    def scored(self) -> Tuple[ScoredCandidate, ...]:
        """Every candidate as the provider gave it (:class:`ScoredCandidate`, raw score),
        built now: a result's ``candidates``."""
        return tuple(map(_scored, self.chunk_ids, self.raw))


class StoredTurns(Sequence):
    """One session's first ``length`` turns, read from the session store's tensors (as
    :class:`ServedTurn` objects) the first time one is needed.

    Args:
        tensors: the store's ``(C, T, M)`` codes, raw and normalized payload tensors as
            they were at the step (a later step never rewrites these turns; a closed
            slot's rows are copied out before the slot is reused).
        slot, length: whose turns, and how many.
        names: code -> chunk ID (the server's :class:`~mapmatched_torch.serving.codes.ChunkCodes`).
    """

    __slots__ = ("_tensors", "_slot", "_length", "_names", "_turns")

    def __init__(self, tensors: Tuple[Tensor, Tensor, Tensor], slot: int, length: int, names: Any) -> None:
        self._tensors, self._slot, self._length, self._names = tensors, slot, length, names
        self._turns: Optional[List[ServedTurn]] = None

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        if self._turns is None:
            codes, raw, normalized = (tensor[self._slot, : self._length].tolist() for tensor in self._tensors)
            turns = []
            for turn_codes, turn_raw, turn_normalized in zip(codes, raw, normalized):
                count = sum(code >= 0 for code in turn_codes)
                turns.append(ServedTurn(
                    tuple(turn_raw[:count]), tuple(turn_normalized[:count]), nodes=tuple(turn_codes[:count]), names=self._names
                ))
            self._turns = turns
        return self._turns[index]


class StepRecord:
    """One session after one step: what its result is built from.

    Args:
        turns: the session's turns (at least ``length``; the first ``length`` are this
            step's trellis).
        length: T, the number of turns after the step.
        row: ``(T,)`` decoded candidate index of every turn.
        distances: ``(T,)`` graph distance into each turn along the path.
        finals: the new turn's forward scores (the ranking; non-finite: locked out).
        revised: the earlier turns whose decoded chunk this step changed.
        reuse: the previous step's ``(path, trace)`` when it was built: their steps
            are kept where the path is unchanged, as a session keeps them, so a result
            costs O(new and revised turns), not O(T).
        costs: ``(T,)`` a learned transition model's cost of the move into each turn
            along the path, or None for the fixed model.
    """

    __slots__ = ("turns", "length", "row", "distances", "finals", "revised", "costs", "_reuse", "_decoded", "_result")

    def __init__(
        self,
        turns: Sequence[ServedTurn],
        length: int,
        row: Tuple[int, ...],
        distances: Tuple[float, ...],
        finals: Tuple[float, ...],
        revised: Tuple[int, ...],
        reuse: Optional[Tuple[DecodedPath, RetrievalTrace]] = None,
        costs: Optional[Tuple[float, ...]] = None,
    ) -> None:
        self.turns, self.length, self.row, self.distances, self.finals = turns, length, row, distances, finals
        self.costs = costs
        self.revised, self._reuse = revised, reuse
        # (the new turn's candidates, path, ranking, trace)
        self._decoded: Optional[Tuple[tuple, DecodedPath, Optional[Tuple[CandidateScore, ...]], RetrievalTrace]] = None
        self._result: Optional[RetrievalResult] = None

    @property
    def built(self) -> bool:
        return self._result is not None

    def decoded(self, retriever: TurnOptions) -> Tuple[tuple, DecodedPath, Any, RetrievalTrace]:
        """``(new turn's candidates, path, ranking, trace)``, built on first call."""
        if self._decoded is None:
            # earlier turns as ServedTurns (one candidate built per turn read), the new
            # one as the tuple the result keeps
            last = self.turns[self.length - 1].candidates
            trellis: List[Sequence[DecoderCandidate]] = [*self.turns[: self.length - 1], last]
            previous_path, previous_trace = self._reuse if self._reuse is not None else (None, None)
            path, ranking = report_step(
                trellis, self.row, self.distances, self.finals,
                settings=retriever.settings,
                reuse=previous_path.steps if previous_path is not None else (),
                cost_row=self.costs,
            )
            revised = check_revisions(self.revised, committed_through(self.length - 1, retriever.settings.fixed_lag))
            self._decoded = (last, path, ranking, turn_trace(retriever, trellis, path, revised, previous_trace))
            self._reuse = None
        return self._decoded

    def result(self, retriever: TurnOptions, neighborhood: Optional[Sequence[str]]) -> RetrievalResult:
        """The step's :class:`RetrievalResult`, built on first call (``neighborhood``: the
        chunk IDs of the decoded chunk's context neighbourhood, or None to ask the graph)."""
        if self._result is None:
            _, path, ranking, trace = self.decoded(retriever)
            scored = self.turns[self.length - 1].scored
            self._result = turn_result(retriever, scored, path, ranking, trace, neighborhood)
        return self._result


class BuiltPaths:
    """The newest built ``(path, trace)`` of each slot, so the next step's result reuses
    their unchanged steps (a slot's entry is dropped when it closes)."""

    def __init__(self) -> None:
        self._built: Dict[int, Tuple[int, DecodedPath, RetrievalTrace]] = {}

    def get(self, slot: int, length: int) -> Optional[Tuple[DecodedPath, RetrievalTrace]]:
        entry = self._built.get(slot)
        return (entry[1], entry[2]) if entry is not None and entry[0] == length else None

    def put(self, slot: int, length: int, path: DecodedPath, trace: RetrievalTrace) -> None:
        entry = self._built.get(slot)
        if entry is None or entry[0] <= length:
            self._built[slot] = (length, path, trace)

    def drop(self, slot: int) -> None:
        self._built.pop(slot, None)


class StepResults(Mapping):
    """The sessions a step decoded -> their :class:`RetrievalResult`, each built on first read.

    A read result equals what an independent :class:`~mapmatched_torch.MapMatchedSession`
    returns for the same turns. Reading every result of a large step costs about
    0.2 ms per session; :meth:`chunk_id` / :meth:`chunk_ids` give the decoded chunks
    and :meth:`context_chunk_ids` / :meth:`contexts` the contexts without building
    anything else (:attr:`tensors` and :meth:`context_codes`: the same as tensors), and
    :meth:`materialize` builds every result with one batched neighbourhood search.

    Args:
        retriever: the server (its graph, settings and context options). store: its session store.
        step: the step's :class:`~mapmatched_torch.serving.session_store.TensorStep`.
        rows: each decoded session's row of ``step``.
        slots: ``(S,)`` each row's slot.
        built: the server's :class:`BuiltPaths`.
        lock: the server's lock: every read that touches the store (a record's turns,
            the built paths, the context table) holds it, so a read in one thread while
            another closes the session and its slot is reused reads the turns of this
            step, never the new session's (None: a lock of its own).
    """

    def __init__(
        self,
        retriever: TurnOptions,
        store: SessionStore,
        step: TensorStep,
        rows: Dict[SessionId, int],
        slots: Tensor,
        built: BuiltPaths,
        lock: Optional[Any] = None,
    ) -> None:
        self._lock = lock if lock is not None else threading.RLock()
        self._retriever, self._store, self.tensors, self._rows = retriever, store, step, rows
        self._slots, self._built = slots, built
        # what this step's results read, taken now: a later load_state_dict replaces the
        # store's codes, context table and tensors with new objects, never these
        self._codes, self._context_table, self._context_limit = store.codes, store.contexts, store.context_limit
        decoder = store.decoder
        self._payload = (decoder.payload("codes"), decoder.payload("raw"), decoder.payload("normalized"))
        self._detached: Dict[int, Tuple[Tensor, Tensor, Tensor]] = {}
        self._records: Dict[SessionId, StepRecord] = {}
        self._lists: Optional[Dict[str, list]] = None
        self._contexts: Optional[Tensor] = None

    # ------------------------------------------------------------- the mapping

    def __getitem__(self, session_id: SessionId) -> RetrievalResult:
        with self._lock:
            return self._get(session_id)

    def _get(self, session_id: SessionId) -> RetrievalResult:
        record = self.record(session_id)
        if record.built:
            return record.result(self._retriever, None)
        neighborhood = self._context_table.neighborhood_ids([self.chunk_id(session_id)])[0]
        return self._finish(session_id, record, neighborhood)

    def __iter__(self) -> Iterator[SessionId]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._rows

    def __repr__(self) -> str:
        built = sum(record.built for record in self._records.values())
        return f"StepResults({len(self._rows)} sessions, {built} built)"

    # ------------------------------------------------------------ no objects

    def chunk_id(self, session_id: SessionId) -> str:
        """The session's decoded chunk for this turn (nothing built)."""
        return self._codes.name(self._list("chunks")[self._rows[session_id]])

    def chunk_ids(self) -> Dict[SessionId, str]:
        """Every session's decoded chunk for this turn (nothing built)."""
        chunks, name = self._list("chunks"), self._codes.name
        return {session_id: name(chunks[row]) for session_id, row in self._rows.items()}

    def context_codes(self) -> Tensor:
        """``(S, C)`` long: every row's context as chunk codes (-1 padded; failed rows -1),
        computed on the device once."""
        with self._lock:
            return self._context_codes()

    def _context_codes(self) -> Tensor:
        if self._contexts is None:
            step = self.tensors
            if step.contexts is not None:
                self._contexts = step.contexts
            else:
                self._contexts = context_codes(
                    self._context_table, self._context_limit, step.chunks, step.candidates, step.status == 0
                )
        return self._contexts

    def context_chunk_ids(self, session_id: SessionId) -> Tuple[str, ...]:
        """The session's context (``result.context_chunk_ids``) without building the result."""
        return self.contexts([session_id])[session_id]

    def contexts(self, session_ids: Optional[Sequence[SessionId]] = None) -> Dict[SessionId, Tuple[str, ...]]:
        """The contexts of these sessions (default: all) as chunk IDs, and nothing else
        built: what a RAG server hands to its LLM."""
        keys = list(self._rows) if session_ids is None else list(session_ids)
        table = self.context_codes()
        rows = [self._rows[key] for key in keys]
        if not rows:
            return {}
        picked = table[torch.tensor(rows, dtype=torch.long, device=table.device)]
        return dict(zip(keys, self._codes.name_rows(picked)))

    # ---------------------------------------------------------------- records

    def record(self, session_id: SessionId) -> StepRecord:
        """The session's :class:`StepRecord` (made on first call, holding the lock: its
        turns are read from the store before another thread can close the slot)."""
        with self._lock:
            return self._record(session_id)

    def _record(self, session_id: SessionId) -> StepRecord:
        record = self._records.get(session_id)
        if record is None:
            row = self._rows[session_id]
            lists = self._row_lists()
            slot, length = lists["slots"][row], lists["lengths"][row]
            detached = self._detached.get(slot)
            tensors, source = (detached, 0) if detached is not None else (self._payload, slot)
            turns = StoredTurns(tensors, source, length, self._codes)
            count = len(turns[length - 1])
            revised = tuple(index for index, flag in enumerate(lists["revised"][row][:length]) if flag)
            reuse = self._built.get(slot, length - 1) if detached is None else None
            record = self._records[session_id] = StepRecord(
                turns, length, tuple(lists["path_index"][row][:length]), tuple(lists["distances"][row][:length]),
                tuple(lists["final_scores"][row][:count]), revised, reuse,
                tuple(lists["transitions"][row][:length]) if "transitions" in lists else None,
            )
        return record

    def _finish(self, session_id: SessionId, record: StepRecord, neighborhood: Optional[Sequence[str]]) -> RetrievalResult:
        result = record.result(self._retriever, neighborhood)
        self.build(session_id)
        return result

    def build(self, session_id: SessionId) -> None:
        """Build the session's path and trace now (they raise what a session raises) and
        keep them for the next step's reuse (not for a slot closed since: another session
        may hold it)."""
        with self._lock:
            self._build(session_id)

    def _build(self, session_id: SessionId) -> None:
        record = self.record(session_id)
        _, path, _, trace = record.decoded(self._retriever)
        slot = self._row_lists()["slots"][self._rows[session_id]]
        if slot not in self._detached:
            self._built.put(slot, record.length, path, trace)

    def materialize(self) -> Dict[SessionId, RetrievalResult]:
        """Every result, built now (the neighbourhoods in one batched call)."""
        with self._lock:
            return self._materialize()

    def _materialize(self) -> Dict[SessionId, RetrievalResult]:
        pending = [key for key in self._rows if not self.record(key).built]
        neighborhoods = self._context_table.neighborhood_ids([self.chunk_id(key) for key in pending])
        for key, neighborhood in zip(pending, neighborhoods):
            self._finish(key, self.record(key), neighborhood)
        return {key: self.record(key).result(self._retriever, None) for key in self._rows}

    def detach(self, slot: int) -> None:
        """Copy ``slot``'s turns out of the store (the server closes the slot, which may be
        reused): this step's results of it stay readable (the server calls it holding its lock)."""
        if slot in self._detached or slot not in self._row_lists()["slot_set"]:
            return
        self._detached[slot] = tuple(tensor[slot : slot + 1].clone() for tensor in self._payload)

    def _list(self, name: str) -> list:
        return self._row_lists()[name]

    def _row_lists(self) -> Dict[str, Any]:
        """The step's tensors as Python lists (once, on first need)."""
        if self._lists is None:
            step = self.tensors
            lists: Dict[str, Any] = {
                name: getattr(step, name).tolist()
                for name in ("chunks", "lengths", "path_index", "distances", "final_scores", "revised")
            }
            if getattr(self._retriever, "learned", None) is not None:  # a learned model's costs
                lists["transitions"] = step.transitions.tolist()
            lists["slots"] = self._slots.tolist()
            lists["slot_set"] = set(lists["slots"])
            self._lists = lists
        return self._lists
