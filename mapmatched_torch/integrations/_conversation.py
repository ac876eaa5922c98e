"""What the framework retriever adapters (LangChain, LlamaIndex) share.

A framework retriever answers one query with a list of documents. Map-matched
retrieval answers one *turn of a conversation*: :class:`Conversation` is that
conversation behind an adapter -- a :class:`~mapmatched_torch.MapMatchedSession`, or one
session of a :class:`~mapmatched_torch.serving.MapMatchedServer` -- with a guard that
refuses two concurrent turns. :class:`ConversationViews` gives both adapters the same
properties and turn methods; :func:`context_contents` and :func:`entry_metadata` turn a
:class:`~mapmatched_torch.core.models.RetrievalResult` into what each adapter's documents
carry, so both ecosystems report a turn identically. :class:`TextMemory` is the
bounded memory of chunk texts both framework providers keep, and
:class:`FrameworkProvider` their shared properties, ``repr`` and ``forget``.

No framework is imported here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import numbers
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..core.checks import check_choice
from ..core.errors import MapMatchedRuntimeError, MapMatchedValueError
from ..core.models import DecoderCandidate, RetrievalResult, RetrievalTrace
from ..core.protocols import CandidatesMethod, contextual_call, provider_answer
from ..core.scoring import normalize_candidates
from ..providers.base import check_name
from ..retrieval.session import MapMatchedRetriever, MapMatchedSession

__all__ = [
    "Conversation",
    "ConversationViews",
    "ContextEntry",
    "DEFAULT_MEMORY",
    "FrameworkProvider",
    "MISSING_TEXT",
    "ROLES",
    "TextMemory",
    "adapter_arguments",
    "check_lookup",
    "check_metadata_key",
    "check_missing_text",
    "check_remember",
    "context_contents",
    "context_entries",
    "entry_metadata",
    "warn_without_text",
]

#: The values of ``missing_text`` (what an adapter does with a context chunk, other
#: than the decoded one, whose text it cannot find): leave it out, or include it with
#: empty text. The decoded chunk is always returned.
MISSING_TEXT = ("skip", "empty")

#: The ``role`` of a context chunk: the decoded chunk of the turn; another candidate of
#: the turn; a chunk that only the graph neighbourhood brought in.
ROLES = ("decoded", "candidate", "neighbor")

#: How many chunks a framework provider remembers with ``remember=True`` (and, as many
#: again, chunk IDs its store did not have).
DEFAULT_MEMORY = 65536

_NO_SESSION_ID = object()


def check_missing_text(value: Any) -> str:
    """``missing_text`` must be one of :data:`MISSING_TEXT`."""
    return check_choice("missing_text", value, MISSING_TEXT)


def check_metadata_key(value: Any) -> str:
    """The metadata key under which the adapters put their per-chunk report."""
    return check_name(value, "metadata_key")


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


def check_remember(value: Any) -> int:
    """``remember=`` of a framework provider as a capacity: True -> :data:`DEFAULT_MEMORY`,
    False -> 0 (remember nothing), an int >= 0 -> that many chunks."""
    if value is True:
        return DEFAULT_MEMORY
    if value is False:
        return 0
    if isinstance(value, numbers.Integral) and value >= 0:
        return int(value)
    raise MapMatchedValueError(f"remember must be True, False or a capacity (an int >= 0), got {value!r}")


# --------------------------------------------------------------------------- the text of chunks


def _warn_unknown_text(source: str, chunk_ids: Sequence[str], reason: str) -> None:
    noun = "chunk" if len(chunk_ids) == 1 else "chunks"
    warnings.warn(
        f"{source}: no text for {noun} {', '.join(map(repr, chunk_ids))}: {reason}; treated as unknown text",
        UserWarning,
        stacklevel=2,
    )


class TextMemory:
    """A framework provider's memory of chunk texts: bounded, least recently used out.

    It keeps the content (a ``Document``, a node) of up to ``capacity`` chunks the
    provider has seen, and up to ``capacity`` chunk IDs its store did not have (so they
    are not asked again; the oldest of these marks go first, and :meth:`forget` drops
    them all, e.g. after documents were added to the store). ``capacity=0`` remembers
    nothing. Thread-safe: server sessions search concurrently.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._known: "OrderedDict[str, Any]" = OrderedDict()
        self._absent: "OrderedDict[str, None]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._known)

    def _put(self, table: "OrderedDict[str, Any]", chunk_id: str, value: Any) -> None:
        if self.capacity == 0:
            return
        table[chunk_id] = value
        table.move_to_end(chunk_id)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def remember(self, pairs: Iterable[Tuple[str, Any]]) -> None:
        """Keep ``(chunk_id, content)`` pairs (the newest are the last evicted)."""
        with self._lock:
            for chunk_id, content in pairs:
                self._put(self._known, chunk_id, content)
                self._absent.pop(chunk_id, None)

    def lookup(
        self, chunk_ids: Iterable[str], fetch: Optional[Callable[[List[str]], Mapping]] = None, source: str = ""
    ) -> Dict[str, Any]:
        """``{chunk_id: content}`` for the chunk IDs known here or found by ``fetch``.

        ``fetch(missing)`` is asked once for the IDs neither remembered nor marked
        absent and returns ``{chunk_id: content}`` for those it has; the others are
        marked absent. If ``fetch`` raises, a warning names ``source``, the chunks and
        the error, and those chunks are left out (and not marked absent).
        """
        wanted = list(dict.fromkeys(chunk_ids))
        with self._lock:
            found = {}
            for chunk_id in wanted:
                if chunk_id in self._known:
                    self._known.move_to_end(chunk_id)
                    found[chunk_id] = self._known[chunk_id]
            missing = [chunk_id for chunk_id in wanted if chunk_id not in found and chunk_id not in self._absent]
        if not missing or fetch is None:
            return found
        try:
            fetched = fetch(missing)
        except Exception as error:  # a store failure must not fail a turn that was decoded
            _warn_unknown_text(source, missing, f"fetching failed ({type(error).__name__}: {error})")
            return found
        with self._lock:
            for chunk_id in missing:
                if chunk_id in fetched:
                    found[chunk_id] = fetched[chunk_id]
                    self._put(self._known, chunk_id, fetched[chunk_id])
                else:
                    self._put(self._absent, chunk_id, None)
        return found

    def forget(self) -> None:
        """Drop every remembered content and every absent mark."""
        with self._lock:
            self._known.clear()
            self._absent.clear()


