"""Tests of mapmatched_torch.graph.knn_faiss: knn_graph(backend="faiss")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mapmatched_torch.graph import faiss_knn_neighbors, knn_graph, knn_neighbors_tensor, knn_recall

pytest.importorskip("faiss", reason="faiss is not installed (the [faiss] extra)")


def _clustered(rows: int = 600, dimension: int = 16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(12, dimension))
    x = centres[rng.integers(0, 12, rows)] + 0.3 * rng.normal(size=(rows, dimension))
    x[5] = x[7]  # exact ties: equal distances go to the smaller ID
    x[9] = x[7]
    return x.astype(np.float32)


IDS = [f"c{i:04d}" for i in range(600)]


@pytest.mark.parametrize("index", ["flat", "ivf", "hnsw"])
def test_faiss_picks_match_the_exact_backend_on_clustered_data(index):
    x = _clustered()
    exact = knn_neighbors_tensor(x, IDS, 5)
    found = faiss_knn_neighbors(x, IDS, 5, index=index, nlist=8, nprobe=4)
    assert torch.equal(found[0], exact[0]) and torch.equal(found[1], exact[1])
    assert knn_recall(x, found[0], sample=100) == 1.0


def test_faiss_graphs_are_deterministic_and_read_memory_maps(tmp_path):
    x = _clustered().astype(np.float16)
    path = tmp_path / "e.npy"
    np.save(path, x)
    mapped = np.load(path, mmap_mode="r")
    options = {"index": "ivf", "nlist": 8, "nprobe": 2, "chunk_rows": 97}
    first = knn_graph(mapped, IDS, 4, backend="faiss", faiss_options=options, maximum_distance=2.0)
    second = knn_graph(x, IDS, 4, backend="faiss", faiss_options=options, maximum_distance=2.0)
    assert torch.equal(first.indices, second.indices) and torch.equal(first.weights, second.weights)
    exact = knn_graph(x, IDS, 4, maximum_distance=2.0)
    assert exact.edge_count == first.edge_count or knn_recall(x, knn_neighbors_tensor(x, IDS, 4)[0]) == 1.0


def test_low_probe_counts_are_widened_and_recall_is_measured():
    x = np.random.default_rng(1).normal(size=(400, 32)).astype(np.float32)  # unclustered: IVF misses some
    ids = IDS[:400]
    info = {}
    neighbors, distances = faiss_knn_neighbors(x, ids, 10, index="ivf", nlist=40, nprobe=1, info=info)
    assert neighbors.shape == (400, 10) and bool((neighbors != torch.arange(400)[:, None]).all())
    assert bool((distances[:, 1:] >= distances[:, :-1]).all())
    assert info["index"] == "ivf" and info["nprobe"] == 1
    recall = knn_recall(x, neighbors, sample=100)
    assert 0.0 < recall < 1.0


def test_faiss_backend_errors():
    x = _clustered()
    with pytest.raises(ValueError, match="unsupported kNN backend"):
        knn_graph(x, IDS, 3, backend="annoy")
    with pytest.raises(ValueError, match="unsupported faiss index"):
        faiss_knn_neighbors(x, IDS, 3, index="pq")
    bad = x.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="row 3 .*'c0003'.* at column 2"):
        faiss_knn_neighbors(bad, IDS, 3)
    bad[3] = 0
    with pytest.raises(ValueError, match="row 3 .*zero vector"):
        faiss_knn_neighbors(bad, IDS, 3)
    with pytest.raises(ValueError, match="received 600 embeddings for 2 chunk IDs"):
        faiss_knn_neighbors(x, IDS[:2], 3)
    single = faiss_knn_neighbors(x[:1], IDS[:1], 3)
    assert single[0].shape == (1, 0)


@pytest.mark.parametrize("index", ["flat", "ivf"])
def test_corpus_index_search_equals_exact_search_with_ties_by_chunk_id(index):
    from mapmatched_torch.graph.knn_faiss import FAISSCorpusIndex

    x = _clustered().astype(np.float64)
    corpus = FAISSCorpusIndex(x, IDS, index=index, nlist=8, nprobe=8)  # every list probed: exact candidates
    rng = np.random.default_rng(1)
    queries = np.concatenate([x[[7, 3]], x[rng.integers(0, 600, 30)] + 0.2 * rng.normal(size=(30, 16))])
    scores, rows = corpus.search(queries, 6)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    expected = (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit.T
    for query in range(queries.shape[0]):
        order = np.lexsort((np.arange(600), -np.round(expected[query], 12)))[:6]
        assert rows[query].tolist() == order.tolist()
        np.testing.assert_allclose(scores[query], expected[query, order], rtol=0, atol=1e-12)
    assert rows[0, :3].tolist() == [5, 7, 9]  # three equal rows: the smaller chunk ID first
    assert np.all(np.diff(scores, axis=1) <= 0) and corpus.kind == index


def test_corpus_index_refuses_bad_queries():
    from mapmatched_torch.core.errors import MapMatchedValueError
    from mapmatched_torch.graph.knn_faiss import FAISSCorpusIndex

    corpus = FAISSCorpusIndex(_clustered(), IDS, index="flat")
    with pytest.raises(MapMatchedValueError, match="queries must be"):
        corpus.search(np.ones((2, 15)), 3)
    with pytest.raises(MapMatchedValueError, match="larger than the corpus"):
        corpus.search(np.ones((2, 16)), 601)
    with pytest.raises(ValueError, match="zero"):
        corpus.search(np.zeros((1, 16)), 3)
