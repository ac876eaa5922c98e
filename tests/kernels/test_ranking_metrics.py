"""nDCG@k, Recall@k and reciprocal rank against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.kernels.ranking_metrics import (
    SparseQrels,
    dcg_at_k,
    dense_qrels,
    labelled,
    ndcg_at_k,
    pack_qrels,
    pack_rankings,
    recall_at_k,
    reciprocal_rank,
)

INDEX = {name: i for i, name in enumerate("abcde")}
log2 = math.log2


def _close(tensor: torch.Tensor, expected) -> None:
    assert tensor.dtype == torch.float64
    assert torch.allclose(tensor.cpu(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12), (tensor, expected)


@pytest.fixture
def graded(device):
    """Turn 0: graded (a:3, c:1, e:2), ranked c a b e. Turn 1: nothing relevant. Turn 2: binary b, ranked d b c."""
    qrels = pack_qrels([{"a": 3, "c": 1, "e": 2}, {"a": 0.0}, {"b": 1}], INDEX, device=device)
    ranked = torch.tensor([[2, 0, 1, 4], [0, 1, 2, 3], [3, 1, 2, -1]], device=device)
    return ranked, qrels


def test_ndcg_graded_linear_and_exponential(graded):
    ranked, qrels = graded
    dcg4 = 1 / log2(2) + 3 / log2(3) + 2 / log2(5)
    ideal4 = 3 / log2(2) + 2 / log2(3) + 1 / log2(4)
    _close(ndcg_at_k(ranked, qrels, 4), [dcg4 / ideal4, 0.0, 1 / log2(3)])
    _close(ndcg_at_k(ranked, qrels, 2), [(1 + 3 / log2(3)) / (3 + 2 / log2(3)), 0.0, 1 / log2(3)])
    _close(ndcg_at_k(ranked, qrels, 1), [1 / 3, 0.0, 0.0])
    # exponential gain 2**g - 1: (1, 7, 0, 3) against the ideal (7, 3, 1)
    exp4 = (1 + 7 / log2(3) + 3 / log2(5)) / (7 + 3 / log2(3) + 1 / log2(4))
    _close(ndcg_at_k(ranked, qrels, 4, gain="exponential"), [exp4, 0.0, 1 / log2(3)])
    _close(dcg_at_k(ranked, qrels), [dcg4, 0.0, 1 / log2(3)])
    assert ndcg_at_k(ranked, qrels, 4).device == ranked.device


def test_recall_and_reciprocal_rank(graded):
    ranked, qrels = graded
    _close(recall_at_k(ranked, qrels, 1), [1 / 3, 0.0, 0.0])
    _close(recall_at_k(ranked, qrels, 2), [2 / 3, 0.0, 1.0])
    _close(recall_at_k(ranked, qrels, 10), [1.0, 0.0, 1.0])
    _close(reciprocal_rank(ranked, qrels), [1.0, 0.0, 0.5])
    _close(reciprocal_rank(ranked, qrels, 1), [1.0, 0.0, 0.0])
    assert labelled(qrels).tolist() == [True, False, True]
    mrr = reciprocal_rank(ranked, qrels)[labelled(qrels)].mean()
    assert float(mrr) == pytest.approx(0.75)


def test_padding_and_repeats_earn_nothing(device):
    qrels = pack_qrels([{"a": 1, "b": 1}], INDEX, device=device)
    ranked = torch.tensor([[1, 1, -1, 0]], device=device)  # b twice, padding, then a
    _close(ndcg_at_k(ranked, qrels, 4), [(1 + 1 / log2(5)) / (1 + 1 / log2(3))])
    _close(recall_at_k(ranked, qrels, 4), [1.0])
    _close(reciprocal_rank(torch.tensor([[-1, 0]], device=device), qrels), [0.5])
    # a list shorter than k is scored as if padded
    _close(ndcg_at_k(torch.tensor([[0]], device=device), qrels, 10), [1 / (1 + 1 / log2(3))])


def test_relevant_passages_missing_from_the_corpus():
    kept = pack_qrels([{"a": 1, "zzz": 1}], INDEX)
    assert kept.ids.tolist() == [[0, -1]] and kept.grades.tolist() == [[1.0, 1.0]]
    ranked = torch.tensor([[0, 1]])
    _close(recall_at_k(ranked, kept, 2), [0.5])
    _close(ndcg_at_k(ranked, kept, 2), [1 / (1 + 1 / log2(3))])
    _close(ndcg_at_k(ranked, kept, 1), [1.0])
    dropped = pack_qrels([{"a": 1, "zzz": 1}], INDEX, unknown="drop")
    _close(recall_at_k(ranked, dropped, 2), [1.0])
    with pytest.raises(MapMatchedValueError, match="turn 0: qrels passage 'zzz' is not in the corpus"):
        pack_qrels([{"a": 1, "zzz": 1}], INDEX, unknown="error")
    with pytest.raises(MapMatchedValueError, match="unsupported unknown-id policy: skip"):
        pack_qrels([], INDEX, unknown="skip")


def test_dense_and_sparse_forms_agree():
    generator = torch.Generator().manual_seed(0)
    turns, passages, width = 50, 30, 12
    grades = torch.randint(0, 4, (turns, passages), generator=generator).double()
    grades[grades < 2] = 0.0  # sparse-ish graded qrels
    grades[:5] = 0.0  # some unlabelled turns
    qrels = [{str(p): float(grades[n, p]) for p in range(passages) if grades[n, p] > 0} for n in range(turns)]
    index = {str(p): p for p in range(passages)}
    sparse = pack_qrels(qrels, index)
    assert torch.equal(dense_qrels(sparse, passages), grades)
    ranked = torch.stack([torch.randperm(passages, generator=generator)[:width] for _ in range(turns)])
    ranked[::7, -3:] = -1
    for k in (1, 3, 10):
        assert torch.allclose(ndcg_at_k(ranked, sparse, k), ndcg_at_k(ranked, grades, k), atol=1e-12)
        assert torch.allclose(recall_at_k(ranked, sparse, k), recall_at_k(ranked, grades, k), atol=1e-12)
        assert torch.equal(reciprocal_rank(ranked, sparse, k), reciprocal_rank(ranked, grades, k))
    assert torch.equal(labelled(sparse), labelled(grades))
    assert bool((ndcg_at_k(ranked, sparse, 10) <= 1.0 + 1e-12).all())
    # a perfect ranking scores 1 on every labelled turn
    perfect = torch.argsort(grades, dim=1, descending=True, stable=True)[:, :width]
    assert torch.allclose(ndcg_at_k(perfect, grades, 10)[labelled(grades)], torch.ones(45, dtype=torch.float64))
    assert sparse.select(labelled(sparse)).ids.shape[0] == 45


def test_pack_rankings():
    ranked = pack_rankings([["b", "a", "zzz"], [], ["e"]], INDEX)
    assert ranked.tolist() == [[1, 0, -1], [-1, -1, -1], [4, -1, -1]]
    assert pack_rankings([["b", "a", "c"]], INDEX, 2).tolist() == [[1, 0]]
    with pytest.raises(MapMatchedValueError, match="k must be positive"):
        pack_rankings([["a"]], INDEX, 0)


def test_metric_errors():
    qrels = pack_qrels([{"a": 1}], INDEX)
    with pytest.raises(MapMatchedValueError, match="integer passage indices"):
        ndcg_at_k(torch.tensor([[0.0]]), qrels, 1)
    with pytest.raises(MapMatchedValueError, match=r"\(N, K\) tensor"):
        recall_at_k(torch.tensor([0]), qrels, 1)
    with pytest.raises(MapMatchedValueError, match="ranked has 2 turns but qrels has 1"):
        reciprocal_rank(torch.tensor([[0], [1]]), qrels)
    with pytest.raises(MapMatchedValueError, match="k must be a positive int, got 0"):
        ndcg_at_k(torch.tensor([[0]]), qrels, 0)
    with pytest.raises(MapMatchedValueError, match="unsupported gain: log"):
        ndcg_at_k(torch.tensor([[0]]), qrels, 1, gain="log")
    with pytest.raises(MapMatchedValueError, match="dense qrels has 2 columns"):
        ndcg_at_k(torch.tensor([[5]]), torch.ones(1, 2), 1)
    with pytest.raises(MapMatchedValueError, match="differ in shape"):
        ndcg_at_k(torch.tensor([[0]]), SparseQrels(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 3)), 1)
    with pytest.raises(MapMatchedValueError, match="grade of 'a' must be finite"):
        pack_qrels([{"a": float("inf")}], INDEX)


# --------------------------------------------------------------------------- huge grades


@pytest.mark.parametrize("gain", ["linear", "exponential"])
@pytest.mark.parametrize("grades", [[1e308, 1e308, 5.0], [1e308, 1.0], [1.7e308, 3e307, 2e-300], [5000.0, 1200.0, 2.0]])
def test_a_perfect_ranking_scores_1_whatever_the_finite_grades(grades, gain):
    from mapmatched_torch.kernels.ranking_metrics import ranking_metrics

    qrels = pack_qrels([{"abcde"[i]: grade for i, grade in enumerate(grades)}], INDEX)
    dense = dense_qrels(qrels, len(INDEX))
    perfect = torch.tensor([list(range(len(grades)))])
    reversed_ = perfect.flip(1)
    for form in (qrels, dense):
        assert ndcg_at_k(perfect, form, 3, gain=gain).tolist() == [1.0]
        assert ranking_metrics(perfect, form, (1, 3), gain=gain)["ndcg@3"].tolist() == [1.0]
        worse = float(ndcg_at_k(reversed_, form, 3, gain=gain)[0])
        assert 0.0 <= worse < 1.0 or len(grades) == 1


def _unscaled_ndcg(ranked, dense, k, gain):
    """The formula before scaling: DCG of the gains over the ideal DCG."""
    def gains(grades):
        grades = grades.clamp(min=0.0)
        return grades if gain == "linear" else torch.expm1(grades * math.log(2.0))

    top = ranked[:, :k]
    picked = torch.where(top >= 0, dense.gather(1, top.clamp(min=0)), torch.zeros((), dtype=torch.float64))
    dcg = (gains(picked) * (1.0 / torch.log2(torch.arange(2, top.shape[1] + 2, dtype=torch.float64)))).sum(1)
    ideal_grades = torch.topk(dense.clamp(min=0.0), min(k, dense.shape[1]), dim=1).values
    ideal = (gains(ideal_grades) * (1.0 / torch.log2(torch.arange(2, ideal_grades.shape[1] + 2,
                                                                   dtype=torch.float64)))).sum(1)
    return torch.where(ideal > 0, dcg / ideal, torch.zeros_like(dcg))


@pytest.mark.parametrize("gain", ["linear", "exponential"])
@pytest.mark.parametrize("kind", ["integer", "real"])
def test_scaling_keeps_ordinary_grades_bit_for_bit(gain, kind):
    generator = torch.Generator().manual_seed(7)
    shape = (64, 30)
    if kind == "integer":
        dense = torch.randint(0, 4, shape, generator=generator).to(torch.float64)
    else:
        dense = torch.rand(shape, generator=generator, dtype=torch.float64) * 37.0 - 5.0
    ranked = torch.argsort(torch.rand(shape, generator=generator), dim=1)[:, :12]
    for k in (1, 3, 10):
        assert torch.equal(ndcg_at_k(ranked, dense, k, gain=gain), _unscaled_ndcg(ranked, dense, k, gain))


def test_non_finite_dense_grades_are_refused():
    dense = torch.tensor([[1.0, 0.0], [float("inf"), 1.0]], dtype=torch.float64)
    with pytest.raises(MapMatchedValueError, match="turn 1 has inf"):
        ndcg_at_k(torch.tensor([[0, 1], [0, 1]]), dense, 2)
