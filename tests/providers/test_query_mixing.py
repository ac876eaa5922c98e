"""Gated query mixing (mapmatched_torch.providers.query_mixing) over every provider that searches by vector."""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import numpy as np
import pytest
import torch

from mapmatched_torch import MapMatchedRetriever
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.providers import DenseProvider, FAISSProvider
from mapmatched_torch.providers.query_mixing import (
    ContextualProvider,
    QueryMixing,
    QueryMixingProvider,
    VectorSearchProvider,
    mixed_queries,
)
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

DIMENSION, SIZE = 6, 12
IDS = tuple(f"chunk-{i}" for i in range(SIZE))
GATE = QueryMixing(0.7, 0.4, -1.2, 0.1, 0.3)


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


CHUNKS = _unit(np.random.RandomState(0).randn(SIZE, DIMENSION))
QUERIES = {f"query {i}": np.random.RandomState(10 + i).randn(DIMENSION).astype(np.float32) for i in range(5)}


def _dense() -> DenseProvider:
    return DenseProvider(torch.from_numpy(CHUNKS), IDS, QUERIES.__getitem__)


def _faiss() -> FAISSProvider:
    faiss = pytest.importorskip("faiss", reason="faiss is not installed (the [faiss] extra)")
    index = faiss.IndexFlatIP(DIMENSION)
    index.add(CHUNKS)
    return FAISSProvider(index, IDS, QUERIES.__getitem__)


def _qdrant(by_point_id: bool = False) -> Any:
    pytest.importorskip("qdrant_client", reason="qdrant-client is not installed (the [qdrant] extra)")
    from qdrant_client import QdrantClient, models

    from mapmatched_torch.providers import QdrantProvider

    client = QdrantClient(":memory:")
    client.create_collection("chunks", vectors_config=models.VectorParams(size=DIMENSION, distance=models.Distance.DOT))
    client.upsert("chunks", [models.PointStruct(id=i, vector=CHUNKS[i].tolist(), payload={"chunk": IDS[i]})
                             for i in range(SIZE)])
    if by_point_id:  # chunk IDs are the point IDs: "0", "1", ...
        return QdrantProvider(client, "chunks", QUERIES.__getitem__)
    return QdrantProvider(client, "chunks", QUERIES.__getitem__, chunk_id_field="chunk")


def _chroma(by_field: bool = False) -> Any:
    pytest.importorskip("chromadb", reason="chromadb is not installed (the [chroma] extra)")
    import uuid

    import chromadb
    from chromadb.config import Settings

    from mapmatched_torch.providers import ChromaProvider

    client = chromadb.EphemeralClient(Settings(anonymized_telemetry=False))
    collection = client.create_collection(f"mix-{uuid.uuid4().hex}", configuration={"hnsw": {"space": "ip"}},
                                          embedding_function=None)
    if by_field:  # records named otherwise, the chunk ID in the metadata
        collection.add(ids=[f"record-{i}" for i in range(SIZE)], embeddings=CHUNKS.tolist(),
                       metadatas=[{"chunk": chunk_id} for chunk_id in IDS])
        return ChromaProvider(collection, QUERIES.__getitem__, chunk_id_field="chunk")
    collection.add(ids=list(IDS), embeddings=CHUNKS.tolist())
    return ChromaProvider(collection, QUERIES.__getitem__)


@pytest.fixture(params=["dense", "faiss", "qdrant", "chroma", "chroma-field"])
def provider(request) -> Any:
    """Every provider of this library that embeds queries and searches by vector."""
    return {"dense": _dense, "faiss": _faiss, "qdrant": _qdrant, "chroma": _chroma,
            "chroma-field": lambda: _chroma(by_field=True)}[request.param]()


def test_every_vector_provider_implements_the_protocol(provider):
    assert isinstance(provider, VectorSearchProvider)
    assert isinstance(QueryMixingProvider(provider, GATE), ContextualProvider)


