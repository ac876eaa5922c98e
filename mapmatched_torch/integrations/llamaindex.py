"""LlamaIndex, both ways (the ``[llamaindex]`` extra: ``llama-index-core``).

- :class:`LlamaIndexProvider`: candidates for map-matched decoding from a LlamaIndex
  retriever (or a ``VectorStoreIndex``) the user already has.
- :func:`as_llamaindex_retriever`: a real ``llama_index.core`` ``BaseRetriever`` whose
  ``retrieve(query)`` / ``aretrieve(query)`` runs one map-matched turn of a
  conversation and returns ``NodeWithScore`` objects in context order, decoded chunk
  first.

llama-index-core is imported when a provider or retriever is built, never when this
module (or ``mapmatched_torch``) is imported; without it both raise
:class:`~mapmatched_torch.core.errors.MissingDependencyError` (an ``ImportError``) naming
the ``[llamaindex]`` extra.

Decisions:

- Scores: ``NodeWithScore.score`` is taken as "higher is better"
  (``score_mode="similarity"``, the default; LlamaIndex's vector retrievers return
  similarities); ``score_mode="distance"`` negates it for a retriever that returns
  distances; ``score_mode="rank"`` ignores it and scores by rank (0, -1, -2, ...).
  A node whose score is None (many non-vector retrievers give none) is an error that
  names ``score_mode="rank"``.
- Chunk IDs: ``node.node_id`` by default (``chunk_id_field=None``), or a metadata
  field of the node.
- Limits: a ``VectorStoreIndex`` is asked with ``similarity_top_k=limit`` (a retriever
  is made from it on every call, so nodes inserted later are seen); a retriever
  returns as many nodes as it is configured to (its ``similarity_top_k``), and the
  provider keeps the first ``limit`` after sorting by (-score, rank).
- Text of context chunks and the per-chunk report: as for LangChain (see
  :mod:`mapmatched_torch.integrations.langchain`). The text comes from the user's
  ``nodes`` (a mapping or callable), then the provider's memory of the nodes it has
  returned (bounded: ``remember=``), then, for a ``VectorStoreIndex``, its docstore
  (kept only when the node's own chunk ID is the one asked for). The decoded chunk is
  always returned, first, as an empty ``TextNode`` with ``text_known=False`` when its
  text is unknown; another unknown chunk is left out (``missing_text="skip"``,
  default) or returned the same way (``"empty"``). A provider that keeps no nodes
  (Qdrant, Chroma, FAISS, ...) needs ``nodes=`` for any text; the adapter warns once,
  when built, if it has no text source at all. A text lookup that fails after the
  turn was decoded is a ``UserWarning`` naming the chunk and the error, and its text
  counts as unknown: the turn stands and its nodes are returned.
- Returned nodes are deep copies of the known nodes (the originals are never
  mutated) with ``metadata["map_matched"]`` added and excluded from the LLM and
  embedding views of the node, so the trace never reaches a prompt. The list order,
  not the score, is the context order.
- ``NodeWithScore.score`` is the chunk's ``raw_score`` this turn: the score the
  engine's provider gave it, "higher is better", before the decoder's normalization.
  With a :class:`LlamaIndexProvider` that is, per ``score_mode``: ``"similarity"``
  the wrapped retriever's own score; ``"distance"`` its negation ``0.0 - d`` (a
  cutoff on distances ``d <= c`` becomes ``score >= -c``); ``"rank"`` ``-rank`` (0,
  -1, -2, ... in the retriever's order), which means nothing to a similarity cutoff.
  Other providers give their own higher-is-better scores (e.g. Qdrant's
  similarity or negated distance, fused reciprocal-rank scores). A chunk that was not
  a candidate this turn (role ``"neighbor"``) has ``score=None``, so LlamaIndex's
  ``SimilarityPostprocessor(similarity_cutoff=...)`` drops every neighbour, and it
  may drop the decoded chunk too, whose score need not be the highest: apply score
  cutoffs to the wrapped retriever, not after this one.
- One adapter is one conversation; a conversation takes one turn at a time (a
  concurrent second ``retrieve``/``aretrieve`` raises
  :class:`~mapmatched_torch.core.errors.MapMatchedRuntimeError`). ``aretrieve`` awaits the
  provider's async retrieval and decodes in the default executor (cancelled while
  decoding, the turn still completes and stands).

The adapter's class, ``MapMatchedLlamaIndexRetriever``, subclasses llama-index-core's
``BaseRetriever``, so it is built on first use;
``providers.llamaindex.MapMatchedLlamaIndexRetriever`` returns it (for ``isinstance`` checks).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

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
    Conversation,
    ConversationViews,
    adapter_arguments,
    pretrained_engine,
)
from ._turn_report import context_contents, entry_metadata

__all__ = ["LlamaIndexProvider", "as_llamaindex_retriever", "SCORE_MODES"]

#: The accepted values of ``score_mode``.
SCORE_MODES = ("similarity", "distance", "rank")

_EXTRA = "llamaindex"


def _llamaindex(feature: str) -> Tuple[Any, Any, Any]:
    """``(core, schema, retrievers)`` modules of llama-index-core, or
    MissingDependencyError naming the ``[llamaindex]`` extra."""
    return (
        import_optional("llama_index.core", _EXTRA, feature),
        import_optional("llama_index.core.schema", _EXTRA, feature),
        import_optional("llama_index.core.retrievers", _EXTRA, feature),
    )


class LlamaIndexProvider(FrameworkProvider):
    """Candidates from a LlamaIndex retriever or ``VectorStoreIndex`` (``CandidateProvider``).

    Args:
        source: a ``llama_index.core`` ``BaseRetriever`` (e.g.
            ``index.as_retriever(similarity_top_k=20)``), or a ``VectorStoreIndex``
            (asked with ``similarity_top_k=limit``).
        chunk_id_field: None (default) takes ``node.node_id``; a string names the node
            metadata key holding the chunk ID.
        score_mode: ``"similarity"`` (default: ``NodeWithScore.score`` as is, higher is
            better), ``"distance"`` (negated) or ``"rank"`` (0, -1, -2, ... in the
            retriever's order; for retrievers that give no scores).
        remember: keep the returned nodes by chunk ID, for the text of context
            chunks (see :meth:`get_nodes`): True (default) keeps the latest 65536
            (:data:`~mapmatched_torch.integrations._chunk_text.DEFAULT_MEMORY`), an
            int that many, False none. As many chunk IDs the docstore did not have are
            remembered too; the least recently used go first, and :meth:`forget`
            drops both.

    Results are sorted by (-score, rank) and hold at most ``limit`` candidates.

    Example:
        >>> from llama_index.core import VectorStoreIndex
        >>> from llama_index.core.embeddings import MockEmbedding
        >>> from llama_index.core.schema import TextNode
        >>> nodes = [TextNode(id_="a", text="alpha"), TextNode(id_="b", text="beta")]
        >>> index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=4))
        >>> provider = LlamaIndexProvider(index)
        >>> sorted(c.chunk_id for c in provider.retrieve("alpha", 5))
        ['a', 'b']
        >>> provider.get_nodes(["b"])["b"].get_content()
        'beta'
    """

    def __init__(
        self,
        source: Any,
        *,
        chunk_id_field: Optional[str] = None,
        score_mode: str = "similarity",
        remember: Union[bool, int] = True,
    ) -> None:
        core, schema, retrievers = _llamaindex("LlamaIndexProvider")
        self._schema = schema
        check_name(chunk_id_field, "chunk_id_field", optional=True)
        self._memory = TextMemory(check_remember(remember))
        check_choice("score mode", score_mode, SCORE_MODES)
        if isinstance(source, core.VectorStoreIndex):
            self._kind = "index"
        elif isinstance(source, retrievers.BaseRetriever):
            self._kind = "retriever"
        else:
            raise MapMatchedValueError(
                f"LlamaIndexProvider takes a llama_index.core BaseRetriever or VectorStoreIndex, "
                f"got {type(source).__name__}"
            )
        self._source = source
        self._chunk_id_field = chunk_id_field
        self._score_mode = score_mode
        self._name = f"LlamaIndex {self._kind} {type(source).__name__}"

    def _retriever(self, limit: int) -> Any:
        if self._kind == "index":
            return self._source.as_retriever(similarity_top_k=limit)
        return self._source

    def retrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """The ``CandidateProvider`` protocol: retrieve and return up to ``limit``
        candidates sorted by (-score, rank)."""
        query, limit = check_request(query, limit)
        return self._candidates(self._retriever(limit).retrieve(query), limit, self._name)

    def retrieve_batch(self, queries: Sequence[str], limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve` for many queries, one after the other."""
        queries, limit = check_batch(queries, limit)
        retriever = self._retriever(limit) if queries else None
        return [
            self._candidates(retriever.retrieve(query), limit, f"{self._name}, query {position}")
            for position, query in enumerate(queries)
        ]

    async def aretrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """:meth:`retrieve` with the retriever's ``aretrieve``."""
        query, limit = check_request(query, limit)
        return self._candidates(await self._retriever(limit).aretrieve(query), limit, self._name)

    def _chunk_id(self, node: Any, where: str) -> Any:
        if not isinstance(node, self._schema.BaseNode):
            raise MapMatchedValueError(f"{where}: expected a llama_index BaseNode, got {type(node).__name__}")
        if self._chunk_id_field is None:
            return node.node_id
        return chunk_id_from_field(node.metadata, self._chunk_id_field, f"{where}: node {node.node_id!r}")

    def _candidates(self, scored_nodes: Any, limit: int, source: str) -> Tuple[ScoredCandidate, ...]:
        nodes, hits = [], []
        for rank, item in enumerate(scored_nodes):
            where = f"{source}, rank {rank}"
            if not isinstance(item, self._schema.NodeWithScore):
                raise MapMatchedValueError(f"{where}: expected a NodeWithScore, got {type(item).__name__}")
            chunk_id = self._chunk_id(item.node, where)
            score = item.score
            if self._score_mode == "rank":
                score = float(-rank)
            elif score is None:
                raise MapMatchedValueError(
                    f"{where}: node {item.node.node_id!r} has no score (the retriever gives none); pass "
                    "score_mode='rank' to score nodes by their rank (0, -1, -2, ...)"
                )
            elif self._score_mode == "distance":
                score = distance_to_score(score)
            nodes.append(item.node)
            hits.append((chunk_id, score))
        candidates = ranked_candidates(hits, limit, source)
        self._memory.remember((chunk_id, node) for (chunk_id, _), node in zip(hits, nodes))
        return candidates

    def get_nodes(self, chunk_ids: Iterable[str]) -> Dict[str, Any]:
        """The node of each chunk ID this provider knows, as ``{chunk_id: BaseNode}``.

        Known: the nodes retrievals returned (as many as ``remember=`` keeps), and, for
        a ``VectorStoreIndex``, nodes in its docstore under the chunk ID -- kept only
        when the node's own chunk ID (by ``chunk_id_field``) is the one asked for. IDs
        the docstore did not have are remembered as absent and not asked again (until
        :meth:`forget`, or until newer marks push them out). Unknown IDs are left out;
        a docstore that raises is a ``UserWarning`` naming the chunks and the error.
        """
        return self._memory.lookup(chunk_ids, self._fetch if self._kind == "index" else None, self._name)

    def _fetch(self, missing: List[str]) -> Dict[str, Any]:
        """``{chunk_id: node}`` from the index's docstore for the chunk IDs it has."""
        found = {}
        for chunk_id in missing:
            node = self._source.docstore.get_node(chunk_id, raise_error=False)
            try:
                matches = node is not None and self._chunk_id(node, self._name) == chunk_id
            except MapMatchedValueError:
                matches = False
            if matches:
                found[chunk_id] = node
        return found


