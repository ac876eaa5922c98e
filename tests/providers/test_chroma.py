"""Tests of mapmatched_torch.providers.chroma against a real, in-process chromadb.

One ``EphemeralClient`` (telemetry off) serves the module; Chroma shares its state across
clients of one process, so every test makes collections with unique names and deletes
them afterwards. Embeddings are always passed in: Chroma's default embedding function
(an ONNX model it would download) is never called.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import pytest

from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.core.protocols import CandidateProvider
from mapmatched_torch.providers.chroma import ChromaProvider

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

chromadb = pytest.importorskip("chromadb", reason="chromadb is not installed (the [chroma] extra)")

SPACES = ("l2", "cosine", "ip")


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def client() -> Any:
    from chromadb.config import Settings

    return chromadb.EphemeralClient(settings=Settings(anonymized_telemetry=False))


@pytest.fixture
def make(client: Any) -> Iterator[Callable[..., Any]]:
    """``make(space=..., vectors=..., chunk_ids=..., metadatas=..., how="configuration")``:
    a new collection with a unique name, deleted after the test."""
    names: List[str] = []

    def build(
        space: Optional[str] = "ip",
        vectors: np.ndarray = VECTORS,
        chunk_ids: Sequence[str] = IDS,
        metadatas: Optional[List[Any]] = None,
        how: str = "configuration",
    ) -> Any:
        name = f"test-{uuid.uuid4().hex}"
        names.append(name)
        options: Dict[str, Any] = {}
        if space is not None:
            options = {"configuration": {"hnsw": {"space": space}}} if how == "configuration" else {"metadata": {"hnsw:space": space}}
        collection = client.create_collection(name, embedding_function=None, **options)
        if len(chunk_ids):
            collection.add(ids=list(chunk_ids), embeddings=vectors, metadatas=metadatas)
        return collection

    yield build
    for name in names:
        client.delete_collection(name)


def _by_hand(ids: Sequence[str], distances: Sequence[float], space: str) -> List[ScoredCandidate]:
    """Candidates built by hand from Chroma's answer (no provider code)."""
    scores = [(0.0 - d) if space == "l2" else (1.0 - d) for d in distances]
    order = sorted(range(len(ids)), key=lambda rank: (-scores[rank], rank))
    return [ScoredCandidate(ids[rank], scores[rank]) for rank in order]


class FakeCollection:
    """Just enough of a Chroma collection to script an answer (order, distances)."""

    def __init__(self, ids: List[str], distances: List[float], space: str = "l2", metadatas: Any = None) -> None:
        self.name, self.configuration, self.metadata = "fake", {"hnsw": {"space": space}}, None
        self.ids, self.distances, self.metadatas = ids, distances, metadatas
        self.queries: List[Tuple[int, int]] = []

    def get(self, limit: int, include: Sequence[str]) -> Mapping[str, Any]:
        return {"embeddings": [[0.0, 0.0]]}

    def query(self, query_embeddings: np.ndarray, n_results: int, where: Any, include: Sequence[str]) -> Mapping[str, Any]:
        self.queries.append((len(query_embeddings), n_results))
        count = len(query_embeddings)
        return {"ids": [self.ids] * count, "distances": [self.distances] * count, "metadatas": [self.metadatas] * count}


# --------------------------------------------------------------------------- scores and order


@pytest.mark.parametrize("space", SPACES)
def test_scores_are_higher_is_better_in_every_space(make: Any, space: str) -> None:
    provider = ChromaProvider(make(space), QUERIES.__getitem__)
    assert provider.space == space and provider.dimension == DIMENSION
    check_brute_force_top_five(provider, space)


@pytest.mark.parametrize("space", SPACES)
def test_conversion_of_chromas_own_distances(make: Any, space: str) -> None:
    collection = make(space)
    provider = ChromaProvider(collection, QUERIES.__getitem__)
    raw = collection.query(query_embeddings=[QUERIES["q5"]], n_results=len(IDS), include=["distances"])
    assert score_pairs(provider.retrieve("q5", len(IDS))) == score_pairs(_by_hand(raw["ids"][0], raw["distances"][0], space))


