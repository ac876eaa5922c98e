"""What the framework retriever adapters (LangChain, LlamaIndex) share.

A framework retriever answers one query with a list of documents. Map-matched
retrieval answers one *turn of a conversation*: :class:`Conversation` is that
conversation behind an adapter -- a :class:`~mapmatched_torch.MapMatchedSession`, or one
session of a :class:`~mapmatched_torch.serving.MapMatchedServer` -- with a guard that
refuses two concurrent turns. :func:`context_entries` and :func:`entry_metadata` turn a
:class:`~mapmatched_torch.models.RetrievalResult` into what each adapter's documents
carry, so both ecosystems report a turn identically.

No framework is imported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from ..errors import MapMatchedRuntimeError, MapMatchedValueError
from ..models import DecoderCandidate, RetrievalResult, RetrievalTrace
from ..retrieval import MapMatchedRetriever, MapMatchedSession

__all__ = [
    "Conversation",
    "ContextEntry",
    "MISSING_TEXT",
    "ROLES",
    "check_lookup",
    "check_metadata_key",
    "check_missing_text",
    "context_entries",
    "entry_metadata",
    "resolve_contents",
]

#: The values of ``missing_text`` (what an adapter does with a context chunk whose
#: text it cannot find): leave it out, or include it with empty text.
MISSING_TEXT = ("skip", "empty")

#: The ``role`` of a context chunk: the decoded chunk of the turn; another candidate of
#: the turn; a chunk that only the graph neighbourhood brought in.
ROLES = ("decoded", "candidate", "neighbor")

_NO_SESSION_ID = object()


def check_missing_text(value: Any) -> str:
    """``missing_text`` must be one of :data:`MISSING_TEXT`."""
    if not isinstance(value, str) or value not in MISSING_TEXT:
        raise MapMatchedValueError(
            f"unsupported missing_text: {value!r} (expected one of {', '.join(map(repr, MISSING_TEXT))})"
        )
    return value


def check_metadata_key(value: Any) -> str:
    """The metadata key under which the adapters put their per-chunk report."""
    if not isinstance(value, str) or not value:
        raise MapMatchedValueError(f"metadata_key must be a non-empty string, got {value!r}")
    return value


def check_lookup(value: Any, name: str) -> Optional[Callable[[str], Any]]:
    """A text source given by the user: None, a mapping chunk ID -> content, or a
    callable chunk ID -> content (None when unknown). Returned as a callable."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return value.get
    if callable(value):
        return value
    raise MapMatchedValueError(
        f"{name} must be a mapping or a callable chunk_id -> content, got {type(value).__name__}"
    )


# --------------------------------------------------------------------------- guards


