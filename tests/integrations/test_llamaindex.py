"""LlamaIndex both ways: LlamaIndexProvider and as_llamaindex_retriever, against llama-index-core."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest

pytest.importorskip("llama_index.core", reason="llama-index-core is not installed (the [llamaindex] extra)")

from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402
from llama_index.core.retrievers import BaseRetriever  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode  # noqa: E402

from mapmatched_torch import MapMatchedRetriever, ScoredCandidate  # noqa: E402
from mapmatched_torch.core.errors import MapMatchedRuntimeError  # noqa: E402
from mapmatched_torch.core.protocols import CandidateProvider  # noqa: E402
from mapmatched_torch.integrations.llamaindex import LlamaIndexProvider, as_llamaindex_retriever  # noqa: E402
from mapmatched_torch.integrations import llamaindex as llamaindex_adapters  # noqa: E402
from mapmatched_torch.serving import MapMatchedServer  # noqa: E402

from ..providers_fixtures import (  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402
    IDS,
    LIMIT,
    QUERIES,
    QUERY_VECTORS,
    STORE_IDS,
    TABLE,
    TEXTS,
    VECTORS,
    chain_graph,
    check_adapter_needs_a_provider,
    check_async_conversation,
    check_batch_and_aretrieve_equal_retrieve,
    check_decoded_chunk_without_text,
    check_rejects_query,
    check_second_thread_refused,
    check_session_over_the_provider,
    missing_extra_errors,
    modules_loaded_by_importing,
    qdrant_provider,
    race_two_async_turns,
    score_pairs,
    session_options,
    store_graph,
)

# --------------------------------------------------------------------------- a small corpus (providers_fixtures)


class TableEmbedding(BaseEmbedding):
    """Embeds known texts by table lookup (offline, deterministic)."""

    def _get_query_embedding(self, query: str) -> List[float]:
        return TABLE[query]

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return TABLE[query]

    def _get_text_embedding(self, text: str) -> List[float]:
        return TABLE[text.rsplit("\n", 1)[-1]]  # the passage follows the node's metadata lines


def _nodes() -> List[TextNode]:
    return [TextNode(id_=chunk, text=TEXTS[chunk], metadata={"source": f"doc-{chunk}", "key": f"k-{chunk}"})
            for chunk in IDS]


def _index() -> VectorStoreIndex:
    return VectorStoreIndex(_nodes(), embed_model=TableEmbedding())


def _index_candidates(index: VectorStoreIndex, query: str, limit: int = LIMIT) -> List[ScoredCandidate]:
    """The candidates, computed without the provider: LlamaIndex's own retriever."""
    return [ScoredCandidate(hit.node.node_id, hit.score) for hit in index.as_retriever(similarity_top_k=limit).retrieve(query)]


def _plain_conversation() -> List[Any]:
    index = _index()
    session = MapMatchedRetriever(chain_graph(), **session_options()).session()
    return [session.retrieve_candidates(_index_candidates(index, query)) for query in QUERIES]


class ListRetriever(BaseRetriever):
    """A retriever that returns fixed (node, score) lists."""

    def __init__(self, hits: List[Tuple[Any, Any]]) -> None:
        super().__init__()
        self.hits = hits
        self.calls: List[str] = []

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        self.calls.append(query_bundle.query_str)
        return [item if not isinstance(item, tuple) else NodeWithScore(node=item[0], score=item[1]) for item in self.hits]


def _node(node_id: str, **metadata: Any) -> TextNode:
    return TextNode(id_=node_id, text=f"text of {node_id}", metadata=metadata)


# --------------------------------------------------------------------------- provider


def test_round_trips_ids_and_scores_from_a_vector_index_and_its_retriever() -> None:
    index = _index()
    for source in (index, index.as_retriever(similarity_top_k=LIMIT)):
        provider = LlamaIndexProvider(source)
        assert isinstance(provider, CandidateProvider)
        for query in QUERIES:
            got = provider.retrieve(query, LIMIT)
            assert score_pairs(got) == score_pairs(_index_candidates(index, query))
            q = QUERY_VECTORS[QUERIES.index(query)]
            cosine = VECTORS @ (q / np.linalg.norm(q))
            assert [c.score for c in got] == pytest.approx([cosine[IDS.index(c.chunk_id)] for c in got], abs=1e-12)


