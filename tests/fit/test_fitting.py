"""Fitting lambda and beta: the set-valued loss, its gradients, recovery, determinism, errors."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import pytest
import torch

from mapmatched_torch.kernels import decode
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.fit.fitting import (
    _decoded_first,
    batch_nll,
    decoded_ndcg,
    fit_weights,
    pack_conversations,
    set_log_likelihood,
)
from mapmatched_torch.fit.model import MapMatchedModel
from mapmatched_torch.fit.sampling import sample_conversations
from mapmatched_torch.standalone import InMemoryCorpusGraph
from mapmatched_torch.testing import random_trellis


def _random_relevant(mask, generator):
    """Random relevant sets: some turns several, some none, some only at padding."""
    relevant = torch.rand(mask.shape, generator=generator) < 0.3
    return relevant.to(mask.device)


def _brute_force_log_likelihood(emissions, transitions, mask_b, relevant_b):
    """log(sum over paths meeting a relevant candidate at every usable turn) - log(sum over all paths)."""
    length = int(mask_b.any(dim=1).sum())
    options = [mask_b[t].nonzero().flatten().tolist() for t in range(length)]
    usable = [bool((mask_b[t] & relevant_b[t]).any()) for t in range(length)]
    all_scores, consistent = [], []
    for path in itertools.product(*options):
        score = float(emissions[0, path[0]])
        for t in range(1, length):
            score = (score + float(transitions[t - 1, path[t - 1], path[t]])) + float(emissions[t, path[t]])
        all_scores.append(score)
        if all(bool(relevant_b[t, m]) or not usable[t] for t, m in enumerate(path)):
            consistent.append(score)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    return float(as_tensor(consistent).logsumexp(0) - as_tensor(all_scores).logsumexp(0))


# ------------------------------------------------------------------------------ loss


@pytest.mark.parametrize("seed", range(4))
def test_set_log_likelihood_equals_brute_force(seed):
    generator = torch.Generator().manual_seed(seed)
    trellis = random_trellis(5, 4, 3, generator=generator)
    relevant = _random_relevant(trellis.mask, generator)
    transitions = -trellis.distances
    got = set_log_likelihood(trellis.emissions, transitions, trellis.mask, relevant)
    for b in range(5):
        expected = _brute_force_log_likelihood(trellis.emissions[b], transitions[b], trellis.mask[b], relevant[b])
        assert got[b].item() == pytest.approx(expected, abs=1e-10)


def test_single_relevant_candidate_is_decode_log_likelihood():
    generator = torch.Generator().manual_seed(7)
    trellis = random_trellis(6, 3, 4, generator=generator)
    gold = torch.where(torch.rand(6, 3, generator=generator) < 0.5, -1, torch.randint(0, 4, (6, 3), generator=generator))
    gold = torch.where(trellis.mask.gather(2, gold.clamp(min=0).unsqueeze(2)).squeeze(2), gold, -1)
    relevant = torch.nn.functional.one_hot(gold.clamp(min=0), 4).bool() & (gold >= 0).unsqueeze(2)
    expected = decode.log_likelihood(trellis.emissions, -trellis.distances, trellis.mask, gold)
    got = set_log_likelihood(trellis.emissions, -trellis.distances, trellis.mask, relevant)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_several_relevant_candidates_add_their_probabilities():
    generator = torch.Generator().manual_seed(3)
    trellis = random_trellis(1, 3, 3, generator=generator, pad=False)
    args = (trellis.emissions, -trellis.distances, trellis.mask)
    one_hot = lambda *ms: torch.zeros(1, 3, 3, dtype=torch.bool).index_put_(  # noqa: E731
        (torch.zeros(len(ms), dtype=torch.long), torch.ones(len(ms), dtype=torch.long), torch.tensor(ms)),
        torch.tensor(True),
    )
    both = set_log_likelihood(*args, one_hot(0, 2)).exp()
    separate = set_log_likelihood(*args, one_hot(0)).exp() + set_log_likelihood(*args, one_hot(2)).exp()
    torch.testing.assert_close(both, separate, rtol=1e-12, atol=0)


def test_gradients_match_finite_differences():
    generator = torch.Generator().manual_seed(1)
    trellis = random_trellis(3, 3, 3, generator=generator, fill=0.25)
    relevant = _random_relevant(trellis.mask, generator)
    emissions = trellis.emissions.clone().requires_grad_(True)
    transitions = (-trellis.distances).clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda e, tr: set_log_likelihood(e, tr, trellis.mask, relevant), (emissions, transitions)
    )
    weights = (torch.tensor(1.3, dtype=torch.float64, requires_grad=True),
               torch.tensor(0.6, dtype=torch.float64, requires_grad=True))
    scores = torch.where(trellis.mask, trellis.emissions, 0.0)
    distances = torch.where(trellis.mask[:, :-1, :, None] & trellis.mask[:, 1:, None, :], trellis.distances, 0.0)
    assert torch.autograd.gradcheck(
        lambda lam, beta: set_log_likelihood(lam * scores, -(beta * distances), trellis.mask, relevant), weights
    )


def test_padding_gets_no_gradient_and_no_nan():
    generator = torch.Generator().manual_seed(4)
    trellis = random_trellis(4, 3, 3, generator=generator)  # NaN at padding
    relevant = _random_relevant(trellis.mask, generator)
    emissions = trellis.emissions.clone().requires_grad_(True)
    set_log_likelihood(emissions, -trellis.distances, trellis.mask, relevant).sum().backward()
    assert torch.isfinite(emissions.grad).all()
    assert bool((emissions.grad[~trellis.mask] == 0).all())


# ---------------------------------------------------------------------- conversations

GRAPH = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c"), ("c", "d")])


def _turn(relevant, **scores):
    return tuple(ScoredCandidate(chunk_id, score) for chunk_id, score in scores.items()), set(relevant)


def _counting_conversations():
    return [
        [_turn({"a"}, a=1.0, b=0.5), _turn((), b=0.2, c=0.9), _turn({"x"}, c=0.1, d=0.4)],
        [_turn({"a", "c"}, a=0.3, c=0.2, d=0.9), _turn({"b"}, b=0.1, d=0.2)],
        [_turn((), a=0.0, b=1.0)],
    ]


def test_unlabelled_and_missing_gold_turns_are_counted():
    result = fit_weights(_counting_conversations(), GRAPH, validation_fraction=0.0, max_iterations=3, progress=False)
    assert (result.n_conversations, result.n_turns, result.n_labelled_turns, result.n_gold_missing,
            result.n_unlabelled) == (3, 6, 4, 1, 2)
    assert (result.n_train_conversations, result.n_validation_conversations) == (3, 0)
    assert result.validation_ndcg_before is None and result.history[0].validation_loss is None


def test_missing_gold_turns_are_marginalized_like_unlabelled_ones():
    conversation = _counting_conversations()[0]
    unlabelled_last = conversation[:2] + [(conversation[2][0], set())]
    model = MapMatchedModel(1.2, 0.7)
    first = batch_nll(model, pack_conversations([conversation], GRAPH))
    second = batch_nll(model, pack_conversations([unlabelled_last], GRAPH))
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert float(first.detach()) > 0.0


def test_decoded_first_ranking_and_ndcg():
    paths = torch.tensor([[2, 0]])
    scores = torch.tensor([[[0.5, 0.9, 0.1, 0.9], [1.0, 0.0, 0.0, 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[[True] * 4, [True, True, False, False]]])
    assert _decoded_first(paths, scores, mask).tolist() == [[[2, 1, 3, 0], [0, 1, -1, -1]]]
    # beta = 0 decodes the per-turn argmax ("b"); relevant: "c" (rank 2) and a chunk that is not a candidate
    batch = pack_conversations([[_turn({"c", "zz"}, a=0.0, b=1.0, c=0.5)]], GRAPH)
    total, count = decoded_ndcg(MapMatchedModel(1.0, 0.0), batch)
    assert count == 1
    assert total == pytest.approx((1 / math.log2(3)) / (1 + 1 / math.log2(3)))


# ------------------------------------------------------------------------- fitting


@pytest.fixture(scope="module")
def sampled():
    return sample_conversations(2000, 4, 4, emission_weight=1.5, transition_weight=0.8,
                                generator=torch.Generator().manual_seed(0))


def test_fit_recovers_the_generating_weights(sampled):
    result = fit_weights(sampled.conversations, sampled.graph, validation_fraction=0.0, progress=False)
    assert result.stopped == "converged"
    assert result.emission_weight == pytest.approx(1.5, rel=0.1)
    assert result.transition_weight == pytest.approx(0.8, rel=0.1)
    losses = result.train_losses
    assert losses[-1] < losses[0]
    assert (result.n_conversations, result.n_labelled_turns, result.n_gold_missing) == (2000, 8000, 0)


def test_adam_with_validation_improves_and_stays_nonnegative(sampled):
    result = fit_weights(sampled.conversations[:300], sampled.graph, optimizer="adam", lr=0.1, max_iterations=15,
                         batch_size=64, init_transition_weight=0.0, progress=False, seed=1)
    assert (result.n_train_conversations, result.n_validation_conversations) == (240, 60)
    assert all(step.transition_weight >= 0.0 and step.emission_weight >= 0.0 for step in result.history)
    best = result.history[result.best_iteration]
    assert best.validation_loss <= result.history[0].validation_loss
    assert (result.emission_weight, result.transition_weight) == (best.emission_weight, best.transition_weight)
    assert 0.0 <= result.validation_ndcg_before <= 1.0 and 0.0 <= result.validation_ndcg_after <= 1.0


@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
def test_fit_is_deterministic_for_a_seed(sampled, optimizer):
    run = lambda seed: fit_weights(sampled.conversations[:200], sampled.graph, optimizer=optimizer,  # noqa: E731
                                   max_iterations=4, batch_size=32, seed=seed, progress=False)
    first = run(5)
    assert run(5) == first
    assert run(6).history != first.history  # another split


def test_explicit_validation_and_l2_prior(sampled):
    train, held = sampled.conversations[:150], sampled.conversations[150:200]
    result = fit_weights(train, sampled.graph, validation=held, l2=1e6, init_emission_weight=0.7,
                         init_transition_weight=0.2, max_iterations=5, progress=False)
    assert (result.n_train_conversations, result.n_validation_conversations, result.n_conversations) == (150, 50, 200)
    assert result.emission_weight == pytest.approx(0.7, abs=1e-3)
    assert result.transition_weight == pytest.approx(0.2, abs=1e-3)
    decay = fit_weights(train, sampled.graph, validation_fraction=0.0, l2=1e6, l2_center="zero", max_iterations=5,
                        progress=False)
    assert decay.emission_weight < 1e-3 and decay.transition_weight < 1e-3


def test_fit_on_any_device_matches_cpu(sampled, device):
    run = lambda where: fit_weights(sampled.conversations[:100], sampled.graph, max_iterations=3, seed=2,  # noqa: E731
                                    device=where, progress=False)
    expected, got = run("cpu"), run(device)
    assert got.emission_weight == pytest.approx(expected.emission_weight, rel=1e-7)
    assert got.transition_weight == pytest.approx(expected.transition_weight, rel=1e-7)
    assert got.validation_ndcg_after == pytest.approx(expected.validation_ndcg_after, rel=1e-9)


def test_tensor_graph_distances_match_the_reference_graph(sampled):
    graph_module = pytest.importorskip("mapmatched_torch.graph")
    tensor_graph = graph_module.TensorCorpusGraph.from_graph(sampled.graph)
    reference = pack_conversations(sampled.conversations[:20], sampled.graph)
    fast = pack_conversations(sampled.conversations[:20], tensor_graph)
    torch.testing.assert_close(fast.distances, reference.distances, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------- bad input


class _Loose(NamedTuple):
    """A duck-typed candidate that, unlike ScoredCandidate, does not check its score."""

    chunk_id: str
    score: float


@pytest.mark.parametrize(
    ("conversations", "message"),
    [
        ([[_turn((), a=1.0, b=0.0)]], "no labelled turns"),
        ([[_turn({"zz"}, a=1.0, b=0.0)]], "no usable training turn"),
        ([[((_Loose("a", float("nan")),), {"a"})]], r"conversation 0 turn 0 candidate 0 \('a'\) score must be finite"),
        ([[((), {"a"})]], "conversation 0 turn 0 has no candidates"),
        ([[_turn({"a"}, a=1.0)], []], "conversation 1 has no turns"),
        ([[((ScoredCandidate("a", 1.0),), "a")]], "relevant must be a collection"),
        ([[((ScoredCandidate("a", 1.0), ScoredCandidate("a", 0.0)), {"a"})]], "duplicate chunk IDs"),
        ([[(ScoredCandidate("a", 1.0),)]], "must be a pair"),
        ([], "at least one conversation"),
    ],
)
def test_bad_conversations_are_clear_errors(conversations, message):
    with pytest.raises(MapMatchedValueError, match=message):
        fit_weights(conversations, GRAPH, validation_fraction=0.0, progress=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"optimizer": "sgd"}, "unsupported optimizer"),
        ({"validation_fraction": 1.0}, "validation_fraction"),
        ({"l2": -1.0}, "l2"),
        ({"l2_center": "mean"}, "unsupported l2_center"),
        ({"init_transition_weight": float("nan")}, "init_transition_weight"),
        ({"score_normalization": "minmax"}, "unsupported score normalization"),
        ({"max_iterations": 0}, "max_iterations"),
        ({"lr": 0.0}, "lr"),
        ({"dtype": torch.int64}, "dtype"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(MapMatchedValueError, match=message):
        fit_weights(_counting_conversations(), GRAPH, progress=False, **options)