@pytest.mark.parametrize("context", [None, "chunk-3", "chunk-7"])
def test_a_zero_mix_weight_gives_the_unmixed_providers_answers_exactly(provider, context):
    mixed = QueryMixingProvider(provider, QueryMixing(0.0, 3.0, -2.0, 0.5, 0.2))
    for query in QUERIES:
        assert mixed.retrieve_in_context(query, 5, context) == provider.retrieve(query, 5)
    assert mixed.retrieve_batch(list(QUERIES), 4) == provider.retrieve_batch(list(QUERIES), 4)


def test_without_context_a_query_is_not_mixed(provider):
    mixed = QueryMixingProvider(provider, GATE)
    assert mixed.retrieve_in_context("query 1", 5, None) == provider.retrieve("query 1", 5)
    assert mixed.candidates("query 2", 3) == provider.retrieve("query 2", 3)


def test_the_mixed_query_is_the_gated_mix_of_query_and_context(provider):
    mixed = QueryMixingProvider(provider, GATE)
    query = torch.from_numpy(QUERIES["query 0"]).double()
    context = torch.from_numpy(CHUNKS[3]).double()
    cosine = float(torch.nn.functional.cosine_similarity(query, context, dim=0))
    weight = 0.7 / (1.0 + np.exp(-(0.4 - 1.2 * (cosine - 0.1) / 0.3)))
    expected = (1 - weight) * query / query.norm() + weight * context
    expected = (expected / expected.norm()).float()
    found = mixed.retrieve_in_context("query 0", 4, "chunk-3")
    assert [c.chunk_id for c in found] == [c.chunk_id for c in provider.search_vectors(expected.unsqueeze(0), 4)[0]]
    scores = torch.from_numpy(CHUNKS).double() @ expected.double()
    assert [c.score for c in found] == pytest.approx(sorted(scores.tolist(), reverse=True)[:4], abs=1e-6)
    # each query gets its own context in a batch
    batch = mixed.retrieve_batch_in_context(["query 0", "query 1"], 4, ["chunk-3", None])
    assert batch == [found, provider.retrieve("query 1", 4)]


def test_dense_and_faiss_mix_alike():
    dense, faiss_provider = QueryMixingProvider(_dense(), GATE), QueryMixingProvider(_faiss(), GATE)
    for query, context in zip(QUERIES, ("chunk-0", "chunk-5", "chunk-9", None, "chunk-11")):
        left, right = dense.retrieve_in_context(query, 6, context), faiss_provider.retrieve_in_context(query, 6, context)
        assert [c.chunk_id for c in left] == [c.chunk_id for c in right]
        assert [c.score for c in left] == pytest.approx([c.score for c in right], abs=1e-5)


def test_apply_keeps_rows_without_context_and_zero_weight_bit_for_bit():
    queries = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    contexts = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    assert QueryMixing(0.0).apply(queries, contexts) is queries
    out = GATE.apply(queries, contexts, torch.tensor([True, False, True]))
    assert torch.equal(out[1], queries[1])
    expected, weights, _ = mixed_queries(queries.double(), contexts.double(), *[getattr(GATE, f) for f in
                                         ("mix_weight", "gate_bias", "gate_weight", "cosine_mean", "cosine_std")])
    assert torch.equal(out[[0, 2]], expected[[0, 2]].float())
    assert bool(((weights > 0) & (weights < 0.7)).all())
    assert torch.allclose(out[[0, 2]].norm(dim=1), torch.ones(2))


def test_query_mixing_rejects_bad_values():
    with pytest.raises(ValueError, match=r"mix_weight must be in \[0, 1\]"):
        QueryMixing(1.5)
    with pytest.raises(ValueError, match="cosine_std must be finite and greater than zero"):
        QueryMixing(0.5, cosine_std=0.0)
    with pytest.raises(ValueError, match="gate_weight must be finite"):
        QueryMixing(0.5, gate_weight=float("nan"))
    assert QueryMixing(**GATE.to_dict()) == GATE