@pytest.mark.parametrize(
    ("options", "space"),
    [({"space": "cosine", "how": "metadata"}, "cosine"), ({"space": "ip", "how": "metadata"}, "ip"), ({"space": None}, "l2")],
)
def test_space_from_legacy_metadata_or_chromas_default(make: Any, options: Dict[str, Any], space: str) -> None:
    provider = ChromaProvider(make(**options), QUERIES.__getitem__)
    assert provider.space == space
    expected = brute_force(space, QUERIES["q2"])
    assert [c.chunk_id for c in provider.retrieve("q2", 4)] == [IDS[i] for i in np.argsort(-expected)[:4]]


def test_zero_distance_is_positive_zero(make: Any) -> None:
    check_zero_distance_is_positive_zero(ChromaProvider(make("l2"), lambda query: VECTORS[4]))


@pytest.mark.parametrize("space", SPACES)
def test_ties_keep_chromas_rank(make: Any, space: str) -> None:
    vectors = tied_vectors()
    collection = make(space, vectors)
    got = ChromaProvider(collection, lambda query: vectors[5]).retrieve("q", len(IDS))
    raw = collection.query(query_embeddings=[vectors[5]], n_results=len(IDS), include=["distances"])
    check_ties_keep_the_store_rank(got, raw["ids"][0])


@pytest.mark.parametrize(
    ("space", "distances", "expected"),
    [
        ("l2", [1.0, 0.5, 1.0], [("r1", -0.5), ("r0", -1.0), ("r2", -1.0)]),
        ("cosine", [0.5, 0.25, 0.5], [("r1", 0.75), ("r0", 0.5), ("r2", 0.5)]),
        ("ip", [3.0, 0.0, 3.0], [("r1", 1.0), ("r0", -2.0), ("r2", -2.0)]),
    ],
)
def test_unsorted_answer_is_sorted_by_score_then_rank(space: str, distances: List[float], expected: Any) -> None:
    collection = FakeCollection(["r0", "r1", "r2"], distances, space)
    assert score_pairs(ChromaProvider(collection, lambda query: [1.0, 0.0]).retrieve("q", 3)) == expected


def test_limit_cuts_and_large_limit_returns_every_record(make: Any) -> None:
    check_limit_cuts(ChromaProvider(make("l2"), QUERIES.__getitem__))


def test_chunk_ids_from_a_metadata_field(make: Any) -> None:
    metadatas = [{"chunk": chunk_id, "group": i % 2} for i, chunk_id in enumerate(IDS)]
    collection = make("ip", chunk_ids=[f"record-{i}" for i in range(len(IDS))], metadatas=metadatas)
    provider = ChromaProvider(collection, QUERIES.__getitem__, chunk_id_field="chunk")
    assert provider.chunk_id_field == "chunk"
    expected = brute_force("ip", QUERIES["q3"])
    assert [c.chunk_id for c in provider.retrieve("q3", 5)] == [IDS[i] for i in np.argsort(-expected)[:5]]


def test_where_filter_applies_to_every_query(make: Any) -> None:
    metadatas = [{"group": i % 2} for i in range(len(IDS))]
    provider = ChromaProvider(make("ip", metadatas=metadatas), QUERIES.__getitem__, where={"group": 1})
    odd = {IDS[i] for i in range(1, len(IDS), 2)}
    single = provider.retrieve("q2", 100)
    assert {c.chunk_id for c in single} == odd
    assert provider.retrieve_batch(["q1", "q2"], 100)[1] == single


def test_empty_collection_gives_no_candidates_without_embedding(make: Any) -> None:
    collection = make("l2", chunk_ids=[])
    asked: List[str] = []

    def embed(query: str) -> np.ndarray:
        asked.append(query)
        return QUERIES[query]

    provider = ChromaProvider(collection, embed)
    assert provider.dimension is None
    assert provider.retrieve("q0", 3) == ()
    assert provider.retrieve_batch(["q0", "q1"], 3) == [(), ()]
    assert asked == []
    collection.add(ids=list(IDS[:2]), embeddings=VECTORS[:2])
    assert [c.chunk_id for c in provider.retrieve("q0", 3)] and provider.dimension == DIMENSION
    assert asked == ["q0"]


def test_properties_repr_and_protocol(make: Any) -> None:
    collection = make("cosine")
    provider = ChromaProvider(collection, QUERIES.__getitem__)
    assert isinstance(provider, CandidateProvider)
    assert provider.collection is collection and provider.chunk_id_field is None
    assert repr(provider) == f"ChromaProvider(collection={collection.name!r}, space='cosine', dimension=6, chunk_id_field=None)"


