"""The conversation behind a framework retriever adapter (LangChain, LlamaIndex).

A framework retriever answers one query with a list of documents. Map-matched
retrieval answers one *turn of a conversation*: :class:`Conversation` is that
conversation behind an adapter -- a :class:`~mapmatched_torch.MapMatchedSession`, or one
session of a :class:`~mapmatched_torch.serving.MapMatchedServer` -- with a guard that
refuses two concurrent turns. :class:`ConversationViews` gives both adapters the same
properties and turn methods; :func:`adapter_arguments` checks and opens what both
adapter builders need.

What the adapters share besides: the text of chunks (``TextMemory``,
``FrameworkProvider``, the text options' checks) is in :mod:`._chunk_text`, the report
of a turn (``context_contents``, ``entry_metadata``) in :mod:`._turn_report`; their
names are still importable from here.

No framework is imported here.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

from ..core.errors import MapMatchedRuntimeError, MapMatchedValueError
from ..core.models import RetrievalResult, RetrievalTrace
from ..core.protocols import contextual_call, provider_answer
from ..retrieval.session import MapMatchedRetriever, MapMatchedSession

# moved to their own modules; still importable from here (not in __all__)
from ._chunk_text import (  # noqa: F401
    DEFAULT_MEMORY,
    MISSING_TEXT,
    FrameworkProvider,
    TextMemory,
    check_lookup,
    check_metadata_key,
    check_missing_text,
    check_remember,
    warn_without_text,
)
from ._turn_report import ROLES, ContextEntry, context_contents, context_entries, entry_metadata  # noqa: F401

__all__ = ["Conversation", "ConversationViews", "adapter_arguments"]

_NO_SESSION_ID = object()


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


def pretrained_engine(
    path: Any, *, graph: Any, provider: Any, embedder: Any, strict: bool, session_id: Any,
    options: Optional[Dict[str, Any]],
) -> Any:
    """The engine of an adapter's ``from_pretrained``: a
    :meth:`MapMatchedRetriever.from_pretrained <mapmatched_torch.MapMatchedRetriever.from_pretrained>`
    (``session_id`` None) or a :meth:`MapMatchedServer.from_pretrained
    <mapmatched_torch.serving.MapMatchedServer.from_pretrained>` (a ``session_id``), ``options``
    the engine's other keyword arguments."""
    arguments = dict(graph=graph, provider=provider, embedder=embedder, strict=strict, **dict(options or {}))
    if session_id is None:
        return MapMatchedRetriever.from_pretrained(path, **arguments)
    from ..serving.server import MapMatchedServer

    return MapMatchedServer.from_pretrained(path, **arguments)


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
