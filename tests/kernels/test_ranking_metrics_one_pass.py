"""ranking_metrics: all metrics from one pass, bit for bit those of the single-metric functions."""

from __future__ import annotations

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.kernels.ranking_metrics import (
    SparseQrels,
    dense_qrels,
    ndcg_at_k,
    ranking_metrics,
    recall_at_k,
    reciprocal_rank,
)


def _random_case(seed: int):
    generator = torch.Generator().manual_seed(seed)
    ranked = torch.randint(-1, 12, (40, 9), generator=generator)  # repeats and -1 padding included
    ids = torch.randint(-1, 12, (40, 3), generator=generator)
    grades = torch.randint(0, 4, (40, 3), generator=generator).to(torch.float64)
    return ranked, SparseQrels(ids, torch.where(ids >= 0, grades, grades))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("gain", ["linear", "exponential"])
def test_equals_the_single_metric_functions(seed, gain):
    ranked, sparse = _random_case(seed)
    for qrels in (sparse, dense_qrels(SparseQrels(sparse.ids.clamp(min=0), sparse.grades), 12)):
        got = ranking_metrics(ranked, qrels, (1, 3, 5, 10), gain=gain)
        assert list(got) == ["ndcg@1", "ndcg@3", "ndcg@5", "ndcg@10", "recall@1", "recall@3", "recall@5",
                             "recall@10", "mrr"]
        for k in (1, 3, 5, 10):
            assert torch.equal(got[f"ndcg@{k}"], ndcg_at_k(ranked, qrels, k, gain=gain))
            assert torch.equal(got[f"recall@{k}"], recall_at_k(ranked, qrels, k))
        assert torch.equal(got["mrr"], reciprocal_rank(ranked, qrels))


def test_rejects_a_bad_cutoff():
    ranked, qrels = _random_case(2)
    with pytest.raises(MapMatchedValueError, match="k must be"):
        ranking_metrics(ranked, qrels, (3, 0))
