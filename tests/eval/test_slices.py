"""Emission entropy, follow-up/standalone slices and topic slices."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.scoring import softmax_entropy
from mapmatched_torch.eval.slices import emission_entropy, entropy_slices, median, topic_slices


def test_emission_entropy_matches_the_reference(eval_device):
    generator = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 5, 6, generator=generator, dtype=torch.float64) * 3
    mask = torch.rand(4, 5, 6, generator=generator) < 0.7
    mask[0, 0] = False
    mask[0, 0, 2] = True  # one real candidate
    mask[0, 1] = False  # none
    for weight in (0.0, 0.5, 2.0):
        got = emission_entropy(scores.to(eval_device), mask.to(eval_device), weight).cpu()
        assert got.shape == (4, 5) and got.dtype == torch.float64
        for b in range(4):
            for t in range(5):
                real = [weight * float(s) for s, m in zip(scores[b, t], mask[b, t]) if m]
                expected = softmax_entropy(real) if real else 0.0  # a turn without candidates: 0.0
                assert float(got[b, t]) == pytest.approx(expected, abs=1e-12)
    assert float(emission_entropy(torch.zeros(1, 4))[0]) == pytest.approx(math.log(4))
    assert float(emission_entropy(torch.tensor([[1e300, -1e300]], dtype=torch.float64))[0]) == 0.0


def test_median():
    assert median(torch.tensor([3.0, 1.0, 2.0])) == 2.0
    assert median(torch.tensor([4.0, 1.0, 3.0, 2.0])) == 2.5
    assert math.isnan(median(torch.tensor([])))


def test_entropy_slices_rules():
    entropy = torch.tensor([9.0, 1.0, 2.0, 3.0, 4.0, 0.5, 5.0], dtype=torch.float64)
    position = torch.tensor([0, 1, 2, 3, 0, 1, 2])
    sliced = entropy_slices(entropy, position)
    # later turns: 1, 2, 3, 0.5, 5 -> median 2.0; turn-0 entropies (9, 4) never count
    assert sliced.threshold == 2.0 and not sliced.configured
    assert sliced.followup.tolist() == [False, False, False, True, False, False, True]
    assert sliced.standalone.tolist() == [True, True, True, False, True, True, False]
    fixed = entropy_slices(entropy, position, threshold=0.75)
    assert fixed.configured and fixed.threshold == 0.75
    assert fixed.followup.tolist() == [False, True, True, True, False, False, True]
    eligible = torch.tensor([True, True, True, True, True, False, False])
    limited = entropy_slices(entropy, position, eligible=eligible)
    assert limited.threshold == 2.0  # median of 1, 2, 3
    assert limited.followup.tolist() == [False, False, False, True, False, False, False]
    assert limited.standalone.tolist() == [True, True, True, False, True, False, False]


def test_entropy_slices_on_a_padded_batch_and_without_later_turns():
    entropy = torch.tensor([[5.0, 1.0, 3.0], [5.0, 2.0, 4.0]], dtype=torch.float64)
    sliced = entropy_slices(entropy, torch.arange(3))
    assert sliced.threshold == 2.5
    assert sliced.followup.tolist() == [[False, False, True], [False, False, True]]
    alone = entropy_slices(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]))
    assert math.isnan(alone.threshold) and not alone.followup.any() and alone.standalone.all()


def test_entropy_slices_errors():
    with pytest.raises(MapMatchedValueError, match="does not broadcast"):
        entropy_slices(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(MapMatchedValueError, match="floating-point"):
        entropy_slices(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(MapMatchedValueError, match="threshold must be a finite number"):
        entropy_slices(torch.zeros(3), torch.zeros(3, dtype=torch.long), threshold=float("nan"))
    with pytest.raises(MapMatchedValueError, match="eligible must be a bool tensor"):
        entropy_slices(torch.zeros(3), torch.zeros(3, dtype=torch.long), eligible=torch.ones(3))
    with pytest.raises(MapMatchedValueError, match="mask shape"):
        emission_entropy(torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool))


def test_topic_slices():
    labels = torch.tensor([0, 1, -1, 0, 1], dtype=torch.int8)
    sliced = topic_slices(labels)
    assert sliced.switch.tolist() == [False, True, False, False, True]
    assert sliced.same.tolist() == [True, False, False, True, False]
    later = topic_slices(labels, position=torch.tensor([0, 1, 2, 0, 1]))
    assert later.same.tolist() == [False, False, False, False, False]
    listed = topic_slices([None, True, False], eligible=torch.tensor([True, True, False]))
    assert listed.switch.tolist() == [False, True, False] and listed.same.tolist() == [False, False, False]
    flags = topic_slices(torch.tensor([True, False]))
    assert flags.switch.tolist() == [True, False] and flags.same.tolist() == [False, True]
    with pytest.raises(MapMatchedValueError, match="1 \\(switch\\), 0 \\(same\\) or -1"):
        topic_slices(torch.tensor([2]))
    with pytest.raises(MapMatchedValueError, match="True, False or None"):
        topic_slices([1, 0])  # type: ignore[list-item]
    with pytest.raises(MapMatchedValueError, match="bool or integer"):
        topic_slices(torch.tensor([0.5]))
