"""The text of chunks, for the framework retriever adapters (LangChain, LlamaIndex).

:class:`TextMemory` is the bounded memory of chunk texts both framework providers keep,
:class:`FrameworkProvider` their shared properties, ``repr`` and ``forget``; the
``check_*`` functions validate the adapters' text options, and
:func:`warn_without_text` warns, once, when no chunk's text can be known.

No framework is imported here.
"""

from __future__ import annotations

import numbers
import threading
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple

from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError
from ..core.protocols import CandidatesMethod
from ..providers.base import check_name

__all__ = [
    "DEFAULT_MEMORY",
    "FrameworkProvider",
    "MISSING_TEXT",
    "TextMemory",
    "check_lookup",
    "check_metadata_key",
    "check_missing_text",
    "check_remember",
    "warn_without_text",
]

#: The values of ``missing_text`` (what an adapter does with a context chunk, other
#: than the decoded one, whose text it cannot find): leave it out, or include it with
#: empty text. The decoded chunk is always returned.
MISSING_TEXT = ("skip", "empty")

#: How many chunks a framework provider remembers with ``remember=True`` (and, as many
#: again, chunk IDs its store did not have).
DEFAULT_MEMORY = 65536


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
