"""Tests of mapmatched_torch.providers.qdrant against a real qdrant-client in local mode.

``QdrantClient(":memory:")`` needs no server; every test builds its own client.

qdrant-client's local mode re-normalizes the stored vectors of a Cosine collection in
place on every query (1.20.0, ``local/distances.py``), so two queries with the same
vector may differ in the last float32 bit of a score. Tests that compare two separate
queries exactly therefore use the other distances, or record the response the provider
itself received.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest

from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.core.protocols import CandidateProvider
from mapmatched_torch.providers.qdrant import QdrantProvider

from ..providers_fixtures import (
    BAD_LIMITS,
    BAD_QUERIES,
    brute_force,
    check_accepts_row_matrices_lists_and_torch_tensors,
    check_batch_argument_errors,
    check_batch_error_names_the_query,
    check_brute_force_top_five,
    check_limit_cuts,
    check_rejects_bad_limit,
    check_server_parity,
    check_store_session_parity,
    check_ties_keep_the_store_rank,
    check_zero_distance_is_positive_zero,
    import_error_without,
    missing_extra_errors,
    score_pairs,
    tied_vectors,
)
from ..providers_fixtures import STORE_DIMENSION as DIMENSION
from ..providers_fixtures import STORE_IDS as IDS
from ..providers_fixtures import STORE_QUERIES as QUERIES
from ..providers_fixtures import STORE_VECTORS as VECTORS

qdrant_client = pytest.importorskip("qdrant_client", reason="qdrant-client is not installed (the [qdrant] extra)")
models = qdrant_client.models

DISTANCES = ("Cosine", "Dot", "Euclid", "Manhattan")


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def client() -> Any:
    return qdrant_client.QdrantClient(":memory:")


def _collection(
    client: Any, distance: str = "Dot", vectors: np.ndarray = VECTORS, chunk_ids: Sequence[str] = IDS, name: str = "docs"
) -> str:
    """Points 0..n-1 with payload {"chunk": chunk ID, "group": position % 2}."""
    client.create_collection(name, vectors_config=models.VectorParams(size=vectors.shape[1], distance=models.Distance(distance)))
    client.upsert(
        name,
        [
            models.PointStruct(id=i, vector=vector.tolist(), payload={"chunk": chunk_id, "group": i % 2})
            for i, (chunk_id, vector) in enumerate(zip(chunk_ids, vectors))
        ],
    )
    return name


def _provider(client: Any, distance: str = "Dot", **kwargs: Any) -> QdrantProvider:
    name = _collection(client, distance)
    return QdrantProvider(client, name, QUERIES.__getitem__, chunk_id_field="chunk", **kwargs)


def _by_hand(points: Sequence[Any], distance: str) -> List[ScoredCandidate]:
    """Candidates built by hand from Qdrant's points (no provider code)."""
    sign = -1.0 if distance in ("Euclid", "Manhattan") else 1.0
    hits = [(sign * p.score, rank, p.payload["chunk"]) for rank, p in enumerate(points)]
    return [ScoredCandidate(chunk, score + 0.0) for score, _, chunk in sorted(hits, key=lambda h: (-h[0], h[1]))]


class FakeClient:
    """Just enough of a QdrantClient to script a response (order, scores, payloads)."""

    def __init__(self, vectors: Any, points: List[Any]) -> None:
        self.vectors, self.points = vectors, points
        self.batch_calls = 0

    def collection_exists(self, name: str) -> bool:
        return name == "docs"

    def get_collection(self, name: str) -> Any:
        return SimpleNamespace(config=SimpleNamespace(params=SimpleNamespace(vectors=self.vectors)))

    def query_points(self, name: str, **kwargs: Any) -> Any:
        return SimpleNamespace(points=self.points)

    def query_batch_points(self, name: str, requests: Sequence[Any]) -> List[Any]:
        self.batch_calls += 1
        return [SimpleNamespace(points=self.points) for _ in requests]


def _points(*hits: Tuple[Any, float, Any]) -> List[Any]:
    return [SimpleNamespace(id=point_id, score=score, payload=payload) for point_id, score, payload in hits]


