"""What a :class:`~mapmatched_torch.serving.MapMatchedServer` step keeps per session,
and the results it returns, built when they are read.

A step of S sessions does its per-session work in bulk: tensors for the decoder, one
``tolist()`` per output. What a session keeps is small: its turns as
:class:`ServedTurn` (chunk IDs or graph node indices, raw and normalized scores) and
one :class:`StepRecord` per step (the decoded candidate of every turn, the distances
along the path, the final turn's forward scores). The Python objects of a
:class:`~mapmatched_torch.core.models.RetrievalResult` (candidates, decoded path, trace,
ranking, context) cost about 0.2 ms per session; :class:`StepResults` builds them on
first read, with the same functions a :class:`~mapmatched_torch.MapMatchedSession`
uses, so a read result equals the independent session's exactly. The context
neighbourhood of the decoded chunk is asked of the graph when the result is read.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

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
from ..core.protocols import CorpusGraph, implements
from ..graph.protocols import NeighborhoodGraph
from ..retrieval.session import MapMatchedRetriever, context_chunk_ids, revised_turns, turn_result, turn_trace
from ..retrieval.streaming import report_step

__all__ = ["ServedTurn", "StepRecord", "StepResults", "NeighborhoodCache"]

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


class StepRecord:
    """One session after one step: what its result is built from.

    Args:
        turns: the session's turns (a list that only grows; the first ``length`` are
            this step's trellis).
        length: T, the number of turns after the step.
        row: ``(T,)`` decoded candidate index of every turn.
        distances: ``(T,)`` graph distance into each turn along the path.
        finals: the new turn's forward scores (the ranking; non-finite: locked out).
        previous_row: the previous step's ``row`` (None at the first turn), for the
            revised turns.
        reuse: the previous step's ``(path, trace)`` when it was built: their steps
            are kept where the path is unchanged, as a session keeps them, so a result
            costs O(new and revised turns), not O(T).
    """

    __slots__ = ("turns", "length", "row", "distances", "finals", "previous_row", "_reuse", "_decoded", "_result")

    def __init__(
        self,
        turns: List[ServedTurn],
        length: int,
        row: Tuple[int, ...],
        distances: Tuple[float, ...],
        finals: Tuple[float, ...],
        previous_row: Optional[Tuple[int, ...]],
        reuse: Optional[Tuple[DecodedPath, RetrievalTrace]] = None,
    ) -> None:
        self.turns, self.length, self.row, self.distances, self.finals = turns, length, row, distances, finals
        self.previous_row, self._reuse = previous_row, reuse
        # (the new turn's candidates, path, ranking, trace)
        self._decoded: Optional[Tuple[tuple, DecodedPath, Optional[Tuple[CandidateScore, ...]], RetrievalTrace]] = None
        self._result: Optional[RetrievalResult] = None

    @classmethod
    def restored(cls, turns: List[ServedTurn], path: DecodedPath, trace: RetrievalTrace) -> "StepRecord":
        """The record of a saved session (its path and trace as saved; no result)."""
        row = tuple(turn.chunk_ids.index(step.chunk_id) for turn, step in zip(turns, path.steps))
        record = cls(turns, len(turns), row, tuple(step.graph_distance for step in path.steps), (), None)
        record._decoded = (turns[-1].candidates, path, None, trace)
        return record

    def successor_reuse(self) -> Optional[Tuple[DecodedPath, RetrievalTrace]]:
        """What the next step's record may reuse: this path and trace, if built."""
        return (self._decoded[1], self._decoded[3]) if self._decoded is not None else None

    @property
    def chunk_id(self) -> str:
        """The decoded chunk of the step's turn (no objects built)."""
        return self.turns[self.length - 1].chunk_id(self.row[self.length - 1])

    @property
    def built(self) -> bool:
        return self._result is not None

    def decoded(self, retriever: MapMatchedRetriever) -> Tuple[tuple, DecodedPath, Any, RetrievalTrace]:
        """``(new turn's candidates, path, ranking, trace)``, built on first call."""
        if self._decoded is None:
            # earlier turns as ServedTurns (one candidate built per turn read), the new
            # one as the tuple the result keeps
            last = self.turns[self.length - 1].candidates
            trellis: List[Sequence[DecoderCandidate]] = [*self.turns[: self.length - 1], last]
            previous_path, previous_trace = self._reuse if self._reuse is not None else (None, None)
            path, ranking = report_step(
                trellis, self.row, self.distances, self.finals,
                emission_weight=retriever.emission_weight,
                transition_weight=retriever.transition_weight,
                fixed_lag=retriever.fixed_lag,
                reuse=previous_path.steps if previous_path is not None else (),
            )
            revised: Tuple[int, ...] = ()
            if self.previous_row is not None:
                previous = [self.turns[turn].chunk_id(index) for turn, index in enumerate(self.previous_row)]
                revised = revised_turns(previous, committed_through(len(previous), retriever.fixed_lag), path.chunk_ids)
            self._decoded = (last, path, ranking, turn_trace(retriever, trellis, path, revised, previous_trace))
            self._reuse = None
        return self._decoded

    def result(self, retriever: MapMatchedRetriever, neighborhood: Optional[Sequence[str]]) -> RetrievalResult:
        """The step's :class:`RetrievalResult`, built on first call (``neighborhood``: the
        chunk IDs of the decoded chunk's context neighbourhood, or None to ask the graph)."""
        if self._result is None:
            _, path, ranking, trace = self.decoded(retriever)
            scored = self.turns[self.length - 1].scored
            self._result = turn_result(retriever, scored, path, ranking, trace, neighborhood)
        return self._result