# --------------------------------------------------------------------------- the retriever adapter


@functools.lru_cache(maxsize=None)
def _retriever_class() -> type:
    """Build the ``BaseRetriever`` subclass (llama-index-core is needed at class creation)."""
    _, schema, retrievers = _llamaindex("as_llamaindex_retriever")
    BaseNode, NodeWithScore, TextNode = schema.BaseNode, schema.NodeWithScore, schema.TextNode

    class MapMatchedLlamaIndexRetriever(ConversationViews, retrievers.BaseRetriever):
        """A LlamaIndex ``BaseRetriever`` over one map-matched conversation.

        Built by :func:`as_llamaindex_retriever` (see there). ``retrieve(query)`` runs
        one turn and returns ``NodeWithScore`` objects in context order; a graph
        neighbour that was not a candidate this turn has ``score=None``.
        """

        def __init__(self, conversation: Conversation, lookup: Any, missing_text: str, metadata_key: str,
                     callback_manager: Any = None, verbose: bool = False) -> None:
            super().__init__(callback_manager=callback_manager, verbose=verbose)
            self.conversation = conversation
            self._lookup = lookup
            self._missing_text = missing_text
            self._metadata_key = metadata_key

        def _retrieve(self, query_bundle: Any) -> List[Any]:
            return self._answer(query_bundle.query_str, self.to_nodes)

        async def _aretrieve(self, query_bundle: Any) -> List[Any]:
            return await self._aanswer(query_bundle.query_str, self.to_nodes)

        def to_nodes(self, result: RetrievalResult) -> List[Any]:
            """``NodeWithScore`` objects for a turn's context, in context order: the
            decoded chunk always (an empty ``TextNode`` when its text is unknown), the
            others as ``missing_text`` says. ``score`` is the chunk's ``raw_score``
            this turn, and None for a neighbour that was not a candidate (role
            ``"neighbor"``: it has no retriever score, so a similarity cutoff after
            this retriever drops it). Never raises for a chunk (see the module
            docstring)."""
            key = self._metadata_key
            out = []
            for entry, content in context_contents(
                result, self.conversation.provider, self._lookup, lookup_name="nodes", method="get_nodes",
                accept=(BaseNode, NodeWithScore, str), missing_text=self._missing_text,
                feature="as_llamaindex_retriever",
                score_normalization=self.conversation.retriever.score_normalization,
            ):
                if isinstance(content, NodeWithScore):
                    content = content.node
                if isinstance(content, BaseNode):
                    node = content.model_copy(deep=True)
                else:
                    node = TextNode(id_=entry.chunk_id, text=content or "")
                node.metadata[key] = entry_metadata(entry, result, content is not None)
                for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
                    if key not in excluded:
                        excluded.append(key)
                score = None if entry.candidate is None else entry.candidate.raw_score
                out.append(NodeWithScore(node=node, score=score))
            return out

        @classmethod
        def from_pretrained(
            cls, path: Any, *, graph: Any, provider: Any = None, embedder: Any = None, strict: bool = True,
            session_id: Any = None, engine_options: Any = None, **adapter_options: Any,
        ) -> Any:
            """A retriever over a fitted model directory (``mapmatched-torch fit --out DIR``): the
            conversation is a ``MapMatchedRetriever.from_pretrained`` session, or with ``session_id``
            a ``MapMatchedServer.from_pretrained`` server's (``engine_options``: their other keyword
            arguments); ``adapter_options`` are :func:`as_llamaindex_retriever`'s (``nodes``, ...)."""
            engine = pretrained_engine(path, graph=graph, provider=provider, embedder=embedder, strict=strict,
                                       session_id=session_id, options=engine_options)
            return as_llamaindex_retriever(engine, session_id=session_id, **adapter_options)

    MapMatchedLlamaIndexRetriever.__module__ = __name__
    return MapMatchedLlamaIndexRetriever


