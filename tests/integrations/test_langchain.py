"""LangChain both ways: LangChainProvider and as_langchain_retriever, against langchain-core."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest

pytest.importorskip("langchain_core", reason="langchain-core is not installed (the [langchain] extra)")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore  # noqa: E402

from mapmatched_torch import MapMatchedRetriever, ScoredCandidate  # noqa: E402
from mapmatched_torch.core.errors import MapMatchedRuntimeError  # noqa: E402
from mapmatched_torch.core.protocols import CandidateProvider  # noqa: E402
from mapmatched_torch.integrations.langchain import LangChainProvider, as_langchain_retriever  # noqa: E402
from mapmatched_torch.integrations import langchain as langchain_adapters  # noqa: E402
from mapmatched_torch.serving import MapMatchedServer  # noqa: E402
from mapmatched_torch.standalone import StandaloneDecoder  # noqa: E402

from ..providers_fixtures import (  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402  # noqa: E402
    IDS,
    LIMIT,
    QUERIES,
    QUERY_VECTORS,
    STORE_IDS,
    TABLE,
    TEXTS,
    VECTORS,
    N,
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


class TableEmbeddings(Embeddings):
    """Embeds known texts by table lookup: passages and queries get fixed vectors."""

    def embed_documents(self, texts: List[str]) -> List[List[float]]:
        return [TABLE[text] for text in texts]

    def embed_query(self, text: str) -> List[float]:
        return TABLE[text]


def _store(ids: Optional[Sequence[str]] = None) -> InMemoryVectorStore:
    store = InMemoryVectorStore(TableEmbeddings())
    documents = [Document(TEXTS[c], metadata={"chunk_id": c, "source": f"doc-{c}"}) for c in IDS]
    store.add_documents(documents, ids=list(ids) if ids is not None else [f"store-{c}" for c in IDS])
    return store


def _store_candidates(store: VectorStore, query: str, limit: int = LIMIT) -> List[ScoredCandidate]:
    """The candidates, computed without the provider: the store's cosine similarities."""
    hits = store.similarity_search_with_score(query, k=limit)
    return [ScoredCandidate(document.metadata["chunk_id"], score) for document, score in hits]


def _plain_conversation(**options: Any) -> List[Any]:
    """The reference: a plain MapMatchedSession fed the same candidates turn by turn."""
    store = _store()
    session = MapMatchedRetriever(chain_graph(), **session_options(**options)).session()
    return [session.retrieve_candidates(_store_candidates(store, query)) for query in QUERIES]


def _provider(store: Optional[VectorStore] = None, **kwargs: Any) -> LangChainProvider:
    return LangChainProvider(store if store is not None else _store(), score_mode="similarity", **kwargs)


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
    """A retriever that returns ``answers[query]``, else the ``documents`` list."""

    documents: List[Document]
    answers: Dict[str, List[Document]] = {}

    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> List[Document]:
        return list(self.answers.get(query, self.documents))


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
        assert score_pairs(got) == score_pairs(_store_candidates(store, query))
        # and the scores are the cosine similarities of the table vectors
        q = QUERY_VECTORS[QUERIES.index(query)]
        expected = VECTORS @ (q / np.linalg.norm(q))
        assert [c.score for c in got] == pytest.approx([expected[IDS.index(c.chunk_id)] for c in got], abs=1e-12)
        assert [c.score for c in got] == sorted((c.score for c in got), reverse=True)


def test_distance_mode_negates_and_ties_keep_the_store_rank() -> None:
    hits = [(_doc("a"), 0.5), (_doc("b"), 0.0), (_doc("c"), 0.5), (_doc("d"), 2.0), (_doc("e"), 0.25)]
    provider = LangChainProvider(ScriptedStore(hits), score_mode="distance")
    got = provider.retrieve("q", 5)
    assert score_pairs(got) == [("b", 0.0), ("e", -0.25), ("a", -0.5), ("c", -0.5), ("d", -2.0)]
    assert np.copysign(1.0, got[0].score) == 1.0  # a zero distance is +0.0
    assert score_pairs(provider.retrieve("q", 2)) == [("b", 0.0), ("a", -0.5)]  # k=2: the store's first two, sorted