def test_an_index_is_asked_for_the_limit_and_a_retriever_is_cut_at_it() -> None:
    index = _index()
    assert len(LlamaIndexProvider(index).retrieve(QUERIES[0], 7)) == 7
    wide = LlamaIndexProvider(index.as_retriever(similarity_top_k=8))
    assert score_pairs(wide.retrieve(QUERIES[0], 3)) == score_pairs(_index_candidates(index, QUERIES[0], 3))
    narrow = LlamaIndexProvider(index.as_retriever(similarity_top_k=2))
    assert len(narrow.retrieve(QUERIES[0], 5)) == 2  # the retriever's own top-k caps it


def test_scores_sorting_distance_and_rank_modes() -> None:
    hits = [(_node("a"), 0.5), (_node("b"), 0.0), (_node("c"), 0.5), (_node("d"), 2.0)]
    assert score_pairs(LlamaIndexProvider(ListRetriever(hits)).retrieve("q", 4)) == \
        [("d", 2.0), ("a", 0.5), ("c", 0.5), ("b", 0.0)]
    distance = LlamaIndexProvider(ListRetriever(hits), score_mode="distance").retrieve("q", 3)
    assert score_pairs(distance) == [("b", 0.0), ("a", -0.5), ("c", -0.5)]
    assert np.copysign(1.0, distance[0].score) == 1.0
    no_scores = [(_node("a"), None), (_node("b"), None)]
    assert score_pairs(LlamaIndexProvider(ListRetriever(no_scores), score_mode="rank").retrieve("q", 5)) == \
        [("a", 0.0), ("b", -1.0)]


def test_a_node_without_a_score_is_a_clear_error() -> None:
    provider = LlamaIndexProvider(ListRetriever([(_node("a"), 0.3), (_node("b"), None)]))
    with pytest.raises(ValueError, match=r"LlamaIndex retriever ListRetriever, rank 1: node 'b' has no score .*"
                                         r"score_mode='rank'"):
        provider.retrieve("q", 2)


def test_chunk_ids_from_node_id_or_a_metadata_field() -> None:
    hits = [(_node("n1", key="k1"), 0.9), (_node("n2", key="k2"), 0.8)]
    assert [c.chunk_id for c in LlamaIndexProvider(ListRetriever(hits)).retrieve("q", 2)] == ["n1", "n2"]
    by_field = LlamaIndexProvider(ListRetriever(hits), chunk_id_field="key")
    assert [c.chunk_id for c in by_field.retrieve("q", 2)] == ["k1", "k2"]
    assert by_field.get_nodes(["k1"])["k1"].node_id == "n1"