def as_llamaindex_retriever(
    engine: Any,
    *,
    session_id: Any = None,
    nodes: Any = None,
    missing_text: str = "skip",
    metadata_key: str = "map_matched",
    callback_manager: Any = None,
) -> Any:
    """A LlamaIndex ``BaseRetriever`` that runs one map-matched turn per query.

    Args:
        engine: the conversation: a :class:`~mapmatched_torch.MapMatchedSession`, a
            :class:`~mapmatched_torch.MapMatchedRetriever` (a new session is opened),
            or a :class:`~mapmatched_torch.serving.MapMatchedServer` with
            ``session_id``. It needs a provider (e.g. a :class:`LlamaIndexProvider`).
        session_id: the conversation in a server (opened here, once every argument
            has been checked, if the server does not have it yet); refused for a
            session.
        nodes: optional text for chunks: a mapping or a callable chunk ID ->
            ``BaseNode``, ``NodeWithScore`` or ``str`` (None when unknown). Asked before
            the provider's memory (:meth:`LlamaIndexProvider.get_nodes`). Needed for
            any text with a provider that keeps none (Qdrant, Chroma, FAISS, ...):
            without it such an adapter warns when built.
        missing_text: ``"skip"`` (default) leaves out a context chunk other than the
            decoded one whose text is unknown; ``"empty"`` returns it as an empty
            ``TextNode``. The decoded chunk is always returned; either way an unknown
            text shows as ``metadata[metadata_key]["text_known"] = False``.
        metadata_key: the node metadata key of the per-chunk report (see
            :func:`~mapmatched_torch.integrations.langchain.as_langchain_retriever`).
        callback_manager: passed to LlamaIndex's ``BaseRetriever``.

    Returns:
        A ``MapMatchedLlamaIndexRetriever``: ``retrieve(query)`` and
        ``aretrieve(query)`` decode one turn and return ``NodeWithScore`` objects in
        context order (decoded chunk, graph neighbourhood, the turn's other candidates
        in provider order) -- never an empty list; score = the chunk's ``raw_score``
        this turn, None for a neighbour (see the module docstring for what that is per
        provider and ``score_mode``, and for similarity cutoffs). ``.trace``,
        ``.last_result``, ``.session`` / ``.server`` give the decoding behind them.

    Raises:
        MissingDependencyError: llama-index-core is not installed (the
            ``[llamaindex]`` extra).
        ValueError: an engine without a provider, a bad ``session_id`` /
            ``missing_text`` / ``metadata_key`` / ``nodes``; at ``retrieve``, an empty
            query (the conversation is unchanged).
        RuntimeError: ``retrieve`` while the same conversation is taking another turn.

    Warns:
        UserWarning: when built, if no chunk's text can be known (no ``nodes`` and a
            provider without ``get_nodes``); at ``retrieve``, for each chunk whose
            text lookup failed.

    Example:
        >>> from llama_index.core import VectorStoreIndex
        >>> from llama_index.core.embeddings import MockEmbedding
        >>> from llama_index.core.schema import TextNode
        >>> from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever
        >>> index = VectorStoreIndex([TextNode(id_=i, text=i) for i in "ab"], embed_model=MockEmbedding(embed_dim=4))
        >>> graph = InMemoryCorpusGraph.from_edges([("a", "b")])
        >>> retriever = as_llamaindex_retriever(MapMatchedRetriever(graph, provider=LlamaIndexProvider(index)))
        >>> [n.node.metadata["map_matched"]["role"] for n in retriever.retrieve("a")]
        ['decoded', 'candidate']
    """
    _llamaindex("as_llamaindex_retriever")  # probed on every call: fail before any side effect
    cls = _retriever_class()
    conversation, lookup, missing_text, metadata_key = adapter_arguments(
        engine, session_id, nodes, text_name="nodes", method="get_nodes", missing_text=missing_text,
        metadata_key=metadata_key, feature="as_llamaindex_retriever",
    )
    return cls(conversation, lookup, missing_text, metadata_key, callback_manager=callback_manager)


def __getattr__(name: str) -> Any:
    if name == "MapMatchedLlamaIndexRetriever":
        return _retriever_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