def test_the_wrapper_names_what_a_provider_lacks_and_unknown_context_chunks(provider):
    with pytest.raises(TypeError, match="lacks embed_queries, chunk_embeddings, search_vectors"):
        QueryMixingProvider(object(), GATE)
    with pytest.raises(TypeError, match="mixing must be a QueryMixing"):
        QueryMixingProvider(provider, 0.5)
    with pytest.raises(ValueError, match="'nowhere' is not"):
        QueryMixingProvider(provider, GATE).retrieve_in_context("query 0", 3, "nowhere")
    with pytest.raises(ValueError, match="2 context chunk IDs for 1 queries"):
        QueryMixingProvider(provider, GATE).retrieve_batch_in_context(["query 0"], 3, [None, None])


def test_a_faiss_index_that_cannot_reconstruct_is_named():
    class Opaque:
        d, ntotal = DIMENSION, SIZE

        def search(self, vectors, limit):  # pragma: no cover - never reached
            raise AssertionError

    provider = FAISSProvider(Opaque(), IDS, QUERIES.__getitem__)
    with pytest.raises(ValueError, match="no reconstruct"):
        provider.chunk_embeddings(["chunk-1"])


class _Recording:
    """A contextual provider that records the context chunk of every call."""

    def __init__(self) -> None:
        self.contexts: List[Optional[str]] = []

    def retrieve_in_context(self, query: str, limit: int, context_chunk_id: Optional[str]):
        self.contexts.append(context_chunk_id)
        return [ScoredCandidate("a", 1.0), ScoredCandidate("b", 0.5)] if query == "first" else [
            ScoredCandidate("c", 1.0), ScoredCandidate("b", 0.9)]

    def retrieve(self, query: str, limit: int):  # pragma: no cover - the session must not call it
        raise AssertionError("a session must ask a contextual provider in context")


def test_a_session_passes_the_previous_decoded_chunk_as_context():
    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")])
    recording = _Recording()
    session = MapMatchedRetriever(graph, provider=recording, transition_weight=0.0).session()
    assert session.retrieve("first").chunk_id == "a"
    assert session.retrieve("second").chunk_id == "c"
    session.retrieve("third")
    assert recording.contexts == [None, "a", "c"]


def test_a_session_over_a_mixing_provider_equals_the_unmixed_session_at_zero_weight():
    graph = InMemoryCorpusGraph.from_edges([(IDS[i], IDS[i + 1]) for i in range(SIZE - 1)])
    plain = MapMatchedRetriever(graph, provider=_dense(), candidate_limit=4).session()
    mixed = MapMatchedRetriever(graph, provider=QueryMixingProvider(_dense(), QueryMixing(0.0)),
                                candidate_limit=4).session()
    for query in QUERIES:
        left, right = plain.retrieve(query), mixed.retrieve(query)
        assert left.candidates == right.candidates and left.path == right.path


def _server_beside_sessions(provider: Any, gate: QueryMixing):
    """A chain graph, the mixing provider, a server with sessions "a" and "b" open, and
    one independent session per ID: ``(graph, mixing, server, sessions)``."""
    from mapmatched_torch.serving import MapMatchedServer

    graph = InMemoryCorpusGraph.from_edges([(IDS[i], IDS[i + 1]) for i in range(SIZE - 1)])
    mixing = QueryMixingProvider(provider, gate)
    server = MapMatchedServer(graph, provider=mixing, candidate_limit=4)
    sessions = {key: MapMatchedRetriever(graph, provider=mixing, candidate_limit=4).session() for key in ("a", "b")}
    for key in sessions:
        server.open(key)
    return graph, mixing, server, sessions


def test_a_server_over_a_mixing_provider_equals_independent_sessions(provider):
    graph, mixing, server, sessions = _server_beside_sessions(provider, GATE)  # a real mix: context matters
    queries = list(QUERIES)
    for turn in range(4):
        asked = {"a": queries[turn], "b": queries[(turn + 2) % len(queries)]}
        results, errors = server.step(asked)
        assert not errors
        for key, query in asked.items():
            assert results[key] == sessions[key].retrieve(query)


