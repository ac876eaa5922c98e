"""LangChain, both ways (the ``[langchain]`` extra: ``langchain-core``).

- :class:`LangChainProvider`: candidates for map-matched decoding from a LangChain
  vector store or retriever the user already has.
- :func:`as_langchain_retriever`: a real ``langchain_core`` ``BaseRetriever`` whose
  ``invoke(query)`` / ``ainvoke(query)`` runs one map-matched turn of a conversation
  and returns ``Document`` objects in context order, decoded chunk first.

langchain-core is imported when a provider or retriever is built, never when this
module (or ``mapmatched_torch``) is imported; without it both raise
:class:`~mapmatched_torch.core.errors.MissingDependencyError` (an ``ImportError``) naming
the ``[langchain]`` extra.

Decisions:

- Scores are "higher is better" (docs/spec.md 9). A vector store's
  ``similarity_search_with_relevance_scores`` is LangChain's own higher-is-better
  score (in [0, 1]) and is the default; many stores do not implement it (e.g.
  ``InMemoryVectorStore``), which is an error naming the two other modes:
  ``score_mode="similarity"`` takes ``similarity_search_with_score`` as it comes (right
  for stores that return similarities, such as ``InMemoryVectorStore``'s cosine) and
  ``score_mode="distance"`` negates it (right for stores that return distances, such
  as FAISS with L2 or Chroma). Which one a store returns is the store's business, so
  the user says it, as for :class:`~mapmatched_torch.providers.FAISSProvider`.
- A ``BaseRetriever`` returns no scores. Unless the user names where scores come
  from, the provider refuses it at construction: ``score_field="..."`` reads a
  higher-is-better score from each document's metadata (e.g. a reranker's
  ``relevance_score``); ``score_mode="rank"`` opts into rank-derived scores, ``-rank``
  (0, -1, -2, ...), which keep the retriever's order and are evenly spaced. A
  ``VectorStoreRetriever`` (``store.as_retriever()``) with ``search_type="similarity"``
  is unwrapped to its vector store (its ``search_kwargs`` other than ``k`` are kept), so
  it gives scores like the store does.
- Limits: a vector store is asked for ``k=limit``; a retriever returns as many
  documents as it is configured to, and the provider keeps the first ``limit`` after
  sorting.
- Candidates are sorted by (-score, the store's rank) and checked by
  :func:`~mapmatched_torch.providers.base.ranked_candidates` (a chunk ID returned
  twice, a missing or empty ID or a non-finite score is a ValueError).
- Text of context chunks: the decoder works on chunk IDs, and a chunk of the graph
  neighbourhood may never have been returned by the store. The retriever adapter
  finds a chunk's text in the user's ``documents`` (a mapping or callable), then in
  the provider's memory of the documents it has returned (the latest
  :data:`~mapmatched_torch.integrations._chunk_text.DEFAULT_MEMORY` = 65536 by default,
  see ``remember=``), then -- when the store can fetch by ID (``get_by_ids``) and its
  IDs are the chunk IDs -- in the store.
- The decoded chunk is always returned, first; when its text is unknown it comes with
  empty ``page_content`` and ``text_known=False``. Another chunk whose text is unknown
  is left out (``missing_text="skip"``, the default: a prompt gets no empty passages)
  or returned the same way (``missing_text="empty"``). No chunk's text is known when
  nothing can give it: a provider that keeps no documents (Qdrant, Chroma, FAISS,
  dense, fusion providers) without ``documents=`` -- the adapter warns once, when
  built -- or ``LangChainProvider(..., remember=False)`` over a store whose IDs are
  not the chunk IDs.
- A text lookup that fails after the turn was decoded -- ``documents=`` raising or
  returning something other than a ``Document`` or ``str``, the store's
  ``get_by_ids`` raising -- is a ``UserWarning`` naming the chunk and the error; the
  chunk's text counts as unknown, the turn stands and its documents are returned (so a
  retry never takes the turn twice).
- Each returned ``Document`` keeps the store's metadata and adds one key,
  ``metadata["map_matched"]`` (``metadata_key``): the chunk ID, its ``role``
  (``"decoded"``, ``"candidate"`` or ``"neighbor"``: brought in by the graph only),
  its context rank, the candidate's raw and normalized score and provider rank and
  trajectory score (None for a neighbour), ``text_known``, and the turn's trace step
  (``trace_step``: raw/normalized/weighted emission, graph distance, transition cost,
  cumulative score, entropy, margin, runner-up, move) with the conversation's path.
- One adapter is one conversation (a session, or one ``session_id`` of a
  :class:`~mapmatched_torch.serving.MapMatchedServer`, opened by the adapter if the
  server does not have it). A conversation takes one turn at a time: a concurrent
  second ``invoke``/``ainvoke`` of the same conversation raises
  :class:`~mapmatched_torch.core.errors.MapMatchedRuntimeError`. ``ainvoke`` awaits the
  store's async search and decodes in the default executor (cancelled while
  decoding, the turn still completes and stands).
- ``batch``/``abatch`` (and ``batch_as_completed``/``abatch_as_completed``) take the
  queries as turns of the one conversation, one after another in input order, and
  return the results in that order (LangChain's default would run them concurrently,
  which a conversation refuses). Without ``return_exceptions=True`` the first failing
  query raises and the later ones are not asked; the turns before it stand.

The adapter's class, ``MapMatchedLangChainRetriever``, subclasses langchain-core's
``BaseRetriever``, so it is built on first use; ``providers.langchain.MapMatchedLangChainRetriever``
returns it (for ``isinstance`` checks).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any, AsyncIterator, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError
from ..core.models import RetrievalResult, ScoredCandidate
from ..core.optional import import_optional
from ..providers.base import (
    check_batch,
    check_name,
    check_request,
    chunk_id_from_field,
    distance_to_score,
    ranked_candidates,
)
from ._chunk_text import FrameworkProvider, TextMemory, check_remember
from ._conversation import (
    ConversationViews,
    adapter_arguments,
    pretrained_engine,
)
from ._turn_report import context_contents, entry_metadata

__all__ = [
    "LangChainProvider",
    "as_langchain_retriever",
    "STORE_SCORE_MODES",
    "RETRIEVER_SCORE_MODES",
]

#: ``score_mode`` values for a vector store (default ``"relevance"``).
STORE_SCORE_MODES = ("relevance", "similarity", "distance")
#: ``score_mode`` values for a retriever (``"metadata"`` needs ``score_field``).
RETRIEVER_SCORE_MODES = ("metadata", "rank")

_EXTRA = "langchain"


def _langchain(feature: str) -> Tuple[Any, Any, Any]:
    """``(documents, retrievers, vectorstores)`` modules of langchain-core, or
    MissingDependencyError naming the ``[langchain]`` extra."""
    return (
        import_optional("langchain_core.documents", _EXTRA, feature),
        import_optional("langchain_core.retrievers", _EXTRA, feature),
        import_optional("langchain_core.vectorstores", _EXTRA, feature),
    )


def _overrides(store: Any, base: type, names: Iterable[str]) -> bool:
    return any(getattr(type(store), name, None) is not getattr(base, name, None) for name in names)


class LangChainProvider(FrameworkProvider):
    """Candidates from a LangChain vector store or retriever (``CandidateProvider``).

    Args:
        source: a ``langchain_core`` ``VectorStore`` or ``BaseRetriever`` (a
            ``VectorStoreRetriever`` with ``search_type="similarity"`` is unwrapped to
            its store, keeping its ``search_kwargs`` except ``k``).
        chunk_id_field: the document metadata key holding the chunk ID (default
            ``"chunk_id"``); None takes ``Document.id``. Chunk IDs must be non-empty
            strings, the IDs of the corpus graph.
        score_mode: where "higher is better" scores come from. For a store:
            ``"relevance"`` (default; ``similarity_search_with_relevance_scores``),
            ``"similarity"`` (``similarity_search_with_score`` as is) or
            ``"distance"`` (``similarity_search_with_score`` negated). For a retriever:
            ``"metadata"`` (the default when ``score_field`` is given) or ``"rank"``
            (``-rank``: 0 for the first document, -1 for the second, ...).
        score_field: for a retriever: the metadata key holding each document's
            higher-is-better score.
        search_kwargs: extra keyword arguments for the store's search (e.g.
            ``filter``); not ``k``, which is the limit. Stores only.
        remember: keep the returned documents by chunk ID, for the text of context
            chunks (see :meth:`get_documents`): True (default) keeps the latest
            65536 (:data:`~mapmatched_torch.integrations._chunk_text.DEFAULT_MEMORY`),
            an int that many, False none. As many chunk IDs the store did not have
            are remembered too (so they are not fetched again); the least recently
            used go first, and :meth:`forget` drops both.

    Results are sorted by (-score, the store's rank) and hold at most ``limit``
    candidates. A retriever without a score source is refused here, with the two ways
    to give it one; a store without relevance scores is refused with the other modes.

    Example:
        >>> from langchain_core.documents import Document
        >>> from langchain_core.embeddings import DeterministicFakeEmbedding
        >>> from langchain_core.vectorstores import InMemoryVectorStore
        >>> store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
        >>> _ = store.add_documents([Document("alpha", metadata={"chunk_id": "a"})])
        >>> provider = LangChainProvider(store, score_mode="similarity")
        >>> [c.chunk_id for c in provider.retrieve("alpha", 3)]
        ['a']
        >>> provider.get_documents(["a"])["a"].page_content
        'alpha'
    """

    def __init__(
        self,
        source: Any,
        *,
        chunk_id_field: Optional[str] = "chunk_id",
        score_mode: Optional[str] = None,
        score_field: Optional[str] = None,
        search_kwargs: Optional[Mapping] = None,
        remember: Union[bool, int] = True,
    ) -> None:
        documents, retrievers, vectorstores = _langchain("LangChainProvider")
        self._document_type = documents.Document
        self._chunk_id_field = check_name(chunk_id_field, "chunk_id_field", optional=True)
        self._score_field = check_name(score_field, "score_field", optional=True)
        self._memory = TextMemory(check_remember(remember))
        if search_kwargs is not None and not isinstance(search_kwargs, Mapping):
            raise MapMatchedValueError(f"search_kwargs must be a mapping, got {type(search_kwargs).__name__}")
        kwargs = dict(search_kwargs or {})
        if "k" in kwargs:
            raise MapMatchedValueError("search_kwargs must not contain 'k': the provider asks for k=limit")
        if (
            isinstance(source, vectorstores.VectorStoreRetriever)
            and source.search_type == "similarity"
            and score_mode not in RETRIEVER_SCORE_MODES
            and score_field is None
        ):
            kwargs = {**{key: value for key, value in source.search_kwargs.items() if key != "k"}, **kwargs}
            source = source.vectorstore
        if isinstance(source, vectorstores.VectorStore):
            self._kind = "vector store"
            mode = "relevance" if score_mode is None else score_mode
            check_choice("score mode for a vector store", mode, STORE_SCORE_MODES)
            if self._score_field is not None:
                raise MapMatchedValueError("score_field applies to a retriever; a vector store gives its own scores")
            relevance = (
                "similarity_search_with_relevance_scores",
                "_similarity_search_with_relevance_scores",
                "_select_relevance_score_fn",
            )
            if mode == "relevance" and not _overrides(source, vectorstores.VectorStore, relevance):
                raise self._no_relevance(source)
        elif isinstance(source, retrievers.BaseRetriever):
            self._kind = "retriever"
            mode = score_mode
            if mode is None:
                if self._score_field is None:
                    raise MapMatchedValueError(
                        f"a LangChain retriever ({type(source).__name__}) returns no scores: pass score_field= "
                        "naming the metadata key that holds a higher-is-better score, or score_mode='rank' to "
                        "score documents by rank (0, -1, -2, ...); or pass the vector store itself"
                    )
                mode = "metadata"
            check_choice("score mode for a retriever", mode, RETRIEVER_SCORE_MODES)
            if mode == "metadata" and self._score_field is None:
                raise MapMatchedValueError("score_mode='metadata' needs score_field= (the metadata key of the score)")
            if mode == "rank" and self._score_field is not None:
                raise MapMatchedValueError("score_mode='rank' ignores scores; drop score_field or use score_mode='metadata'")
            if kwargs:
                raise MapMatchedValueError("search_kwargs apply to a vector store; configure the retriever itself")
        else:
            raise MapMatchedValueError(
                f"LangChainProvider takes a langchain_core VectorStore or BaseRetriever, got {type(source).__name__}"
            )
        self._source = source
        self._score_mode = mode
        self._search_kwargs = kwargs
        self._name = f"LangChain {self._kind} {type(source).__name__}"

    # ----------------------------------------------------------------- searching

    def retrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """The ``CandidateProvider`` protocol: search and return up to ``limit``
        candidates sorted by (-score, the store's rank)."""
        query, limit = check_request(query, limit)
        return self._candidates(self._search(query, limit), limit, self._name)

    def retrieve_batch(self, queries: Sequence[str], limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve` for many queries (a retriever's own ``batch``, which runs
        them concurrently; a store is searched query by query)."""
        queries, limit = check_batch(queries, limit)
        if not queries:
            return []
        if self._kind == "retriever":
            answers = [self._scored(documents) for documents in self._source.batch(queries)]
        else:
            answers = [self._search(query, limit) for query in queries]
        return [
            self._candidates(answer, limit, f"{self._name}, query {position}")
            for position, answer in enumerate(answers)
        ]

    async def aretrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """:meth:`retrieve` with the store's (or retriever's) async search."""
        query, limit = check_request(query, limit)
        source = self._source
        if self._kind == "retriever":
            answer = self._scored(await source.ainvoke(query))
        else:
            try:
                if self._score_mode == "relevance":
                    answer = await source.asimilarity_search_with_relevance_scores(query, k=limit, **self._search_kwargs)
                else:
                    answer = await source.asimilarity_search_with_score(query, k=limit, **self._search_kwargs)
            except NotImplementedError as error:
                raise self._unsupported(error) from error
            answer = self._from_store(answer)
        return self._candidates(answer, limit, self._name)

    def _search(self, query: str, limit: int) -> List[Tuple[Any, Any]]:
        """``(document, score)`` pairs in the store's order, scores higher-is-better."""
        source = self._source
        if self._kind == "retriever":
            return self._scored(source.invoke(query))
        try:
            if self._score_mode == "relevance":
                answer = source.similarity_search_with_relevance_scores(query, k=limit, **self._search_kwargs)
            else:
                answer = source.similarity_search_with_score(query, k=limit, **self._search_kwargs)
        except NotImplementedError as error:
            raise self._unsupported(error) from error
        return self._from_store(answer)

    def _from_store(self, answer: Any) -> List[Tuple[Any, Any]]:
        pairs = []
        for rank, item in enumerate(answer):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise MapMatchedValueError(
                    f"{self._name} returned {item!r} at rank {rank}; expected (Document, score) pairs"
                )
            document, score = item
            pairs.append((document, distance_to_score(score) if self._score_mode == "distance" else score))
        return pairs

    def _scored(self, documents: Any) -> List[Tuple[Any, Any]]:
        """Scores for a retriever's documents: from metadata, or ``-rank``."""
        pairs = []
        for rank, document in enumerate(documents):
            if self._score_mode == "rank":
                pairs.append((document, float(-rank)))
                continue
            metadata = getattr(document, "metadata", None)
            if not isinstance(metadata, Mapping) or self._score_field not in metadata:
                keys = sorted(metadata) if isinstance(metadata, Mapping) else []
                raise MapMatchedValueError(
                    f"{self._name} returned a document without the score field {self._score_field!r} at rank "
                    f"{rank} (its metadata keys: {keys})"
                )
            pairs.append((document, metadata[self._score_field]))
        return pairs

    def _chunk_id(self, document: Any, where: str) -> Any:
        if not isinstance(document, self._document_type):
            raise MapMatchedValueError(f"{where}: expected a langchain_core Document, got {type(document).__name__}")
        if self._chunk_id_field is None:
            if document.id is None:
                raise MapMatchedValueError(
                    f"{where}: the Document has no id; set chunk_id_field= to the metadata key holding chunk IDs"
                )
            return document.id
        return chunk_id_from_field(document.metadata, self._chunk_id_field, f"{where}: the Document")

    def _candidates(self, pairs: List[Tuple[Any, Any]], limit: int, source: str) -> Tuple[ScoredCandidate, ...]:
        ids = [self._chunk_id(document, f"{source}, rank {rank}") for rank, (document, _) in enumerate(pairs)]
        candidates = ranked_candidates(zip(ids, (score for _, score in pairs)), limit, source)
        self._memory.remember(zip(ids, (document for document, _ in pairs)))
        return candidates

    def _no_relevance(self, store: Any) -> MapMatchedValueError:
        return MapMatchedValueError(
            f"{type(store).__name__} gives no relevance scores (similarity_search_with_relevance_scores is not "
            "implemented): pass score_mode='similarity' if its similarity_search_with_score returns similarities "
            "(higher is better, e.g. InMemoryVectorStore), or score_mode='distance' if it returns distances "
            "(lower is better, e.g. FAISS with L2, Chroma)"
        )

    def _unsupported(self, error: NotImplementedError) -> MapMatchedValueError:
        if self._score_mode == "relevance":
            return self._no_relevance(self._source)
        return MapMatchedValueError(
            f"{type(self._source).__name__} does not implement similarity_search_with_score ({error}); "
            "try score_mode='relevance'"
        )

    # ----------------------------------------------------------------- text of chunks

    def get_documents(self, chunk_ids: Iterable[str]) -> Dict[str, Any]:
        """The ``Document`` of each chunk ID this provider knows, as ``{chunk_id: Document}``.

        Known: the documents searches returned (as many as ``remember=`` keeps), and,
        for a vector store that implements ``get_by_ids``, documents fetched by chunk ID
        in one call -- kept only when the fetched document's own chunk ID (by
        ``chunk_id_field``) is the one asked for, so a store whose IDs are not chunk IDs
        returns nothing here. IDs the store did not have are remembered as absent and
        not asked again (until :meth:`forget`, or until newer marks push them out).
        Unknown IDs are left out. A ``get_by_ids`` that raises is a ``UserWarning``
        naming the chunks and the error; they are left out and asked again next time.
        """
        return self._memory.lookup(chunk_ids, self._fetch if self._kind == "vector store" else None, self._name)

    def _fetch(self, missing: List[str]) -> Dict[str, Any]:
        """``{chunk_id: Document}`` from the store's ``get_by_ids`` for the chunk IDs it has."""
        try:
            fetched = self._source.get_by_ids(missing)
        except NotImplementedError:
            return {}
        wanted, found = set(missing), {}
        for document in fetched:
            try:
                chunk_id = self._chunk_id(document, self._name)
            except MapMatchedValueError:
                continue
            if chunk_id in wanted and chunk_id not in found:
                found[chunk_id] = document
        return found


# --------------------------------------------------------------------------- the retriever adapter


@functools.lru_cache(maxsize=None)
def _retriever_class() -> type:
    """Build the ``BaseRetriever`` subclass (langchain-core is needed at class creation)."""
    documents, retrievers, _ = _langchain("as_langchain_retriever")
    config_list = import_optional("langchain_core.runnables.config", _EXTRA, "as_langchain_retriever").get_config_list
    Document, BaseRetriever = documents.Document, retrievers.BaseRetriever

    class MapMatchedLangChainRetriever(ConversationViews, BaseRetriever):
        """A LangChain ``BaseRetriever`` over one map-matched conversation.

        Built by :func:`as_langchain_retriever` (see there). ``invoke(query)`` runs
        one turn and returns ``Document`` objects in context order; ``batch(queries)``
        runs one turn per query, in order.
        """

        conversation: Any
        lookup: Any = None
        missing_text: str = "skip"
        metadata_key: str = "map_matched"

        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> List[Any]:
            return self._answer(query, self.to_documents)

        async def _aget_relevant_documents(self, query: str, *, run_manager: Any) -> List[Any]:
            return await self._aanswer(query, self.to_documents)

        def to_documents(self, result: RetrievalResult) -> List[Any]:
            """``Document`` objects for a turn's context, in context order: the decoded
            chunk always (with empty text when unknown), the others as
            ``missing_text`` says. Never raises for a chunk (see the module docstring)."""
            out = []
            for entry, content in context_contents(
                result, self.conversation.provider, self.lookup, lookup_name="documents", method="get_documents",
                accept=(Document, str), missing_text=self.missing_text, feature="as_langchain_retriever",
                score_normalization=self.conversation.retriever.score_normalization,
            ):
                if isinstance(content, Document):
                    text, metadata, document_id = content.page_content, copy.deepcopy(content.metadata), content.id
                else:
                    text, metadata, document_id = content or "", {}, entry.chunk_id
                metadata[self.metadata_key] = entry_metadata(entry, result, content is not None)
                out.append(Document(page_content=text, metadata=metadata, id=document_id))
            return out

        def batch_as_completed(
            self, inputs: Sequence[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
        ) -> Iterator[Tuple[int, Any]]:
            """One turn per input, one after another in input order (yields
            ``(index, documents or exception)``)."""
            inputs = list(inputs)
            for index, (value, one) in enumerate(zip(inputs, config_list(config, len(inputs)) if inputs else [])):
                try:
                    output = self.invoke(value, one, **kwargs)
                except Exception as error:
                    if not return_exceptions:
                        raise
                    output = error
                yield index, output

        def batch(
            self, inputs: List[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
        ) -> List[Any]:
            """One turn per input, one after another in input order; the results in that
            order (an exception in place of a failed turn with ``return_exceptions``)."""
            return [out for _, out in self.batch_as_completed(inputs, config, return_exceptions=return_exceptions, **kwargs)]

        async def abatch_as_completed(
            self, inputs: Sequence[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
        ) -> AsyncIterator[Tuple[int, Any]]:
            """:meth:`batch_as_completed` with ``ainvoke``: each turn is awaited before the next."""
            inputs = list(inputs)
            for index, (value, one) in enumerate(zip(inputs, config_list(config, len(inputs)) if inputs else [])):
                try:
                    output = await self.ainvoke(value, one, **kwargs)
                except Exception as error:
                    if not return_exceptions:
                        raise
                    output = error
                yield index, output

        async def abatch(
            self, inputs: List[Any], config: Any = None, *, return_exceptions: bool = False, **kwargs: Any
        ) -> List[Any]:
            """:meth:`batch` with ``ainvoke``: each turn is awaited before the next."""
            iterator = self.abatch_as_completed(inputs, config, return_exceptions=return_exceptions, **kwargs)
            return [out async for _, out in iterator]

        @classmethod
        def from_pretrained(
            cls, path: Any, *, graph: Any, provider: Any = None, embedder: Any = None, strict: bool = True,
            session_id: Any = None, engine_options: Any = None, **adapter_options: Any,
        ) -> Any:
            """A retriever over a fitted model directory (``mapmatched-torch fit --out DIR``): the
            conversation is a ``MapMatchedRetriever.from_pretrained`` session, or with ``session_id``
            a ``MapMatchedServer.from_pretrained`` server's (``engine_options``: their other keyword
            arguments); ``adapter_options`` are :func:`as_langchain_retriever`'s (``documents``, ...)."""
            engine = pretrained_engine(path, graph=graph, provider=provider, embedder=embedder, strict=strict,
                                       session_id=session_id, options=engine_options)
            return as_langchain_retriever(engine, session_id=session_id, **adapter_options)

    MapMatchedLangChainRetriever.__module__ = __name__
    return MapMatchedLangChainRetriever


def as_langchain_retriever(
    engine: Any,
    *,
    session_id: Any = None,
    documents: Any = None,
    missing_text: str = "skip",
    metadata_key: str = "map_matched",
) -> Any:
    """A LangChain ``BaseRetriever`` that runs one map-matched turn per query.

    Args:
        engine: the conversation: a :class:`~mapmatched_torch.MapMatchedSession`, a
            :class:`~mapmatched_torch.MapMatchedRetriever` (a new session is opened),
            or a :class:`~mapmatched_torch.serving.MapMatchedServer` with
            ``session_id``. It needs a provider (e.g. a :class:`LangChainProvider`).
        session_id: the conversation in a server (opened here, once every argument
            has been checked, if the server does not have it yet); refused for a
            session.
        documents: optional text for chunks: a mapping or a callable chunk ID ->
            ``Document`` or ``str`` (None when unknown). Asked before the provider's
            memory (:meth:`LangChainProvider.get_documents`). Needed for any text
            with a provider that keeps none (Qdrant, Chroma, FAISS, ...): without it
            such an adapter warns when built.
        missing_text: ``"skip"`` (default) leaves out a context chunk other than the
            decoded one whose text is unknown; ``"empty"`` returns it with empty
            ``page_content``. The decoded chunk is always returned; either way an
            unknown text shows as ``metadata[metadata_key]["text_known"] = False``.
        metadata_key: the metadata key of the per-chunk report (see the module
            docstring); the store's own metadata is kept beside it.

    Returns:
        A ``MapMatchedLangChainRetriever`` (a ``langchain_core`` ``BaseRetriever``):
        ``invoke(query)`` and ``ainvoke(query)`` decode one turn and return
        ``Document`` objects in context order -- the decoded chunk, its graph
        neighbourhood, the turn's other candidates in provider order -- never an empty
        list. ``batch(queries)`` / ``abatch`` take the queries as consecutive turns, in
        order. ``.trace``, ``.last_result``, ``.session`` / ``.server`` give the
        decoding behind them. The text of chunks is looked up after the turn is
        decoded; a failing lookup is a warning, not an error (the turn stands).

    Raises:
        MissingDependencyError: langchain-core is not installed (the ``[langchain]``
            extra).
        ValueError: an engine without a provider, a bad ``session_id`` /
            ``missing_text`` / ``metadata_key`` / ``documents``; at ``invoke``, an empty
            query (the conversation is unchanged).
        RuntimeError: ``invoke`` while the same conversation is taking another turn.

    Warns:
        UserWarning: when built, if no chunk's text can be known (no ``documents``
            and a provider without ``get_documents``); at ``invoke``, for each chunk
            whose text lookup failed.

    Example:
        >>> from langchain_core.documents import Document
        >>> from langchain_core.embeddings import DeterministicFakeEmbedding
        >>> from langchain_core.vectorstores import InMemoryVectorStore
        >>> from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever
        >>> store = InMemoryVectorStore(DeterministicFakeEmbedding(size=8))
        >>> _ = store.add_documents([Document(t, metadata={"chunk_id": t}) for t in ("a", "b")])
        >>> graph = InMemoryCorpusGraph.from_edges([("a", "b")])
        >>> provider = LangChainProvider(store, score_mode="similarity")
        >>> retriever = as_langchain_retriever(MapMatchedRetriever(graph, provider=provider))
        >>> [d.metadata["map_matched"]["role"] for d in retriever.invoke("a")]
        ['decoded', 'candidate']
    """
    _langchain("as_langchain_retriever")  # probed on every call: fail before any side effect
    cls = _retriever_class()
    conversation, lookup, missing_text, metadata_key = adapter_arguments(
        engine, session_id, documents, text_name="documents", method="get_documents", missing_text=missing_text,
        metadata_key=metadata_key, feature="as_langchain_retriever",
    )
    return cls(conversation=conversation, lookup=lookup, missing_text=missing_text, metadata_key=metadata_key)


def __getattr__(name: str) -> Any:
    if name == "MapMatchedLangChainRetriever":
        return _retriever_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