# --------------------------------------------------------------------------- batches


@pytest.mark.parametrize("space", SPACES)
def test_retrieve_batch_equals_retrieve_with_one_query_call(make: Any, space: str) -> None:
    collection = make(space)
    provider = ChromaProvider(collection, QUERIES.__getitem__)
    singles = [provider.retrieve(query, 4) for query in QUERIES]
    calls: List[int] = []

    class Counting:
        """Delegates to the real collection, counting query calls."""

        def __getattr__(self, name: str) -> Any:
            return getattr(collection, name)

        def query(self, query_embeddings: Any, **kwargs: Any) -> Any:
            calls.append(len(query_embeddings))
            return collection.query(query_embeddings=query_embeddings, **kwargs)

    assert ChromaProvider(Counting(), QUERIES.__getitem__).retrieve_batch(list(QUERIES), 4) == singles
    assert calls == [len(QUERIES)]


def test_retrieve_batch_edge_cases() -> None:
    collection = FakeCollection(["r0"], [0.5])
    provider = ChromaProvider(collection, lambda query: [1.0, 0.0])
    check_batch_argument_errors(provider)
    assert collection.queries == []
    assert provider.retrieve_batch(("a", "b"), 2) == [(ScoredCandidate("r0", -0.5),)] * 2
    assert collection.queries == [(2, 2)]