def test_similarity_mode_sorts_an_unsorted_store_answer() -> None:
    hits = [(_doc("a"), 0.1), (_doc("b"), 0.9), (_doc("c"), 0.9)]
    got = LangChainProvider(ScriptedStore(hits), score_mode="similarity").retrieve("q", 3)
    assert score_pairs(got) == [("b", 0.9), ("c", 0.9), ("a", 0.1)]


def test_relevance_mode_uses_the_stores_relevance_scores() -> None:
    hits = [(_doc("a"), 0.2), (_doc("b"), 1.0), (_doc("c"), 0.6)]
    store = ScriptedStore(hits, relevance=lambda distance: 1.0 - distance / 2.0)
    provider = LangChainProvider(store, search_kwargs={"filter": "x"})
    assert provider.score_mode == "relevance"
    got = provider.retrieve("q", 3)
    expected = sorted(((d.metadata["chunk_id"], s) for d, s in store.similarity_search_with_relevance_scores("q", 3)),
                      key=lambda pair: -pair[1])
    assert score_pairs(got) == expected == [("a", 0.9), ("c", 0.7), ("b", 0.5)]
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
    assert score_pairs(by_field.retrieve("q", 2)) == [("b", 0.9), ("c", 0.5)]
    by_rank = LangChainProvider(retriever, score_mode="rank")
    assert score_pairs(by_rank.retrieve("q", 3)) == [("a", 0.0), ("b", -1.0), ("c", -2.0)]


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
        ({"score_mode": "cosine"}, r"unsupported score mode for a vector store: cosine"),
        ({"score_mode": "rank"}, r"unsupported score mode for a vector store: rank"),
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
        ({"score_mode": "similarity"}, r"unsupported score mode for a retriever: similarity"),
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
    assert score_pairs(got) == score_pairs(unfiltered)
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
        ([(Document("x", metadata={"chunk_id": 7}), 0.5)], {},
         r"rank 0: the Document has metadata field 'chunk_id' = 7, not a non-empty string chunk ID"),
        ([(Document("x", metadata={"chunk_id": ""}), 0.5)], {}, r"metadata field 'chunk_id' = '', not a non-empty"),
        ([(Document("x", id=""), 0.5)], {"chunk_id_field": None}, r"rank 0 must be non-empty"),
        ([(_doc("a"), float("inf"))], {}, r"must be finite, got inf \(chunk 'a'\)"),
        ([(_doc("a"), float("nan"))], {"score_mode": "distance"}, r"must be finite, got nan \(chunk 'a'\)"),
        ([(_doc("a"), "0.5")], {"score_mode": "distance"}, r"rank 0 must be a real number, got str"),
        (["not a pair"], {}, r"returned 'not a pair' at rank 0; expected \(Document, score\) pairs"),
        ([("not a document", 0.5)], {}, r"rank 0: expected a langchain_core Document, got str"),
    ],
)
def test_bad_store_answers_are_rejected(hits: Any, kwargs: Dict[str, Any], message: str) -> None:
    provider = LangChainProvider(ScriptedStore(hits), **{"score_mode": "similarity", **kwargs})
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q", 5)
    assert provider.get_documents(["a", "x"]) == {}  # nothing from a rejected answer is remembered


# --------------------------------------------------------------------------- provider: queries, batches, async


@pytest.mark.parametrize(("query", "message"), [("", "must not be empty"), (None, "must be a string"), (b"q", "must be a string")])
def test_rejects_bad_queries(query: Any, message: str) -> None:
    store = ScriptedStore([(_doc("a"), 0.5)])
    check_rejects_query(LangChainProvider(store, score_mode="similarity"), query, message)
    assert store.calls == []