class _Guards:
    """Per engine: which conversations are in a turn, and a lock around server steps."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.busy: set = set()
        self.step = threading.Lock()


_GUARDS: "weakref.WeakKeyDictionary[Any, _Guards]" = weakref.WeakKeyDictionary()
_GUARDS_MUTEX = threading.Lock()


def _guards_of(engine: Any) -> _Guards:
    with _GUARDS_MUTEX:
        guards = _GUARDS.get(engine)
        if guards is None:
            guards = _GUARDS[engine] = _Guards()
        return guards


# --------------------------------------------------------------------------- the conversation


class Conversation:
    """One conversation behind a framework retriever.

    Args:
        engine: a :class:`~mapmatched_torch.MapMatchedSession` (the conversation
            itself), a :class:`~mapmatched_torch.MapMatchedRetriever` (a new session is
            opened from it), or a :class:`~mapmatched_torch.serving.MapMatchedServer`
            (then ``session_id`` names the conversation; it is opened here if the
            server does not have it yet).
        session_id: required with a server, refused otherwise.
        feature: names the adapter in error messages.

    The engine must have a provider: a framework retriever is asked with query
    strings. A turn is exactly what the engine does with that query:
    ``session.retrieve(query)``, or ``server.step({session_id: candidates})`` with the
    provider's ``retrieve(query, candidate_limit)``.

    Concurrency: a conversation takes one turn at a time (its trellis grows turn by
    turn, so two concurrent turns have no meaning). A second turn of the same
    conversation while one is running -- from another thread, or a second coroutine
    -- raises :class:`~mapmatched_torch.errors.MapMatchedRuntimeError` at once, also
    across two adapters over the same session. Different sessions of one server may be
    asked concurrently: their candidate searches run in parallel, and their server
    steps are serialized by a lock per server (the server is not thread-safe).
    """

    def __init__(self, engine: Any, session_id: Any = _NO_SESSION_ID, *, feature: str) -> None:
        from ..serving import MapMatchedServer

        self._feature = feature
        self._last: Optional[RetrievalResult] = None
        if isinstance(engine, MapMatchedRetriever):
            engine = engine.session()
        if isinstance(engine, MapMatchedServer):
            if session_id is _NO_SESSION_ID or session_id is None:
                raise MapMatchedValueError(f"{feature} over a MapMatchedServer needs session_id= (one per conversation)")
            hash(session_id)
            if session_id not in engine:
                engine.open(session_id)
            self._server, self._session, self._key = engine, None, session_id
            retriever = engine.retriever
        elif isinstance(engine, MapMatchedSession):
            if session_id is not _NO_SESSION_ID and session_id is not None:
                raise MapMatchedValueError(
                    f"session_id applies to a MapMatchedServer only; {feature} got a MapMatchedSession"
                )
            self._server, self._session, self._key = None, engine, None
            retriever = engine.retriever
        else:
            raise MapMatchedValueError(
                f"{feature} takes a MapMatchedSession, a MapMatchedRetriever or a MapMatchedServer, "
                f"got {type(engine).__name__}"
            )
        if retriever.provider is None:
            raise MapMatchedValueError(
                f"{feature} needs a CandidateProvider to answer queries: pass provider= to "
                f"{'MapMatchedServer' if self._server is not None else 'MapMatchedRetriever'}"
            )
        self._retriever = retriever
        self._guards = _guards_of(self._server if self._server is not None else self._session)

    # ----------------------------------------------------------------- state

    @property
    def session(self) -> Optional[MapMatchedSession]:
        """The session (None in server mode)."""
        return self._session

    @property
    def server(self) -> Any:
        """The server (None in session mode)."""
        return self._server

    @property
    def session_id(self) -> Any:
        """The conversation's ID in the server (None in session mode)."""
        return self._key

    @property
    def provider(self) -> Any:
        """The engine's candidate provider."""
        return self._retriever.provider

    @property
    def retriever(self) -> MapMatchedRetriever:
        """The configuration (graph, weights, limits)."""
        return self._retriever

    @property
    def last_result(self) -> Optional[RetrievalResult]:
        """The result of the latest turn taken through this object (None before one)."""
        return self._last

    @property
    def trace(self) -> Optional[RetrievalTrace]:
        """The conversation's latest trace (None before its first turn)."""
        if self._server is not None:
            return self._server.trace(self._key) if self._key in self._server else None
        return self._session.trace

    # ----------------------------------------------------------------- turns

    @contextmanager
    def _turn(self) -> Iterator[None]:
        guards, key = self._guards, self._key
        with guards.mutex:
            if key in guards.busy:
                where = "this session" if self._server is None else f"session {key!r}"
                raise MapMatchedRuntimeError(
                    f"{self._feature}: {where} is already taking a turn; a map-matched conversation takes one "
                    "turn at a time (await each turn before the next; use one retriever per conversation)"
                )
            guards.busy.add(key)
        try:
            yield
        finally:
            with guards.mutex:
                guards.busy.discard(key)

    def _check_query(self, query: Any) -> str:
        if not isinstance(query, str) or not query.strip():
            raise MapMatchedValueError(f"query must be a non-empty string, got {query!r}")
        if self._server is not None and self._key not in self._server:
            raise MapMatchedValueError(f"unknown session {self._key!r} (it is no longer open in the server)")
        return query

    def _server_step(self, candidates: Any) -> RetrievalResult:
        with self._guards.step:
            results, errors = self._server.step({self._key: candidates})
        if self._key in errors:
            raise errors[self._key]
        return results[self._key]

    def turn(self, query: Any) -> RetrievalResult:
        """Decode one turn for ``query``; the engine's state is unchanged if it raises."""
        query = self._check_query(query)
        with self._turn():
            if self._server is None:
                result = self._session.retrieve(query)
            else:
                candidates = self.provider.retrieve(query, self._retriever.candidate_limit)
                result = self._server_step(candidates)
        self._last = result
        return result

    async def aturn(self, query: Any) -> RetrievalResult:
        """:meth:`turn` for asyncio: the provider's ``aretrieve`` is awaited when it has
        one (else its ``retrieve`` runs in the default executor), then the decoding runs
        in the default executor, so the event loop never waits for the graph search."""
        query = self._check_query(query)
        with self._turn():
            provider, limit = self.provider, self._retriever.candidate_limit
            loop = asyncio.get_running_loop()
            fetch = getattr(provider, "aretrieve", None)
            if callable(fetch):
                candidates = await fetch(query, limit)
            else:
                candidates = await loop.run_in_executor(None, provider.retrieve, query, limit)
            if self._server is None:
                result = await loop.run_in_executor(None, self._session.retrieve_candidates, candidates)
            else:
                result = await loop.run_in_executor(None, self._server_step, candidates)
        self._last = result
        return result


