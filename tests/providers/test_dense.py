"""DenseProvider, exact_top_k and FusionProvider."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.providers.dense import DenseProvider, exact_top_k
from mapmatched_torch.providers.fusion import FusionProvider, reciprocal_rank_fusion


def reference_top_k(row, k):
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
    return [row[i] for i in order], order


def test_exact_top_k_matches_sorting_with_ties():
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        scores = torch.randint(0, 4, (5, 17), generator=generator).double()
        for k in (1, 3, 17):
            values, indices = exact_top_k(scores, k)
            for row, vrow, irow in zip(scores.tolist(), values.tolist(), indices.tolist()):
                assert (vrow, irow) == tuple(reference_top_k(row, k))


def embedder(table):
    return lambda query: table[query]


def test_inner_product_and_cosine_ordering():
    matrix = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    ids = ["a", "b", "c", "d"]
    provider = DenseProvider(matrix, ids, embedder({"x": [1.0, 0.0]}))
    assert [c.chunk_id for c in provider.retrieve("x", 4)] == ["b", "a", "d", "c"]
    cosine = DenseProvider(matrix, ids, embedder({"x": [1.0, 0.0]}), metric="cosine")
    result = cosine.retrieve("x", 3)
    assert [c.chunk_id for c in result] == ["a", "b", "d"]  # a and b tie at 1.0: position order
    assert result[2].score == pytest.approx(math.sqrt(0.5))


def test_limit_above_n_and_batch_equals_single():
    generator = torch.Generator().manual_seed(1)
    matrix = torch.randn(20, 8, generator=generator)
    queries = {f"q{i}": torch.randn(8, generator=generator) for i in range(6)}
    provider = DenseProvider(matrix, [f"c{i}" for i in range(20)], embedder(queries), metric="cosine")
    assert len(provider.retrieve("q0", 50)) == 20
    batch = provider.retrieve_batch(list(queries), 5)
    assert batch == [provider.retrieve(q, 5) for q in queries]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"embeddings": torch.zeros(2, 0)}, "matrix"),
        ({"embeddings": torch.ones(3, 2)}, "3 rows but 2 chunk IDs"),
        ({"embeddings": torch.tensor([[1.0, math.nan], [1.0, 0.0]])}, "row 0 contains a non-finite"),
        ({"embeddings": torch.tensor([[1.0, 0.0], [0.0, 0.0]]), "metric": "cosine"}, "row 1 is a zero vector"),
        ({"metric": "l2"}, "unsupported metric: l2 \\(expected one of 'inner_product', 'cosine'\\)"),
        ({"metric": "cos"}, "did you mean 'cosine'\\?"),
        ({"chunk_ids": ["a", "a"]}, "chunk IDs must be unique: 'a' at positions 0 and 1"),
        # a float32 norm that overflows: refused as the kNN graphs refuse it, not turned into zeros
        ({"embeddings": torch.tensor([[1.0, 0.0], [3e38, 3e38]]), "metric": "cosine"},
         "^embeddings row 1 has a norm too large for float32$"),
    ],
)
def test_dense_validation(kwargs, message):
    arguments = {"embeddings": torch.eye(2), "chunk_ids": ["a", "b"]}
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        DenseProvider(arguments.pop("embeddings"), arguments.pop("chunk_ids"), **arguments)


def test_dense_cosine_refuses_a_query_whose_norm_overflows():
    provider = DenseProvider(torch.eye(2), ["a", "b"], embedder({"big": [3e38, 3e38]}), metric="cosine")
    with pytest.raises(ValueError, match="^query 0 has a norm too large for float32$"):
        provider.retrieve("big", 1)
    # the same row is fine in float64, and inner products never normalize
    assert DenseProvider(torch.tensor([[3e38, 3e38]]), ["a"], metric="cosine", dtype=torch.float64).search(
        torch.tensor([[1.0, 1.0]]), 1
    )[0][0].chunk_id == "a"


def test_dense_and_knn_graphs_check_chunk_ids_with_one_function():
    from mapmatched_torch.core.embeddings import check_embedding_ids
    from mapmatched_torch.providers import base

    assert base.check_chunk_ids is check_embedding_ids
    for bad in (["a", "a"], ["a", ""], "ab", []):
        with pytest.raises(ValueError) as provider_error:
            DenseProvider(torch.eye(2)[: max(len(bad), 1)], bad)
        with pytest.raises(ValueError) as reference_error:
            check_embedding_ids(bad)
        assert str(provider_error.value) == str(reference_error.value)


def test_dense_query_validation():
    provider = DenseProvider(torch.eye(2), ["a", "b"], embedder({"x": [1.0, 0.0, 0.0], "n": [math.nan, 0.0]}))
    with pytest.raises(ValueError, match=r"^query 0 embedding has dimension 3 but the embedding matrix has dimension 2 \(the query"):
        provider.retrieve("x", 1)
    with pytest.raises(ValueError, match="non-finite"):
        provider.retrieve("n", 1)
    with pytest.raises(ValueError, match="^query 0 must not be empty$"):
        provider.retrieve("", 1)
    with pytest.raises(ValueError, match="limit must be greater than zero"):
        provider.retrieve("x", 0)
    with pytest.raises(ValueError, match="embed_query"):
        DenseProvider(torch.eye(2), ["a", "b"]).retrieve("x", 1)


class Fixed:
    def __init__(self, ids):
        self.ids = ids

    def retrieve(self, query, limit):
        return [ScoredCandidate(i, 10.0 - n) for n, i in enumerate(self.ids[:limit])]


def test_reciprocal_rank_fusion_by_hand():
    fused = reciprocal_rank_fusion(
        [Fixed(["a", "b", "c"]).retrieve("q", 3), Fixed(["c", "a"]).retrieve("q", 2)], [1.0, 2.0], 60.0, 10
    )
    scores = {c.chunk_id: c.score for c in fused}
    assert scores == {"a": 1 / 61 + 2 / 62, "b": 1 / 62, "c": 1 / 63 + 2 / 61}
    assert [c.chunk_id for c in fused] == ["c", "a", "b"]


def test_fusion_ties_by_chunk_id_and_limit():
    fusion = FusionProvider([Fixed(["z", "y"]), Fixed(["y", "z"])])
    assert [c.chunk_id for c in fusion.retrieve("q", 5)] == ["y", "z"]
    assert len(fusion.retrieve("q", 1)) == 1
    assert fusion.retrieve_batch(["q", "r"], 2) == [fusion.retrieve("q", 2), fusion.retrieve("r", 2)]


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ([], {}, "at least one provider"),
        ([object()], {}, "provider 0: provider must implement the CandidateProvider protocol"),
        ([Fixed(["a"])], {"weights": [1.0, 2.0]}, "2 weights for 1 providers"),
        ([Fixed(["a"])], {"weights": [0.0]}, "at least one fusion weight"),
        ([Fixed(["a"])], {"weights": [-1.0]}, "weight 0 must be finite and nonnegative"),
        ([Fixed(["a"])], {"rank_constant": math.nan}, "rank_constant"),
        ([Fixed(["a"])], {"depth": 0}, "depth must be greater than zero"),
    ],
)
def test_fusion_validation(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        FusionProvider(args, **kwargs)