class FrameworkProvider(CandidatesMethod):
    """What the framework providers (LangChain, LlamaIndex) share: the properties of
    what they search, their ``repr``, :meth:`forget` and upstream mapmatched's
    ``candidates(query, limit)`` (their ``retrieve``). A subclass sets ``_source``,
    ``_score_mode``, ``_chunk_id_field`` and ``_memory`` (a :class:`TextMemory`)."""

    @property
    def source(self) -> Any:
        """The vector store, retriever or index searched (after unwrapping a LangChain
        ``VectorStoreRetriever`` to its store)."""
        return self._source

    @property
    def score_mode(self) -> str:
        """Where the "higher is better" scores come from (see the class docstring)."""
        return self._score_mode

    @property
    def chunk_id_field(self) -> Optional[str]:
        """The metadata key holding the chunk ID (None: the document's or node's own ID)."""
        return self._chunk_id_field

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self._source).__name__}, score_mode={self._score_mode!r}, "
            f"chunk_id_field={self._chunk_id_field!r})"
        )

    def forget(self) -> None:
        """Drop the remembered documents (or nodes) and the marks of chunk IDs the store
        did not have (e.g. after the store or index changed)."""
        self._memory.forget()


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


def _retrieve_exception(future: "asyncio.Future[Any]") -> None:
    """Done callback: a turn whose awaiting task was cancelled may still fail; its
    error is not logged as 'never retrieved'."""
    if not future.cancelled():
        future.exception()


# --------------------------------------------------------------------------- the conversation