def _fake(distance: str, points: List[Any], **kwargs: Any) -> QdrantProvider:
    vectors = models.VectorParams(size=2, distance=models.Distance(distance))
    return QdrantProvider(FakeClient(vectors, points), "docs", lambda query: [1.0, 0.0], **kwargs)


# --------------------------------------------------------------------------- scores and order


@pytest.mark.parametrize("distance", DISTANCES)
def test_scores_are_higher_is_better_for_every_distance(client: Any, distance: str) -> None:
    provider = _provider(client, distance)
    assert provider.distance == distance and provider.dimension == DIMENSION
    check_brute_force_top_five(provider, distance)


@pytest.mark.parametrize("distance", ["Euclid", "Manhattan"])
def test_zero_distance_is_positive_zero(client: Any, distance: str) -> None:
    name = _collection(client, distance)
    check_zero_distance_is_positive_zero(QdrantProvider(client, name, lambda query: VECTORS[4], chunk_id_field="chunk"))


@pytest.mark.parametrize("distance", DISTANCES)
def test_ties_keep_qdrants_rank(client: Any, distance: str) -> None:
    vectors = tied_vectors()
    name = _collection(client, distance, vectors)
    got = QdrantProvider(client, name, lambda query: vectors[5], chunk_id_field="chunk").retrieve("q", len(IDS))
    raw = client.query_points(name, query=vectors[5].tolist(), limit=len(IDS), with_payload=True).points
    check_ties_keep_the_store_rank(got, [p.payload["chunk"] for p in raw])


@pytest.mark.parametrize(
    ("distance", "scores", "expected"),
    [
        ("Dot", [1.0, 2.0, 1.0], [("p1", 2.0), ("p0", 1.0), ("p2", 1.0)]),
        ("Euclid", [1.0, 0.5, 1.0], [("p1", -0.5), ("p0", -1.0), ("p2", -1.0)]),
        ("Manhattan", [0.0, 3.0, 0.0], [("p0", 0.0), ("p2", 0.0), ("p1", -3.0)]),
    ],
)
def test_unsorted_response_is_sorted_by_score_then_rank(distance: str, scores: List[float], expected: Any) -> None:
    points = _points(*((i, score, {"chunk": f"p{i}"}) for i, score in enumerate(scores)))
    assert score_pairs(_fake(distance, points, chunk_id_field="chunk").retrieve("q", 3)) == expected


def test_limit_cuts_and_large_limit_returns_every_point(client: Any) -> None:
    check_limit_cuts(_provider(client, "Dot"))


def test_point_ids_are_chunk_ids_by_default(client: Any) -> None:
    client.create_collection("ids", vectors_config=models.VectorParams(size=2, distance=models.Distance.DOT))
    key = uuid.UUID("12345678-9ABC-4DEF-8123-456789ABCDEF")
    client.upsert("ids", [models.PointStruct(id=7, vector=[1.0, 0.0]), models.PointStruct(id=str(key), vector=[0.0, 1.0])])
    provider = QdrantProvider(client, "ids", lambda query: [0.25, 0.5])
    assert provider.chunk_id_field is None
    assert score_pairs(provider.retrieve("q", 5)) == [(str(key), 0.5), ("7", 0.25)]


def test_named_vectors(client: Any) -> None:
    client.create_collection(
        "named",
        vectors_config={
            "text": models.VectorParams(size=DIMENSION, distance=models.Distance.DOT),
            "title": models.VectorParams(size=3, distance=models.Distance.EUCLID),
        },
    )
    titles = np.random.default_rng(5).standard_normal((len(IDS), 3)).astype(np.float32)
    client.upsert(
        "named",
        [
            models.PointStruct(id=i, vector={"text": VECTORS[i].tolist(), "title": titles[i].tolist()}, payload={"chunk": c})
            for i, c in enumerate(IDS)
        ],
    )
    text = QdrantProvider(client, "named", QUERIES.__getitem__, chunk_id_field="chunk", using="text")
    title = QdrantProvider(client, "named", lambda query: titles[2], chunk_id_field="chunk", using="title")
    assert (text.using, text.distance, text.dimension) == ("text", "Dot", DIMENSION)
    assert (title.using, title.distance, title.dimension) == ("title", "Euclid", 3)
    expected = brute_force("Dot", QUERIES["q1"])
    assert [c.chunk_id for c in text.retrieve("q1", 3)] == [IDS[i] for i in np.argsort(-expected)[:3]]
    assert title.retrieve("q", 1)[0] == ScoredCandidate(IDS[2], 0.0)
    with pytest.raises(ValueError, match=r"several named vectors \('text', 'title'\); pass using="):
        QdrantProvider(client, "named", QUERIES.__getitem__)
    with pytest.raises(ValueError, match=r"no dense vector named 'body' \(it has 'text', 'title'\)"):
        QdrantProvider(client, "named", QUERIES.__getitem__, using="body")
    with pytest.raises(ValueError, match=r"query embedding has dimension 6 but vector 'title' of Qdrant"):
        QdrantProvider(client, "named", QUERIES.__getitem__, chunk_id_field="chunk", using="title").retrieve("q1", 2)