@pytest.mark.parametrize(
    ("hits", "kwargs", "message"),
    [
        ([(_node("a"), 0.5)], {"chunk_id_field": "key"},
         r"rank 0: node 'a' has no metadata field 'key' \(its metadata keys: \[\]\)"),
        ([(_node("a", key=""), 0.5)], {"chunk_id_field": "key"},
         r"rank 0: node 'a' has metadata field 'key' = '', not a non-empty string chunk ID"),
        ([(_node("b", key="x"), 0.4), (_node("c", key="x"), 0.3)], {"chunk_id_field": "key"},
         r"chunk ID 'x' returned twice .* \(ranks 0 and 1\)"),
        ([(_node("a", key=3), 0.5)], {"chunk_id_field": "key"}, r"node 'a' has metadata field 'key' = 3, not a non"),
        ([NodeWithScore.model_construct(node=_node("a"), score="0.5")], {"score_mode": "distance"},
         r"rank 0 must be a real number, got str"),
        ([(_node("a"), float("nan"))], {}, r"must be finite, got nan \(chunk 'a'\)"),
        ([NodeWithScore.model_construct(node=_node("a"), score="0.5")], {}, r"must be a real number, got str"),
        ([(_node("a"), float("-inf"))], {"score_mode": "distance"}, r"must be finite, got -inf \(chunk 'a'\)"),
    ],
)
def test_bad_retriever_answers_are_rejected(hits: Any, kwargs: Dict[str, Any], message: str) -> None:
    provider = LlamaIndexProvider(ListRetriever(hits), **kwargs)
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q", 5)
    assert provider.get_nodes(["a", "b", "c", "x"]) == {}  # nothing from a rejected answer is remembered


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"score_mode": "relevance"}, r"unsupported score mode: relevance"),
        ({"chunk_id_field": ""}, r"chunk_id_field must be a non-empty string or None"),
    ],
)
def test_options_are_checked(kwargs: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaIndexProvider(ListRetriever([]), **kwargs)


def test_rejects_what_is_neither_a_retriever_nor_a_vector_index() -> None:
    with pytest.raises(ValueError, match="takes a llama_index.core BaseRetriever or VectorStoreIndex, got list"):
        LlamaIndexProvider([])


@pytest.mark.parametrize(("query", "message"), [("", "must not be empty"), (None, "must be a string")])
def test_rejects_bad_queries_and_limits(query: Any, message: str) -> None:
    retriever = ListRetriever([(_node("a"), 0.5)])
    provider = LlamaIndexProvider(retriever)
    check_rejects_query(provider, query, message)
    for limit, limit_message in ((0, "limit must be greater than zero, got 0"), (True, "limit must be an integer")):
        with pytest.raises(ValueError, match=limit_message):
            provider.retrieve("q", limit)
        with pytest.raises(ValueError, match=limit_message):
            provider.retrieve_batch(["q"], limit)
    with pytest.raises(ValueError, match="not a single string"):
        provider.retrieve_batch("q", 1)
    assert retriever.calls == []


def test_retrieve_batch_and_aretrieve_equal_retrieve() -> None:
    check_batch_and_aretrieve_equal_retrieve(LlamaIndexProvider(_index()))


def test_get_nodes_remembers_and_reads_the_index_docstore() -> None:
    index = _index()
    provider = LlamaIndexProvider(index)
    found = provider.get_nodes(["c9", "nope"])
    assert set(found) == {"c9"} and found["c9"].get_content() == TEXTS["c9"]
    by_field = LlamaIndexProvider(index, chunk_id_field="key")
    assert by_field.get_nodes(["c9"]) == {}  # node c9's chunk ID is "k-c9": not the one asked for
    retriever_only = LlamaIndexProvider(index.as_retriever(similarity_top_k=2))
    assert retriever_only.get_nodes(["c9"]) == {}
    seen = [c.chunk_id for c in retriever_only.retrieve(QUERIES[0], 2)]
    assert set(retriever_only.get_nodes(seen)) == set(seen)


def test_a_session_over_the_provider_equals_a_plain_session_fed_the_same_candidates() -> None:
    check_session_over_the_provider(LlamaIndexProvider(_index()), _plain_conversation())


# --------------------------------------------------------------------------- retriever adapter


def _adapter(source: Any = None, **kwargs: Any) -> Any:
    engine = kwargs.pop("engine", None)
    if engine is None:
        provider = LlamaIndexProvider(source if source is not None else _index())
        engine = MapMatchedRetriever(chain_graph(), provider=provider, **session_options())
    return as_llamaindex_retriever(engine, **kwargs)


def _ids(scored: Sequence[NodeWithScore]) -> List[str]:
    return [item.node.metadata["map_matched"]["chunk_id"] for item in scored]


def test_the_adapter_is_a_llamaindex_retriever_and_reports_each_chunk() -> None:
    retriever = _adapter()
    assert isinstance(retriever, BaseRetriever)
    assert isinstance(retriever, llamaindex_adapters.MapMatchedLlamaIndexRetriever)
    scored = retriever.retrieve(QUERIES[0])
    result = retriever.last_result
    assert all(isinstance(item, NodeWithScore) and isinstance(item.node, TextNode) for item in scored)
    assert _ids(scored) == list(result.context_chunk_ids)
    assert [item.node.node_id for item in scored] == list(result.context_chunk_ids)
    assert [item.node.get_content() for item in scored] == [TEXTS[c] for c in result.context_chunk_ids]
    candidates = {c.chunk_id: c for c in result.candidates}
    step = dataclasses.asdict(result.trace.steps[-1])
    roles = []
    for rank, item in enumerate(scored):
        report = item.node.metadata["map_matched"]
        chunk = report["chunk_id"]
        roles.append(report["role"])
        assert report["context_rank"] == rank and report["trace_step"] == step
        assert item.node.metadata["source"] == f"doc-{chunk}"  # the node's own metadata is kept
        if chunk in candidates:
            assert item.score == report["raw_score"] == candidates[chunk].score
        else:
            assert item.score is None and report["raw_score"] is None and report["role"] == "neighbor"
    assert roles[0] == "decoded" and {"candidate", "neighbor"} <= set(roles)
    # the report never reaches a prompt or an embedding
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        content = scored[0].node.get_content(metadata_mode=mode)
        assert "source" in content and "map_matched" not in content and "trace_step" not in content


def test_a_conversation_through_the_adapter_equals_the_plain_session() -> None:
    retriever = _adapter()
    expected = _plain_conversation()
    for query, plain in zip(QUERIES, expected):
        scored = retriever.retrieve(QueryBundle(query))
        assert _ids(scored) == list(plain.context_chunk_ids)
        assert retriever.last_result == plain
        assert {str(item.node.metadata["map_matched"]["trace_step"]) for item in scored} == \
            {str(dataclasses.asdict(plain.trace.steps[-1]))}
    assert retriever.trace.to_dict() == expected[-1].trace.to_dict()
    assert retriever.session.path == expected[-1].path


def test_aretrieve_decodes_the_same_conversation() -> None:
    retriever = _adapter()
    check_async_conversation(retriever, retriever.aretrieve, _ids, _plain_conversation())


def test_server_mode_equals_the_plain_session() -> None:
    server = MapMatchedServer(chain_graph(), provider=LlamaIndexProvider(_index()), **session_options())
    retriever = as_llamaindex_retriever(server, session_id=("tenant", 1))
    other = as_llamaindex_retriever(server, session_id=("tenant", 2))
    expected = _plain_conversation()
    for turn, (query, plain) in enumerate(zip(QUERIES, expected)):
        assert _ids(retriever.retrieve(query)) == list(plain.context_chunk_ids)
        if turn == 1:
            other.retrieve(QUERIES[0])
    assert server.trace(("tenant", 1)).to_dict() == expected[-1].trace.to_dict()
    assert server.turn_count(("tenant", 2)) == 1
    with pytest.raises(ValueError, match="needs session_id="):
        as_llamaindex_retriever(server)


def test_the_adapter_copies_nodes_and_never_mutates_the_originals() -> None:
    index = _index()
    provider = LlamaIndexProvider(index)
    retriever = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=provider, **session_options()))
    scored = retriever.retrieve(QUERIES[0])
    originals = provider.get_nodes(_ids(scored))
    for chunk, node in originals.items():
        assert "map_matched" not in node.metadata
        assert "map_matched" not in node.excluded_llm_metadata_keys
    assert index.docstore.get_node(_ids(scored)[0]).metadata == {"source": f"doc-{_ids(scored)[0]}",
                                                                 "key": f"k-{_ids(scored)[0]}"}


