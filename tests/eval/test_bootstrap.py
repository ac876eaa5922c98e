"""Paired bootstrap over conversations and the pass/fail verdict."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.bootstrap import (
    BootstrapResult,
    bootstrap_mean,
    bootstrap_means,
    paired_bootstrap,
    paired_difference,
    verdict,
)


def _clustered(seed: int, conversations: int = 120, turns: int = 6, mean: float = 0.1):
    """Per-turn differences with a per-conversation effect: true mean ``mean``."""
    generator = torch.Generator().manual_seed(seed)
    effect = torch.randn(conversations, 1, generator=generator, dtype=torch.float64) * 0.2
    values = mean + effect + torch.randn(conversations, turns, generator=generator, dtype=torch.float64) * 0.3
    conversation = torch.arange(conversations).unsqueeze(1).expand(conversations, turns)
    return values.reshape(-1), conversation.reshape(-1)


def test_same_seed_same_interval(eval_device):
    values, conversation = _clustered(0)
    baseline = torch.zeros_like(values)
    first = paired_bootstrap(values.to(eval_device), baseline.to(eval_device), conversation.to(eval_device), seed=7)
    second = paired_bootstrap(values.to(eval_device), baseline.to(eval_device), conversation.to(eval_device), seed=7)
    assert first == second
    other = paired_bootstrap(values.to(eval_device), baseline.to(eval_device), conversation.to(eval_device), seed=8)
    assert (other.low, other.high) != (first.low, first.high)
    assert first.mean == pytest.approx(float(values.mean()))
    assert (first.n, first.n_turns, first.n_resamples, first.confidence, first.seed) == (120, 720, 1000, 0.95, 7)


def test_interval_contains_the_true_mean():
    values, conversation = _clustered(1)
    result = bootstrap_mean(values, conversation, seed=0)
    assert result.low < result.mean < result.high
    assert result.contains(0.1)
    assert result.high - result.low < 0.15
    # coverage over independent samples is close to nominal (27 of these 30; ~91% over 200)
    covered = sum(bootstrap_mean(*_clustered(seed), n_resamples=300, seed=seed).contains(0.1) for seed in range(2, 32))
    assert covered >= 24


def test_weightings_and_mask():
    values = torch.tensor([1.0, 1.0, 1.0, 0.0, 4.0], dtype=torch.float64)
    conversation = torch.tensor([10, 10, 10, 20, 30])
    by_turn = bootstrap_mean(values, conversation, n_resamples=50)
    by_conversation = bootstrap_mean(values, conversation, n_resamples=50, weighting="conversation")
    assert by_turn.mean == pytest.approx(7.0 / 5.0)
    assert by_conversation.mean == pytest.approx((1.0 + 0.0 + 4.0) / 3.0)
    mask = torch.tensor([True, False, False, True, False])
    masked = bootstrap_mean(values, conversation, mask, n_resamples=50)
    assert (masked.mean, masked.n, masked.n_turns) == (0.5, 2, 2)
    constant = bootstrap_mean(torch.full((6,), 0.25, dtype=torch.float64), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert (constant.low, constant.mean, constant.high) == (0.25, 0.25, 0.25)
    assert constant.to_dict()["weighting"] == "turn"


def test_empty_slice_gives_nan_and_fails_the_verdict():
    result = bootstrap_mean(torch.ones(3), torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.bool))
    assert result.n == 0 and result.n_turns == 0 and math.isnan(result.mean) and math.isnan(result.low)
    lift = BootstrapResult(0.1, 0.05, 0.15, 10, 30, 0.95, 1000, "turn", 0)
    assert not verdict(result, lift).passed
    assert not verdict(lift, result, tolerance=1.0).passed


def test_bootstrap_errors():
    values = torch.zeros(4)
    conversation = torch.tensor([0, 0, 1, 1])
    with pytest.raises(MapMatchedValueError, match="differ in shape"):
        paired_bootstrap(values, torch.zeros(3), conversation)
    with pytest.raises(MapMatchedValueError, match="conversation must be a \\(N,\\) tensor"):
        bootstrap_mean(values, torch.tensor([0, 1]))
    with pytest.raises(MapMatchedValueError, match="integer conversation indices"):
        bootstrap_mean(values, conversation.double())
    with pytest.raises(MapMatchedValueError, match="mask must be a bool tensor"):
        bootstrap_mean(values, conversation, torch.ones(4))
    with pytest.raises(MapMatchedValueError, match="confidence must be in \\(0, 1\\)"):
        bootstrap_mean(values, conversation, confidence=1.0)
    with pytest.raises(MapMatchedValueError, match="n_resamples must be a positive int"):
        bootstrap_mean(values, conversation, n_resamples=0)
    with pytest.raises(MapMatchedValueError, match="unsupported weighting: dialogue"):
        bootstrap_mean(values, conversation, weighting="dialogue")
    with pytest.raises(MapMatchedValueError, match="must be finite"):
        bootstrap_mean(torch.tensor([0.0, float("nan"), 0.0, 0.0]), conversation)


def _result(low: float, mean: float = 0.0, high: float = 1.0) -> BootstrapResult:
    return BootstrapResult(mean, low, high, 10, 40, 0.95, 1000, "turn", 0)


@pytest.mark.parametrize(
    "followup_low, standalone_low, tolerance, expected",
    [
        (0.01, -0.005, 0.01, (True, True, True)),
        (0.01, -0.01, 0.01, (True, True, True)),  # a loss of exactly the tolerance is allowed
        (0.01, -0.0101, 0.01, (False, True, False)),
        (0.0, 0.02, 0.01, (False, False, True)),  # the lift must be strictly above zero
        (-0.02, -0.5, 0.0, (False, False, False)),
        (0.03, 0.0, 0.0, (True, True, True)),
    ],
)
def test_verdict_cases(followup_low, standalone_low, tolerance, expected):
    outcome = verdict(_result(followup_low), _result(standalone_low), tolerance)
    assert (outcome.passed, outcome.followup_ok, outcome.standalone_ok) == expected
    assert bool(outcome) is expected[0]
    assert outcome.reason.startswith("PASS" if expected[0] else "FAIL")
    assert outcome.tolerance == tolerance


def test_verdict_rejects_a_negative_tolerance():
    with pytest.raises(MapMatchedValueError, match="tolerance must be finite and nonnegative"):
        verdict(_result(0.1), _result(0.0), -0.01)


@pytest.mark.parametrize("weighting", ["turn", "conversation"])
def test_bootstrap_means_equals_one_bootstrap_per_column(weighting):
    values, conversation = _clustered(4, conversations=50, turns=4)
    mask = torch.arange(values.numel()) % 3 != 0
    columns = [values, values * 0.5 - 0.1, paired_difference(values, values.flip(0))]
    options = dict(n_resamples=300, confidence=0.9, seed=5, weighting=weighting)
    together = bootstrap_means((column for column in columns), conversation, mask, **options)
    assert together == [bootstrap_mean(column, conversation, mask, **options) for column in columns]
    assert paired_bootstrap(values, values.flip(0), conversation, mask, **options) == together[2]


def test_bootstrap_means_of_an_empty_slice_and_of_no_column():
    values, conversation = _clustered(5, conversations=4, turns=2)
    empty = bootstrap_means([values, values], conversation, torch.zeros_like(values, dtype=torch.bool))
    assert [(r.n, r.n_turns, math.isnan(r.mean)) for r in empty] == [(0, 0, True), (0, 0, True)]
    assert bootstrap_means([], conversation) == []


def test_intervals_do_not_depend_on_the_number_of_threads():
    # long enough that torch splits a plain 1-D sum across threads (its last bits then move)
    values, conversation = _clustered(6, conversations=70_000, turns=1)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(bootstrap_mean(values, conversation, n_resamples=20, seed=1))
    finally:
        torch.set_num_threads(threads)
    assert results[0] == results[1]
    assert results[0].mean == pytest.approx(math.fsum(values.tolist()) / values.numel(), rel=1e-14)
