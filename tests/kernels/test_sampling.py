"""Exact path sampling (forward filtering, backward sampling) and synthetic conversations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy.stats import chi2

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.fit.sampling import random_graph, sample_conversations, sample_paths
from mapmatched_torch.testing import enumerate_paths, random_trellis


def _path_probabilities(emissions, transitions, mask_b):
    """{path tuple: probability} of one conversation by enumeration."""
    length = int(mask_b.any(dim=1).sum())
    options = [mask_b[t].nonzero().flatten().tolist() for t in range(length)]
    scores = {}
    for path in itertools.product(*options):
        score = float(emissions[0, path[0]])
        for t in range(1, length):
            score += float(transitions[t - 1, path[t - 1], path[t]]) + float(emissions[t, path[t]])
        scores[path] = score
    log_z = enumerate_paths(emissions, transitions, mask_b).log_partition
    return {path: math.exp(score - log_z) for path, score in scores.items()}


def test_samples_match_enumerated_path_probabilities():
    trellis = random_trellis(3, 3, 3, generator=torch.Generator().manual_seed(5))
    emissions, transitions = trellis.emissions, -trellis.distances
    samples = sample_paths(emissions, transitions, trellis.mask, 20000, torch.Generator().manual_seed(11))
    assert samples.shape == (20000, 3, 3)
    for b in range(3):
        probabilities = _path_probabilities(emissions[b], transitions[b], trellis.mask[b])
        length = len(next(iter(probabilities)))
        counts = {}
        for row in samples[:, b].tolist():
            assert all(value == -1 for value in row[length:])
            counts[tuple(row[:length])] = counts.get(tuple(row[:length]), 0) + 1
        assert set(counts) <= set(probabilities)  # never a masked candidate
        n = samples.shape[0]
        statistic = sum((counts.get(p, 0) - n * q) ** 2 / (n * q) for p, q in probabilities.items())
        degrees = max(len(probabilities) - 1, 1)
        assert statistic < chi2.ppf(1.0 - 1e-4, degrees), (b, statistic, degrees)


def test_samples_never_pick_padding_even_with_nan_garbage():
    trellis = random_trellis(6, 4, 5, generator=torch.Generator().manual_seed(2), fill=float("nan"))
    samples = sample_paths(trellis.emissions, -trellis.distances, trellis.mask, 200, torch.Generator().manual_seed(0))
    lengths = trellis.mask.any(dim=2).sum(dim=1)
    turns = torch.arange(4)
    real_turn = turns < lengths.unsqueeze(1)
    assert bool(((samples == -1) == ~real_turn).all())
    picked = trellis.mask.unsqueeze(0).expand(200, -1, -1, -1).gather(3, samples.clamp(min=0).unsqueeze(3)).squeeze(3)
    assert bool((picked | ~real_turn).all())


def test_sampling_is_reproducible_for_a_seed_and_batch_independent():
    trellis = random_trellis(4, 3, 3, generator=torch.Generator().manual_seed(3))
    draw = lambda seed: sample_paths(  # noqa: E731
        trellis.emissions, -trellis.distances, trellis.mask, 50, torch.Generator().manual_seed(seed)
    )
    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))


def test_sampling_on_any_device_matches_cpu(device):
    trellis = random_trellis(4, 3, 3, generator=torch.Generator().manual_seed(8))
    on_device = random_trellis(4, 3, 3, generator=torch.Generator().manual_seed(8), device=device)
    expected = sample_paths(trellis.emissions, -trellis.distances, trellis.mask, 64, torch.Generator().manual_seed(0))
    got = sample_paths(on_device.emissions, -on_device.distances, on_device.mask, 64, torch.Generator().manual_seed(0))
    assert got.device.type == device.type
    assert torch.equal(got.cpu(), expected)


def test_single_turn_and_near_deterministic_chain():
    emissions = torch.tensor([[[0.0, 30.0, 0.0]]], dtype=torch.float64)
    samples = sample_paths(emissions, torch.zeros(1, 0, 3, 3, dtype=torch.float64), torch.ones(1, 1, 3, dtype=torch.bool), 10)
    assert samples.flatten().tolist() == [1] * 10
    emissions = torch.zeros(1, 3, 2, dtype=torch.float64)
    emissions[0, 2, 1] = 40.0
    stay = torch.tensor([[0.0, -40.0], [-40.0, 0.0]], dtype=torch.float64).expand(1, 2, 2, 2)
    samples = sample_paths(emissions, stay, torch.ones(1, 3, 2, dtype=torch.bool), 20, torch.Generator().manual_seed(0))
    assert samples[:, 0].tolist() == [[1, 1, 1]] * 20


def test_sampling_rejects_bad_input():
    trellis = random_trellis(1, 2, 2, generator=torch.Generator().manual_seed(0), pad=False)
    with pytest.raises(MapMatchedValueError, match="num_samples"):
        sample_paths(trellis.emissions, -trellis.distances, trellis.mask, 0)
    bad = trellis.emissions.clone()
    bad[0, 1, 0] = float("nan")
    with pytest.raises(MapMatchedValueError, match="finite"):
        sample_paths(bad, -trellis.distances, trellis.mask)


def test_random_graph_is_connected_and_seeded():
    graph = random_graph(16, generator=torch.Generator().manual_seed(0))
    assert len(graph.nodes) == 16
    assert graph.distance("n000", "n001") < graph.maximum_distance
    again = random_graph(16, generator=torch.Generator().manual_seed(0))
    assert [(e.source_chunk_id, e.target_chunk_id, e.distance) for e in graph.edges()] == [
        (e.source_chunk_id, e.target_chunk_id, e.distance) for e in again.edges()
    ]
    with pytest.raises(MapMatchedValueError, match="num_nodes"):
        random_graph(2)


def test_sample_conversations_format_and_labels():
    data = sample_conversations(
        30, 4, 5, emission_weight=1.0, transition_weight=0.5, label_probability=0.5,
        generator=torch.Generator().manual_seed(4),
    )
    assert len(data.conversations) == 30 and data.paths.shape == (30, 4)
    labelled = 0
    for conversation, path in zip(data.conversations, data.paths.tolist()):
        assert len(conversation) == 4
        for (candidates, relevant), state in zip(conversation, path):
            assert len(candidates) == 5 and all(isinstance(c, ScoredCandidate) for c in candidates)
            assert len({c.chunk_id for c in candidates}) == 5
            assert all(c.chunk_id in data.graph for c in candidates)
            if relevant:
                labelled += 1
                assert relevant == {candidates[state].chunk_id}
    assert 0 < labelled < 120
    again = sample_conversations(
        30, 4, 5, emission_weight=1.0, transition_weight=0.5, label_probability=0.5,
        generator=torch.Generator().manual_seed(4),
    )
    assert again.conversations == data.conversations


def test_sample_conversations_follow_the_emission_weight():
    """With a large lambda and beta = 0 the sampled state is (almost always) the turn's best score."""
    data = sample_conversations(50, 3, 4, emission_weight=60.0, transition_weight=0.0,
                                generator=torch.Generator().manual_seed(1))
    turns = [turn for conversation in data.conversations for turn in conversation]
    best = [relevant == {max(candidates, key=lambda c: c.score).chunk_id} for candidates, relevant in turns]
    assert sum(best) >= 0.95 * len(turns)


def test_sample_conversations_rejects_bad_options():
    with pytest.raises(MapMatchedValueError, match="label_probability"):
        sample_conversations(2, 2, 2, label_probability=1.5)
    with pytest.raises(MapMatchedValueError, match="candidates"):
        sample_conversations(2, 2, 100, graph=random_graph(8))
    with pytest.raises(MapMatchedValueError, match="transition_weight"):
        sample_conversations(2, 2, 2, transition_weight=-1.0)