def test_unknown_text_is_skipped_or_returned_empty_and_nodes_fill_it_in() -> None:
    index = _index()
    source = index.as_retriever(similarity_top_k=LIMIT)  # a retriever: no docstore lookups
    skipping = _adapter(source)
    scored = skipping.retrieve(QUERIES[0])
    context = list(skipping.last_result.context_chunk_ids)
    candidates = [c.chunk_id for c in skipping.last_result.candidates]
    neighbors_only = [c for c in context if c not in candidates]
    assert neighbors_only
    assert _ids(scored) == [c for c in context if c in candidates]

    empty = _adapter(source, missing_text="empty")
    scored = empty.retrieve(QUERIES[0])
    assert _ids(scored) == context
    for item in scored:
        known = item.node.metadata["map_matched"]["chunk_id"] in candidates
        assert item.node.metadata["map_matched"]["text_known"] is known
        assert (item.node.get_content() != "") is known

    extra = {neighbors_only[0]: "neighbour text", candidates[0]: NodeWithScore(node=_node("other"), score=1.0)}
    given = _adapter(source, nodes=extra)
    by_id = {item.node.metadata["map_matched"]["chunk_id"]: item for item in given.retrieve(QUERIES[0])}
    assert by_id[neighbors_only[0]].node.get_content() == "neighbour text"
    assert by_id[neighbors_only[0]].node.node_id == neighbors_only[0]
    assert by_id[candidates[0]].node.get_content() == "text of other"
    # the default index source finds every chunk in the docstore
    assert _ids(_adapter(index).retrieve(QUERIES[0])) == context