# --------------------------------------------------------------------------- reporting a turn


@dataclasses.dataclass(frozen=True)
class ContextEntry:
    """One chunk of a turn's context, with why it is there.

    Attributes:
        chunk_id: the chunk.
        role: ``"decoded"`` (position 0), ``"candidate"`` (another candidate of this
            turn) or ``"neighbor"`` (brought in by the graph neighbourhood only).
        context_rank: position in ``result.context_chunk_ids``.
        candidate: the turn's :class:`DecoderCandidate` for this chunk (raw and
            normalized score), None for a neighbor.
        provider_rank: the candidate's position in provider order, None for a neighbor.
        trajectory_score: the best path score ending at this candidate
            (``result.candidate_ranking``), None when not ranked.
    """

    chunk_id: str
    role: str
    context_rank: int
    candidate: Optional[DecoderCandidate]
    provider_rank: Optional[int]
    trajectory_score: Optional[float]


def context_entries(result: RetrievalResult) -> Tuple[ContextEntry, ...]:
    """The context of ``result`` in order (decoded chunk first), with roles and scores."""
    candidates = {candidate.chunk_id: (rank, candidate) for rank, candidate in enumerate(result.candidates)}
    trajectory = {ranked.chunk_id: ranked.score for ranked in result.candidate_ranking}
    entries = []
    for position, chunk_id in enumerate(result.context_chunk_ids):
        rank, candidate = candidates.get(chunk_id, (None, None))
        role = "decoded" if position == 0 else ("candidate" if candidate is not None else "neighbor")
        entries.append(ContextEntry(chunk_id, role, position, candidate, rank, trajectory.get(chunk_id)))
    return tuple(entries)


def entry_metadata(entry: ContextEntry, result: RetrievalResult, text_known: bool) -> Dict[str, Any]:
    """The per-chunk report an adapter puts under its ``metadata_key`` (plain values).

    Keys: ``chunk_id``, ``role``, ``context_rank``, ``turn_index``, ``raw_score``,
    ``normalized_score``, ``provider_rank``, ``trajectory_score`` (None for a
    neighbor), ``text_known``, ``trace_step`` (the turn's
    :class:`~mapmatched_torch.models.TraceStep` as a dict: scores, distance,
    transition, move, entropy, margin, cumulative score, runner-up),
    ``path_chunk_ids`` and ``revised_prior_indices`` (of the whole conversation).
    """
    step = result.trace.steps[-1]
    candidate = entry.candidate
    return {
        "chunk_id": entry.chunk_id,
        "role": entry.role,
        "context_rank": entry.context_rank,
        "turn_index": step.turn_index,
        "raw_score": None if candidate is None else candidate.raw_score,
        "normalized_score": None if candidate is None else candidate.normalized_score,
        "provider_rank": entry.provider_rank,
        "trajectory_score": entry.trajectory_score,
        "text_known": text_known,
        "trace_step": dataclasses.asdict(step),
        "path_chunk_ids": list(result.trace.path_chunk_ids),
        "revised_prior_indices": list(result.trace.revised_prior_indices),
    }


def resolve_contents(
    chunk_ids: Sequence[str], lookup: Optional[Callable[[str], Any]], provider: Any, method: str
) -> Dict[str, Any]:
    """The content known for each of ``chunk_ids`` (unknown ones are left out).

    The user's ``lookup`` is asked first, chunk by chunk; the chunks it does not know
    go in one call to the provider's ``method`` (``get_documents`` / ``get_nodes``:
    chunk IDs -> {chunk ID: content}) when the provider has one.
    """
    found: Dict[str, Any] = {}
    if lookup is not None:
        for chunk_id in chunk_ids:
            content = lookup(chunk_id)
            if content is not None:
                found[chunk_id] = content
    rest = [chunk_id for chunk_id in chunk_ids if chunk_id not in found]
    getter = getattr(provider, method, None)
    if rest and callable(getter):
        from_provider = getter(rest)
        found.update((chunk_id, from_provider[chunk_id]) for chunk_id in rest if chunk_id in from_provider)
    return found
