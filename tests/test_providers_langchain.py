"""LangChain both ways: LangChainProvider and as_langchain_retriever, against langchain-core."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import textwrap
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest

pytest.importorskip("langchain_core", reason="langchain-core is not installed (the [langchain] extra)")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore  # noqa: E402

from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever, ScoredCandidate, _optional  # noqa: E402
from mapmatched_torch.errors import MapMatchedRuntimeError, MissingDependencyError  # noqa: E402
from mapmatched_torch.protocols import CandidateProvider  # noqa: E402
from mapmatched_torch.providers import langchain as langchain_adapters  # noqa: E402
from mapmatched_torch.providers.langchain import LangChainProvider, as_langchain_retriever  # noqa: E402
from mapmatched_torch.serving import MapMatchedServer  # noqa: E402

# --------------------------------------------------------------------------- a small corpus

N, D, LIMIT = 10, 6, 4
IDS = [f"c{i}" for i in range(N)]
WALK = [2, 3, 3, 4, 8, 5]  # the chunks the user reads; queries are noisy views of them


def _corpus() -> Tuple[np.ndarray, List[np.ndarray]]:
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((N, D))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = [vectors[i] + 0.8 * rng.standard_normal(D) for i in WALK]
    return vectors, queries


VECTORS, QUERY_VECTORS = _corpus()
QUERIES = [f"question {t}" for t in range(len(WALK))]
TEXTS = {chunk: f"passage about {chunk}" for chunk in IDS}


class TableEmbeddings(Embeddings):
    """Embeds known texts by table lookup: passages and queries get fixed vectors."""

    def __init__(self) -> None:
        self.table = {TEXTS[chunk]: VECTORS[i].tolist() for i, chunk in enumerate(IDS)}
        self.table.update({q: v.tolist() for q, v in zip(QUERIES, QUERY_VECTORS)})

    def embed_documents(self, texts: List[str]) -> List[List[float]]:
        return [self.table[text] for text in texts]

    def embed_query(self, text: str) -> List[float]:
        return self.table[text]


def _store(ids: Optional[Sequence[str]] = None) -> InMemoryVectorStore:
    store = InMemoryVectorStore(TableEmbeddings())
    documents = [Document(TEXTS[c], metadata={"chunk_id": c, "source": f"doc-{c}"}) for c in IDS]
    store.add_documents(documents, ids=list(ids) if ids is not None else [f"store-{c}" for c in IDS])
    return store


def _graph() -> InMemoryCorpusGraph:
    return InMemoryCorpusGraph.from_edges([(IDS[i], IDS[i + 1]) for i in range(N - 1)], maximum_distance=4.0)


def _options(**overrides: Any) -> Dict[str, Any]:
    return {"candidate_limit": LIMIT, "context_radius": 1.0, **overrides}


def _store_candidates(store: VectorStore, query: str, limit: int = LIMIT) -> List[ScoredCandidate]:
    """The candidates, computed without the provider: the store's cosine similarities."""
    hits = store.similarity_search_with_score(query, k=limit)
    return [ScoredCandidate(document.metadata["chunk_id"], score) for document, score in hits]


def _plain_conversation(**options: Any) -> List[Any]:
    """The reference: a plain MapMatchedSession fed the same candidates turn by turn."""
    store = _store()
    session = MapMatchedRetriever(_graph(), **_options(**options)).session()
    return [session.retrieve_candidates(_store_candidates(store, query)) for query in QUERIES]


def _provider(store: Optional[VectorStore] = None, **kwargs: Any) -> LangChainProvider:
    return LangChainProvider(store if store is not None else _store(), score_mode="similarity", **kwargs)


def _pairs(candidates: Sequence[ScoredCandidate]) -> List[Tuple[str, float]]:
    return [(c.chunk_id, c.score) for c in candidates]