def test_batch_error_names_the_query(make: Any) -> None:
    collection = make("l2")
    check_batch_error_names_the_query(lambda embed_query: ChromaProvider(collection, embed_query))


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("query", "message"), BAD_QUERIES)
def test_rejects_bad_queries(make: Any, query: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChromaProvider(make(), QUERIES.__getitem__).retrieve(query, 1)


@pytest.mark.parametrize(("limit", "message"), BAD_LIMITS)
def test_rejects_bad_limits(make: Any, limit: Any, message: str) -> None:
    check_rejects_bad_limit(ChromaProvider(make(), QUERIES.__getitem__), limit, message)


@pytest.mark.parametrize(
    ("vector", "message"),
    [
        (np.ones(5), r"query embedding has dimension 5 but Chroma collection 'test-\w+' has dimension 6"),
        (np.ones((2, 6)), r"shape \(2, 6\) for query; expected \(6,\) or \(1, 6\)"),
        ([1.0, float("nan"), 0, 0, 0, 0], r"^query vector values must be finite: .* has nan at dimension 1"),
        ([0, 0, 0, 0, 0, float("inf")], r"^query vector values must be finite: .* has inf at dimension 5"),
        (["a"] * 6, r"dtype <U1 for query"),
    ],
)
def test_rejects_bad_query_vectors(make: Any, vector: Any, message: str) -> None:
    provider = ChromaProvider(make("l2"), lambda query: vector)
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q", 2)


def test_accepts_row_matrices_lists_and_torch_tensors(make: Any) -> None:
    collection = make("cosine")
    check_accepts_row_matrices_lists_and_torch_tensors(lambda embed_query: ChromaProvider(collection, embed_query))


def test_rejects_bad_arguments(make: Any) -> None:
    collection = make()
    with pytest.raises(ValueError, match="embed_query must be callable, got str"):
        ChromaProvider(collection, "not callable")
    with pytest.raises(ValueError, match="chunk_id_field must be a non-empty string or None, got ''"):
        ChromaProvider(collection, QUERIES.__getitem__, chunk_id_field="")
    with pytest.raises(ValueError, match=r"where must be a Chroma metadata filter \(a dict\), got str"):
        ChromaProvider(collection, QUERIES.__getitem__, where="group = 1")
    with pytest.raises(ValueError, match=r"collection has no query\(\) method"):
        ChromaProvider(object(), QUERIES.__getitem__)
    with pytest.raises(ValueError, match=r"unsupported Chroma space of collection 'fake': manhattan \(expected one of 'l2', 'cosine', 'ip'\)"):
        ChromaProvider(FakeCollection([], [], space="manhattan"), QUERIES.__getitem__)


def test_missing_metadata_field_names_the_record(make: Any) -> None:
    metadatas: List[Any] = [{"chunk": chunk_id} for chunk_id in IDS]
    metadatas[8] = {"other": 1}
    metadatas[3] = {"chunk": 17}
    collection = make("l2", metadatas=metadatas)
    provider = ChromaProvider(collection, lambda query: VECTORS[8], chunk_id_field="chunk")
    with pytest.raises(ValueError, match=rf"Chroma record '{IDS[8]}' of collection '{collection.name}' \(query, rank 0\) has no metadata field 'chunk'"):
        provider.retrieve("q", 2)
    provider = ChromaProvider(collection, lambda query: VECTORS[3], chunk_id_field="chunk")
    with pytest.raises(ValueError, match=rf"Chroma record '{IDS[3]}' .* has metadata field 'chunk' = 17, not a non-empty string chunk ID"):
        provider.retrieve("q", 1)


def test_record_without_metadata_has_no_chunk_id_field() -> None:
    provider = ChromaProvider(FakeCollection(["r0"], [0.0], metadatas=[None]), lambda query: [1.0, 0.0], chunk_id_field="chunk")
    with pytest.raises(ValueError, match=r"Chroma record 'r0' of collection 'fake' \(query, rank 0\) has no metadata field 'chunk'"):
        provider.retrieve("q", 1)


def test_duplicate_chunk_ids_in_the_store_are_rejected(make: Any) -> None:
    metadatas = [{"chunk": chunk_id} for chunk_id in IDS]
    metadatas[6] = {"chunk": IDS[2]}
    collection = make("l2", chunk_ids=[f"record-{i}" for i in range(len(IDS))], metadatas=metadatas)
    provider = ChromaProvider(collection, lambda query: VECTORS[2], chunk_id_field="chunk")
    with pytest.raises(ValueError, match=rf"chunk ID '{IDS[2]}' returned twice by Chroma collection '{collection.name}', query"):
        provider.retrieve("q", len(IDS))


@pytest.mark.parametrize(
    ("ids", "distances", "message"),
    [
        (["r0"], [float("nan")], r"score from Chroma collection 'fake', query, rank 0 must be finite, got nan"),
        (["r0"], [None], r"rank 0 must be a real number, got NoneType"),
        (["r0", "r1"], [0.5], r"invalid Chroma result for query: 2 IDs, 1 distances"),
        (["r0", "r1", "r2"], [0.1, 0.2, 0.3], r"invalid Chroma result for query: 3 records for limit 2"),
    ],
)
def test_rejects_invalid_chroma_results(ids: List[str], distances: List[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChromaProvider(FakeCollection(ids, distances), lambda query: [1.0, 0.0]).retrieve("q", 2)


# --------------------------------------------------------------------------- optional dependency


def test_missing_chromadb_names_the_extra() -> None:
    (error,) = missing_extra_errors("chromadb", "chroma", lambda: ChromaProvider(object(), str))
    assert "ChromaProvider" in str(error)


def test_module_imports_without_chromadb() -> None:
    assert "[chroma]" in import_error_without("chromadb", "ChromaProvider", "object(), str")


# --------------------------------------------------------------------------- sessions and the server


@pytest.mark.parametrize(
    ("space", "options"),
    [
        ("ip", {}),
        ("l2", {"fixed_lag": 1, "candidate_limit": 4}),
        ("cosine", {"transition_weight": 2.5, "score_normalization": "center", "candidate_limit": 6}),
        ("l2", {"fixed_lag": 0, "candidate_limit": 3, "context_limit": 4}),
    ],
)
def test_session_through_the_provider_equals_a_plain_session(make: Any, space: str, options: Dict[str, Any]) -> None:
    collection = make(space)
    limit = options.get("candidate_limit", 20)

    def by_hand(query: str) -> List[ScoredCandidate]:
        raw = collection.query(query_embeddings=[QUERIES[query]], n_results=limit, include=["distances"])
        return _by_hand(raw["ids"][0], raw["distances"][0], space)

    check_store_session_parity(ChromaProvider(collection, QUERIES.__getitem__), options, by_hand)


def test_server_step_through_the_provider_equals_sessions(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    collection = make("cosine")
    session_provider = ChromaProvider(collection, QUERIES.__getitem__)
    server_provider = ChromaProvider(collection, QUERIES.__getitem__)
    check_server_parity(session_provider, server_provider, monkeypatch)