def test_the_decoded_chunk_is_returned_even_when_no_text_is_known() -> None:
    # remember=False over a retriever (no docstore): no chunk's text is known
    provider = LlamaIndexProvider(_index().as_retriever(similarity_top_k=LIMIT), remember=False)
    engine = MapMatchedRetriever(chain_graph(), provider=provider, **session_options())
    for retriever in check_decoded_chunk_without_text(
        lambda missing_text: as_llamaindex_retriever(engine.session(), missing_text=missing_text),
        lambda retriever: [(n.node.get_content(), n.node.metadata["map_matched"]) for n in retriever.retrieve(QUERIES[0])],
    ):
        decoded = retriever.retrieve(QUERIES[1])[0]
        assert decoded.node.node_id == retriever.session.current_chunk_id
        assert decoded.score == decoded.node.metadata["map_matched"]["raw_score"] is not None


def test_node_scores_are_the_raw_provider_scores() -> None:
    hits = [(_node(chunk), distance) for chunk, distance in (("c3", 0.25), ("c4", 0.5), ("c8", 1.5))]
    for score_mode, expected in (("distance", {"c3": -0.25, "c4": -0.5, "c8": -1.5}),
                                 ("rank", {"c3": 0.0, "c4": -1.0, "c8": -2.0})):
        provider = LlamaIndexProvider(ListRetriever(hits), score_mode=score_mode)
        retriever = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=provider, **session_options()),
                             missing_text="empty")
        scored = retriever.retrieve("q")
        for item in scored:
            report = item.node.metadata["map_matched"]
            assert item.score == expected.get(report["chunk_id"]) == report["raw_score"]
            assert (item.score is None) is (report["role"] == "neighbor")
    # a similarity cutoff after the adapter drops every neighbour (score None)
    from llama_index.core.postprocessor import SimilarityPostprocessor

    kept = SimilarityPostprocessor(similarity_cutoff=-10.0).postprocess_nodes(scored)
    assert [item.node.metadata["map_matched"]["role"] for item in kept] == \
        [item.node.metadata["map_matched"]["role"] for item in scored if item.score is not None]
    assert "neighbor" in [item.node.metadata["map_matched"]["role"] for item in scored]