class Conversation:
    """One conversation behind a framework retriever.

    Args:
        engine: a :class:`~mapmatched_torch.MapMatchedSession` (the conversation
            itself), a :class:`~mapmatched_torch.MapMatchedRetriever` (a new session is
            opened from it), or a :class:`~mapmatched_torch.serving.MapMatchedServer`
            (then ``session_id`` names the conversation; it is opened here, after every
            check has passed, if the server does not have it yet).
        session_id: required with a server, refused otherwise.
        feature: names the adapter in error messages.

    The engine must have a provider: a framework retriever is asked with query
    strings. A turn is exactly what the engine does with that query:
    ``session.retrieve(query)``, or ``server.step({session_id: candidates})`` with the
    provider's ``retrieve(query, candidate_limit)``. A contextual provider (one with
    ``retrieve_in_context``, e.g. ``QueryMixingProvider``) is asked by the engine, with
    the conversation's previous decoded chunk and query: ``session.retrieve(query)`` or
    ``server.step({session_id: query})``, in :meth:`aturn` too.

    Concurrency: a conversation takes one turn at a time (its trellis grows turn by
    turn, so two concurrent turns have no meaning). A second turn of the same
    conversation while one is running -- from another thread, or a second coroutine
    -- raises :class:`~mapmatched_torch.core.errors.MapMatchedRuntimeError` at once, also
    across two adapters over the same session. A turn ends when its decoding ends:
    cancelling the task awaiting :meth:`aturn` while the decoding runs in the executor
    does not stop the decoding, and the turn stands; the conversation stays busy until
    it is done. Different sessions of one server may be asked concurrently: their
    candidate searches run in parallel, and their server steps are serialized by a
    lock per server (the server is not thread-safe). A contextual provider's search is
    part of the server step, so those searches are serialized too (and its
    ``aretrieve``, if any, is not used).
    """

    def __init__(self, engine: Any, session_id: Any = _NO_SESSION_ID, *, feature: str) -> None:
        from ..serving.server import MapMatchedServer

        self._feature = feature
        self._last: Optional[RetrievalResult] = None
        if isinstance(engine, MapMatchedRetriever):
            engine = engine.session()
        if isinstance(engine, MapMatchedServer):
            if session_id is _NO_SESSION_ID or session_id is None:
                raise MapMatchedValueError(f"{feature} over a MapMatchedServer needs session_id= (one per conversation)")
            hash(session_id)
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
        if self._server is not None and session_id not in self._server:
            self._server.open(session_id)  # last: a refused build opens nothing

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

    def _acquire(self) -> None:
        guards, key = self._guards, self._key
        with guards.mutex:
            if key in guards.busy:
                where = "this session" if self._server is None else f"session {key!r}"
                raise MapMatchedRuntimeError(
                    f"{self._feature}: {where} is already taking a turn; a map-matched conversation takes one "
                    "turn at a time (await each turn before the next; use one retriever per conversation)"
                )
            guards.busy.add(key)

    def _release(self) -> None:
        with self._guards.mutex:
            self._guards.busy.discard(self._key)

    @contextmanager
    def _turn(self) -> Iterator[None]:
        self._acquire()
        try:
            yield
        finally:
            self._release()

    def _check_query(self, query: Any) -> str:
        if not isinstance(query, str) or not query.strip():
            raise MapMatchedValueError(f"query must be a non-empty string, got {query!r}")
        if self._server is not None and self._key not in self._server:
            raise MapMatchedValueError(f"unknown session {self._key!r} (it is no longer open in the server)")
        return query

    def _decode(self, candidates: Any) -> RetrievalResult:
        """Append the turn and decode (the guard is held); ``candidates`` may be the query
        string itself in server mode (the server then asks its provider, in context)."""
        if self._server is None:
            result = self._session.retrieve_candidates(candidates)
        else:
            with self._guards.step:
                results, errors = self._server.step({self._key: candidates})
            if self._key in errors:
                raise errors[self._key]
            result = results[self._key]
        self._last = result
        return result

    def _decode_then_release(self, candidates: Any) -> RetrievalResult:
        try:
            return self._decode(candidates)
        finally:
            self._release()

    def turn(self, query: Any) -> RetrievalResult:
        """Decode one turn for ``query``; the engine's state is unchanged if it raises."""
        query = self._check_query(query)
        with self._turn():
            return self._locked_turn(query)

    def _locked_turn(self, query: str) -> RetrievalResult:
        """One whole turn, search included (the guard is held). A contextual provider
        (e.g. ``QueryMixingProvider``) is asked by the engine itself, which holds the
        conversation's previous decoded chunk and query; any other is asked here, outside
        the server's step lock."""
        if self._server is None:
            result = self._session.retrieve(query)
            self._last = result
            return result
        if contextual_call(self.provider) is not None:
            return self._decode(query)
        return self._decode(provider_answer(self.provider)[1](query, self._retriever.candidate_limit))

    def _turn_then_release(self, query: str) -> RetrievalResult:
        try:
            return self._locked_turn(query)
        finally:
            self._release()

    async def aturn(self, query: Any) -> RetrievalResult:
        """:meth:`turn` for asyncio: the provider's ``aretrieve`` is awaited when it has
        one (else its ``retrieve``, or upstream's ``candidates``, runs in the default
        executor), then the decoding runs
        in the default executor, so the event loop never waits for the graph search. A
        contextual provider (e.g. ``QueryMixingProvider``) is asked by the engine in the
        executor, search and decoding together, with the conversation's previous decoded
        chunk and query.

        Cancelled while the candidates are searched, the turn is not taken (with a
        contextual provider the search is part of the decoding). Cancelled while
        decoding, the decoding still finishes in its thread and the turn stands
        (``last_result`` and the trace show it); the conversation refuses other turns
        until then.
        """
        query = self._check_query(query)
        self._acquire()
        try:
            provider, limit = self.provider, self._retriever.candidate_limit
            loop = asyncio.get_running_loop()
            fetch = getattr(provider, "aretrieve", None)
            if contextual_call(provider) is not None:
                decoding = loop.run_in_executor(None, self._turn_then_release, query)
            else:
                if callable(fetch):
                    candidates = await fetch(query, limit)
                else:
                    candidates = await loop.run_in_executor(None, provider_answer(provider)[1], query, limit)
                decoding = loop.run_in_executor(None, self._decode_then_release, candidates)
        except BaseException:
            self._release()
            raise
        # The worker thread now holds the guard and releases it when the decoding ends;
        # the shield keeps a cancellation of this task from cancelling that future.
        decoding.add_done_callback(_retrieve_exception)
        return await asyncio.shield(decoding)


