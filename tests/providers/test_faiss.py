"""Tests of mapmatched_torch.providers.faiss (docs/spec.md 9) and mapmatched_torch.core.optional."""

from __future__ import annotations

import doctest
import subprocess
import sys
import textwrap
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest

from mapmatched_torch.core import optional as _optional
from mapmatched_torch.core.errors import (
    FAISSDependencyUnavailableError,
    FAISSNotInstalledError,
    MapMatchedBackendError,
    MapMatchedTypeError,
    MissingDependencyError,
)
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.core.protocols import CandidateProvider
from mapmatched_torch.providers import faiss as faiss_provider
from mapmatched_torch.providers.faiss import FAISSProvider

from ..providers_fixtures import BAD_LIMITS, check_batch_argument_errors, check_rejects_bad_limit

IDS = ("d", "b", "e", "a", "c")  # deliberately not sorted: ties must follow index position


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def faiss() -> Any:
    return pytest.importorskip("faiss", reason="faiss is not installed (the [faiss] extra)")


@pytest.fixture
def fresh_probe_cache():
    """Empty the dependency cache before and after the test (it may poison faiss's entry)."""
    _optional.clear_cache()
    yield
    _optional.clear_cache()


@pytest.fixture
def no_faiss_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a fake-index test with faiss unimportable: the provider never needs it."""
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes `import faiss` raise ImportError


def _vectors(seed: int = 0, count: int = len(IDS), dimension: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, dimension)).astype(np.float32)


def _embedder(table: Dict[str, Any]):
    return table.__getitem__


def _flat(faiss: Any, vectors: np.ndarray, metric: str = "ip") -> Any:
    index = faiss.IndexFlatIP(vectors.shape[1]) if metric == "ip" else faiss.IndexFlatL2(vectors.shape[1])
    index.add(vectors)
    return index


def _expected(scores: np.ndarray, ids: Sequence[str], limit: int) -> List[Tuple[str, float]]:
    """Brute force: sort every position by (-score, position), keep the first ``limit``."""
    order = sorted(range(len(ids)), key=lambda i: (-float(scores[i]), i))[:limit]
    return [(ids[i], float(scores[i])) for i in order]


def _pairs(candidates: Sequence[ScoredCandidate]) -> List[Tuple[str, float]]:
    return [(c.chunk_id, c.score) for c in candidates]


class FakeIndex:
    """Just enough of a FAISS index: ``ntotal``, ``d`` and a scripted ``search``."""

    def __init__(self, ntotal: int, d: int, scores: Any, labels: Any) -> None:
        self.ntotal, self.d = ntotal, d
        self._scores, self._labels = scores, labels
        self.calls: List[Tuple[Tuple[int, ...], int]] = []

    def search(self, x: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
        assert x.dtype == np.float32 and x.flags.c_contiguous
        self.calls.append((x.shape, k))
        return np.asarray(self._scores, dtype=np.float32), np.asarray(self._labels, dtype=np.int64)


def _fake_provider(scores: Any, labels: Any, count: int = 3, **kwargs: Any) -> Tuple[FAISSProvider, FakeIndex]:
    index = FakeIndex(count, 2, scores, labels)
    ids = [f"c{i}" for i in range(count)]
    return FAISSProvider(index, ids, lambda query: [1.0, 0.0], **kwargs), index


# --------------------------------------------------------------------------- scoring and order


def test_inner_product_keeps_similarities_best_first(faiss: Any) -> None:
    vectors = _vectors()
    query = _vectors(seed=1, count=1)[0]
    provider = FAISSProvider(_flat(faiss, vectors), IDS, _embedder({"q": query}))
    got = provider.retrieve("q", 3)
    assert all(isinstance(c, ScoredCandidate) for c in got)
    expected = _expected(vectors @ query, IDS, 3)
    assert [c.chunk_id for c in got] == [chunk for chunk, _ in expected]
    assert [c.score for c in got] == pytest.approx([score for _, score in expected], rel=1e-5)


def test_l2_distance_mode_negates_nearest_first(faiss: Any) -> None:
    vectors = _vectors()
    query = _vectors(seed=2, count=1)[0]
    provider = FAISSProvider(_flat(faiss, vectors, "l2"), IDS, _embedder({"q": query}), score_mode="distance")
    got = provider.retrieve("q", len(IDS))
    squared = ((vectors - query) ** 2).sum(axis=1)
    expected = _expected(-squared, IDS, len(IDS))
    assert [c.chunk_id for c in got] == [chunk for chunk, _ in expected]
    assert got[0].chunk_id == IDS[int(np.argmin(squared))]
    assert all(c.score <= 0.0 for c in got)
    assert [c.score for c in got] == pytest.approx([score for _, score in expected], rel=1e-5)


def test_l2_similarity_mode_keeps_raw_distances(faiss: Any) -> None:
    vectors = _vectors()
    query = _vectors(seed=2, count=1)[0]
    provider = FAISSProvider(_flat(faiss, vectors, "l2"), IDS, _embedder({"q": query}))
    got = provider.retrieve("q", len(IDS))
    squared = ((vectors - query) ** 2).sum(axis=1)
    assert [c.chunk_id for c in got] == [chunk for chunk, _ in _expected(squared, IDS, len(IDS))]
    assert [c.score for c in got] == pytest.approx(sorted(squared.tolist(), reverse=True), rel=1e-5)


def test_zero_distance_is_positive_zero(faiss: Any) -> None:
    vectors = _vectors()
    provider = FAISSProvider(_flat(faiss, vectors, "l2"), IDS, _embedder({"q": vectors[3]}), score_mode="distance")
    best = provider.retrieve("q", 1)[0]
    assert best.chunk_id == IDS[3]
    assert best.score == 0.0 and np.copysign(1.0, best.score) == 1.0


def test_ties_follow_index_position(faiss: Any) -> None:
    vectors = _vectors()
    vectors[[0, 2, 4]] = vectors[1]  # four identical vectors at positions 0, 1, 2, 4
    provider = FAISSProvider(_flat(faiss, vectors), IDS, _embedder({"q": vectors[1]}))
    got = provider.retrieve("q", len(IDS))
    tied = [c.chunk_id for c in got if c.score == got[0].score]
    assert tied == [IDS[0], IDS[1], IDS[2], IDS[4]]


def test_ties_are_sorted_by_the_provider_not_by_faiss(no_faiss_needed: None) -> None:
    provider, _ = _fake_provider([[1.0, 2.0, 1.0]], [[2, 1, 0]])
    assert _pairs(provider.retrieve("q", 3)) == [("c1", 2.0), ("c0", 1.0), ("c2", 1.0)]


def test_limit_above_size_returns_every_chunk(faiss: Any) -> None:
    vectors = _vectors()
    provider = FAISSProvider(_flat(faiss, vectors), IDS, _embedder({"q": vectors[0]}))
    got = provider.retrieve("q", 100)
    assert sorted(c.chunk_id for c in got) == sorted(IDS)


def test_asks_faiss_for_min_of_limit_and_size(no_faiss_needed: None) -> None:
    provider, index = _fake_provider([[3.0, 2.0, 1.0]], [[0, 1, 2]])
    assert len(provider.retrieve("q", 50)) == 3
    assert index.calls == [((1, 2), 3)]


def test_accepts_lists_row_matrices_and_torch_tensors(faiss: Any) -> None:
    torch = pytest.importorskip("torch")
    vectors = _vectors()
    query = vectors[2]
    table = {
        "numpy": query,
        "list": query.tolist(),
        "row": query[None, :],
        "float64": query.astype(np.float64),
        "tensor": torch.tensor(query, requires_grad=True),
        "bfloat16": torch.tensor(query).to(torch.bfloat16),
    }
    table["bfloat16 as float32"] = table["bfloat16"].float().numpy()
    provider = FAISSProvider(_flat(faiss, vectors), IDS, _embedder(table))
    reference = provider.retrieve("numpy", 2)
    for name in ("list", "row", "float64", "tensor"):
        assert provider.retrieve(name, 2) == reference, name
    assert provider.retrieve("bfloat16", 2) == provider.retrieve("bfloat16 as float32", 2)


def test_properties_repr_and_protocol(faiss: Any) -> None:
    provider = FAISSProvider(_flat(faiss, _vectors()), list(IDS), _embedder({}), score_mode="distance")
    assert provider.chunk_ids == IDS and isinstance(provider.chunk_ids, tuple)
    assert provider.score_mode == "distance"
    assert isinstance(provider, CandidateProvider)
    assert "size=5" in repr(provider) and "dimension=4" in repr(provider)


# --------------------------------------------------------------------------- batches


def test_retrieve_batch_equals_retrieve_with_one_search(faiss: Any) -> None:
    vectors = _vectors()
    queries = _vectors(seed=3, count=4)
    table = {f"q{i}": row for i, row in enumerate(queries)}
    calls: List[int] = []

    class CountingIndex:
        def __init__(self, inner: Any) -> None:
            self.inner, self.ntotal, self.d = inner, inner.ntotal, inner.d

        def search(self, x: np.ndarray, k: int) -> Any:
            calls.append(x.shape[0])
            return self.inner.search(x, k)

    index = _flat(faiss, vectors)
    provider = FAISSProvider(index, IDS, _embedder(table))
    batched = FAISSProvider(CountingIndex(index), IDS, _embedder(table)).retrieve_batch(list(table), 3)
    assert calls == [4]
    assert batched == [provider.retrieve(name, 3) for name in table]


def test_retrieve_batch_edge_cases(no_faiss_needed: None) -> None:
    provider, index = _fake_provider([[1.0]], [[0]])
    check_batch_argument_errors(provider)
    assert index.calls == []


# --------------------------------------------------------------------------- construction checks


@pytest.mark.parametrize(
    ("chunk_ids", "message"),
    [
        # the kNN graphs' check and messages (core.embeddings.check_embedding_ids)
        (["a", "b", "a"], r"^chunk IDs must be unique: 'a' at positions 0 and 2"),
        (["a", "", "c"], r"^chunk IDs must not be empty \(position 1\)"),
        (["a", 7, "c"], r"chunk ID at position 1 must be a string"),
        ("abc", r"not a string: 'abc'"),
    ],
)
def test_rejects_bad_chunk_ids(no_faiss_needed: None, chunk_ids: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FAISSProvider(FakeIndex(3, 2, [], []), chunk_ids, str)


def test_rejects_empty_chunk_ids(no_faiss_needed: None) -> None:
    with pytest.raises(ValueError, match="^chunk_ids must contain at least one ID"):
        FAISSProvider(FakeIndex(0, 2, [], []), [], str)


def test_rejects_size_mismatch(faiss: Any) -> None:
    with pytest.raises(ValueError, match="^FAISS index contains 5 vectors but received 4 chunk IDs$"):
        FAISSProvider(_flat(faiss, _vectors()), IDS[:4], str)


def test_rejects_index_that_changed_after_construction(faiss: Any) -> None:
    vectors = _vectors()
    index = _flat(faiss, vectors)
    provider = FAISSProvider(index, IDS, _embedder({"q": vectors[0]}))
    index.add(vectors[:1])
    with pytest.raises(MapMatchedBackendError, match="^FAISS index size changed after provider construction: the index now holds 6 vectors but the provider maps 5") as caught:
        provider.retrieve("q", 2)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)


@pytest.mark.parametrize("score_mode", ["cosine", "Distance", "", None])
def test_rejects_unknown_score_mode(no_faiss_needed: None, score_mode: Any) -> None:
    shown = score_mode if score_mode else repr(score_mode)  # upstream's wording: a plain word unquoted
    with pytest.raises(ValueError, match=f"^unsupported FAISS score mode: {shown!s}"):
        FAISSProvider(FakeIndex(1, 2, [], []), ["a"], str, score_mode=score_mode)


def test_rejects_non_index_and_non_callable_embedder(no_faiss_needed: None) -> None:
    with pytest.raises(MapMatchedTypeError, match="^embed_query must be callable, got str"):
        FAISSProvider(FakeIndex(1, 2, [], []), ["a"], "not callable")
    with pytest.raises(ValueError, match="no 'd' attribute"):
        FAISSProvider(object(), ["a"], str)
    with pytest.raises(ValueError, match=r"^FAISS index dimension must be greater than zero, got 0 \(index.d\)"):
        FAISSProvider(FakeIndex(1, 0, [], []), ["a"], str)
    for d, ntotal, what in ((2.0, 1, "dimension"), (True, 1, "dimension"), (2, 1.0, "ntotal")):
        with pytest.raises(MapMatchedTypeError, match=f"^FAISS index {what} must be an integer"):
            FAISSProvider(FakeIndex(ntotal, d, [], []), ["a"], str)
    index = FakeIndex(1, 2, [], [])
    index.search = None
    with pytest.raises(ValueError, match="index has no search"):
        FAISSProvider(index, ["a"], str)


# --------------------------------------------------------------------------- query checks


@pytest.mark.parametrize(
    ("vector", "message"),
    [
        ([1.0, 2.0, 3.0], r"^query embedding has dimension 3 but the index has dimension 2 \(the query embedder and the index disagree.*; query vector has dimension 3; expected 2$"),
        ([[1.0, 2.0], [3.0, 4.0]], r"shape \(2, 2\) for query; expected \(2,\) or \(1, 2\)"),
        (5.0, r"shape \(\) for query"),
        ([1.0, float("nan")], r"^query vector values must be finite: .* has nan at dimension 1"),
        ([float("inf"), 0.0], r"^query vector values must be finite: .* has inf at dimension 0"),
        ([1e300, 0.0], r"^query vector values must be finite: .* has inf at dimension 0"),  # overflows float32
        (["x", "y"], r"dtype <U1 for query"),
        ([[1.0], [2.0, 3.0]], r"no numeric vector for query"),
    ],
)
def test_rejects_bad_query_vectors(no_faiss_needed: None, vector: Any, message: str) -> None:
    provider = FAISSProvider(FakeIndex(1, 2, [[1.0]], [[0]]), ["a"], lambda query: vector)
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q", 1)


@pytest.mark.parametrize(("query", "message"), [("", "must not be empty"), (None, "must be a string"), (b"q", "must be a string")])
def test_rejects_bad_queries(no_faiss_needed: None, query: Any, message: str) -> None:
    provider, index = _fake_provider([[1.0]], [[0]], count=1)
    with pytest.raises(ValueError, match=message):
        provider.retrieve(query, 1)
    assert index.calls == []


@pytest.mark.parametrize(("limit", "message"), BAD_LIMITS)
def test_rejects_bad_limits(no_faiss_needed: None, limit: Any, message: str) -> None:
    provider, index = _fake_provider([[1.0]], [[0]], count=1)
    check_rejects_bad_limit(provider, limit, message)
    assert index.calls == []


# --------------------------------------------------------------------------- FAISS result checks


@pytest.mark.parametrize(
    ("scores", "labels", "message"),
    [
        ([[2.0, 1.0]], [[0, -1]], r"^FAISS returned invalid result index -1 for query at rank 1 \(the index returned fewer"),
        ([[2.0, 1.0]], [[3, 0]], r"^FAISS returned invalid result index 3 for query at rank 0: labels are in \[0, 3\)"),
        ([[2.0, 1.0]], [[0, -2]], r"^FAISS returned invalid result index -2 .*\[0, 3\)"),
        ([[2.0, 1.0]], [[1, 1]], r"^FAISS returned duplicate result index 1 for query at rank 1$"),
        ([[2.0, float("nan")]], [[0, 1]], r"^FAISS returned a non-finite score for query at rank 1: nan for label 1$"),
        ([[float("-inf"), 1.0]], [[0, 1]], r"^FAISS returned a non-finite score for query at rank 0: -inf for label 0$"),
        ([[2.0, 1.0]], [[0]], r"^FAISS returned different score and index counts: 2 scores and 1 labels for query$"),
        ([[2.0, 1.0, 0.5]], [[0, 1, 2]], r"^FAISS returned more results than asked: 3 hits for query, limit 2$"),
        ([2.0, 1.0], [0, 1], r"^FAISS returned a malformed result: row 0 of its scores for query is 2.0, not a list"),
        ([], [], r"^FAISS returned a malformed result: cannot read row 0 of its scores for query as result\[0\].tolist\(\) \(IndexError"),
    ],
)
def test_rejects_invalid_faiss_results(no_faiss_needed: None, scores: Any, labels: Any, message: str) -> None:
    provider, _ = _fake_provider(scores, labels)
    with pytest.raises(MapMatchedBackendError, match=message) as caught:
        provider.retrieve("q", 2)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)  # ours, and upstream's


def test_fewer_hits_than_asked_are_fine(no_faiss_needed: None) -> None:
    provider, _ = _fake_provider([[2.0]], [[1]])
    assert _pairs(provider.retrieve("q", 2)) == [("c1", 2.0)]


class RowMatrix:
    """A search result that is not a numpy array: rows by ``[i]``, values by ``tolist()``."""

    def __init__(self, rows: List[List[Any]]) -> None:
        self._rows = rows

    def __getitem__(self, row: int) -> "RowMatrix":
        return RowMatrix(self._rows[row])

    def tolist(self) -> List[Any]:
        return list(self._rows)


def test_search_results_need_only_rows_and_tolist(no_faiss_needed: None) -> None:
    provider, index = _fake_provider([], [])
    index.search = lambda x, k: (RowMatrix([[1.0, 3], [0.5, 2.0]]), RowMatrix([[2, 0], [1, 0]]))
    assert [_pairs(answer) for answer in provider.retrieve_batch(["a", "b"], 2)] == [
        [("c0", 3.0), ("c2", 1.0)],
        [("c0", 2.0), ("c1", 0.5)],
    ]
    index.search = lambda x, k: (RowMatrix([["high"]]), RowMatrix([[0]]))
    with pytest.raises(MapMatchedBackendError, match="^FAISS returned a non-numeric score for query at rank 0: 'high' for label 0$"):
        provider.retrieve("q", 1)


def test_invalid_result_names_the_batch_position(no_faiss_needed: None) -> None:
    provider, _ = _fake_provider([[2.0], [1.0]], [[0], [-1]])
    with pytest.raises(ValueError, match="invalid result index -1 for query 1 at rank 0"):
        provider.retrieve_batch(["a", "b"], 1)


def test_rejects_float_labels(no_faiss_needed: None) -> None:
    provider, index = _fake_provider([[2.0]], [[0]])
    index.search = lambda x, k: (np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32))
    with pytest.raises(MapMatchedTypeError, match="^FAISS index result index must be an integer: got 0.0 for query at rank 0$") as caught:
        provider.retrieve("q", 1)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, ValueError)


# --------------------------------------------------------------------------- optional dependency


def test_missing_numpy_fails_the_search_before_it_runs(no_faiss_needed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    provider, index = _fake_provider([[1.0]], [[0]], count=1)  # no faiss needed to build it
    real_import = faiss_provider.importlib.import_module

    def without_numpy(name: str, package: Any = None) -> Any:
        if name == "numpy":
            raise ImportError("no numpy here")
        return real_import(name, package)

    monkeypatch.setattr(faiss_provider.importlib, "import_module", without_numpy)
    with pytest.raises(FAISSDependencyUnavailableError) as caught:
        provider.retrieve("q", 1)
    assert FAISSDependencyUnavailableError is FAISSNotInstalledError
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, MissingDependencyError)
    assert str(caught.value).startswith("numpy is required for FAISSProvider searches; install it with `pip install 'mapmatched-torch[faiss]'`")
    assert isinstance(caught.value.__cause__, ImportError)
    assert index.calls == []
    monkeypatch.undo()
    assert provider.retrieve("q", 1) == (ScoredCandidate("c0", 1.0),)


def test_require_faiss_and_import_optional(monkeypatch: pytest.MonkeyPatch, fresh_probe_cache: None) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(FAISSNotInstalledError, match=r"\[faiss\]"):
        _optional.require_faiss("a GPU index")
    assert not _optional.has_module("faiss")
    with pytest.raises(MissingDependencyError, match=r"for graph export; install it with `pip install 'mapmatched-torch\[networkx\]'`, or from a clone of the repository with `pip install -e '\.\[networkx\]'`"):
        _optional.import_optional("no_such_module_mapmatched", "networkx", "graph export")
    assert _optional.import_optional("math", "unused").sqrt(9.0) == 3.0


def test_probes_each_module_once(monkeypatch: pytest.MonkeyPatch, fresh_probe_cache: None) -> None:
    imported: List[str] = []
    real_import = _optional.importlib.import_module

    def counting_import(name: str) -> Any:
        imported.append(name)
        return real_import(name)

    monkeypatch.setattr(_optional.importlib, "import_module", counting_import)
    for _ in range(3):
        assert _optional.has_module("json")
        assert not _optional.has_module("no_such_module_mapmatched")
    assert imported == ["json", "no_such_module_mapmatched"]
    _optional.clear_cache("json")
    assert _optional.has_module("json") and imported[-1] == "json"


def test_module_imports_without_faiss() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["faiss"] = None
        import numpy as np
        from mapmatched_torch.providers.faiss import FAISSProvider

        class Index:
            d, ntotal = 2, 2

            def search(self, x, k):
                return np.array([[0.5, 1.0]]), np.array([[1, 0]])

        print(FAISSProvider(Index(), ["a", "b"], lambda query: [1.0, 0.0]).retrieve("q", 2))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "ScoredCandidate(chunk_id='a', score=1.0), ScoredCandidate(chunk_id='b', score=0.5)" in result.stdout


def test_docstring_examples_run(faiss: Any) -> None:
    for module in (faiss_provider, _optional):
        outcome = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert outcome.attempted > 0 and outcome.failed == 0, module.__name__