class NeighborhoodCache:
    """An LRU of context neighbourhoods (chunk ID -> ``graph.neighborhood(chunk, radius)``,
    the chunk IDs by distance) for a graph that answers many at once (an immutable
    :class:`~mapmatched_torch.graph.NeighborhoodGraph`, e.g. a tensor graph); any other
    graph is asked one chunk at a time, every time."""

    def __init__(self, graph: CorpusGraph, radius: float, capacity: int = 65536) -> None:
        self.graph, self.radius, self.capacity = graph, radius, capacity
        self._batched = graph.neighborhoods if implements(graph, NeighborhoodGraph) else None
        self._cache: "OrderedDict[str, tuple]" = OrderedDict()

    def get(self, chunk_ids: Sequence[str]) -> List[tuple]:
        """Each chunk's neighbourhood (from the cache, else one batched call)."""
        if self._batched is None:
            return [tuple(self.graph.neighborhood(chunk_id, self.radius)) for chunk_id in chunk_ids]
        cache = self._cache
        missing = list(dict.fromkeys(chunk_id for chunk_id in chunk_ids if chunk_id not in cache))
        if missing:
            for chunk_id, neighborhood in zip(missing, self._batched(missing, self.radius)):
                cache[chunk_id] = neighborhood
        found = []
        for chunk_id in chunk_ids:
            cache.move_to_end(chunk_id)
            found.append(cache[chunk_id])
        while len(cache) > self.capacity:
            cache.popitem(last=False)
        return found


class StepResults(Mapping):
    """The sessions a step decoded -> their :class:`RetrievalResult`, each built on first read.

    A read result equals what an independent :class:`~mapmatched_torch.MapMatchedSession`
    returns for the same turns. Reading every result of a large step costs about
    0.2 ms per session; :meth:`chunk_id` / :meth:`chunk_ids` give the decoded chunks
    and :meth:`context_chunk_ids` / :meth:`contexts` the contexts without building
    anything else, and :meth:`materialize` builds every result with one batched
    neighbourhood search.
    """

    def __init__(
        self, retriever: MapMatchedRetriever, records: Dict[SessionId, StepRecord], neighborhoods: NeighborhoodCache
    ) -> None:
        self._retriever, self._records, self._neighborhoods = retriever, records, neighborhoods

    def __getitem__(self, session_id: SessionId) -> RetrievalResult:
        record = self._records[session_id]
        if record.built:
            return record.result(self._retriever, None)
        return record.result(self._retriever, self._neighborhoods.get([record.chunk_id])[0])

    def __iter__(self) -> Iterator[SessionId]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._records

    def __repr__(self) -> str:
        built = sum(record.built for record in self._records.values())
        return f"StepResults({len(self._records)} sessions, {built} built)"

    def chunk_id(self, session_id: SessionId) -> str:
        """The session's decoded chunk for this turn (nothing built)."""
        return self._records[session_id].chunk_id

    def chunk_ids(self) -> Dict[SessionId, str]:
        """Every session's decoded chunk for this turn (nothing built)."""
        return {session_id: record.chunk_id for session_id, record in self._records.items()}

    def context_chunk_ids(self, session_id: SessionId) -> Tuple[str, ...]:
        """The session's context (``result.context_chunk_ids``) without building the result."""
        return self.contexts([session_id])[session_id]

    def contexts(self, session_ids: Optional[Sequence[SessionId]] = None) -> Dict[SessionId, Tuple[str, ...]]:
        """The contexts of these sessions (default: all), the neighbourhoods in one
        batched call, and nothing else built: what a RAG server hands to its LLM."""
        records = self._records
        keys = list(records) if session_ids is None else list(session_ids)
        chunk_ids = [records[key].chunk_id for key in keys]
        limit = self._retriever.context_limit
        return {
            key: context_chunk_ids(chunk_id, neighborhood, records[key].turns[records[key].length - 1].chunk_ids, limit)
            for key, chunk_id, neighborhood in zip(keys, chunk_ids, self._neighborhoods.get(chunk_ids))
        }

    def materialize(self) -> Dict[SessionId, RetrievalResult]:
        """Every result, built now (the neighbourhoods in one batched call)."""
        pending = [record for record in self._records.values() if not record.built]
        neighborhoods = self._neighborhoods.get([record.chunk_id for record in pending])
        for record, neighborhood in zip(pending, neighborhoods):
            record.result(self._retriever, neighborhood)
        return {session_id: record.result(self._retriever, None) for session_id, record in self._records.items()}