def _view(name: str, doc: str) -> property:
    """A read-only property giving ``self.conversation.<name>``."""
    return property(lambda self: getattr(self.conversation, name), doc=doc)


class ConversationViews:
    """What both adapter classes expose about the conversation behind them.

    The adapter keeps its :class:`Conversation` in ``self.conversation``.
    """

    conversation: Any

    def _answer(self, query: Any, build: Callable[[RetrievalResult], Any]) -> Any:
        """One turn, then ``build`` (documents or nodes) from its result."""
        return build(self.conversation.turn(query))

    async def _aanswer(self, query: Any, build: Callable[[RetrievalResult], Any]) -> Any:
        """One turn (awaited), then ``build`` in the default executor (text lookups may block)."""
        result = await self.conversation.aturn(query)
        return await asyncio.get_running_loop().run_in_executor(None, build, result)

    session = _view("session", "The :class:`~mapmatched_torch.MapMatchedSession` (None in server mode).")
    server = _view("server", "The :class:`~mapmatched_torch.serving.MapMatchedServer` (None in session mode).")
    session_id = _view("session_id", "The conversation's ID in the server (None in session mode).")
    last_result = _view(
        "last_result",
        "The :class:`~mapmatched_torch.core.models.RetrievalResult` of the latest turn taken through this retriever "
        "(None before one).",
    )
    trace = _view("trace", "The conversation's latest trace (``trace.render()`` prints it).")


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


def context_entries(result: RetrievalResult, score_normalization: str) -> Tuple[ContextEntry, ...]:
    """The context of ``result`` in order (decoded chunk first), with roles and scores
    (``score_normalization``: the retriever's, which normalized the turn: the entries'
    candidates are the trellis states the session decoded, rebuilt from the result's
    raw candidates)."""
    normalized = normalize_candidates(result.candidates, score_normalization)
    candidates = {candidate.chunk_id: (rank, candidate) for rank, candidate in enumerate(normalized)}
    trajectory = {ranked.chunk_id: ranked.trajectory_score for ranked in result.candidate_ranking}
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
    :class:`~mapmatched_torch.core.models.TraceStep` as a dict: scores, distance,
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


def _resolve_contents(
    chunk_ids: Sequence[str],
    lookup: Optional[Callable[[str], Any]],
    lookup_name: str,
    provider: Any,
    method: str,
    accept: Tuple[type, ...],
    feature: str,
) -> Dict[str, Any]:
    """The content known for each of ``chunk_ids`` (unknown ones are left out).

    The user's ``lookup`` is asked first, chunk by chunk; the chunks it does not give
    go in one call to the provider's ``method`` (``get_documents`` / ``get_nodes``:
    chunk IDs -> {chunk ID: content}) when the provider has one. A lookup that raises
    or gives something not in ``accept`` is a warning and counts as not found there
    (the provider is asked); a provider method that raises or gives such content is a
    warning too, and those chunks stay unknown.
    """
    names = [kind.__name__ for kind in accept]
    expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    found: Dict[str, Any] = {}

    def take(chunk_id: str, content: Any, origin: str) -> None:
        if content is None:
            return
        if isinstance(content, accept):
            found[chunk_id] = content
        else:
            _warn_unknown_text(feature, [chunk_id], f"{origin} gave {type(content).__name__}, not {expected}")

    if lookup is not None:
        for chunk_id in chunk_ids:
            try:
                content = lookup(chunk_id)
            except Exception as error:
                _warn_unknown_text(feature, [chunk_id], f"{lookup_name}= raised {type(error).__name__}: {error}")
                continue
            take(chunk_id, content, f"{lookup_name}=")
    rest = [chunk_id for chunk_id in chunk_ids if chunk_id not in found]
    getter = getattr(provider, method, None)
    if rest and callable(getter):
        origin = f"{type(provider).__name__}.{method}()"
        try:
            from_provider = getter(rest)
        except Exception as error:
            _warn_unknown_text(feature, rest, f"{origin} raised {type(error).__name__}: {error}")
            from_provider = {}
        for chunk_id in rest:
            if chunk_id in from_provider:
                take(chunk_id, from_provider[chunk_id], origin)
    return found


