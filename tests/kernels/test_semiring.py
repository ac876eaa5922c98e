"""The semirings of the chain dynamic program: identities, tie rules, log vs max."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from mapmatched_torch.kernels.semiring import LEXICOGRAPHIC, LOG, MAX_PLUS, Semiring

SCALAR = [MAX_PLUS, LOG]
INF = float("inf")


def scores(*rows):
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("semiring", SCALAR + [LEXICOGRAPHIC], ids=repr)
def test_zero_and_one_are_the_identities(semiring):
    generator = torch.Generator().manual_seed(0)
    # shape: (B, M, *V)
    x = torch.randn((3, 4, *semiring.value_shape), generator=generator, dtype=torch.float64)
    zero = torch.full_like(x, semiring.zero)
    # plus(x, zero) == x: stacking a "no path" alternative changes nothing
    value, _ = semiring.sum(torch.stack((x, zero), dim=1), dim=1)
    assert torch.equal(value, x)
    # times(x, one) == x and times(x, zero) == zero (times is +)
    assert torch.equal(x + semiring.one, x)
    assert torch.equal(x + zero, zero)
    # a reduction over one element is that element
    value, _ = semiring.sum(x.unsqueeze(1), dim=1)
    assert torch.equal(value, x)


def test_max_plus_sum_is_the_max_and_the_first_maximum_wins():
    value, index = MAX_PLUS.sum(scores([1.0, 3.0, 3.0, -INF], [-INF, -INF, 2.0, 2.0]), dim=1)
    assert value.tolist() == [3.0, 2.0] and index.tolist() == [1, 2]
    assert MAX_PLUS.has_argmax and index.dtype == torch.long


def test_log_sum_is_logsumexp_without_indices():
    x = scores([0.0, math.log(3.0)], [-INF, 1.5])
    value, index = LOG.sum(x, dim=1)
    assert index is None and not LOG.has_argmax
    assert value.tolist() == pytest.approx([math.log(4.0), 1.5], abs=1e-15)


def test_log_sum_lies_between_the_max_and_the_max_plus_log_count():
    # log vs max: max <= logsumexp <= max + log(M), and logsumexp(k x) / k -> max
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    high, _ = MAX_PLUS.sum(x, dim=1)
    soft, _ = LOG.sum(x, dim=1)
    assert bool((high <= soft).all()) and bool((soft <= high + math.log(7)).all())
    cold, _ = LOG.sum(200.0 * x, dim=1)
    assert torch.allclose(cold / 200.0, high, atol=math.log(7) / 200.0)


def test_log_gradients_through_the_zero_are_exactly_zero_and_finite():
    x = scores([0.5, -INF, 1.0]).requires_grad_(True)
    value, _ = LOG.sum(x, dim=1)
    (gradient,) = torch.autograd.grad(value.sum(), x, create_graph=True)
    assert gradient[0, 1].item() == 0.0 and bool(torch.isfinite(gradient).all())
    (second,) = torch.autograd.grad(gradient[0, 0], x)
    assert bool(torch.isfinite(second).all()) and second[0, 1].item() == 0.0


def test_lexicographic_sum_compares_the_primary_then_the_secondary():
    # pairs (primary, secondary) over M = 4 candidates, B = 3 rows
    pairs = torch.tensor(
        [
            [[-1.0, 0.0], [-1.0, 5.0], [-2.0, 9.0], [-1.0, 5.0]],  # tie on primary: secondary decides, first of equals
            [[-3.0, 9.0], [0.0, -7.0], [-INF, 0.0], [-1.0, 100.0]],  # the primary decides alone
            [[-INF, -INF], [-INF, -INF], [-INF, -INF], [-INF, -INF]],  # no path at all
        ],
        dtype=torch.float64,
    )
    value, index = LEXICOGRAPHIC.sum(pairs, dim=1)
    assert value[:2].tolist() == [[-1.0, 5.0], [0.0, -7.0]] and index[:2].tolist() == [1, 1]
    assert value[2].tolist() == [-INF, -INF] and LEXICOGRAPHIC.value_shape == (2,)


def test_lexicographic_sum_equals_python_max_over_pairs():
    generator = torch.Generator().manual_seed(2)
    # small integers: many exact ties on both components
    pairs = torch.randint(-2, 2, (40, 5, 2), generator=generator).to(torch.float64)
    value, index = LEXICOGRAPHIC.sum(pairs, dim=1)
    for row, got_value, got_index in zip(pairs.tolist(), value.tolist(), index.tolist()):
        best = max(map(tuple, row))
        assert tuple(got_value) == best and got_index == [tuple(p) for p in row].index(best)


@pytest.mark.parametrize("semiring", SCALAR + [LEXICOGRAPHIC], ids=repr)
def test_step_sum_reduces_over_predecessors(semiring):
    generator = torch.Generator().manual_seed(3)
    batch, width, shape = 2, 3, semiring.value_shape
    # shape: (B, M_from, *V), (B, M_from, M_to, *V)
    alpha = torch.randint(-3, 3, (batch, width, *shape), generator=generator).to(torch.float64)
    transitions = torch.randint(-3, 3, (batch, width, width, *shape), generator=generator).to(torch.float64)
    value, index = semiring.step_sum(alpha, transitions)
    assert value.shape == (batch, width, *shape)
    for b, i in itertools.product(range(batch), range(width)):
        column = torch.stack([alpha[b, j] + transitions[b, j, i] for j in range(width)])
        expected, expected_index = semiring.sum(column.unsqueeze(0), dim=1)
        assert torch.equal(value[b, i], expected[0])
        if semiring.has_argmax:
            assert index[b, i] == expected_index[0]


def test_finite_looks_at_every_component_of_a_value():
    assert MAX_PLUS.finite(scores([1.0, INF, -INF, float("nan")])).tolist() == [[True, False, False, False]]
    pairs = torch.tensor([[[0.0, 1.0], [0.0, -INF], [INF, 0.0]]], dtype=torch.float64)
    assert LEXICOGRAPHIC.finite(pairs).tolist() == [[True, False, False]]


def test_the_base_class_has_no_plus():
    with pytest.raises(NotImplementedError):
        Semiring().sum(scores([1.0]), dim=1)
    assert repr(MAX_PLUS) == "MaxPlusSemiring()" and Semiring.zero == -INF and Semiring.one == 0.0