# ----------------------------------------------------------------- the previous query as a second source

BOTH = QueryMixing(0.4, 0.4, -1.2, 0.1, 0.3, query_mix_weight=0.35, query_gate_bias=-0.2, query_gate_weight=0.8,
                   query_cosine_mean=0.05, query_cosine_std=0.4)


def test_the_two_source_mix_is_the_hand_written_one_and_a_zero_query_weight_is_the_chunk_mix_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    queries, contexts, previous = (torch.randn(5, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    known = torch.tensor([True, False, True, True, False])
    out = BOTH.apply(queries, contexts, previous_queries=previous, has_previous_query=known)
    unit = torch.nn.functional.normalize
    q, e, p = unit(queries, dim=-1), unit(contexts, dim=-1), unit(previous, dim=-1)
    a = 0.4 * torch.sigmoid(0.4 - 1.2 * ((q * e).sum(-1) - 0.1) / 0.3)
    c = torch.where(known, 0.35 * torch.sigmoid(-0.2 + 0.8 * ((q * p).sum(-1) - 0.05) / 0.4), 0.0)
    expected = unit((1 - a - c)[:, None] * q + a[:, None] * e + c[:, None] * p, dim=-1)
    assert torch.allclose(out, expected, atol=1e-15)
    # rows without a known previous query take the chunk alone, as a one-source mix
    chunk_only = QueryMixing(*(getattr(BOTH, f) for f in ("mix_weight", "gate_bias", "gate_weight", "cosine_mean",
                                                         "cosine_std")))
    assert torch.equal(out[~known], chunk_only.apply(queries, contexts)[~known])
    assert torch.equal(chunk_only.apply(queries, contexts, previous_queries=previous),
                       chunk_only.apply(queries, contexts))
    single, weights, _ = mixed_queries(queries, contexts, 0.4, 0.4, -1.2, 0.1, 0.3)
    assert torch.equal(chunk_only.apply(queries, contexts), single) and weights.shape == (5,)
    assert not chunk_only.uses_previous_query and BOTH.uses_previous_query
    assert QueryMixing(**BOTH.to_dict()) == BOTH
    with pytest.raises(ValueError, match="at most 1"):
        QueryMixing(0.6, query_mix_weight=0.5)
    with pytest.raises(ValueError, match="query_cosine_std"):
        QueryMixing(0.2, query_mix_weight=0.2, query_cosine_std=0.0)


def test_providers_mix_the_previous_query_in_as_the_hand_written_search(provider):
    wrapped = QueryMixingProvider(provider, BOTH)
    assert wrapped.uses_previous_query
    queries = list(QUERIES)
    vectors = provider.embed_queries(queries)
    for i, (context, earlier) in enumerate([("chunk-3", queries[4]), ("chunk-7", None), (None, queries[0])]):
        got = wrapped.retrieve_in_context(queries[i], 5, context, previous_query=earlier)
        if context is None:
            expected = provider.search_vectors(vectors[i:i + 1], 5)[0]
        else:
            mixed = BOTH.apply(vectors[i:i + 1], provider.chunk_embeddings([context]),
                               previous_queries=None if earlier is None else provider.embed_queries([earlier]))
            expected = provider.search_vectors(mixed, 5)[0]
        assert [c.chunk_id for c in got] == [c.chunk_id for c in expected]
    batch = wrapped.retrieve_batch_in_context(queries[:3], 5, ["chunk-3", "chunk-7", None],
                                              [queries[4], None, queries[0]])
    assert batch == [wrapped.retrieve_in_context(q, 5, c, previous_query=p)
                     for q, c, p in zip(queries[:3], ["chunk-3", "chunk-7", None], [queries[4], None, queries[0]])]
    with pytest.raises(ValueError, match="2 previous queries for 3 queries"):
        wrapped.retrieve_batch_in_context(queries[:3], 5, [None] * 3, [None] * 2)
    with pytest.raises(ValueError, match="query 0"):
        wrapped.retrieve_batch_in_context(queries[:1], 5, ["chunk-1"], [""])


class _RecordingBoth(_Recording):
    uses_previous_query = True

    def __init__(self) -> None:
        super().__init__()
        self.previous: List[Optional[str]] = []

    def retrieve_in_context(self, query: str, limit: int, context_chunk_id: Optional[str],
                            previous_query: Optional[str] = None):
        self.previous.append(previous_query)
        return super().retrieve_in_context(query, limit, context_chunk_id)


def test_a_session_passes_the_previous_query_only_to_a_provider_that_uses_it():
    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")])
    recording = _RecordingBoth()
    session = MapMatchedRetriever(graph, provider=recording, transition_weight=0.0).session()
    session.retrieve("first")
    session.retrieve("second")
    session.retrieve_candidates([("a", 1.0)])  # a turn given as candidates has no query
    assert session.previous_query is None
    session.retrieve("third")
    session.retrieve("fourth")
    assert recording.previous == [None, "first", None, "third"]
    assert session.previous_query == "fourth"
    # a three-argument contextual provider is still asked with three arguments
    plain = _Recording()
    MapMatchedRetriever(graph, provider=plain).session().retrieve("first")


def test_a_server_over_a_two_source_mix_equals_independent_sessions_and_keeps_them_over_a_restore(provider):
    from mapmatched_torch.serving import MapMatchedServer

    graph, mixing, server, sessions = _server_beside_sessions(provider, BOTH)
    queries = list(QUERIES)
    for turn in range(5):
        if turn == 2:  # session b's turn comes as candidates: it has no previous query at turn 3
            asked = {"a": queries[turn], "b": [(IDS[1], 0.9), (IDS[2], 0.5)]}
        else:
            asked = {"a": queries[turn], "b": queries[(turn + 2) % len(queries)]}
        if turn == 3:  # a restored server continues with the saved previous queries
            restored = MapMatchedServer(graph, provider=mixing, candidate_limit=4)
            restored.load_state_dict(server.state_dict())
            server = restored
        results, errors = server.step(asked)
        assert not errors
        for key, request in asked.items():
            expected = (sessions[key].retrieve(request) if isinstance(request, str)
                        else sessions[key].retrieve_candidates(request))
            assert results[key] == expected
    state = server.state_dict()
    assert [slot for slot, _ in state["previous_queries"]] == sorted(server.slots(["a", "b"]).tolist())
    broken = dict(state, previous_queries=[[99, "x"]])
    del broken["checksum"]  # the entry checks, not the checksum
    with pytest.raises(ValueError, match="no whole-state checksum"):
        server.load_state_dict(broken)
    with pytest.raises(ValueError, match="previous_queries"):
        server.load_state_dict(broken, legacy=True)
    server.close("a")
    assert [slot for slot, _ in server.state_dict()["previous_queries"]] == server.slots(["b"]).tolist()


@pytest.mark.parametrize("store", ["qdrant by payload field", "qdrant by point ID", "chroma by ID",
                                   "chroma by metadata field"])
def test_vector_stores_look_up_stored_vectors_by_id_and_by_field_and_name_what_is_missing(store):
    make = {"qdrant by payload field": _qdrant, "qdrant by point ID": lambda: _qdrant(by_point_id=True),
            "chroma by ID": _chroma, "chroma by metadata field": lambda: _chroma(by_field=True)}[store]
    provider = make()
    ids = [str(i) for i in range(SIZE)] if store == "qdrant by point ID" else list(IDS)
    wanted = [ids[5], ids[2], ids[5]]  # any order, repeats allowed
    assert torch.allclose(provider.chunk_embeddings(wanted), torch.from_numpy(CHUNKS[[5, 2, 5]]), atol=1e-6)
    with pytest.raises(ValueError, match="'99999' is not in"):
        provider.chunk_embeddings([ids[1], "99999"])
    found = provider.search_vectors(torch.from_numpy(CHUNKS[[4]]), 3)[0]
    assert found[0].chunk_id == ids[4] and len(found) == 3
    with pytest.raises(ValueError, match="query vector 0"):
        provider.search_vectors(torch.full((1, DIMENSION), float("nan")), 3)
    assert torch.equal(provider.embed_queries(["query 1"])[0], torch.from_numpy(QUERIES["query 1"]))


def test_query_vectors_search_as_their_queries_retrieve(provider):
    vectors = provider.embed_queries(list(QUERIES))
    assert provider.search_vectors(vectors, 4) == provider.retrieve_batch(list(QUERIES), 4)


@pytest.mark.parametrize("mode", ["session", "server"])
def test_framework_conversations_over_a_mixing_provider_mix_in_context_sync_and_async(mode):
    import asyncio

    from mapmatched_torch.integrations._conversation import Conversation
    from mapmatched_torch.serving import MapMatchedServer

    graph = InMemoryCorpusGraph.from_edges([(IDS[i], IDS[i + 1]) for i in range(SIZE - 1)])
    mixing = QueryMixingProvider(_dense(), BOTH)
    reference = MapMatchedRetriever(graph, provider=mixing, candidate_limit=4).session()
    engine = (MapMatchedRetriever(graph, provider=mixing, candidate_limit=4).session() if mode == "session"
              else MapMatchedServer(graph, provider=mixing, candidate_limit=4))
    conversation = Conversation(engine, "c" if mode == "server" else None, feature="test")
    queries = list(QUERIES)
    expected = []
    for turn, query in enumerate(queries):
        got = conversation.turn(query) if turn % 2 == 0 else asyncio.run(conversation.aturn(query))
        expected.append(reference.retrieve(query))
        assert got == expected[-1]
    # the mix changes the answers here, so a conversation that skipped it would fail above
    plain = MapMatchedRetriever(graph, provider=_dense(), candidate_limit=4).session()
    assert [plain.retrieve(q).candidates for q in queries] != [result.candidates for result in expected]


def test_a_server_state_with_a_changed_session_id_or_previous_query_is_refused_and_an_older_one_loads():
    from mapmatched_torch.serving import MapMatchedServer

    graph = InMemoryCorpusGraph.from_edges([(IDS[i], IDS[i + 1]) for i in range(SIZE - 1)])
    mixing = QueryMixingProvider(_dense(), BOTH)
    server = MapMatchedServer(graph, provider=mixing, candidate_limit=4)
    for key in ("alice", "bob"):
        server.open(key)
    server.step({"alice": "query 0", "bob": "query 1"})
    state = server.state_dict()
    fresh = MapMatchedServer(graph, provider=mixing, candidate_limit=4)
    renamed = dict(state, sessions=[["alicf" if key == "alice" else key, slot] for key, slot in state["sessions"]])
    requeried = dict(state, previous_queries=[[slot, text + "!"] for slot, text in state["previous_queries"]])
    for damaged in (renamed, requeried):
        with pytest.raises(ValueError, match="checksum"):
            fresh.load_state_dict(damaged)
        assert len(fresh) == 0  # nothing changed
    with pytest.raises(ValueError, match="checksum"):  # a cleared checksum is a damaged one
        fresh.load_state_dict(dict(renamed, checksum=None))
    # a format-2 state saved before previous queries existed: loaded only when asked (legacy=True)
    older = {"version": 2, "options": state["options"], "store": state["store"], "sessions": state["sessions"]}
    with pytest.raises(ValueError, match="legacy=True"):
        fresh.load_state_dict(older)
    assert len(fresh) == 0
    fresh.load_state_dict(older, legacy=True)  # no previous queries known
    assert sorted(fresh.session_ids) == ["alice", "bob"] and fresh.state_dict()["previous_queries"] == []
    fresh.load_state_dict(state)
    assert fresh.step({"alice": "query 2"})[0]["alice"] == server.step({"alice": "query 2"})[0]["alice"]


def test_vector_store_lookups_stay_within_the_providers_filter_and_an_empty_chroma_collection_mixes_nothing():
    pytest.importorskip("qdrant_client")
    pytest.importorskip("chromadb")
    import uuid

    import chromadb
    from chromadb.config import Settings
    from qdrant_client import QdrantClient, models

    from mapmatched_torch.providers import ChromaProvider, QdrantProvider

    vectors = np.eye(4, dtype=np.float32)
    embed = lambda query: np.array([1.0, 0.5, 0.0, 0.0], dtype=np.float32)  # noqa: E731
    chunk, tenant = ["a", "b", "a", "b"], ["x", "x", "y", "y"]  # one chunk ID in two tenants
    client = QdrantClient(":memory:")
    client.create_collection("t", vectors_config=models.VectorParams(size=4, distance=models.Distance.DOT))
    client.upsert("t", [models.PointStruct(id=i, vector=vectors[i].tolist(), payload={"chunk": chunk[i], "t": tenant[i]})
                        for i in range(4)])
    only_y = models.Filter(must=[models.FieldCondition(key="t", match=models.MatchValue(value="y"))])
    qdrant = QdrantProvider(client, "t", embed, chunk_id_field="chunk", query_filter=only_y)
    chroma_client = chromadb.EphemeralClient(Settings(anonymized_telemetry=False))
    collection = chroma_client.create_collection(f"t-{uuid.uuid4().hex}", configuration={"hnsw": {"space": "ip"}},
                                                 embedding_function=None)
    collection.add(ids=[f"r{i}" for i in range(4)], embeddings=vectors.tolist(),
                   metadatas=[{"chunk": chunk[i], "t": tenant[i]} for i in range(4)])
    chroma = ChromaProvider(collection, embed, chunk_id_field="chunk", where={"t": "y"})
    for provider in (qdrant, chroma):  # tenant y's "a" is row 2
        assert torch.equal(provider.chunk_embeddings(["a"]), torch.from_numpy(vectors[[2]]))
        assert QueryMixingProvider(provider, QueryMixing(0.5)).retrieve_in_context("q", 2, "a")[0].chunk_id == "a"
    by_id = ChromaProvider(collection, embed, where={"t": "x"})
    with pytest.raises(ValueError, match="'r2' is not in"):  # outside the filter
        by_id.chunk_embeddings(["r2"])
    empty = ChromaProvider(chroma_client.create_collection(f"e-{uuid.uuid4().hex}", embedding_function=None), embed)
    assert QueryMixingProvider(empty, QueryMixing(0.0)).retrieve("q", 2) == empty.retrieve("q", 2) == ()
    assert QueryMixingProvider(empty, BOTH).retrieve_in_context("q", 2, None) == ()


def test_a_bad_previous_query_is_named_by_its_row():
    bad = {**QUERIES, "bad": np.ones(3, dtype=np.float32)}
    wrapped = QueryMixingProvider(DenseProvider(torch.from_numpy(CHUNKS), IDS, bad.__getitem__), BOTH)
    with pytest.raises(ValueError, match="the previous query of query 1: "):
        wrapped.retrieve_batch_in_context(["query 0", "query 1"], 5, [IDS[1], IDS[2]], [None, "bad"])


def test_a_turn_stepped_by_slot_ends_the_previous_query_as_a_candidates_turn_does():
    _, _, server, sessions = _server_beside_sessions(_dense(), BOTH)
    queries = list(QUERIES)
    server.step({"a": queries[0], "b": queries[1]})
    for key, query in (("a", queries[0]), ("b", queries[1])):
        sessions[key].retrieve(query)
    slot = server.slot("a")
    codes = server.store.codes.codes([IDS[3], IDS[4]])
    step = server.step_slots(torch.tensor([slot]), torch.tensor([codes]), torch.tensor([[0.8, 0.3]], dtype=torch.float64))
    assert int(step.status[0]) == 0
    sessions["a"].retrieve_candidates([(IDS[3], 0.8), (IDS[4], 0.3)])
    assert [entry[0] for entry in server.state_dict()["previous_queries"]] == [server.slot("b")]
    results, _ = server.step({"a": queries[2], "b": queries[3]})
    assert results["a"] == sessions["a"].retrieve(queries[2]) and results["b"] == sessions["b"].retrieve(queries[3])


# ----------------------------------------------------------------- the recurrent state (issue 33 item 5)

RECURRENT = dataclasses.replace(BOTH, recurrent=True)


def test_a_recurrent_provider_answers_with_the_vector_it_searched_and_mixes_it_back_in(provider):
    import pickle

    from mapmatched_torch.core.protocols import searched_query
    from mapmatched_torch.providers.query_mixing import SearchedAnswer, SearchedQuery

    wrapped = QueryMixingProvider(provider, RECURRENT)
    queries = list(QUERIES)
    first = wrapped.retrieve_in_context(queries[0], 5, None)
    assert isinstance(first, SearchedAnswer) and first == provider.search_vectors(provider.embed_queries(queries[:1]), 5)[0]
    state = searched_query(first, queries[0])
    assert isinstance(state, SearchedQuery) and state == queries[0]
    assert torch.equal(state.vector, provider.embed_queries(queries[:1])[0])  # no context: the raw query searched
    second = wrapped.retrieve_in_context(queries[1], 5, "chunk-3", previous_query=state)
    mixed = RECURRENT.apply(provider.embed_queries(queries[1:2]), provider.chunk_embeddings(["chunk-3"]),
                            previous_queries=state.vector[None])
    assert second == provider.search_vectors(mixed, 5)[0] and torch.equal(second.searched_query.vector, mixed[0])
    # a third turn mixes the second's searched vector, not its raw query
    third = wrapped.retrieve_in_context(queries[2], 5, "chunk-7", previous_query=second.searched_query)
    expected = RECURRENT.apply(provider.embed_queries(queries[2:3]), provider.chunk_embeddings(["chunk-7"]),
                               previous_queries=mixed)
    assert torch.equal(third.searched_query.vector, expected[0])
    # a plain text (e.g. restored from an older state) is embedded: the raw previous query
    plain = wrapped.retrieve_in_context(queries[2], 5, "chunk-7", previous_query=queries[1])
    assert plain == QueryMixingProvider(provider, BOTH).retrieve_in_context(queries[2], 5, "chunk-7", queries[1])
    # the state pickles, keeps its vector, and a candidates turn (no query) keeps none
    copy = pickle.loads(pickle.dumps(second))
    assert copy == second and torch.equal(copy.searched_query.vector, second.searched_query.vector)
    assert searched_query(second, None) is None and searched_query(second, "other") == "other"
    assert searched_query(QueryMixingProvider(provider, BOTH).retrieve(queries[0], 5), queries[0]) == queries[0]
    with pytest.raises(ValueError, match="searched previous query of query 0 has"):
        wrapped.retrieve_in_context(queries[1], 5, "chunk-3", previous_query=SearchedQuery("x", torch.ones(2)))


def test_searched_queries_round_trip_through_saved_entries_and_bad_ones_are_named():
    from mapmatched_torch.providers.query_mixing import SearchedQuery, previous_query_entry, previous_query_of_entry

    vector = torch.randn(4, generator=torch.Generator().manual_seed(1))
    entry = previous_query_entry(SearchedQuery("where?", vector))
    back = previous_query_of_entry(entry)
    assert isinstance(back, SearchedQuery) and back == "where?" and torch.equal(back.vector.to(vector), vector)
    assert previous_query_entry("where?") == ["where?"] and previous_query_of_entry(["where?"]) == "where?"
    for bad in ([], [""], [3], ["x", []], ["x", [1]], ["x", [0.5], 1]):
        assert previous_query_of_entry(bad) is None
    with pytest.raises(TypeError, match=r"\(D,\) tensor"):
        SearchedQuery("x", [1.0])
    with pytest.raises(TypeError, match="recurrent"):
        QueryMixing(0.5, recurrent=1)
    assert QueryMixing(**RECURRENT.to_dict()) == RECURRENT
