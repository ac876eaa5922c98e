"""Gated query mixing (mapmatched_torch.providers.query_mixing) over every provider that searches by vector."""

from __future__ import annotations

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


@pytest.fixture(params=["dense", "faiss"])
def provider(request) -> Any:
    """Every provider of this library that embeds queries and searches by vector."""
    return _dense() if request.param == "dense" else _faiss()


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


def test_a_server_over_a_mixing_provider_equals_independent_sessions(provider):
    from mapmatched_torch.serving import MapMatchedServer

    graph = InMemoryCorpusGraph.from_edges([(IDS[i], IDS[i + 1]) for i in range(SIZE - 1)])
    mixing = QueryMixingProvider(provider, GATE)  # a real mix: the context changes the candidates
    server = MapMatchedServer(graph, provider=mixing, candidate_limit=4)
    sessions = {key: MapMatchedRetriever(graph, provider=mixing, candidate_limit=4).session() for key in ("a", "b")}
    for key in sessions:
        server.open(key)
    queries = list(QUERIES)
    for turn in range(4):
        asked = {"a": queries[turn], "b": queries[(turn + 2) % len(queries)]}
        results, errors = server.step(asked)
        assert not errors
        for key, query in asked.items():
            assert results[key] == sessions[key].retrieve(query)