def test_a_provider_without_text_gives_the_decoded_chunk_and_warns_when_built() -> None:
    engine = MapMatchedRetriever(store_graph(), provider=qdrant_provider("Euclid"), candidate_limit=5)
    with pytest.warns(UserWarning, match=r"QdrantProvider has no get_nodes\(\) and no nodes= was given"):
        retriever = as_llamaindex_retriever(engine)
    for query in ("q0", "q1", "q4"):
        scored = retriever.retrieve(query)
        assert _ids(scored) == [retriever.session.current_chunk_id]
        assert scored[0].node.get_content() == "" and scored[0].node.metadata["map_matched"]["text_known"] is False
        assert scored[0].score <= 0.0  # Qdrant's negated Euclidean distance
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a text source: no warning
        given = as_llamaindex_retriever(engine, nodes={chunk: f"text {chunk}" for chunk in STORE_IDS})
        scored = given.retrieve("q0")
    assert [item.node.get_content() for item in scored] == [f"text {c}" for c in given.last_result.context_chunk_ids]


def test_a_failing_lookup_after_decoding_warns_and_the_turn_stands() -> None:
    def lookup(chunk_id: str) -> Any:
        raise TimeoutError(f"cache timeout for {chunk_id}")

    provider = LlamaIndexProvider(_index().as_retriever(similarity_top_k=LIMIT))
    retriever = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=provider, **session_options()),
                         nodes=lookup)
    with pytest.warns(UserWarning) as caught:
        scored = retriever.retrieve(QUERIES[0])
    assert retriever.session.turn_count == 1
    context = retriever.last_result.context_chunk_ids
    assert sorted(str(w.message) for w in caught) == sorted(
        f"as_llamaindex_retriever: no text for chunk {c!r}: nodes= raised TimeoutError: cache timeout for {c}; "
        "treated as unknown text" for c in context)
    candidates = [c.chunk_id for c in retriever.last_result.candidates]
    assert _ids(scored) == [c for c in retriever.last_result.context_chunk_ids if c in candidates]  # from memory
    assert all(item.node.get_content() == TEXTS[item.node.node_id] for item in scored)


def test_memory_is_bounded_and_forgotten_on_request() -> None:
    hits = [(_node("a"), 0.3), (_node("b"), 0.2), (_node("c"), 0.1)]
    retriever = ListRetriever(hits)
    provider = LlamaIndexProvider(retriever, remember=2)
    provider.retrieve("q", 3)
    assert set(provider.get_nodes(["a", "b", "c"])) == {"b", "c"}
    provider.get_nodes(["b"])
    retriever.hits = [(_node("d"), 0.5)]
    provider.retrieve("q", 1)
    assert set(provider.get_nodes(["a", "b", "c", "d"])) == {"b", "d"}
    provider.forget()
    assert provider.get_nodes(["b", "d"]) == {}
    with pytest.raises(ValueError, match=r"remember must be True, False or a capacity \(an int >= 0\), got -3"):
        LlamaIndexProvider(retriever, remember=-3)
    # absent docstore marks: bounded, and dropped by forget()
    index = _index()
    asked: List[str] = []
    real = index.docstore.get_node
    index.docstore.get_node = lambda node_id, raise_error=True: asked.append(node_id) or real(node_id, raise_error)
    by_index = LlamaIndexProvider(index, remember=1)
    assert by_index.get_nodes(["x"]) == {} and by_index.get_nodes(["x"]) == {} and asked == ["x"]
    assert by_index.get_nodes(["y"]) == {}  # pushes the mark of x out
    assert by_index.get_nodes(["x"]) == {} and asked == ["x", "y", "x"]
    by_index.forget()
    assert by_index.get_nodes(["x"]) == {} and asked[-1] == "x" and len(asked) == 4


def test_adapter_arguments_and_queries_are_checked() -> None:
    check_adapter_needs_a_provider(as_llamaindex_retriever)
    with pytest.raises(ValueError, match="takes a MapMatchedSession, a MapMatchedRetriever or a MapMatchedServer"):
        as_llamaindex_retriever(_index())
    with pytest.raises(ValueError, match="unsupported missing_text: drop"):
        _adapter(missing_text="drop")
    with pytest.raises(ValueError, match="nodes must be a mapping or a callable"):
        _adapter(nodes=3)
    # nodes= giving the wrong type: a warning per chunk, and the provider (the docstore) is asked instead
    retriever = _adapter(nodes=lambda chunk_id: 1.5)
    with pytest.warns(UserWarning, match=r"no text for chunk 'c\d': nodes= gave float, not BaseNode, NodeWithScore or str"):
        scored = retriever.retrieve(QUERIES[0])
    assert [item.node.get_content() for item in scored] == [TEXTS[c] for c in retriever.last_result.context_chunk_ids]
    fresh = _adapter()
    with pytest.raises(ValueError, match="query must be a non-empty string"):
        fresh.retrieve(" ")
    with pytest.raises(ValueError, match="query must be a non-empty string"):
        asyncio.run(fresh.aretrieve(""))
    assert fresh.session.turn_count == 0