def context_contents(
    result: RetrievalResult,
    provider: Any,
    lookup: Optional[Callable[[str], Any]],
    *,
    lookup_name: str,
    method: str,
    accept: Tuple[type, ...],
    missing_text: str,
    feature: str,
    score_normalization: str,
) -> List[Tuple[ContextEntry, Any]]:
    """The context of a decoded turn, as ``(entry, content)`` pairs in context order
    (``score_normalization``: the retriever's, see :func:`context_entries`).

    ``content`` is what ``lookup`` (the user's ``lookup_name=``) or else the provider's
    ``method`` gave for the chunk -- an instance of one of ``accept`` -- or None when
    the text is unknown. Unknown chunks are left out with ``missing_text="skip"``,
    except the decoded chunk, which is always first.

    Nothing here raises for a chunk: the turn is already decoded and committed, so a
    lookup that raises, or gives something not in ``accept``, is a ``UserWarning``
    naming the chunk and the reason (see :func:`_resolve_contents`).
    """
    entries = context_entries(result, score_normalization)
    contents = _resolve_contents([e.chunk_id for e in entries], lookup, lookup_name, provider, method, accept, feature)
    return [
        (entry, contents.get(entry.chunk_id))
        for entry in entries
        if entry.chunk_id in contents or missing_text == "empty" or entry.role == "decoded"
    ]


def adapter_arguments(
    engine: Any,
    session_id: Any,
    text: Any,
    *,
    text_name: str,
    method: str,
    missing_text: Any,
    metadata_key: Any,
    feature: str,
) -> Tuple["Conversation", Optional[Callable[[str], Any]], str, str]:
    """What both adapter builders (``as_langchain_retriever``, ``as_llamaindex_retriever``)
    check and open, in the order that keeps a refused build free of side effects: the
    arguments first, then the :class:`Conversation` (which may open a server session),
    then the warning when no chunk's text can be known.

    Args:
        engine, session_id: as for :class:`Conversation`.
        text: the user's text source (``documents=`` / ``nodes=``), named ``text_name``.
        method: the provider method that gives text (``get_documents`` / ``get_nodes``).
        missing_text, metadata_key: the adapter's options, checked here.
        feature: the builder's name, for messages.

    Returns:
        ``(conversation, lookup, missing_text, metadata_key)``, checked.
    """
    lookup = check_lookup(text, text_name)
    missing_text = check_missing_text(missing_text)
    metadata_key = check_metadata_key(metadata_key)
    conversation = Conversation(engine, session_id, feature=feature)
    warn_without_text(conversation.provider, lookup, lookup_name=text_name, method=method, missing_text=missing_text,
                      feature=feature, stacklevel=4)
    return conversation, lookup, missing_text, metadata_key


def warn_without_text(
    provider: Any, lookup: Any, *, lookup_name: str, method: str, missing_text: str, feature: str, stacklevel: int = 3
) -> None:
    """A ``UserWarning`` (once, when the adapter is built) when nothing can give the text
    of a chunk: no ``lookup_name=`` and a provider without ``method`` (e.g. a
    :class:`~mapmatched_torch.providers.QdrantProvider`, which returns IDs and scores)."""
    if lookup is not None or callable(getattr(provider, method, None)):
        return
    returned = "only the decoded chunk, " if missing_text == "skip" else "every context chunk "
    warnings.warn(
        f"{feature}: {type(provider).__name__} has no {method}() and no {lookup_name}= was given, so no chunk's "
        f"text is known: each turn returns {returned}with empty text and text_known=False. Pass {lookup_name}= "
        "(a mapping or callable chunk ID -> text)",
        UserWarning,
        stacklevel=stacklevel,
    )