@pytest.mark.parametrize(("limit", "message"), [(0, "limit must be greater than zero, got 0"), (-1, "must be greater than zero"),
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
    check_batch_and_aretrieve_equal_retrieve(provider)
    with pytest.raises(ValueError, match="not a single string"):
        provider.retrieve_batch("q", LIMIT)
    answers = {"x": [_doc("a", s=0.1), _doc("b", s=0.3)], "y": [_doc("c", s=0.7)], "z": [_doc("b", s=0.2), _doc("d", s=0.9)]}
    by_field = LangChainProvider(ListRetriever(documents=[], answers=answers), score_field="s")
    singles = [by_field.retrieve(query, 5) for query in "xyz"]
    assert len({tuple(single) for single in singles}) == 3  # the answer depends on the query
    assert by_field.retrieve_batch(["x", "y", "z", "x"], 5) == [*singles, singles[0]]  # in query order
    assert by_field.retrieve_batch(["z", "y"], 5) == singles[:0:-1]
    assert asyncio.run(by_field.aretrieve("z", 5)) == singles[2]


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


def test_memory_is_bounded_least_recently_used_first() -> None:
    store = ScriptedStore([(_doc("a"), 0.3), (_doc("b"), 0.2), (_doc("c"), 0.1)])  # no get_by_ids: memory only
    provider = LangChainProvider(store, score_mode="similarity", remember=2)
    provider.retrieve("q", 3)
    assert set(provider.get_documents(["a", "b", "c"])) == {"b", "c"}  # a, the first remembered, went first
    provider.get_documents(["b"])  # b is now the most recently used
    store.hits = [(_doc("d"), 0.5)]
    provider.retrieve("q", 1)
    assert set(provider.get_documents(["a", "b", "c", "d"])) == {"b", "d"}
    provider.forget()
    assert provider.get_documents(["b", "d"]) == {}
    nothing = LangChainProvider(ScriptedStore([(_doc("a"), 0.3)]), score_mode="similarity", remember=0)
    nothing.retrieve("q", 1)
    assert nothing.get_documents(["a"]) == {}


@pytest.mark.parametrize("remember", [-1, 2.5, "yes", None])
def test_remember_must_be_a_bool_or_a_capacity(remember: Any) -> None:
    with pytest.raises(ValueError, match=r"remember must be True, False or a capacity \(an int >= 0\)"):
        LangChainProvider(_store(), score_mode="similarity", remember=remember)


def test_absent_marks_are_bounded_and_forgotten_on_request() -> None:
    store = _store(ids=IDS)
    asked: List[List[str]] = []
    real = store.get_by_ids
    store.get_by_ids = lambda ids: asked.append(list(ids)) or real(ids)  # type: ignore[method-assign]
    provider = _provider(store, remember=2)

    def add(chunk: str) -> None:
        store.add_documents([Document(TEXTS["c0"], metadata={"chunk_id": chunk})], ids=[chunk])

    assert provider.get_documents(["new-1"]) == {}
    add("new-1")
    assert provider.get_documents(["new-1"]) == {} and asked == [["new-1"]]  # marked absent: not asked again
    assert provider.get_documents(["x", "y"]) == {}  # two newer marks push the mark of new-1 out
    assert provider.get_documents(["new-1"])["new-1"].metadata["chunk_id"] == "new-1"
    add("x")
    assert provider.get_documents(["x"]) == {}  # still marked absent
    provider.forget()
    assert provider.get_documents(["x"])["x"].metadata["chunk_id"] == "x"


class FailingStore(InMemoryVectorStore):
    """An InMemoryVectorStore whose get_by_ids fails while ``down`` is set."""

    down = True

    def get_by_ids(self, ids: Sequence[str]) -> List[Document]:
        if self.down:
            raise ConnectionError("store unreachable")
        return super().get_by_ids(ids)


def _failing_store() -> FailingStore:
    store = FailingStore(TableEmbeddings())
    store.add_documents([Document(TEXTS[c], metadata={"chunk_id": c}) for c in IDS], ids=IDS)
    return store


def test_a_failing_get_by_ids_warns_and_is_asked_again_later() -> None:
    store = _failing_store()
    provider = _provider(store)
    seen = [c.chunk_id for c in provider.retrieve(QUERIES[0], 2)]
    other = next(chunk for chunk in IDS if chunk not in seen)
    with pytest.warns(UserWarning, match=rf"no text for chunk '{other}': fetching failed \(ConnectionError: store unreachable\)"):
        found = provider.get_documents([seen[0], other])
    assert set(found) == {seen[0]}  # the remembered one is still returned
    store.down = False
    assert provider.get_documents([other])[other].page_content == TEXTS[other]  # not marked absent


# --------------------------------------------------------------------------- provider: parity


def test_a_session_over_the_provider_equals_a_plain_session_fed_the_same_candidates() -> None:
    expected = _plain_conversation()
    check_session_over_the_provider(_provider(), expected)
    # the conversation is not trivial: the graph also overruled the best score
    assert any(step.normalized_emission_margin < 0 for step in expected[-1].trace.steps)


# --------------------------------------------------------------------------- retriever adapter


def _adapter(**kwargs: Any) -> Any:
    engine = kwargs.pop("engine", None)
    if engine is None:
        engine = MapMatchedRetriever(chain_graph(), provider=_provider(_store(ids=kwargs.pop("store_ids", None))), **session_options())
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
    # the result holds the provider's raw candidates; the normalized turn is the session's
    candidates = {c.chunk_id: c for c in retriever.session.trellis[-1]}
    assert [(c.chunk_id, c.raw_score) for c in candidates.values()] == [(c.chunk_id, c.score) for c in result.candidates]
    ranking = {r.chunk_id: r.trajectory_score for r in result.candidate_ranking}
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
    check_async_conversation(retriever, retriever.ainvoke, _ids, _plain_conversation())


def test_batch_takes_the_queries_as_consecutive_turns_in_input_order() -> None:
    expected = [list(r.context_chunk_ids) for r in _plain_conversation()]
    final = _plain_conversation()[-1].trace.to_dict()

    async def consume(iterator: Any) -> List[Tuple[int, Any]]:
        return [item async for item in iterator]

    runs = {
        "batch": lambda r: r.batch(QUERIES),
        "abatch": lambda r: asyncio.run(r.abatch(QUERIES)),
        "batch_as_completed": lambda r: [d for _, d in r.batch_as_completed(QUERIES)],
        "abatch_as_completed": lambda r: [d for _, d in asyncio.run(consume(r.abatch_as_completed(QUERIES)))],
    }
    for name, run in runs.items():
        retriever = _adapter(store_ids=IDS)
        assert [_ids(documents) for documents in run(retriever)] == expected, name
        assert retriever.session.turn_count == len(QUERIES) and retriever.trace.to_dict() == final, name
    indices = [index for index, _ in _adapter(store_ids=IDS).batch_as_completed(QUERIES)]
    assert indices == list(range(len(QUERIES)))
    assert _adapter().batch([]) == [] and asyncio.run(_adapter().abatch([])) == []


def test_a_failing_query_in_a_batch_stops_it_or_is_returned_in_place() -> None:
    expected = _plain_conversation()
    for run in (lambda r, qs, **kw: r.batch(qs, **kw), lambda r, qs, **kw: asyncio.run(r.abatch(qs, **kw))):
        retriever = _adapter(store_ids=IDS)
        with pytest.raises(ValueError, match="query must be a non-empty string"):
            run(retriever, [QUERIES[0], "", QUERIES[1]])
        assert retriever.session.turn_count == 1  # the turn before the failure stands; none after it was taken
        answers = run(retriever, [QUERIES[1], " ", QUERIES[2]], return_exceptions=True)
        assert isinstance(answers[1], ValueError)
        assert [_ids(answers[0]), _ids(answers[2])] == [list(r.context_chunk_ids) for r in expected[1:3]]
        assert retriever.trace.to_dict() == expected[2].trace.to_dict()


def test_server_mode_equals_the_plain_session_and_keeps_conversations_apart() -> None:
    server = MapMatchedServer(chain_graph(), provider=_provider(_store(ids=IDS)), **session_options())
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
    server = MapMatchedServer(chain_graph(), provider=LangChainProvider(store, score_mode="similarity"), **session_options())
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
    retriever = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=LangChainProvider(store, score_mode="similarity")))
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