def test_single_named_vector_needs_no_using(client: Any) -> None:
    client.create_collection("one", vectors_config={"dense": models.VectorParams(size=2, distance=models.Distance.DOT)})
    client.upsert("one", [models.PointStruct(id=1, vector={"dense": [1.0, 2.0]})])
    provider = QdrantProvider(client, "one", lambda query: [1.0, 1.0])
    assert provider.using == "dense"
    assert score_pairs(provider.retrieve("q", 2)) == [("1", 3.0)]


def test_unnamed_vector_rejects_using(client: Any) -> None:
    name = _collection(client)
    with pytest.raises(ValueError, match=r"has one unnamed vector; leave using=None \(got 'text'\)"):
        QdrantProvider(client, name, QUERIES.__getitem__, using="text")


def test_query_filter_and_search_params_apply_to_every_query(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    only_even = models.Filter(must=[models.FieldCondition(key="group", match=models.MatchValue(value=0))])
    exact = models.SearchParams(exact=True)
    provider = _provider(client, "Dot", query_filter=only_even, search_params=exact)
    even = {IDS[i] for i in range(0, len(IDS), 2)}
    # local mode warns that search_params have no effect: proof that they were passed on
    with pytest.warns(UserWarning, match="search_params"):
        single = provider.retrieve("q2", 100)
    assert {c.chunk_id for c in single} == even
    seen: List[Any] = []
    real = client.query_batch_points

    def recording(name: str, requests: Sequence[Any]) -> Any:
        seen.extend(requests)
        return real(name, requests=requests)

    monkeypatch.setattr(client, "query_batch_points", recording)
    assert provider.retrieve_batch(["q2", "q3"], 100)[0] == single
    assert [(r.filter, r.params, r.limit) for r in seen] == [(only_even, exact, 100)] * 2


def test_empty_collection_gives_no_candidates(client: Any) -> None:
    client.create_collection("empty", vectors_config=models.VectorParams(size=DIMENSION, distance=models.Distance.COSINE))
    provider = QdrantProvider(client, "empty", QUERIES.__getitem__)
    assert provider.retrieve("q0", 3) == ()
    assert provider.retrieve_batch(["q0", "q1"], 3) == [(), ()]


def test_properties_repr_and_protocol(client: Any) -> None:
    provider = _provider(client, "Manhattan")
    assert isinstance(provider, CandidateProvider)
    assert (provider.collection_name, provider.chunk_id_field, provider.using) == ("docs", "chunk", None)
    assert repr(provider) == (
        "QdrantProvider(collection_name='docs', using=None, distance='Manhattan', dimension=6, chunk_id_field='chunk')"
    )


# --------------------------------------------------------------------------- batches


@pytest.mark.parametrize("distance", ["Dot", "Euclid", "Manhattan"])
def test_retrieve_batch_equals_retrieve_with_one_request(client: Any, distance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    provider = _provider(client, distance)
    singles = [provider.retrieve(query, 4) for query in QUERIES]
    calls: List[int] = []
    real = client.query_batch_points

    def counting(name: str, requests: Sequence[Any], **kwargs: Any) -> Any:
        calls.append(len(requests))
        return real(name, requests=requests, **kwargs)

    monkeypatch.setattr(client, "query_batch_points", counting)
    assert provider.retrieve_batch(list(QUERIES), 4) == singles
    assert calls == [len(QUERIES)]


def test_cosine_batch_matches_retrieve_up_to_local_mode_rounding(client: Any) -> None:
    provider = _provider(client, "Cosine")
    singles = [provider.retrieve(query, 4) for query in QUERIES]
    batched = provider.retrieve_batch(list(QUERIES), 4)
    assert [[c.chunk_id for c in turn] for turn in batched] == [[c.chunk_id for c in turn] for turn in singles]
    for got, expected in zip(batched, singles):
        assert [c.score for c in got] == pytest.approx([c.score for c in expected], rel=1e-6, abs=1e-6)


def test_retrieve_batch_edge_cases(client: Any) -> None:
    points = _points((0, 1.0, None))
    provider = _fake("Dot", points)
    check_batch_argument_errors(provider)
    assert provider._client.batch_calls == 0
    assert provider.retrieve_batch(("a", "b"), 2) == [(ScoredCandidate("0", 1.0),)] * 2


def test_batch_error_names_the_query(client: Any) -> None:
    name = _collection(client)
    check_batch_error_names_the_query(lambda embed_query: QdrantProvider(client, name, embed_query, chunk_id_field="chunk"))


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("query", "message"), BAD_QUERIES)
def test_rejects_bad_queries(client: Any, query: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _provider(client).retrieve(query, 1)


@pytest.mark.parametrize(("limit", "message"), BAD_LIMITS)
def test_rejects_bad_limits(client: Any, limit: Any, message: str) -> None:
    check_rejects_bad_limit(_provider(client), limit, message)


@pytest.mark.parametrize(
    ("vector", "message"),
    [
        (np.ones(5), r"query embedding has dimension 5 but Qdrant collection 'docs' has dimension 6"),
        (np.ones((2, 6)), r"shape \(2, 6\) for query; expected \(6,\) or \(1, 6\)"),
        ([1.0, float("nan"), 0, 0, 0, 0], r"^query vector values must be finite: .* has nan at dimension 1"),
        ([0, 0, 0, 0, 0, float("-inf")], r"^query vector values must be finite: .* has -inf at dimension 5"),
        (["a"] * 6, r"dtype <U1 for query"),
    ],
)
def test_rejects_bad_query_vectors(client: Any, vector: Any, message: str) -> None:
    name = _collection(client)
    provider = QdrantProvider(client, name, lambda query: vector, chunk_id_field="chunk")
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q", 2)


def test_accepts_row_matrices_lists_and_torch_tensors(client: Any) -> None:
    name = _collection(client)
    check_accepts_row_matrices_lists_and_torch_tensors(
        lambda embed_query: QdrantProvider(client, name, embed_query, chunk_id_field="chunk")
    )


def test_rejects_a_missing_collection_and_bad_arguments(client: Any) -> None:
    name = _collection(client)
    with pytest.raises(ValueError, match="Qdrant collection 'nope' does not exist"):
        QdrantProvider(client, "nope", QUERIES.__getitem__)
    with pytest.raises(ValueError, match="embed_query must be callable, got str"):
        QdrantProvider(client, name, "not callable")
    with pytest.raises(ValueError, match="collection_name must be a non-empty string, got ''"):
        QdrantProvider(client, "", QUERIES.__getitem__)
    with pytest.raises(ValueError, match="chunk_id_field must be a non-empty string or None, got 3"):
        QdrantProvider(client, name, QUERIES.__getitem__, chunk_id_field=3)
    with pytest.raises(ValueError, match=r"client has no collection_exists\(\) method"):
        QdrantProvider(object(), name, QUERIES.__getitem__)


def test_rejects_multivector_and_sparse_only_collections(client: Any) -> None:
    client.create_collection(
        "multi",
        vectors_config=models.VectorParams(
            size=2, distance=models.Distance.COSINE,
            multivector_config=models.MultiVectorConfig(comparator=models.MultiVectorComparator.MAX_SIM),
        ),
    )
    with pytest.raises(ValueError, match="Qdrant collection 'multi' is a multivector"):
        QdrantProvider(client, "multi", QUERIES.__getitem__)
    client.create_collection("sparse", vectors_config={}, sparse_vectors_config={"words": models.SparseVectorParams()})
    with pytest.raises(ValueError, match="Qdrant collection 'sparse' has no dense vectors"):
        QdrantProvider(client, "sparse", QUERIES.__getitem__)


def test_missing_payload_field_names_the_point(client: Any) -> None:
    name = _collection(client, "Euclid")
    client.set_payload(name, payload={"chunk": 17}, points=[3])
    client.delete_payload(name, keys=["chunk"], points=[8])
    provider = QdrantProvider(client, name, lambda query: VECTORS[8], chunk_id_field="chunk")
    with pytest.raises(ValueError, match=r"Qdrant point 8 of collection 'docs' \(query, rank 0\) has no payload field 'chunk'"):
        provider.retrieve("q", len(IDS))
    provider = QdrantProvider(client, name, lambda query: VECTORS[3], chunk_id_field="chunk")
    with pytest.raises(ValueError, match=r"Qdrant point 3 .* has payload field 'chunk' = 17, not a non-empty string chunk ID"):
        provider.retrieve("q", 1)


def test_duplicate_chunk_ids_in_the_store_are_rejected(client: Any) -> None:
    chunk_ids = list(IDS)
    chunk_ids[6] = chunk_ids[2]
    name = _collection(client, "Euclid", chunk_ids=chunk_ids)
    provider = QdrantProvider(client, name, lambda query: VECTORS[2], chunk_id_field="chunk")
    with pytest.raises(ValueError, match=rf"chunk ID '{IDS[2]}' returned twice by Qdrant collection 'docs', query"):
        provider.retrieve("q", len(IDS))


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (_points((0, float("nan"), None)), r"score from Qdrant collection 'docs', query, rank 0 must be finite, got nan"),
        (_points((0, None, None)), r"rank 0 must be a real number, got NoneType"),
        (_points((0, 1.0, None), (1, 0.5, None), (2, 0.2, None)), r"invalid Qdrant result for query: 3 points for limit 2"),
    ],
)
def test_rejects_invalid_qdrant_results(points: List[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _fake("Euclid", points).retrieve("q", 2)


# --------------------------------------------------------------------------- optional dependency


def test_missing_qdrant_client_names_the_extra() -> None:
    (error,) = missing_extra_errors("qdrant_client", "qdrant", lambda: QdrantProvider(object(), "docs", str))
    assert "QdrantProvider" in str(error)


def test_module_imports_without_qdrant_client() -> None:
    assert "[qdrant]" in import_error_without("qdrant_client", "QdrantProvider", "object(), 'docs', str")


# --------------------------------------------------------------------------- sessions and the server


@pytest.mark.parametrize(
    ("distance", "options"),
    [
        ("Cosine", {}),
        ("Euclid", {"fixed_lag": 1, "candidate_limit": 4}),
        ("Dot", {"transition_weight": 2.5, "score_normalization": "center", "candidate_limit": 6}),
        ("Manhattan", {"fixed_lag": 0, "candidate_limit": 3, "context_limit": 4}),
    ],
)
def test_session_through_the_provider_equals_a_plain_session(
    client: Any, distance: str, options: Dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = _provider(client, distance)
    limit = options.get("candidate_limit", 20)
    received: List[Tuple[Dict[str, Any], Any]] = []
    real = client.query_points

    def recording(name: str, **kwargs: Any) -> Any:
        response = real(name, **kwargs)
        received.append((kwargs, response.points))
        return response

    def by_hand(query: str) -> List[ScoredCandidate]:
        (kwargs, points), = received  # the provider's one request of this turn
        received.clear()
        assert kwargs["limit"] == limit and kwargs["query"] == QUERIES[query].tolist()
        return _by_hand(points, distance)  # the same points, by hand

    monkeypatch.setattr(client, "query_points", recording)
    check_store_session_parity(provider, options, by_hand)


def test_server_step_through_the_provider_equals_sessions(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    session_provider = _provider(client, "Dot")
    server_provider = QdrantProvider(client, "docs", QUERIES.__getitem__, chunk_id_field="chunk")
    check_server_parity(session_provider, server_provider, monkeypatch)
