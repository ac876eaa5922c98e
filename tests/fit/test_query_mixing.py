"""Fitting the query-mixing gate (mapmatched_torch.fit.query_mixing): the objective, its gradient, recovery."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.fit.query_mixing import cosine_statistics, fit_query_mixing, query_mixing_loss
from mapmatched_torch.providers.query_mixing import QueryMixing, mixed_queries


def _unit(rows: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(rows, dim=-1)


def _problem(turns: int, passages: int, dimension: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    corpus = _unit(torch.randn(passages, dimension, generator=generator, dtype=torch.float64))
    contexts = corpus[torch.randint(passages, (turns,), generator=generator)]
    queries = _unit(0.5 * contexts + 0.5 * torch.randn(turns, dimension, generator=generator, dtype=torch.float64))
    return generator, corpus, queries, contexts


def test_the_loss_is_the_gold_sets_softmax_cross_entropy_over_the_corpus():
    _, corpus, queries, contexts = _problem(3, 5, 4, seed=0)
    relevant = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 1]], dtype=torch.bool)
    parameters = torch.tensor([0.3, -0.2, 0.8, math.log(0.2)], dtype=torch.float64)
    loss = query_mixing_loss(queries, contexts, relevant, corpus, parameters, 0.1, 0.4)
    expected = 0.0
    for n in range(3):
        a = torch.sigmoid(parameters[0]) * torch.sigmoid(
            parameters[1] + parameters[2] * (torch.dot(queries[n], contexts[n]) - 0.1) / 0.4)
        mixed = _unit((1 - a) * queries[n] + a * contexts[n])
        probabilities = torch.softmax(corpus @ mixed / 0.2, dim=0)
        expected += -math.log(float(probabilities[relevant[n]].sum()))
    assert float(loss) == pytest.approx(expected / 3, rel=1e-12)


def test_the_gradient_of_the_objective_matches_finite_differences():
    _, corpus, queries, contexts = _problem(6, 7, 3, seed=1)
    relevant = torch.zeros(6, 7, dtype=torch.bool)
    relevant[torch.arange(6), torch.tensor([0, 3, 3, 6, 2, 1])] = True
    relevant[2, 5] = True
    parameters = torch.tensor([-0.4, 0.3, -0.9, math.log(0.3)], dtype=torch.float64, requires_grad=True)
    mean, std = cosine_statistics(queries, contexts)

    def loss(p: torch.Tensor) -> torch.Tensor:
        return query_mixing_loss(queries, contexts, relevant, corpus, p, mean, std)

    assert torch.autograd.gradcheck(loss, (parameters,), eps=1e-6, atol=1e-7)
    # the query and context embeddings are differentiable too (the mix itself)
    assert torch.autograd.gradcheck(
        lambda q, e: mixed_queries(q, e, 0.6, 0.1, -0.5, mean, std)[0],
        (queries.clone().requires_grad_(), contexts.clone().requires_grad_()), eps=1e-6, atol=1e-7,
    )


def test_fitting_recovers_the_gate_from_turns_sampled_from_the_model():
    generator, corpus, queries, contexts = _problem(2000, 40, 8, seed=3)
    mean, std = cosine_statistics(queries, contexts)
    truth = QueryMixing(0.6, 0.5, -1.5, mean, std)
    mixed, _, _ = mixed_queries(queries, contexts, truth.mix_weight, truth.gate_bias, truth.gate_weight, mean, std)
    gold = torch.multinomial(torch.softmax(mixed @ corpus.T / 0.1, dim=-1), 1, generator=generator).squeeze(1)
    relevant = torch.zeros(2000, 40, dtype=torch.bool)
    relevant[torch.arange(2000), gold] = True
    fit = fit_query_mixing(queries, contexts, relevant, corpus, l2=0.0)
    assert fit.mixing.mix_weight == pytest.approx(0.6, abs=0.06)
    assert fit.mixing.gate_bias == pytest.approx(0.5, abs=0.25)
    assert fit.mixing.gate_weight == pytest.approx(-1.5, abs=0.3)
    assert fit.temperature == pytest.approx(0.1, rel=0.1)
    assert (fit.mixing.cosine_mean, fit.mixing.cosine_std) == (mean, std)
    assert fit.loss < fit.initial_loss and fit.turns == 2000


def test_turns_without_gold_are_dropped_and_a_fit_without_any_is_refused():
    _, corpus, queries, contexts = _problem(4, 5, 3, seed=4)
    relevant = torch.zeros(4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="at least one turn with a relevant passage"):
        fit_query_mixing(queries, contexts, relevant, corpus)
    relevant[1, 2] = relevant[3, 0] = True
    fit = fit_query_mixing(queries, contexts, relevant, corpus, iterations=5)
    assert fit.turns == 2
    assert (fit.mixing.cosine_mean, fit.mixing.cosine_std) == cosine_statistics(queries[[1, 3]], contexts[[1, 3]])
    with pytest.raises(ValueError, match=r"relevant must be \(N, P\)"):
        query_mixing_loss(queries, contexts, relevant[:, :3], corpus, torch.zeros(4, dtype=torch.float64), 0.0, 1.0)
    with pytest.raises(ValueError, match="initial_mix_weight must be in"):
        fit_query_mixing(queries, contexts, relevant, corpus, initial_mix_weight=1.0)


def test_a_held_temperature_stays_put_and_the_gate_is_still_recovered():
    generator, corpus, queries, contexts = _problem(2000, 40, 8, seed=5)
    mean, std = cosine_statistics(queries, contexts)
    mixed, _, _ = mixed_queries(queries, contexts, 0.6, 0.5, -1.5, mean, std)
    gold = torch.multinomial(torch.softmax(mixed @ corpus.T / 0.1, dim=-1), 1, generator=generator).squeeze(1)
    relevant = torch.zeros(2000, 40, dtype=torch.bool)
    relevant[torch.arange(2000), gold] = True
    held = fit_query_mixing(queries, contexts, relevant, corpus, l2=0.0, temperature=0.1, fit_temperature=False)
    assert held.temperature == 0.1
    assert held.mixing.mix_weight == pytest.approx(0.6, abs=0.06)
    assert held.mixing.gate_bias == pytest.approx(0.5, abs=0.25)
    assert held.mixing.gate_weight == pytest.approx(-1.5, abs=0.3)
    # held at a wrong temperature, the gate still fits (and the loss cannot beat the fitted one)
    wrong = fit_query_mixing(queries, contexts, relevant, corpus, l2=0.0, temperature=0.3, fit_temperature=False)
    free = fit_query_mixing(queries, contexts, relevant, corpus, l2=0.0, temperature=0.3)
    assert wrong.temperature == 0.3 and free.temperature == pytest.approx(0.1, rel=0.1)
    assert free.loss < wrong.loss < wrong.initial_loss
    with pytest.raises(TypeError, match="fit_temperature must be True or False"):
        fit_query_mixing(queries, contexts, relevant, corpus, fit_temperature=1)


# ----------------------------------------------------------------- the previous query as a second source


def _two_source_problem(turns: int, passages: int, dimension: int, seed: int):
    generator, corpus, queries, contexts = _problem(turns, passages, dimension, seed)
    previous = _unit(0.5 * queries + torch.randn(turns, dimension, generator=generator, dtype=torch.float64))
    return generator, corpus, queries, contexts, previous


def test_the_two_source_loss_is_the_cross_entropy_of_the_hand_written_mix():
    _, corpus, queries, contexts, previous = _two_source_problem(4, 6, 5, seed=4)
    relevant = torch.zeros(4, 6, dtype=torch.bool)
    relevant[torch.arange(4), torch.tensor([0, 2, 5, 1])] = True
    parameters = torch.tensor([0.2, -0.3, 0.7, -0.5, 0.4, -1.1, math.log(0.25)], dtype=torch.float64)
    present = torch.tensor([[True, True], [True, False], [True, True], [True, True]])
    loss = query_mixing_loss(queries, torch.stack([contexts, previous], dim=1), relevant, corpus, parameters,
                             [0.1, 0.2], [0.4, 0.5], present)
    denominator = 1 + math.exp(0.2) + math.exp(-0.5)
    share_chunk, share_query = math.exp(0.2) / denominator, math.exp(-0.5) / denominator
    expected = 0.0
    for n in range(4):
        a = share_chunk * torch.sigmoid(-0.3 + 0.7 * (torch.dot(queries[n], contexts[n]) - 0.1) / 0.4)
        c = share_query * torch.sigmoid(0.4 - 1.1 * (torch.dot(queries[n], previous[n]) - 0.2) / 0.5)
        c = c if present[n, 1] else 0.0
        mixed = _unit((1 - a - c) * queries[n] + a * contexts[n] + c * previous[n])
        probabilities = torch.softmax(corpus @ mixed / 0.25, dim=0)
        expected += -math.log(float(probabilities[relevant[n]].sum()))
    assert float(loss) == pytest.approx(expected / 4, rel=1e-12)
    with pytest.raises(ValueError, match="3 S \\+ 1"):
        query_mixing_loss(queries, torch.stack([contexts, previous], dim=1), relevant, corpus, parameters[:4],
                          [0.1, 0.2], [0.4, 0.5])


def test_the_two_source_gradient_matches_finite_differences():
    _, corpus, queries, contexts, previous = _two_source_problem(6, 7, 3, seed=5)
    relevant = torch.zeros(6, 7, dtype=torch.bool)
    relevant[torch.arange(6), torch.tensor([0, 3, 3, 6, 2, 1])] = True
    parameters = torch.tensor([-0.4, 0.3, -0.9, -0.8, 0.2, 0.6, math.log(0.3)], dtype=torch.float64,
                              requires_grad=True)
    sources = torch.stack([contexts, previous], dim=1)
    present = torch.tensor([True, True, False, True, True, True]).unsqueeze(1).expand(6, 2).clone()
    present[:, 0] = True
    assert torch.autograd.gradcheck(
        lambda p: query_mixing_loss(queries, sources, relevant, corpus, p, [0.1, -0.1], [0.5, 0.6], present),
        (parameters,), eps=1e-6, atol=1e-7)


def test_fitting_recovers_both_gates_from_turns_sampled_from_the_model():
    generator, corpus, queries, contexts, previous = _two_source_problem(3000, 40, 8, seed=6)
    chunk_stats, query_stats = cosine_statistics(queries, contexts), cosine_statistics(queries, previous)
    truth = QueryMixing(0.45, 0.5, -1.5, *chunk_stats, query_mix_weight=0.3, query_gate_bias=-0.5,
                        query_gate_weight=1.0, query_cosine_mean=query_stats[0], query_cosine_std=query_stats[1])
    mixed = truth.apply(queries, contexts, previous_queries=previous)
    gold = torch.multinomial(torch.softmax(mixed @ corpus.T / 0.1, dim=-1), 1, generator=generator).squeeze(1)
    relevant = torch.zeros(3000, 40, dtype=torch.bool)
    relevant[torch.arange(3000), gold] = True
    fit = fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=previous)
    got = fit.mixing
    assert got.mix_weight == pytest.approx(0.45, abs=0.06) and got.query_mix_weight == pytest.approx(0.3, abs=0.06)
    assert got.gate_bias == pytest.approx(0.5, abs=0.35) and got.gate_weight == pytest.approx(-1.5, abs=0.35)
    assert got.query_gate_bias == pytest.approx(-0.5, abs=0.35)
    assert got.query_gate_weight == pytest.approx(1.0, abs=0.35)
    assert fit.temperature == pytest.approx(0.1, rel=0.1)
    assert (got.query_cosine_mean, got.query_cosine_std) == query_stats
    # without the previous queries the fit is the one-source fit (no query weight)
    assert fit_query_mixing(queries[:50], contexts[:50], relevant[:50], corpus, iterations=3).mixing.query_mix_weight == 0.0


def test_unknown_previous_queries_are_left_out_of_the_second_source():
    _, corpus, queries, contexts, previous = _two_source_problem(40, 10, 4, seed=7)
    relevant = torch.eye(10, dtype=torch.bool)[torch.arange(40) % 10]
    known = torch.arange(40) % 3 != 0
    fit = fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=previous,
                           has_previous_query=known, iterations=5)
    assert (fit.mixing.query_cosine_mean, fit.mixing.query_cosine_std) == cosine_statistics(queries[known],
                                                                                            previous[known])
    with pytest.raises(ValueError, match="previous query is known"):
        fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=previous,
                         has_previous_query=torch.zeros(40, dtype=torch.bool))
    with pytest.raises(ValueError, match="initial_mix_weight"):
        fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=previous, initial_mix_weight=0.6)


def test_a_two_source_fit_warm_started_from_a_one_source_fit_still_learns_the_query_source():
    generator = torch.Generator().manual_seed(1)
    turns, dimension, size = 200, 16, 60
    corpus = _unit(torch.randn(size, dimension, generator=generator, dtype=torch.float64))
    gold = torch.randint(0, size, (turns,), generator=generator)
    previous = corpus[gold] + 0.3 * torch.randn(turns, dimension, generator=generator, dtype=torch.float64)
    queries = torch.randn(turns, dimension, generator=generator, dtype=torch.float64) + 0.3 * corpus[gold]
    contexts = torch.randn(turns, dimension, generator=generator, dtype=torch.float64)  # says nothing
    relevant = torch.zeros(turns, size, dtype=torch.bool)
    relevant[torch.arange(turns), gold] = True
    one = fit_query_mixing(queries, contexts, relevant, corpus, iterations=50)
    fresh = fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=previous, iterations=50)
    warm = fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=previous, initial=one.mixing,
                            iterations=50)
    assert fresh.mixing.query_mix_weight > 0.5 and warm.mixing.query_mix_weight > 0.5
    assert warm.loss == pytest.approx(fresh.loss, rel=0.05) and warm.loss < one.loss


def test_previous_query_flags_are_checked_and_unknown_rows_are_never_read():
    _, corpus, queries, contexts, previous = _two_source_problem(12, 8, 4, seed=8)
    relevant = torch.eye(8, dtype=torch.bool)[torch.arange(12) % 8]
    known = torch.arange(12) % 2 == 0
    with pytest.raises(ValueError, match="has_previous_query must be"):
        fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=previous, has_previous_query=known[:5])
    with pytest.raises(ValueError, match="needs previous_queries"):
        fit_query_mixing(queries, contexts, relevant, corpus, has_previous_query=known)
    poisoned = previous.clone()
    poisoned[~known] = float("nan")
    clean = previous.clone()
    clean[~known] = 0.0
    left = fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=poisoned, has_previous_query=known,
                            iterations=5)
    right = fit_query_mixing(queries, contexts, relevant, corpus, previous_queries=clean, has_previous_query=known,
                             iterations=5)
    assert left.mixing == right.mixing
    both = QueryMixing(0.3, query_mix_weight=0.3)
    assert torch.equal(both.apply(queries, contexts, previous_queries=poisoned, has_previous_query=known),
                       both.apply(queries, contexts, previous_queries=clean, has_previous_query=known))


@pytest.mark.parametrize("block", [1, 7, 64])
def test_a_fit_evaluated_block_by_block_equals_the_whole_matrix_fit(block, monkeypatch):
    # the (N, P) logits are made a block of turns at a time on a large corpus: the loss
    # and gradient are the same mean (to rounding), so the fit lands on the same gates
    from mapmatched_torch.fit import query_mixing as module

    generator, corpus, queries, contexts = _problem(300, 40, 6, seed=8)
    previous = _unit(torch.randn(300, 6, generator=generator, dtype=torch.float64))
    relevant = torch.zeros(300, 40, dtype=torch.bool)
    relevant[torch.arange(300), torch.randint(40, (300,), generator=generator)] = True
    known = torch.rand(300, generator=generator) < 0.8
    options = dict(previous_queries=previous, has_previous_query=known, iterations=30, l2=0.01)
    whole = fit_query_mixing(queries, contexts, relevant, corpus, **options)
    monkeypatch.setattr(module, "LOGIT_BLOCK", block * corpus.shape[0])  # `block` turns per block
    blocked = fit_query_mixing(queries, contexts, relevant, corpus, **options)
    assert blocked.initial_loss == pytest.approx(whole.initial_loss, rel=1e-12)
    assert blocked.loss == pytest.approx(whole.loss, rel=1e-9)
    for name, value in whole.mixing.to_dict().items():
        assert getattr(blocked.mixing, name) == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert blocked.temperature == pytest.approx(whole.temperature, rel=1e-5)


def test_gold_indices_list_each_rows_relevant_passages_in_order():
    from mapmatched_torch.fit.query_mixing import gold_indices

    generator = torch.Generator().manual_seed(3)
    relevant = torch.rand(9, 13, generator=generator) < 0.2
    relevant[4] = False  # a row without gold
    index, real = gold_indices(relevant)
    assert index.shape == real.shape == (9, int(relevant.sum(dim=-1).max()))
    for n in range(9):
        assert index[n][real[n]].tolist() == relevant[n].nonzero().flatten().tolist()
    assert not bool(real[4].any())
    index, real = gold_indices(torch.zeros(0, 5, dtype=torch.bool))
    assert index.shape == (0, 1) and real.shape == (0, 1)