def test_the_decoded_chunk_is_returned_even_when_no_text_is_known() -> None:
    # remember=False over a store whose IDs are not chunk IDs: no chunk's text is known
    engine = MapMatchedRetriever(chain_graph(), provider=_provider(_store(), remember=False), **session_options())
    for retriever in check_decoded_chunk_without_text(
        lambda missing_text: as_langchain_retriever(engine.session(), missing_text=missing_text),
        lambda retriever: [(d.page_content, d.metadata["map_matched"]) for d in retriever.invoke(QUERIES[0])],
    ):
        decoded = retriever.invoke(QUERIES[1])[0]
        assert decoded.id == retriever.session.current_chunk_id and list(decoded.metadata) == ["map_matched"]


def test_a_provider_without_text_gives_the_decoded_chunk_and_warns_when_built() -> None:
    engine = MapMatchedRetriever(store_graph(), provider=qdrant_provider(), candidate_limit=5)
    with pytest.warns(UserWarning, match=r"QdrantProvider has no get_documents\(\) and no documents= was given.*"
                                         r"only the decoded chunk, with empty text"):
        retriever = as_langchain_retriever(engine)
    for turn, query in enumerate(["q0", "q1", "q4"]):
        documents = retriever.invoke(query)
        assert _ids(documents) == [retriever.session.current_chunk_id]
        assert documents[0].page_content == "" and documents[0].metadata["map_matched"]["text_known"] is False
        assert documents[0].metadata["map_matched"]["turn_index"] == turn
    with pytest.warns(UserWarning, match="every context chunk with empty text"):
        empty = as_langchain_retriever(engine, missing_text="empty")
    assert _ids(empty.invoke("q0")) == list(empty.last_result.context_chunk_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a text source: no warning
        given = as_langchain_retriever(engine, documents={chunk: f"text {chunk}" for chunk in STORE_IDS})
        documents = given.invoke("q0")
    assert [d.page_content for d in documents] == [f"text {c}" for c in given.last_result.context_chunk_ids]


def test_a_failing_lookup_after_decoding_warns_and_the_turn_stands() -> None:
    def lookup(chunk_id: str) -> Any:
        if chunk_id == failing:
            raise KeyError(f"no row for {chunk_id}")
        return None

    store = _failing_store()  # the store's get_by_ids fails too
    retriever = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=_provider(store), **session_options()),
                         documents=lookup, missing_text="empty")
    failing = "c2"  # the decoded chunk of the first turn
    with pytest.warns(UserWarning) as caught:
        documents = retriever.invoke(QUERIES[0])
    assert retriever.session.turn_count == 1 and retriever.session.current_chunk_id == failing
    messages = [str(w.message) for w in caught]
    assert any("no text for chunk 'c2': documents= raised KeyError: 'no row for c2'" in m for m in messages)
    assert any("fetching failed (ConnectionError: store unreachable)" in m for m in messages)
    by_id = {d.metadata["map_matched"]["chunk_id"]: d for d in documents}
    assert _ids(documents) == list(retriever.last_result.context_chunk_ids)
    assert by_id[failing].page_content == TEXTS[failing]  # the provider's memory knew it
    candidates = {c.chunk_id for c in retriever.last_result.candidates}
    assert all(d.metadata["map_matched"]["text_known"] is (chunk in candidates) for chunk, d in by_id.items())
    # a provider method that raises: a warning, the chunks stay unknown
    provider = _provider(_store(ids=IDS))
    provider.get_documents = lambda chunk_ids: 1 / 0  # type: ignore[method-assign]
    broken = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=provider, **session_options()))
    with pytest.warns(UserWarning, match=r"LangChainProvider.get_documents\(\) raised ZeroDivisionError"):
        documents = broken.invoke(QUERIES[0])
    assert _ids(documents) == [broken.session.current_chunk_id] and broken.session.turn_count == 1


