"""Normalization, entropy and margin (docs/spec.md sections 2-3)."""

from __future__ import annotations

import math
import re

import pytest

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.core.scoring import (
    normalize_candidates,
    normalize_scores,
    normalized_margin,
    runner_up_index,
    softmax_entropy,
)


def test_zscore_uses_the_population_std():
    # mean 2, population variance ((1 + 0 + 1) / 3) = 2/3
    values = normalize_scores([1.0, 2.0, 3.0], "zscore")
    std = math.sqrt(2.0 / 3.0)
    assert values == [-1.0 / std, 0.0, 1.0 / std]


def test_zscore_is_the_default_and_constant_scores_give_zero():
    assert normalize_scores([4.0, 4.0, 4.0]) == [0.0, 0.0, 0.0]
    assert normalize_scores([7.5]) == [0.0]


def test_center_and_none():
    assert normalize_scores([1.0, 2.0, 6.0], "center") == [-2.0, -1.0, 3.0]
    assert normalize_scores([1.0, 2.0, 6.0], "none") == [1.0, 2.0, 6.0]


@pytest.mark.parametrize("method", ["minmax", "", None, "ZSCORE"])
def test_unsupported_normalization(method):
    # The message names the bad value (a plain word unquoted, as mapmatched 0.1.0 words
    # it) and lists every valid choice.
    shown = method if method else repr(method)
    expected = re.escape(f"unsupported score normalization: {shown} (expected one of 'zscore', 'center', 'none'")
    with pytest.raises(MapMatchedValueError, match=expected):
        normalize_scores([1.0], method)


def test_unsupported_normalization_suggests_the_close_choice():
    with pytest.raises(MapMatchedValueError, match=r"did you mean 'zscore'\?"):
        normalize_scores([1.0], "ZSCORE")


def test_normalize_candidates_keeps_raw_and_order():
    candidates = [ScoredCandidate("b", 3.0), ScoredCandidate("a", 1.0)]
    normalized = normalize_candidates(candidates, "center")
    assert [(c.chunk_id, c.raw_score, c.normalized_score) for c in normalized] == [("b", 3.0, 1.0), ("a", 1.0, -1.0)]


def test_softmax_entropy_values():
    assert softmax_entropy([0.3]) == 0.0
    assert softmax_entropy(scores=[2.0, 2.0]) == pytest.approx(math.log(2.0))  # mapmatched's parameter name
    assert softmax_entropy([1.0, 1.0, 1.0, 1.0]) == pytest.approx(math.log(4.0), abs=1e-15)
    p = [math.exp(1.0) / (math.exp(1.0) + 1.0), 1.0 / (math.exp(1.0) + 1.0)]
    assert softmax_entropy([1.0, 0.0]) == pytest.approx(-sum(x * math.log(x) for x in p), abs=1e-15)


@pytest.mark.parametrize(
    "scores, message",
    [([], "^entropy requires at least one score$"), ([1.0, math.nan], "^entropy scores must be finite"),
     ([1.0, math.inf], "^entropy scores must be finite"), ([-math.inf], "^entropy scores must be finite")],
)
def test_softmax_entropy_rejects_empty_and_nonfinite_scores(scores, message):
    with pytest.raises(ValueError, match=message):
        softmax_entropy(scores)


def test_softmax_entropy_is_safe_for_large_inputs():
    assert softmax_entropy([1e300, 1e300]) == pytest.approx(math.log(2.0))
    assert softmax_entropy([1e300, -1e300]) == 0.0
    assert softmax_entropy([-1e308, -1e308, -1e308]) == pytest.approx(math.log(3.0))


def test_runner_up_and_margin():
    scores = [1.0, 2.0, 2.0, -1.0]
    assert runner_up_index(scores, 0) == 1  # ties go to the earlier one
    assert runner_up_index(scores, 1) == 2
    assert normalized_margin(scores, 1) == 0.0
    assert normalized_margin(scores, 0) == -1.0
    assert normalized_margin(scores, 3) == -3.0
    assert runner_up_index([5.0], 0) is None
    assert normalized_margin([5.0], 0) == 0.0