class GatedRetriever(BaseRetriever):
    """Wraps a retriever; retrieval waits for a gate, to hold a turn open."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.agate: Optional[asyncio.Event] = None

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return self.inner.retrieve(query_bundle)

    async def _aretrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        self.entered.set()
        await self.agate.wait()
        return self.inner.retrieve(query_bundle)


def test_one_conversation_takes_one_turn_at_a_time() -> None:
    gated = GatedRetriever(_index().as_retriever(similarity_top_k=LIMIT))
    retriever = _adapter(gated)
    first, second = race_two_async_turns(gated, retriever.aretrieve)
    assert isinstance(second, MapMatchedRuntimeError) and "already taking a turn" in str(second)
    assert retriever.session.turn_count == 1
    gated.entered.clear()
    check_second_thread_refused(gated, lambda: retriever.retrieve(QUERIES[1]), lambda: retriever.retrieve(QUERIES[2]),
                                "already taking a turn")
    assert retriever.session.turn_count == 2


# --------------------------------------------------------------------------- the optional dependency


def test_missing_llamaindex_names_the_extra() -> None:
    session = MapMatchedRetriever(chain_graph(), provider=object()).session()
    missing_extra_errors("llama_index", "llamaindex", lambda: LlamaIndexProvider(object()),
                         lambda: as_llamaindex_retriever(session))


def test_importing_the_library_does_not_import_llamaindex() -> None:
    assert modules_loaded_by_importing("LlamaIndexProvider, as_llamaindex_retriever", "llama_index") == []


def test_from_pretrained_builds_the_retriever_of_a_model_directory(tmp_path) -> None:
    from mapmatched_torch import InMemoryCorpusGraph
    from mapmatched_torch.core.settings import DecodeSettings
    from mapmatched_torch.fit.artifacts import save_model
    from mapmatched_torch.fit.model import MapMatchedModel
    from mapmatched_torch.integrations.llamaindex import MapMatchedLlamaIndexRetriever

    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")])
    folder = save_model(tmp_path / "m", MapMatchedModel(1.0, 2.0), DecodeSettings(1.0, 2.0), graph=graph)
    answers = {"q1": [ScoredCandidate("a", 1.0), ScoredCandidate("c", 0.5)],
               "q2": [ScoredCandidate("c", 1.0), ScoredCandidate("b", 0.99)]}

    class Provider:
        def candidates(self, query: str, limit: int) -> Sequence[ScoredCandidate]:
            return answers[query][:limit]

    nodes = {chunk: f"text of {chunk}" for chunk in "abc"}
    retriever = MapMatchedLlamaIndexRetriever.from_pretrained(folder, graph=graph, provider=Provider(), nodes=nodes)
    assert retriever.session.retriever.settings == DecodeSettings(1.0, 2.0)
    assert retriever.retrieve("q1")[0].node.get_content() == "text of a"
    expected = MapMatchedRetriever(graph, provider=Provider(), transition_weight=2.0).session()
    expected.retrieve("q1")
    assert retriever.retrieve("q2")[0].node.metadata["map_matched"]["chunk_id"] == expected.retrieve("q2").chunk_id
    served = MapMatchedLlamaIndexRetriever.from_pretrained(folder, graph=graph, provider=Provider(), session_id=7,
                                                           nodes=nodes)
    assert served.server.settings.transition_weight == 2.0 and served.session_id == 7