def test_the_adapter_never_mutates_the_stores_documents() -> None:
    provider = _provider(_store(ids=IDS))
    retriever = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=provider, **session_options()))
    documents = retriever.invoke(QUERIES[0])
    remembered = provider.get_documents(_ids(documents))
    assert all("map_matched" not in d.metadata for d in remembered.values())


# --------------------------------------------------------------------------- adapter: bad input


def test_adapter_arguments_are_checked() -> None:
    check_adapter_needs_a_provider(as_langchain_retriever)
    graph = chain_graph()
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
    with pytest.raises(ValueError, match="unsupported missing_text: error"):
        as_langchain_retriever(server, session_id="s", missing_text="error")
    with pytest.raises(ValueError, match="metadata_key must be a non-empty string"):
        as_langchain_retriever(server, session_id="s", metadata_key="")
    with pytest.raises(ValueError, match="documents must be a mapping or a callable"):
        as_langchain_retriever(server, session_id="s", documents=["a"])
    assert len(server) == 0  # nothing was opened by a refused call
    # documents= giving the wrong type: a warning per chunk, and the provider is asked instead
    bad_text = as_langchain_retriever(engine, documents=lambda chunk_id: 42)
    with pytest.warns(UserWarning, match=r"no text for chunk 'c\d': documents= gave int, not Document or str"):
        documents = bad_text.invoke(QUERIES[0])
    assert documents[0].page_content == TEXTS[bad_text.session.current_chunk_id]
    assert bad_text.session.turn_count == 1


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
    retriever = _adapter(engine=MapMatchedRetriever(chain_graph(), provider=_provider(store), **session_options()))
    first, second = race_two_async_turns(store, retriever.ainvoke)
    assert isinstance(second, MapMatchedRuntimeError) and isinstance(second, RuntimeError)
    assert "already taking a turn" in str(second)
    assert _ids(first)[0] == retriever.session.current_chunk_id
    assert retriever.session.turn_count == 1
    store.gate.set()
    retriever.invoke(QUERIES[1])  # the guard is released after the turn
    assert retriever.session.turn_count == 2