class ScriptedStore(VectorStore):
    """A VectorStore whose searches return fixed (Document, score) lists, in that order."""

    def __init__(self, hits: List[Tuple[Document, Any]], relevance: Any = None) -> None:
        self.hits, self.relevance, self.calls = hits, relevance, []

    def add_texts(self, texts: Any, metadatas: Any = None, **kwargs: Any) -> List[str]:
        raise NotImplementedError

    @classmethod
    def from_texts(cls, texts: Any, embedding: Any, metadatas: Any = None, **kwargs: Any) -> "ScriptedStore":
        raise NotImplementedError

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> List[Document]:
        return [document for document, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> List[Tuple[Document, Any]]:
        self.calls.append((query, k, kwargs))
        return self.hits[:k]

    def _select_relevance_score_fn(self) -> Any:
        if self.relevance is None:
            raise NotImplementedError("no relevance function")
        return self.relevance


class ListRetriever(BaseRetriever):
    """A retriever that returns a fixed document list."""

    documents: List[Document]

    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> List[Document]:
        return list(self.documents)


def _doc(chunk_id: str, **metadata: Any) -> Document:
    return Document(f"text of {chunk_id}", metadata={"chunk_id": chunk_id, **metadata})


# --------------------------------------------------------------------------- provider: scores and order


def test_similarity_mode_round_trips_ids_and_scores_from_a_real_store() -> None:
    store = _store()
    provider = _provider(store)
    assert isinstance(provider, CandidateProvider)
    for query in QUERIES:
        got = provider.retrieve(query, LIMIT)
        assert all(isinstance(c, ScoredCandidate) for c in got)
        assert _pairs(got) == _pairs(_store_candidates(store, query))
        # and the scores are the cosine similarities of the table vectors
        q = QUERY_VECTORS[QUERIES.index(query)]
        expected = VECTORS @ (q / np.linalg.norm(q))
        assert [c.score for c in got] == pytest.approx([expected[IDS.index(c.chunk_id)] for c in got], abs=1e-12)
        assert [c.score for c in got] == sorted((c.score for c in got), reverse=True)


def test_distance_mode_negates_and_ties_keep_the_store_rank() -> None:
    hits = [(_doc("a"), 0.5), (_doc("b"), 0.0), (_doc("c"), 0.5), (_doc("d"), 2.0), (_doc("e"), 0.25)]
    provider = LangChainProvider(ScriptedStore(hits), score_mode="distance")
    got = provider.retrieve("q", 5)
    assert _pairs(got) == [("b", 0.0), ("e", -0.25), ("a", -0.5), ("c", -0.5), ("d", -2.0)]
    assert np.copysign(1.0, got[0].score) == 1.0  # a zero distance is +0.0
    assert _pairs(provider.retrieve("q", 2)) == [("b", 0.0), ("a", -0.5)]  # k=2: the store's first two, sorted


def test_similarity_mode_sorts_an_unsorted_store_answer() -> None:
    hits = [(_doc("a"), 0.1), (_doc("b"), 0.9), (_doc("c"), 0.9)]
    got = LangChainProvider(ScriptedStore(hits), score_mode="similarity").retrieve("q", 3)
    assert _pairs(got) == [("b", 0.9), ("c", 0.9), ("a", 0.1)]


def test_relevance_mode_uses_the_stores_relevance_scores() -> None:
    hits = [(_doc("a"), 0.2), (_doc("b"), 1.0), (_doc("c"), 0.6)]
    store = ScriptedStore(hits, relevance=lambda distance: 1.0 - distance / 2.0)
    provider = LangChainProvider(store, search_kwargs={"filter": "x"})
    assert provider.score_mode == "relevance"
    got = provider.retrieve("q", 3)
    expected = sorted(((d.metadata["chunk_id"], s) for d, s in store.similarity_search_with_relevance_scores("q", 3)),
                      key=lambda pair: -pair[1])
    assert _pairs(got) == expected == [("a", 0.9), ("c", 0.7), ("b", 0.5)]
    assert store.calls[0] == ("q", 3, {"filter": "x"})


def test_store_without_relevance_scores_is_refused_naming_the_other_modes() -> None:
    with pytest.raises(ValueError, match=r"InMemoryVectorStore gives no relevance scores.*score_mode='similarity'.*"
                                         r"score_mode='distance'"):
        LangChainProvider(_store())
    # a store that claims relevance scores but raises NotImplementedError at search time
    provider = LangChainProvider(ScriptedStore([(_doc("a"), 0.1)]))
    with pytest.raises(ValueError, match="ScriptedStore gives no relevance scores"):
        provider.retrieve("q", 1)
    with pytest.raises(ValueError, match="ScriptedStore gives no relevance scores"):
        asyncio.run(provider.aretrieve("q", 1))


def test_a_retriever_gives_no_scores_unless_told_where_they_come_from() -> None:
    documents = [_doc("a", score=0.2), _doc("b", score=0.9), _doc("c", score=0.5)]
    retriever = ListRetriever(documents=documents)
    with pytest.raises(ValueError, match=r"returns no scores: pass score_field=.*score_mode='rank'"):
        LangChainProvider(retriever)
    by_field = LangChainProvider(retriever, score_field="score")
    assert by_field.score_mode == "metadata"
    assert _pairs(by_field.retrieve("q", 2)) == [("b", 0.9), ("c", 0.5)]
    by_rank = LangChainProvider(retriever, score_mode="rank")
    assert _pairs(by_rank.retrieve("q", 3)) == [("a", 0.0), ("b", -1.0), ("c", -2.0)]


@pytest.mark.parametrize(
    ("documents", "message"),
    [
        ([_doc("a", score=0.2), _doc("b")], r"without the score field 'score' at rank 1 \(its metadata keys: \['chunk_id'\]\)"),
        ([_doc("a", score="high")], r"score from LangChain retriever ListRetriever, rank 0 must be a real number, got str"),
        ([_doc("a", score=float("nan"))], r"rank 0 must be finite, got nan"),
    ],
)
def test_bad_metadata_scores_are_rejected(documents: List[Document], message: str) -> None:
    provider = LangChainProvider(ListRetriever(documents=documents), score_field="score")
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q", 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"score_mode": "cosine"}, r"unsupported score mode for a vector store: 'cosine'"),
        ({"score_mode": "rank"}, r"unsupported score mode for a vector store: 'rank'"),
        ({"score_mode": "similarity", "score_field": "s"}, r"score_field applies to a retriever"),
        ({"score_mode": "similarity", "search_kwargs": {"k": 3}}, r"must not contain 'k'"),
        ({"score_mode": "similarity", "search_kwargs": [("filter", 1)]}, r"search_kwargs must be a mapping"),
        ({"score_mode": "similarity", "chunk_id_field": ""}, r"chunk_id_field must be a non-empty string or None"),
    ],
)
def test_store_options_are_checked(kwargs: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LangChainProvider(_store(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"score_mode": "similarity"}, r"unsupported score mode for a retriever: 'similarity'"),
        ({"score_mode": "metadata"}, r"score_mode='metadata' needs score_field="),
        ({"score_mode": "rank", "score_field": "s"}, r"score_mode='rank' ignores scores"),
        ({"score_mode": "rank", "search_kwargs": {"filter": 1}}, r"search_kwargs apply to a vector store"),
    ],
)
def test_retriever_options_are_checked(kwargs: Dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LangChainProvider(ListRetriever(documents=[]), **kwargs)


def test_rejects_what_is_neither_a_store_nor_a_retriever() -> None:
    with pytest.raises(ValueError, match="takes a langchain_core VectorStore or BaseRetriever, got dict"):
        LangChainProvider({})


def test_a_vector_store_retriever_is_unwrapped_to_its_store() -> None:
    store = _store()
    wrapped = store.as_retriever(search_kwargs={"k": 2, "filter": lambda d: d.metadata["chunk_id"] != "c2"})
    provider = LangChainProvider(wrapped, score_mode="similarity")
    assert provider.source is store
    got = provider.retrieve(QUERIES[0], LIMIT)
    assert len(got) == LIMIT  # k comes from the limit, not from the retriever's search_kwargs
    assert "c2" not in [c.chunk_id for c in got]  # the filter is kept
    unfiltered = [c for c in _store_candidates(store, QUERIES[0], N) if c.chunk_id != "c2"][:LIMIT]
    assert _pairs(got) == _pairs(unfiltered)
    # mmr gives no scores: the retriever stays a retriever
    with pytest.raises(ValueError, match="returns no scores"):
        LangChainProvider(store.as_retriever(search_type="mmr"))


# --------------------------------------------------------------------------- provider: chunk IDs


def test_chunk_ids_from_a_named_field_or_from_document_id() -> None:
    hits = [(Document("x", id="id-1", metadata={"key": "k1"}), 0.5), (Document("y", id="id-2", metadata={"key": "k2"}), 0.4)]
    assert [c.chunk_id for c in LangChainProvider(ScriptedStore(hits), score_mode="similarity",
                                                  chunk_id_field="key").retrieve("q", 2)] == ["k1", "k2"]
    assert [c.chunk_id for c in LangChainProvider(ScriptedStore(hits), score_mode="similarity",
                                                  chunk_id_field=None).retrieve("q", 2)] == ["id-1", "id-2"]


@pytest.mark.parametrize(
    ("hits", "kwargs", "message"),
    [
        ([(Document("x", metadata={"other": 1}), 0.5)], {},
         r"LangChain vector store ScriptedStore, rank 0: the Document has no metadata field 'chunk_id' "
         r"\(its metadata keys: \['other'\]\)"),
        ([(Document("x"), 0.5)], {"chunk_id_field": None}, r"rank 0: the Document has no id"),
        ([(_doc("a"), 0.5), (_doc("a"), 0.4)], {}, r"chunk ID 'a' returned twice .* \(ranks 0 and 1\)"),
        ([(Document("x", metadata={"chunk_id": 7}), 0.5)], {}, r"rank 0 must be a string, got int"),
        ([(Document("x", metadata={"chunk_id": ""}), 0.5)], {}, r"rank 0 must be non-empty"),
        ([(_doc("a"), float("inf"))], {}, r"must be finite, got inf \(chunk 'a'\)"),
        (["not a pair"], {}, r"returned 'not a pair' at rank 0; expected \(Document, score\) pairs"),
        ([("not a document", 0.5)], {}, r"rank 0: expected a langchain_core Document, got str"),
    ],
)
def test_bad_store_answers_are_rejected(hits: Any, kwargs: Dict[str, Any], message: str) -> None:
    provider = LangChainProvider(ScriptedStore(hits), score_mode="similarity", **kwargs)
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q", 5)
    assert provider.get_documents(["a", "x"]) == {}  # nothing from a rejected answer is remembered


# --------------------------------------------------------------------------- provider: queries, batches, async


@pytest.mark.parametrize(("query", "message"), [("", "non-empty"), (None, "must be a string"), (b"q", "must be a string")])
def test_rejects_bad_queries(query: Any, message: str) -> None:
    store = ScriptedStore([(_doc("a"), 0.5)])
    provider = LangChainProvider(store, score_mode="similarity")
    with pytest.raises(ValueError, match=message):
        provider.retrieve(query, 1)
    with pytest.raises(ValueError, match=message):
        asyncio.run(provider.aretrieve(query, 1))
    with pytest.raises(ValueError, match=f"query 1 .*{message}"):
        provider.retrieve_batch(["q", query], 1)
    assert store.calls == []


@pytest.mark.parametrize(("limit", "message"), [(0, "limit must be positive, got 0"), (-1, "must be positive"),
                                                (True, "must be an integer, got True"), (2.0, "must be an integer")])
def test_rejects_bad_limits(limit: Any, message: str) -> None:
    store = ScriptedStore([(_doc("a"), 0.5)])
    provider = LangChainProvider(store, score_mode="similarity")
    for call in (lambda: provider.retrieve("q", limit), lambda: provider.retrieve_batch(["q"], limit),
                 lambda: asyncio.run(provider.aretrieve("q", limit))):
        with pytest.raises(ValueError, match=message):
            call()
    assert store.calls == []


def test_retrieve_batch_and_aretrieve_equal_retrieve() -> None:
    provider = _provider()
    expected = [provider.retrieve(query, LIMIT) for query in QUERIES]
    assert provider.retrieve_batch(QUERIES, LIMIT) == expected
    assert [asyncio.run(provider.aretrieve(query, LIMIT)) for query in QUERIES] == expected
    assert provider.retrieve_batch([], LIMIT) == []
    with pytest.raises(ValueError, match="not a single string"):
        provider.retrieve_batch("q", LIMIT)
    retriever = ListRetriever(documents=[_doc("a", s=0.1), _doc("b", s=0.3)])
    by_field = LangChainProvider(retriever, score_field="s")
    assert by_field.retrieve_batch(["x", "y"], 5) == [by_field.retrieve("x", 5)] * 2
    assert asyncio.run(by_field.aretrieve("x", 5)) == by_field.retrieve("x", 5)


def test_batch_errors_name_the_query() -> None:
    class PerQueryStore(ScriptedStore):
        def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> List[Tuple[Document, Any]]:
            return [(_doc("a"), 0.5), (_doc("a" if query == "bad" else "b"), 0.4)]

    provider = LangChainProvider(PerQueryStore([]), score_mode="similarity")
    assert [c.chunk_id for c in provider.retrieve_batch(["good"], 2)[0]] == ["a", "b"]
    with pytest.raises(ValueError, match=r"chunk ID 'a' returned twice by LangChain vector store PerQueryStore, query 1"):
        provider.retrieve_batch(["good", "bad"], 2)


# --------------------------------------------------------------------------- provider: remembered text


def test_get_documents_remembers_and_fetches_by_id_when_ids_are_chunk_ids() -> None:
    provider = _provider(_store(ids=IDS))  # the store's IDs are the chunk IDs
    provider.retrieve(QUERIES[0], 2)
    seen = [c.chunk_id for c in provider.retrieve(QUERIES[0], 2)]
    found = provider.get_documents(["c9", seen[0], "nope"])
    assert set(found) == {"c9", seen[0]}
    assert found["c9"].page_content == TEXTS["c9"] and found["c9"].metadata["source"] == "doc-c9"
    # a store whose IDs differ from the chunk IDs: the fetched document's own chunk ID must match
    other = _provider(_store(ids=[f"c{(i + 1) % N}" for i in range(N)]))  # store ID c1 holds chunk c0, ...
    assert other.get_documents(["c3"]) == {}
    without_memory = _provider(_store(ids=IDS), remember=False)
    without_memory.retrieve(QUERIES[0], 2)
    assert without_memory.get_documents(seen[:1])[seen[0]].page_content == TEXTS[seen[0]]  # fetched, not remembered


def test_get_documents_of_a_retriever_are_the_remembered_ones() -> None:
    provider = LangChainProvider(ListRetriever(documents=[_doc("a", s=1.0)]), score_field="s")
    assert provider.get_documents(["a"]) == {}
    provider.retrieve("q", 1)
    assert provider.get_documents(["a", "b"]) == {"a": _doc("a", s=1.0)}


# --------------------------------------------------------------------------- provider: parity


def test_a_session_over_the_provider_equals_a_plain_session_fed_the_same_candidates() -> None:
    session = MapMatchedRetriever(_graph(), provider=_provider(), **_options()).session()
    got = [session.retrieve(query) for query in QUERIES]
    expected = _plain_conversation()
    assert got == expected
    assert [r.trace.to_dict() for r in got] == [r.trace.to_dict() for r in expected]
    # the conversation is not trivial: the graph revised earlier turns and overruled the best score
    assert any(r.trace.revised_prior_indices for r in expected)
    assert any(step.normalized_emission_margin < 0 for step in expected[-1].trace.steps)


# --------------------------------------------------------------------------- retriever adapter


def _adapter(**kwargs: Any) -> Any:
    engine = kwargs.pop("engine", None)
    if engine is None:
        engine = MapMatchedRetriever(_graph(), provider=_provider(_store(ids=kwargs.pop("store_ids", None))), **_options())
    return as_langchain_retriever(engine, **kwargs)


def _ids(documents: Sequence[Document]) -> List[str]:
    return [d.metadata["map_matched"]["chunk_id"] for d in documents]


def test_the_adapter_is_a_langchain_retriever_and_reports_each_chunk() -> None:
    retriever = _adapter(store_ids=IDS)  # every chunk's text can be fetched from the store
    assert isinstance(retriever, BaseRetriever)
    assert isinstance(retriever, langchain_adapters.MapMatchedLangChainRetriever)
    with pytest.raises(AttributeError):
        langchain_adapters.NoSuchName
    documents = retriever.invoke(QUERIES[0])
    result = retriever.last_result
    assert all(isinstance(d, Document) for d in documents)
    assert _ids(documents) == list(result.context_chunk_ids)
    assert [d.page_content for d in documents] == [TEXTS[c] for c in result.context_chunk_ids]
    assert [d.metadata["source"] for d in documents] == [f"doc-{c}" for c in result.context_chunk_ids]  # kept
    candidates = {c.chunk_id: c for c in result.candidates}
    ranking = {r.chunk_id: r.score for r in result.candidate_ranking}
    step = dataclasses.asdict(result.trace.steps[-1])
    for rank, document in enumerate(documents):
        report = document.metadata["map_matched"]
        chunk = report["chunk_id"]
        assert report["context_rank"] == rank and report["turn_index"] == 0 and report["text_known"]
        assert report["role"] == ("decoded" if rank == 0 else "candidate" if chunk in candidates else "neighbor")
        assert report["trace_step"] == step
        assert report["path_chunk_ids"] == list(result.path.chunk_ids)
        if chunk in candidates:
            assert report["raw_score"] == candidates[chunk].raw_score
            assert report["normalized_score"] == candidates[chunk].normalized_score
            assert report["provider_rank"] == [c.chunk_id for c in result.candidates].index(chunk)
            assert report["trajectory_score"] == ranking[chunk]
        else:
            assert report["raw_score"] is report["provider_rank"] is report["trajectory_score"] is None
    assert {"decoded", "candidate", "neighbor"} == {d.metadata["map_matched"]["role"] for d in documents}
    assert documents[0].metadata["map_matched"]["chunk_id"] == result.chunk_id
    assert documents[0].metadata["map_matched"]["trace_step"]["move"] == "start"


def test_a_conversation_through_the_adapter_equals_the_plain_session() -> None:
    retriever = _adapter(store_ids=IDS)
    expected = _plain_conversation()
    for query, plain in zip(QUERIES, expected):
        documents = retriever.invoke(query)
        assert _ids(documents) == list(plain.context_chunk_ids)
        assert retriever.last_result == plain
        assert retriever.session.path == plain.path
        assert [d.metadata["map_matched"]["trace_step"] for d in documents] == \
            [dataclasses.asdict(plain.trace.steps[-1])] * len(documents)
    assert retriever.trace.to_dict() == expected[-1].trace.to_dict()
    assert retriever.session.turn_count == len(QUERIES)


def test_ainvoke_decodes_the_same_conversation() -> None:
    retriever = _adapter(store_ids=IDS)
    expected = _plain_conversation()

    async def talk() -> List[List[Document]]:
        return [await retriever.ainvoke(query) for query in QUERIES]

    answers = asyncio.run(talk())
    assert [_ids(documents) for documents in answers] == [list(r.context_chunk_ids) for r in expected]
    assert retriever.trace.to_dict() == expected[-1].trace.to_dict()
    assert retriever.session.path == expected[-1].path


def test_server_mode_equals_the_plain_session_and_keeps_conversations_apart() -> None:
    server = MapMatchedServer(_graph(), provider=_provider(_store(ids=IDS)), **_options())
    alice = as_langchain_retriever(server, session_id="alice")
    bob = as_langchain_retriever(server, session_id="bob")
    assert "alice" in server and "bob" in server  # opened by the adapter
    assert alice.session is None and alice.server is server and alice.session_id == "alice"
    expected = _plain_conversation()
    for turn, (query, plain) in enumerate(zip(QUERIES, expected)):
        assert _ids(alice.invoke(query)) == list(plain.context_chunk_ids)
        assert alice.last_result == plain
        if turn < 2:
            bob.invoke(QUERIES[-1 - turn])
    assert server.trace("alice").to_dict() == expected[-1].trace.to_dict()
    assert server.turn_count("alice") == len(QUERIES) and server.turn_count("bob") == 2
    # an already open session is reused, not reopened
    again = as_langchain_retriever(server, session_id="alice")
    assert again.trace.to_dict() == expected[-1].trace.to_dict()


def test_server_mode_raises_the_sessions_error_and_leaves_it_unchanged() -> None:
    hits = [(_doc("c1"), 0.5), (_doc("c2"), 0.4)]
    store = ScriptedStore(hits)
    server = MapMatchedServer(_graph(), provider=LangChainProvider(store, score_mode="similarity"), **_options())
    retriever = as_langchain_retriever(server, session_id=7)
    assert _ids(retriever.invoke("q")) == ["c1", "c2"]
    before = server.trace(7)
    store.hits = [(_doc("c1"), float("nan"))]
    with pytest.raises(ValueError, match="must be finite"):
        retriever.invoke("q")
    with pytest.raises(ValueError, match="query must be a non-empty string"):
        retriever.invoke("   ")
    assert server.turn_count(7) == 1 and server.trace(7) == before
    server.close(7)
    store.hits = hits
    with pytest.raises(ValueError, match="unknown session 7"):
        retriever.invoke("q")


def test_a_failed_turn_leaves_the_session_unchanged() -> None:
    store = ScriptedStore([(_doc("c1"), 0.5)])
    retriever = _adapter(engine=MapMatchedRetriever(_graph(), provider=LangChainProvider(store, score_mode="similarity")))
    retriever.invoke("q")
    store.hits = [(_doc("c1"), 0.5), (_doc("c1"), 0.4)]
    with pytest.raises(ValueError, match="returned twice"):
        retriever.invoke("q")
    with pytest.raises(ValueError, match="query must be a non-empty string"):
        retriever.invoke("")
    with pytest.raises(ValueError, match="query must be a non-empty string"):
        asyncio.run(retriever.ainvoke(""))
    assert retriever.session.turn_count == 1


def test_unknown_text_is_skipped_or_returned_empty_and_documents_fill_it_in() -> None:
    # store IDs are not chunk IDs: only chunks the store returned have text
    skipping = _adapter()
    documents = skipping.invoke(QUERIES[0])
    context = list(skipping.last_result.context_chunk_ids)
    candidates = [c.chunk_id for c in skipping.last_result.candidates]
    neighbors_only = [c for c in context if c not in candidates]
    assert neighbors_only, "the scenario needs a graph neighbour that was not a candidate"
    assert _ids(documents) == [c for c in context if c in candidates]  # context order, neighbours left out

    empty = _adapter(missing_text="empty")
    documents = empty.invoke(QUERIES[0])
    assert _ids(documents) == context
    for document in documents:
        known = document.metadata["map_matched"]["chunk_id"] in candidates
        assert document.metadata["map_matched"]["text_known"] is known
        assert (document.page_content != "") is known
        if not known:
            assert document.id == document.metadata["map_matched"]["chunk_id"]
            assert set(document.metadata) == {"map_matched"}

    mapping = {neighbors_only[0]: "from the mapping", candidates[0]: Document("override", metadata={"k": 1})}
    given = _adapter(documents=mapping)
    documents = given.invoke(QUERIES[0])
    by_id = {d.metadata["map_matched"]["chunk_id"]: d for d in documents}
    assert by_id[neighbors_only[0]].page_content == "from the mapping"
    assert by_id[candidates[0]].page_content == "override" and by_id[candidates[0]].metadata["k"] == 1
    called = _adapter(documents=lambda chunk_id: f"text {chunk_id}")
    assert [d.page_content for d in called.invoke(QUERIES[0])] == [f"text {c}" for c in context]


def test_the_adapter_never_mutates_the_stores_documents() -> None:
    provider = _provider(_store(ids=IDS))
    retriever = _adapter(engine=MapMatchedRetriever(_graph(), provider=provider, **_options()))
    documents = retriever.invoke(QUERIES[0])
    remembered = provider.get_documents(_ids(documents))
    assert all("map_matched" not in d.metadata for d in remembered.values())


# --------------------------------------------------------------------------- adapter: bad input


def test_adapter_arguments_are_checked() -> None:
    graph = _graph()
    with pytest.raises(ValueError, match="needs a CandidateProvider to answer queries: pass provider= to MapMatchedRetriever"):
        as_langchain_retriever(MapMatchedRetriever(graph))
    with pytest.raises(ValueError, match="pass provider= to MapMatchedServer"):
        as_langchain_retriever(MapMatchedServer(graph), session_id="x")
    with pytest.raises(ValueError, match="takes a MapMatchedSession, a MapMatchedRetriever or a MapMatchedServer, got str"):
        as_langchain_retriever("not an engine")
    engine = MapMatchedRetriever(graph, provider=_provider())
    with pytest.raises(ValueError, match="session_id applies to a MapMatchedServer only"):
        as_langchain_retriever(engine.session(), session_id="x")
    server = MapMatchedServer(graph, provider=_provider())
    with pytest.raises(ValueError, match="needs session_id="):
        as_langchain_retriever(server)
    with pytest.raises(TypeError):
        as_langchain_retriever(server, session_id=["unhashable"])
    with pytest.raises(ValueError, match="unsupported missing_text: 'error'"):
        as_langchain_retriever(server, session_id="s", missing_text="error")
    with pytest.raises(ValueError, match="metadata_key must be a non-empty string"):
        as_langchain_retriever(server, session_id="s", metadata_key="")
    with pytest.raises(ValueError, match="documents must be a mapping or a callable"):
        as_langchain_retriever(server, session_id="s", documents=["a"])
    assert len(server) == 0  # nothing was opened by a refused call
    bad_text = as_langchain_retriever(engine, documents=lambda chunk_id: 42)
    with pytest.raises(ValueError, match=r"the text of chunk 'c\d' must be a Document or a str, got int"):
        bad_text.invoke(QUERIES[0])


def test_invoke_rejects_non_string_input() -> None:
    retriever = _adapter()
    with pytest.raises(ValueError, match="query must be a non-empty string"):
        retriever.invoke(None)
    assert retriever.session.turn_count == 0


# --------------------------------------------------------------------------- adapter: one turn at a time


class GatedStore(InMemoryVectorStore):
    """An InMemoryVectorStore whose searches wait for a gate (sync: a threading.Event;
    async: an asyncio.Event), to hold a turn open."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.agate: Optional[asyncio.Event] = None
        self.waiting = 0

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> List[Tuple[Document, float]]:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().similarity_search_with_score(query, k, **kwargs)

    async def asimilarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> List[Tuple[Document, float]]:
        self.entered.set()
        self.waiting += 1
        await self.agate.wait()
        return InMemoryVectorStore.similarity_search_with_score(self, query, k, **kwargs)


def _gated() -> GatedStore:
    store = GatedStore(TableEmbeddings())
    store.add_documents([Document(TEXTS[c], metadata={"chunk_id": c}) for c in IDS])
    return store


def test_concurrent_ainvoke_of_one_conversation_is_refused() -> None:
    store = _gated()
    retriever = _adapter(engine=MapMatchedRetriever(_graph(), provider=_provider(store), **_options()))

    async def race() -> Tuple[Any, Any]:
        store.agate = asyncio.Event()
        first = asyncio.ensure_future(retriever.ainvoke(QUERIES[0]))
        for _ in range(10_000):
            if store.entered.is_set():
                break
            await asyncio.sleep(0)
        second = await asyncio.wait_for(asyncio.gather(retriever.ainvoke(QUERIES[1]), return_exceptions=True), 10)
        store.agate.set()
        return await first, second[0]

    first, second = asyncio.run(race())
    assert isinstance(second, MapMatchedRuntimeError) and isinstance(second, RuntimeError)
    assert "already taking a turn" in str(second)
    assert _ids(first)[0] == retriever.session.current_chunk_id
    assert retriever.session.turn_count == 1
    store.gate.set()
    retriever.invoke(QUERIES[1])  # the guard is released after the turn
    assert retriever.session.turn_count == 2


def test_concurrent_invoke_from_threads_is_refused_and_two_adapters_share_the_guard() -> None:
    store = _gated()
    session = MapMatchedRetriever(_graph(), provider=_provider(store), **_options()).session()
    one, two = as_langchain_retriever(session), as_langchain_retriever(session)
    outcome: Dict[str, Any] = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("first", one.invoke(QUERIES[0])))
    worker.start()
    assert store.entered.wait(10)
    with pytest.raises(MapMatchedRuntimeError, match="this session is already taking a turn"):
        two.invoke(QUERIES[1])
    store.gate.set()
    worker.join(10)
    assert session.turn_count == 1 and _ids(outcome["first"])[0] == session.current_chunk_id


def test_different_server_sessions_may_run_concurrently() -> None:
    store = _gated()
    server = MapMatchedServer(_graph(), provider=_provider(store), **_options())
    alice, bob = as_langchain_retriever(server, session_id="a"), as_langchain_retriever(server, session_id="b")

    async def both() -> List[Any]:
        store.agate = asyncio.Event()
        tasks = [asyncio.ensure_future(alice.ainvoke(QUERIES[0])), asyncio.ensure_future(bob.ainvoke(QUERIES[0]))]
        for _ in range(10_000):  # until both conversations are inside their turn at once
            if store.waiting == 2:
                break
            await asyncio.sleep(0)
        assert store.waiting == 2, "the second conversation waited for the first"
        store.agate.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), 10)

    a, b = asyncio.run(both())
    assert _ids(a) == _ids(b) and server.turn_count("a") == server.turn_count("b") == 1


# --------------------------------------------------------------------------- the optional dependency


@pytest.fixture
def without_langchain(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in [name for name in sys.modules if name == "langchain_core" or name.startswith("langchain_core.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "langchain_core", None)
    _optional.clear_cache()
    yield
    _optional.clear_cache()


def test_missing_langchain_names_the_extra(without_langchain: Any) -> None:
    session = MapMatchedRetriever(_graph(), provider=object()).session()
    for build in (lambda: LangChainProvider(object()), lambda: as_langchain_retriever(session)):
        with pytest.raises(MissingDependencyError) as caught:
            build()
        assert isinstance(caught.value, ImportError)
        assert "pip install mapmatched-torch[langchain]" in str(caught.value)
        assert caught.value.extra == "langchain"


def test_importing_the_library_does_not_import_langchain() -> None:
    script = textwrap.dedent(
        """
        import sys
        import mapmatched_torch
        import mapmatched_torch.providers
        from mapmatched_torch import LangChainProvider, as_langchain_retriever
        print(sorted(name for name in sys.modules if name.startswith("langchain")))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