class BlockingDecoder(StandaloneDecoder):
    """The standalone decoder, holding each decoding until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def decode_ranked(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.release.wait(10), "the test never released the decoder"
        return super().decode_ranked(*args, **kwargs)


def test_a_cancelled_ainvoke_keeps_the_turn_and_the_guard_until_decoding_ends() -> None:
    decoder = BlockingDecoder()
    engine = MapMatchedRetriever(chain_graph(), provider=_provider(_store(ids=IDS)), decoder=decoder, **session_options())
    retriever = as_langchain_retriever(engine)
    expected = _plain_conversation()

    async def cancel_then_continue() -> List[Document]:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(retriever.ainvoke(QUERIES[0]), 0.5)  # cancelled while decoding
        assert decoder.entered.is_set(), "the first turn never reached the decoder"
        # the first turn is still decoding in its thread: its conversation is busy
        with pytest.raises(MapMatchedRuntimeError, match="already taking a turn"):
            await asyncio.wait_for(retriever.ainvoke(QUERIES[1]), 5)
        with pytest.raises(MapMatchedRuntimeError, match="already taking a turn"):
            retriever.invoke(QUERIES[1])
        decoder.release.set()
        for _ in range(500):  # until the first turn's thread has released the guard
            try:
                return await asyncio.wait_for(retriever.ainvoke(QUERIES[1]), 5)
            except MapMatchedRuntimeError:
                await asyncio.sleep(0.01)
        raise AssertionError("the conversation stayed busy after its decoding ended")

    second = asyncio.run(cancel_then_continue())
    assert retriever.session.turn_count == 2  # the cancelled turn stands, and nothing else was added
    assert _ids(second) == list(expected[1].context_chunk_ids)
    assert retriever.trace.to_dict() == expected[1].trace.to_dict()
    assert retriever.last_result == expected[1]


def test_concurrent_invoke_from_threads_is_refused_and_two_adapters_share_the_guard() -> None:
    store = _gated()
    session = MapMatchedRetriever(chain_graph(), provider=_provider(store), **session_options()).session()
    one, two = as_langchain_retriever(session), as_langchain_retriever(session)
    outcome: Dict[str, Any] = {}
    check_second_thread_refused(store, lambda: outcome.setdefault("first", one.invoke(QUERIES[0])),
                                lambda: two.invoke(QUERIES[1]), "this session is already taking a turn")
    assert session.turn_count == 1 and _ids(outcome["first"])[0] == session.current_chunk_id


def test_different_server_sessions_may_run_concurrently() -> None:
    store = _gated()
    server = MapMatchedServer(chain_graph(), provider=_provider(store), **session_options())
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


def test_missing_langchain_names_the_extra() -> None:
    session = MapMatchedRetriever(chain_graph(), provider=object()).session()
    missing_extra_errors("langchain_core", "langchain", lambda: LangChainProvider(object()),
                         lambda: as_langchain_retriever(session))


def test_importing_the_library_does_not_import_langchain() -> None:
    assert modules_loaded_by_importing("LangChainProvider, as_langchain_retriever", "langchain") == []


def test_from_pretrained_builds_the_retriever_of_a_model_directory(tmp_path) -> None:
    from mapmatched_torch import InMemoryCorpusGraph
    from mapmatched_torch.core.settings import DecodeSettings
    from mapmatched_torch.fit.artifacts import save_model
    from mapmatched_torch.fit.model import MapMatchedModel
    from mapmatched_torch.integrations.langchain import MapMatchedLangChainRetriever

    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")])
    folder = save_model(tmp_path / "m", MapMatchedModel(1.0, 2.0), DecodeSettings(1.0, 2.0), graph=graph,
                        candidate_limit=2)
    answers = {"q1": [ScoredCandidate("a", 1.0), ScoredCandidate("c", 0.5)],
               "q2": [ScoredCandidate("c", 1.0), ScoredCandidate("b", 0.99)]}

    class Provider:
        def candidates(self, query: str, limit: int) -> Sequence[ScoredCandidate]:
            return answers[query][:limit]

    documents = {chunk: f"text of {chunk}" for chunk in "abc"}
    retriever = MapMatchedLangChainRetriever.from_pretrained(folder, graph=graph, provider=Provider(),
                                                             documents=documents)
    assert retriever.session.retriever.settings == DecodeSettings(1.0, 2.0)
    assert retriever.invoke("q1")[0].page_content == "text of a"
    expected = MapMatchedRetriever(graph, provider=Provider(), candidate_limit=2, transition_weight=2.0).session()
    expected.retrieve("q1")
    assert retriever.invoke("q2")[0].metadata["map_matched"]["chunk_id"] == expected.retrieve("q2").chunk_id
    served = MapMatchedLangChainRetriever.from_pretrained(folder, graph=graph, provider=Provider(), session_id="s",
                                                          documents=documents, engine_options={"capacity": 2})
    assert served.server.settings.transition_weight == 2.0 and [d.page_content for d in served.invoke("q1")][0] == \
        "text of a"
