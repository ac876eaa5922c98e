"""The batched dynamic programs: brute force, batching, padding, fixed lag, streaming,
validation, devices, and parity with the pure-Python StandaloneDecoder."""

from __future__ import annotations

import itertools
import math
import random
import re

import pytest
import torch

from mapmatched_torch.kernels import chain
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import DecoderCandidate
from mapmatched_torch.fit.model import MapMatchedModel
from mapmatched_torch.kernels.states import FixedLagState, ViterbiState
from mapmatched_torch.kernels.decode import (
    fixed_lag_viterbi,
    forward_scores,
    geodesic_viterbi,
    log_likelihood,
    log_partition,
    marginals,
    path_score,
    pointwise_decode,
    viterbi,
)
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.testing import enumerate_paths, random_trellis

NONFINITE = "decoder accumulation produced a nonfinite score"


# ----------------------------------------------------------------------- helpers


def trials(seed, count, *, integer, batch=3, max_turns=4, max_candidates=3, **kwargs):
    """Random padded batches (T <= max_turns, M <= max_candidates) with weighted transitions."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        turns = int(torch.randint(1, max_turns + 1, (1,), generator=generator))
        candidates = int(torch.randint(1, max_candidates + 1, (1,), generator=generator))
        emissions, distances, mask = random_trellis(
            batch, turns, candidates, generator=generator, integer=integer, **kwargs
        )
        beta = 1.0 if integer else 0.75
        yield emissions, -(beta * distances), mask


def lengths_of(mask):
    return mask.any(dim=-1).sum(dim=1).tolist()


def one(emissions, transitions, mask, b):
    """Conversation b alone, cut to its own length."""
    n = lengths_of(mask)[b]
    return emissions[b : b + 1, :n], transitions[b : b + 1, : n - 1], mask[b : b + 1, :n]


def literal_fixed_lag(emissions, transitions, mask, lag):
    """docs/spec.md section 5's lock procedure, literally, by enumeration (one conversation)."""
    length = lengths_of(mask.unsqueeze(0))[0]
    allowed = mask.clone()
    for t in range(length):
        prefix = allowed.clone()
        prefix[t + 1 :] = False
        chosen = enumerate_paths(emissions, transitions, prefix).path
        if t >= lag:
            allowed[t - lag] = False
            allowed[t - lag, chosen[t - lag]] = True
    return enumerate_paths(emissions, transitions, allowed)


def geodesic_brute_force(emissions, distances, mask):
    """(path, distance, emission) minimizing distance, then maximizing emission, then reverse-lex."""
    rows = mask.tolist()
    length = sum(1 for row in rows if any(row))
    options = [[m for m, real in enumerate(row) if real] for row in rows[:length]]
    e, d = emissions.tolist(), distances.tolist()
    scored = []
    for path in itertools.product(*options):
        distance, emission = 0.0, e[0][path[0]]
        for t in range(1, length):
            distance = distance + d[t - 1][path[t - 1]][path[t]]
            emission = emission + e[t][path[t]]
        scored.append((path, distance, emission))
    best = min(scored, key=lambda item: (item[1], -item[2], item[0][::-1]))
    return best


def assert_same_path(paths_row, expected, length):
    assert paths_row[:length].tolist() == list(expected)
    assert (paths_row[length:] == -1).all()


# ------------------------------------------------------------------- brute force


@pytest.mark.parametrize("integer", [True, False], ids=["integer", "float"])
def test_viterbi_matches_brute_force(integer):
    for emissions, transitions, mask in trials(1, 40, integer=integer):
        decoded = viterbi(emissions, transitions, mask)
        for b, length in enumerate(lengths_of(mask)):
            truth = enumerate_paths(emissions[b], transitions[b], mask[b])
            assert decoded.scores[b].item() == truth.score
            if integer:
                assert_same_path(decoded.paths[b], truth.path, length)
            assert (decoded.paths[b, length:] == -1).all()


def test_viterbi_tie_rule_on_exact_ties():
    # Every path scores 0: the tie rule picks candidate 0 everywhere.
    emissions = torch.zeros(1, 3, 3, dtype=torch.float64)
    transitions = torch.zeros(1, 2, 3, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, 3, dtype=torch.bool)
    assert viterbi(emissions, transitions, mask).paths.tolist() == [[0, 0, 0]]
    # Two optimal paths (0, 1) and (1, 0): the smaller LAST index wins (reverse-lexicographic).
    emissions = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]], dtype=torch.float64)
    transitions = torch.tensor([[[[-5.0, 0.0], [2.0, -5.0]]]], dtype=torch.float64)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    assert viterbi(emissions, transitions, mask).paths.tolist() == [[1, 0]]
    assert enumerate_paths(emissions[0], transitions[0], mask[0]).path == (1, 0)


@pytest.mark.parametrize("integer", [True, False], ids=["integer", "float"])
def test_log_partition_and_marginals_match_brute_force(integer):
    for emissions, transitions, mask in trials(2, 25, integer=integer):
        log_z = log_partition(emissions, transitions, mask)
        posterior = marginals(emissions, transitions, mask)
        for b, length in enumerate(lengths_of(mask)):
            truth = enumerate_paths(emissions[b], transitions[b], mask[b])
            assert log_z[b].item() == pytest.approx(truth.log_partition, rel=1e-12, abs=1e-12)
            torch.testing.assert_close(posterior[b], truth.marginals, rtol=0, atol=1e-12)
            sums = posterior[b, :length].sum(dim=-1)
            torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-12)
        assert (posterior[~mask] == 0).all()


def test_path_score_matches_decoder_and_brute_force():
    for emissions, transitions, mask in trials(3, 20, integer=False):
        decoded = viterbi(emissions, transitions, mask)
        assert torch.equal(path_score(emissions, transitions, mask, decoded.paths), decoded.scores)
        # any other real path scores at most the optimum
        other = torch.where(mask.any(-1), mask.to(torch.long).argmax(dim=-1), -1)
        assert (path_score(emissions, transitions, mask, other) <= decoded.scores).all()


def test_log_likelihood_matches_brute_force():
    for emissions, transitions, mask in trials(4, 15, integer=False):
        generator = torch.Generator().manual_seed(5)
        # gold: the first real candidate at random labelled turns, -1 elsewhere
        first_real = mask.to(torch.long).argmax(dim=-1)
        labelled = torch.rand(first_real.shape, generator=generator) < 0.6
        gold = torch.where(labelled & mask.any(-1), first_real, -1)
        result = log_likelihood(emissions, transitions, mask, gold)
        for b in range(mask.shape[0]):
            restricted = mask[b].clone()
            for t, g in enumerate(gold[b].tolist()):
                if g >= 0:
                    restricted[t] = False
                    restricted[t, g] = True
            expected = (
                enumerate_paths(emissions[b], transitions[b], restricted).log_partition
                - enumerate_paths(emissions[b], transitions[b], mask[b]).log_partition
            )
            assert result[b].item() == pytest.approx(expected, abs=1e-12)
            assert result[b].item() <= 1e-12


# ----------------------------------------------------------- batching and padding


def test_batched_equals_one_at_a_time():
    for emissions, transitions, mask in trials(6, 10, integer=True, batch=5, max_turns=5):
        full = viterbi(emissions, transitions, mask)
        lagged = fixed_lag_viterbi(emissions, transitions, mask, 1)
        log_z = log_partition(emissions, transitions, mask)
        posterior = marginals(emissions, transitions, mask)
        for b, length in enumerate(lengths_of(mask)):
            e, tr, m = one(emissions, transitions, mask, b)
            alone = viterbi(e, tr, m)
            assert torch.equal(alone.paths[0], full.paths[b, :length])
            assert torch.equal(alone.scores[0], full.scores[b])
            alone_lagged = fixed_lag_viterbi(e, tr, m, 1)
            assert torch.equal(alone_lagged.paths[0], lagged.paths[b, :length])
            assert torch.equal(alone_lagged.committed_through[0], lagged.committed_through[b])
            torch.testing.assert_close(log_partition(e, tr, m)[0], log_z[b], rtol=1e-14, atol=1e-14)
            torch.testing.assert_close(marginals(e, tr, m)[0], posterior[b, :length], rtol=0, atol=1e-13)


def _embed(emissions, transitions, mask, extra_candidates, extra_turns, generator):
    """Spread the candidates over a wider M (order kept) and append padding turns, all
    new positions masked and filled with garbage (nan, inf, huge)."""
    batch, turns, candidates = mask.shape
    wide, long = candidates + extra_candidates, turns + extra_turns
    slots = sorted(torch.randperm(wide, generator=generator)[:candidates].tolist())
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e300, -5.0], dtype=emissions.dtype)

    def noise(shape):
        return garbage[torch.randint(0, len(garbage), shape, generator=generator)]

    new_emissions = noise((batch, long, wide))
    new_transitions = noise((batch, long - 1, wide, wide))
    new_mask = torch.zeros(batch, long, wide, dtype=torch.bool)
    index = torch.tensor(slots)
    new_emissions[:, :turns, index] = torch.where(mask, emissions, noise(mask.shape))
    new_mask[:, :turns, index] = mask
    if turns > 1:
        new_transitions[:, : turns - 1, index[:, None], index[None, :]] = torch.where(
            mask[:, :-1, :, None] & mask[:, 1:, None, :], transitions, noise(transitions.shape)
        )
    return new_emissions, new_transitions, new_mask, index


def test_padding_has_no_effect():
    generator = torch.Generator().manual_seed(7)
    for emissions, transitions, mask in trials(8, 15, integer=True):
        wide_e, wide_tr, wide_mask, index = _embed(emissions, transitions, mask, 2, 2, generator)
        turns = mask.shape[1]

        def mapped(paths):
            return torch.where(paths >= 0, index[paths.clamp_min(0)], -1)

        narrow, wide = viterbi(emissions, transitions, mask), viterbi(wide_e, wide_tr, wide_mask)
        assert torch.equal(mapped(narrow.paths), wide.paths[:, :turns])
        assert (wide.paths[:, turns:] == -1).all()
        assert torch.equal(narrow.scores, wide.scores)
        for lag in (0, 1, 3):
            narrow_l, wide_l = (
                fixed_lag_viterbi(emissions, transitions, mask, lag),
                fixed_lag_viterbi(wide_e, wide_tr, wide_mask, lag),
            )
            assert torch.equal(mapped(narrow_l.paths), wide_l.paths[:, :turns])
            assert torch.equal(narrow_l.scores, wide_l.scores)
            assert torch.equal(narrow_l.committed_through, wide_l.committed_through)
        torch.testing.assert_close(
            log_partition(emissions, transitions, mask), log_partition(wide_e, wide_tr, wide_mask), rtol=1e-14, atol=0
        )
        posterior = marginals(wide_e, wide_tr, wide_mask)
        assert torch.isfinite(posterior).all()
        torch.testing.assert_close(posterior[:, :turns, index], marginals(emissions, transitions, mask), rtol=0, atol=1e-13)
        assert (posterior[~wide_mask] == 0).all()
        narrow_fw = forward_scores(emissions, transitions, mask)
        wide_fw = forward_scores(wide_e, wide_tr, wide_mask)
        assert torch.equal(wide_fw[:, :turns, index], narrow_fw)
        assert (wide_fw[~wide_mask] == -math.inf).all()
        pointwise = pointwise_decode(emissions, mask)
        assert torch.equal(mapped(pointwise.paths), pointwise_decode(wide_e, wide_mask).paths[:, :turns])


def test_gradients_are_finite_and_zero_at_padding():
    generator = torch.Generator().manual_seed(9)
    for emissions, transitions, mask in trials(10, 8, integer=False):
        wide_e, wide_tr, wide_mask, _ = _embed(emissions, transitions, mask, 1, 1, generator)
        wide_e.requires_grad_(True)
        wide_tr.requires_grad_(True)
        log_z = log_partition(wide_e, wide_tr, wide_mask)
        grad_e, grad_tr = torch.autograd.grad(log_z.sum(), (wide_e, wide_tr))
        assert torch.isfinite(grad_e).all() and torch.isfinite(grad_tr).all()
        assert (grad_e[~wide_mask] == 0).all()
        pairs = wide_mask[:, :-1, :, None] & wide_mask[:, 1:, None, :]
        assert (grad_tr[~pairs] == 0).all()
        # second order: marginals are differentiable too
        posterior = marginals(wide_e, wide_tr, wide_mask)
        (second,) = torch.autograd.grad((posterior * posterior).sum(), wide_tr)
        assert torch.isfinite(second).all()


def test_single_turn_and_single_candidate():
    emissions = torch.tensor([[[1.5]], [[-2.0]]], dtype=torch.float64)
    transitions = torch.empty(2, 0, 1, 1, dtype=torch.float64)
    mask = torch.ones(2, 1, 1, dtype=torch.bool)
    decoded = viterbi(emissions, transitions, mask)
    assert decoded.paths.tolist() == [[0], [0]] and decoded.scores.tolist() == [1.5, -2.0]
    assert fixed_lag_viterbi(emissions, transitions, mask, 0).committed_through.tolist() == [0, 0]
    assert log_partition(emissions, transitions, mask).tolist() == [1.5, -2.0]
    assert marginals(emissions, transitions, mask).tolist() == [[[1.0]], [[1.0]]]
    # M = 1, T = 3: the only path
    emissions = torch.tensor([[[1.0], [2.0], [3.0]]], dtype=torch.float64)
    transitions = torch.full((1, 2, 1, 1), -0.5, dtype=torch.float64)
    mask = torch.ones(1, 3, 1, dtype=torch.bool)
    assert viterbi(emissions, transitions, mask).scores.item() == ((1.0 - 0.5) + 2.0 - 0.5) + 3.0
    assert log_partition(emissions, transitions, mask).item() == 5.0


def test_empty_batch():
    emissions = torch.empty(0, 2, 3, dtype=torch.float64)
    transitions = torch.empty(0, 1, 3, 3, dtype=torch.float64)
    mask = torch.empty(0, 2, 3, dtype=torch.bool)
    assert viterbi(emissions, transitions, mask).paths.shape == (0, 2)
    assert log_partition(emissions, transitions, mask).shape == (0,)


def test_inputs_are_not_modified():
    emissions, transitions, mask = next(trials(11, 1, integer=False, max_turns=4))
    emissions.requires_grad_(False)
    copies = [emissions.clone(), transitions.clone(), mask.clone()]
    viterbi(emissions, transitions, mask)
    locks = fixed_lag_viterbi(emissions, transitions, mask, 0).locks
    locks_copy = locks.clone()
    forward_scores(emissions, transitions, mask, locks)
    log_partition(emissions, transitions, mask)
    marginals(emissions, transitions, mask)
    pointwise_decode(emissions, mask)
    geodesic_viterbi(emissions, -transitions, mask)
    for before, after in zip(copies, (emissions, transitions, mask)):
        assert torch.equal(before.nan_to_num(7.0), after.nan_to_num(7.0))
    assert torch.equal(locks, locks_copy)


def test_float32_and_float64_give_the_same_paths():
    for emissions, transitions, mask in trials(12, 10, integer=False, batch=16, max_turns=6, max_candidates=5, tie_prob=0.0):
        double = viterbi(emissions, transitions, mask)
        single = viterbi(emissions.float(), transitions.float(), mask)
        assert torch.equal(double.paths, single.paths)
        assert single.scores.dtype == torch.float32
        torch.testing.assert_close(single.scores.double(), double.scores, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------- fixed lag


def test_fixed_lag_matches_the_literal_lock_procedure():
    for emissions, transitions, mask in trials(13, 20, integer=True, max_turns=5):
        turns = mask.shape[1]
        for lag in range(0, turns + 2):
            decoded = fixed_lag_viterbi(emissions, transitions, mask, lag)
            for b, length in enumerate(lengths_of(mask)):
                truth = literal_fixed_lag(emissions[b], transitions[b], mask[b], lag)
                assert_same_path(decoded.paths[b], truth.path, length)
                assert decoded.scores[b].item() == truth.score
                committed = length - lag - 1 if length - lag - 1 >= 0 else -1
                assert decoded.committed_through[b].item() == committed
                expected_locks = [truth.path[t] if t <= committed else -1 for t in range(turns)]
                assert decoded.locks[b].tolist() == expected_locks


def test_fixed_lag_scores_equal_path_scores_on_floats():
    for emissions, transitions, mask in trials(14, 15, integer=False, max_turns=5):
        for lag in (0, 1, 2):
            decoded = fixed_lag_viterbi(emissions, transitions, mask, lag)
            assert torch.equal(path_score(emissions, transitions, mask, decoded.paths), decoded.scores)
            assert (decoded.scores <= viterbi(emissions, transitions, mask).scores).all()


def test_fixed_lag_limits():
    for emissions, transitions, mask in trials(15, 15, integer=False, max_turns=5):
        turns = mask.shape[1]
        full = viterbi(emissions, transitions, mask)
        for lag in (turns - 1, turns, turns + 5, 10**9):
            long_lag = fixed_lag_viterbi(emissions, transitions, mask, lag)
            assert torch.equal(long_lag.paths, full.paths) and torch.equal(long_lag.scores, full.scores)
        # lag 0 = causal filtering: every turn is its prefix decode's final choice
        causal = fixed_lag_viterbi(emissions, transitions, mask, 0)
        for b, length in enumerate(lengths_of(mask)):
            locks = mask[b].clone()
            for t in range(length):
                prefix = locks.clone()
                prefix[t + 1 :] = False
                alpha = forward_scores(emissions[b : b + 1], transitions[b : b + 1], prefix.unsqueeze(0))[0, t]
                assert causal.paths[b, t].item() == int(alpha.argmax())
                locks[t] = False
                locks[t, causal.paths[b, t]] = True


def test_committed_turns_never_change_across_prefixes():
    for emissions, transitions, mask in trials(16, 10, integer=False, batch=1, max_turns=6):
        length = lengths_of(mask)[0]
        for lag in range(0, 3):
            history = []
            for prefix in range(1, length + 1):
                decoded = fixed_lag_viterbi(emissions[:, :prefix], transitions[:, : prefix - 1], mask[:, :prefix], lag)
                committed = decoded.committed_through[0].item()
                history.append(decoded.paths[0, : committed + 1].tolist())
            for earlier, later in zip(history, history[1:]):
                assert later[: len(earlier)] == earlier


def test_ranking_under_locks_tops_the_decoded_candidate():
    for emissions, transitions, mask in trials(17, 10, integer=True, max_turns=5):
        for lag in (0, 1, 2):
            decoded = fixed_lag_viterbi(emissions, transitions, mask, lag)
            alphas = forward_scores(emissions, transitions, mask, decoded.locks)
            last = torch.tensor(lengths_of(mask)) - 1
            finals = alphas[torch.arange(mask.shape[0]), last]
            best, index = finals.max(dim=-1)
            assert torch.equal(best, decoded.scores)
            assert torch.equal(index, decoded.paths[torch.arange(mask.shape[0]), last])


# ------------------------------------------------------------- other decoders


def test_pointwise_decode_is_the_exact_per_turn_argmax():
    # 1e16 + 0.5 and 1e16 + 1.0 both round to 1e16: max-plus with zero transitions sees a
    # tie the emissions do not have; pointwise_decode does not.
    emissions = torch.tensor([[[1e16, 0.0], [0.5, 1.0]]], dtype=torch.float64)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    zeros = -(0.0 * torch.ones(1, 1, 2, 2, dtype=torch.float64))
    assert viterbi(emissions, zeros, mask).paths.tolist() == [[0, 0]]
    decoded = pointwise_decode(emissions, mask)
    assert decoded.paths.tolist() == [[0, 1]]
    assert decoded.scores.item() == (1e16 - 0.0) + 1.0
    lagged = pointwise_decode(emissions, mask, fixed_lag=1)
    assert lagged.committed_through.tolist() == [0] and lagged.locks.tolist() == [[0, -1]]
    for emissions, _, mask in trials(18, 10, integer=True):
        decoded = pointwise_decode(emissions, mask)
        expected = torch.where(mask, emissions, -math.inf).argmax(dim=-1)
        assert torch.equal(decoded.paths, torch.where(mask.any(-1), expected, -1))


def test_geodesic_matches_brute_force():
    generator = torch.Generator().manual_seed(19)
    for _ in range(30):
        turns = int(torch.randint(1, 5, (1,), generator=generator))
        candidates = int(torch.randint(1, 4, (1,), generator=generator))
        emissions, distances, mask = random_trellis(
            3, turns, candidates, generator=generator, integer=True, tie_prob=0.5
        )
        decoded = geodesic_viterbi(emissions, distances, mask)
        for b, length in enumerate(lengths_of(mask)):
            path, distance, emission = geodesic_brute_force(emissions[b], distances[b], mask[b])
            assert_same_path(decoded.paths[b], path, length)
            assert decoded.distances[b].item() == distance
            assert decoded.emission_scores[b].item() == emission


def test_geodesic_is_the_large_beta_limit():
    for emissions, negative, mask in trials(20, 10, integer=True):
        distances = -negative
        geodesic = geodesic_viterbi(emissions, distances, mask)
        # with integer inputs, beta = 1000 makes one unit of distance outweigh any emission gain
        decoded = viterbi(emissions, -(1000.0 * torch.where(torch.isnan(distances), 0.0, distances)), mask)
        assert torch.equal(geodesic.paths, decoded.paths)


# --------------------------------------------------------------------- streaming


def _feed(state, emissions, transitions, mask, schedule=None):
    """Feed turns; ``schedule[b]`` lists the steps at which conversation b gets its next turn."""
    batch, turns, candidates = mask.shape
    if schedule is None:
        for t in range(turns):
            state.step(emissions[:, t], transitions[:, t - 1] if t else None, mask[:, t])
        return turns
    steps = max(max(s) for s in schedule if s) + 1
    position = [0] * batch
    for step in range(steps):
        e = torch.zeros(batch, candidates, dtype=emissions.dtype)
        tr = torch.full((batch, candidates, candidates), float("nan"), dtype=emissions.dtype)
        m = torch.zeros(batch, candidates, dtype=torch.bool)
        for b in range(batch):
            if step in schedule[b]:
                t = position[b]
                e[b], m[b] = emissions[b, t], mask[b, t]
                if t:
                    tr[b] = transitions[b, t - 1]
                position[b] += 1
        state.step(e, tr, m)
    return steps


def test_streaming_states_equal_batch_results():
    for emissions, transitions, mask in trials(21, 12, integer=False, batch=4, max_turns=5):
        batch, turns, candidates = mask.shape
        state = ViterbiState(batch, candidates)
        _feed(state, emissions, transitions, mask)
        streamed, full = state.backtrack(), viterbi(emissions, transitions, mask)
        assert torch.equal(streamed.paths, full.paths) and torch.equal(streamed.scores, full.scores)
        for lag in range(0, turns + 1):
            state = FixedLagState(batch, candidates, lag)
            _feed(state, emissions, transitions, mask)
            streamed, batch_result = state.backtrack(), fixed_lag_viterbi(emissions, transitions, mask, lag)
            for got, expected in zip(streamed, batch_result):
                assert torch.equal(got, expected)


def test_streaming_with_conversations_advancing_at_different_steps():
    rng = random.Random(22)
    for emissions, transitions, mask in trials(22, 10, integer=True, batch=4, max_turns=5):
        batch, turns, candidates = mask.shape
        schedule = []
        for length in lengths_of(mask):
            schedule.append(sorted(rng.sample(range(2 * turns + 1), length)))
        for lag in (None, 0, 1, 2):
            state = ViterbiState(batch, candidates) if lag is None else FixedLagState(batch, candidates, lag)
            steps = _feed(state, emissions, transitions, mask, schedule)
            streamed = state.backtrack()
            expected = viterbi(emissions, transitions, mask) if lag is None else fixed_lag_viterbi(
                emissions, transitions, mask, lag
            )
            assert streamed.paths.shape == (batch, steps)
            assert torch.equal(streamed.paths[:, :turns], expected.paths)
            assert (streamed.paths[:, turns:] == -1).all()
            assert torch.equal(streamed.scores, expected.scores)
            if lag is not None:
                assert torch.equal(streamed.committed_through, expected.committed_through)


def test_streaming_backtrack_between_steps_and_empty_state():
    emissions, transitions, mask = next(trials(23, 1, integer=True, batch=3, max_turns=4))
    batch, turns, candidates = mask.shape
    state = FixedLagState(batch, candidates, 1)
    empty = state.backtrack()
    assert empty.paths.shape == (batch, 0) and (empty.scores == -math.inf).all()
    for t in range(turns):
        state.step(emissions[:, t], transitions[:, t - 1] if t else None, mask[:, t])
        prefix = fixed_lag_viterbi(emissions[:, : t + 1], transitions[:, :t], mask[:, : t + 1], 1)
        got = state.backtrack()
        alive = mask[:, 0].any(-1)
        assert torch.equal(got.paths, prefix.paths)
        assert torch.equal(got.scores[alive], prefix.scores[alive])
    assert state.steps == turns and state.lengths.tolist() == lengths_of(mask)


def test_chain_backtrack_and_compact():
    backpointers = torch.tensor([[[0, 0], [1, 0], [0, 0], [0, 1]]])
    advanced = torch.tensor([[True, True, False, True]])
    per_step = chain.backtrack(backpointers, advanced, torch.tensor([1]))
    assert per_step.tolist() == [[0, 1, -1, 1]]
    assert chain.compact(per_step, advanced).tolist() == [[0, 1, 1, -1]]


# -------------------------------------------------------------------- validation


def _valid():
    emissions = torch.zeros(2, 3, 2, dtype=torch.float64)
    transitions = torch.zeros(2, 2, 2, 2, dtype=torch.float64)
    mask = torch.ones(2, 3, 2, dtype=torch.bool)
    return emissions, transitions, mask


def _case(change):
    emissions, transitions, mask = _valid()
    return change(emissions, transitions, mask)


def _set(tensor, index, value):
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


VALIDATION_CASES = {
    "emissions not a tensor": (lambda e, tr, m: ([[0.0]], tr, m), "torch.Tensor"),
    "emissions 2-D": (lambda e, tr, m: (e[0], tr, m), "shape (B, T, M)"),
    "integer emissions": (lambda e, tr, m: (e.long(), tr, m), "floating-point"),
    "no turns": (lambda e, tr, m: (e[:, :0], tr[:, :0], m[:, :0]), "at least one turn"),
    "float mask": (lambda e, tr, m: (e, tr, m.double()), "bool"),
    "mask shape": (lambda e, tr, m: (e, tr, m[:, :, :1]), "does not match"),
    "transition shape": (lambda e, tr, m: (e, tr[:, :1], m), "(B, T-1, M, M)"),
    "transition dtype": (lambda e, tr, m: (e, tr.float(), m), "dtype"),
    "nan emission": (lambda e, tr, m: (_set(e, (1, 2, 0), math.nan), tr, m), "emissions[b=1, t=2, m=0]"),
    "inf transition": (
        lambda e, tr, m: (e, _set(tr, (0, 1, 1, 0), -math.inf), m),
        "transitions[b=0, t=1, from=1, to=0]",
    ),
    "empty conversation": (lambda e, tr, m: (e, tr, _set(m, (1,), False)), "conversation b=1 has no candidates"),
    "gap": (lambda e, tr, m: (e, tr, _set(m, (0, 1), False)), "real turns must come first"),
}


@pytest.mark.parametrize("name", sorted(VALIDATION_CASES))
def test_validation_errors(name):
    change, words = VALIDATION_CASES[name]
    emissions, transitions, mask = _case(change)
    for function in (viterbi, log_partition, marginals, forward_scores):
        with pytest.raises(ValueError, match=re.escape(words)) as info:
            function(emissions, transitions, mask)
        assert isinstance(info.value, MapMatchedValueError)
    with pytest.raises(MapMatchedValueError, match=re.escape(words)):
        fixed_lag_viterbi(emissions, transitions, mask, 1)


def test_garbage_at_masked_positions_is_not_an_error():
    emissions, transitions, mask = _valid()
    mask = _set(mask, (0, 2, 1), False)
    emissions = _set(emissions, (0, 2, 1), math.nan)
    transitions = _set(transitions, (0, 1, 0, 1), math.inf)
    assert viterbi(emissions, transitions, mask).paths.tolist() == [[0, 0, 0], [0, 0, 0]]


def test_other_argument_errors():
    emissions, transitions, mask = _valid()
    for lag in (-1, 1.5, True, "1"):
        with pytest.raises(MapMatchedValueError, match="fixed_lag"):
            fixed_lag_viterbi(emissions, transitions, mask, lag)
    with pytest.raises(MapMatchedValueError, match=r"paths\[b=1, t=2\] = 5"):
        path_score(emissions, transitions, mask, torch.tensor([[0, 0, 0], [0, 1, 5]]))
    with pytest.raises(MapMatchedValueError, match=r"paths\[b=0, t=1\] = 1"):
        path_score(emissions, transitions, _set(mask, (0, 1, 1), False), torch.tensor([[0, 1, 0], [0, 1, 1]]))
    with pytest.raises(MapMatchedValueError, match="integer"):
        path_score(emissions, transitions, mask, torch.zeros(2, 3))
    with pytest.raises(MapMatchedValueError, match=r"locks\[b=0, t=0\] = -2"):
        forward_scores(emissions, transitions, mask, torch.tensor([[-2, -1, -1], [-1, -1, -1]]))
    with pytest.raises(MapMatchedValueError, match=r"gold\[b=1, t=0\] = 2"):
        log_likelihood(emissions, transitions, mask, torch.tensor([[0, -1, -1], [2, -1, -1]]))
    with pytest.raises(MapMatchedValueError, match="nonnegative"):
        geodesic_viterbi(emissions, _set(transitions, (1, 0, 0, 0), -1.0), mask)
    # entries after a conversation's end are ignored
    short = _set(mask, (1, 2), False)
    path_score(emissions, transitions, short, torch.tensor([[0, 0, 0], [0, 0, 99]]))


def test_nonfinite_accumulation_raises():
    emissions = torch.tensor([[[1.0], [1.0]], [[1e308], [1e308]]], dtype=torch.float64)
    transitions = torch.zeros(2, 1, 1, 1, dtype=torch.float64)
    mask = torch.ones(2, 2, 1, dtype=torch.bool)
    for call in (
        lambda: viterbi(emissions, transitions, mask),
        lambda: fixed_lag_viterbi(emissions, transitions, mask, 0),
        lambda: log_partition(emissions, transitions, mask),
        lambda: pointwise_decode(emissions, mask),
        lambda: forward_scores(emissions, transitions, mask),
    ):
        with pytest.raises(ValueError, match=f"{NONFINITE}.*b=\\[1\\]"):
            call()
    # pointwise: a non-chosen candidate overflowing to -inf raises too, like the standalone decoder
    emissions = torch.tensor([[[-1e308, math.nan], [-1e308, 5.0]]], dtype=torch.float64)
    mask = torch.tensor([[[True, False], [True, True]]])
    with pytest.raises(ValueError, match=NONFINITE):
        pointwise_decode(emissions, mask)
    with pytest.raises(ValueError, match=NONFINITE):
        viterbi(emissions, torch.zeros(1, 1, 2, 2, dtype=torch.float64), mask)


def test_streaming_validation():
    state = ViterbiState(2, 3)
    ok = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(MapMatchedValueError, match="shape"):
        state.step(torch.zeros(2, 2, dtype=torch.float64), None, ok)
    with pytest.raises(MapMatchedValueError, match="float64"):
        state.step(torch.zeros(2, 3), None, ok)
    with pytest.raises(MapMatchedValueError, match=r"emissions_t\[b=1, m=2\]"):
        state.step(torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, math.nan]], dtype=torch.float64), None, ok)
    state.step(torch.zeros(2, 3, dtype=torch.float64), None, ok)
    with pytest.raises(MapMatchedValueError, match="None"):
        state.step(torch.zeros(2, 3, dtype=torch.float64), None, ok)
    bad = torch.zeros(2, 3, 3, dtype=torch.float64)
    bad[1, 2, 0] = math.nan
    with pytest.raises(MapMatchedValueError, match=r"transitions_t\[b=1, from=2, to=0\]"):
        state.step(torch.zeros(2, 3, dtype=torch.float64), bad, ok)
    # a NaN into a masked candidate is ignored
    state.step(torch.zeros(2, 3, dtype=torch.float64), bad, torch.tensor([[True] * 3, [False, True, True]]))
    with pytest.raises(MapMatchedValueError, match="fixed_lag"):
        FixedLagState(2, 3, -1)
    with pytest.raises(MapMatchedValueError, match="num_candidates"):
        ViterbiState(2, 0)


# ------------------------------------------------------------------------ devices


def test_device_results_equal_cpu_results(device):
    for emissions, transitions, mask in trials(24, 6, integer=False, batch=6, max_turns=5, max_candidates=4):
        moved = [x.to(device) for x in (emissions, transitions, mask)]
        for cpu, other in (
            (viterbi(emissions, transitions, mask), viterbi(*moved)),
            (fixed_lag_viterbi(emissions, transitions, mask, 1), fixed_lag_viterbi(*moved, 1)),
            (pointwise_decode(emissions, mask), pointwise_decode(moved[0], moved[2])),
        ):
            for a, b in zip(cpu, other):
                assert b.device.type == device.type
                assert torch.equal(a, b.cpu())
        geodesic = geodesic_viterbi(emissions, -transitions, mask)
        for a, b in zip(geodesic, geodesic_viterbi(moved[0], -moved[1], moved[2])):
            assert torch.equal(a, b.cpu())
        torch.testing.assert_close(log_partition(*moved).cpu(), log_partition(emissions, transitions, mask))
        torch.testing.assert_close(marginals(*moved).cpu(), marginals(emissions, transitions, mask))
        state = FixedLagState(mask.shape[0], mask.shape[2], 1, device=device)
        _feed(state, *moved)
        for a, b in zip(fixed_lag_viterbi(emissions, transitions, mask, 1), state.backtrack()):
            assert torch.equal(a, b.cpu())


# --------------------------------------------------------- standalone parity


class DictGraph:
    """A fixture graph: exact pair distances from a dict; 0 on equal IDs."""

    def __init__(self, table, maximum_distance):
        self.table = table
        self.maximum_distance = maximum_distance

    def distance(self, a, b):
        return 0.0 if a == b else self.table[(a, b)]

    def neighborhood(self, chunk_id, radius):
        return ()


def _parity_batch(rng, batch, max_turns, max_candidates, integer):
    """Random conversations as DecoderCandidate trellises + one dict graph + tensors."""
    pool = [f"c{i}" for i in range(max_candidates + 2)]
    table = {
        (a, b): float(rng.randint(0, 4)) if integer else rng.choice([rng.uniform(0, 3), 1.0, 0.1 + 0.2])
        for a in pool
        for b in pool
        if a != b
    }
    graph = DictGraph(table, maximum_distance=4.0)
    trellises = []
    for _ in range(batch):
        trellis = []
        for _ in range(rng.randint(1, max_turns)):
            ids = rng.sample(pool, rng.randint(1, max_candidates))
            values = [
                float(rng.randint(-2, 2)) if integer else rng.choice([rng.gauss(0, 1), 0.5, 0.1 + 0.2]) for _ in ids
            ]
            trellis.append([DecoderCandidate(c, 3.0 * s, s) for c, s in zip(ids, values)])
        trellises.append(trellis)
    turns = max(len(t) for t in trellises)
    scores = torch.full((batch, turns, max_candidates), math.nan, dtype=torch.float64)
    distances = torch.full((batch, max(turns - 1, 0), max_candidates, max_candidates), math.nan, dtype=torch.float64)
    mask = torch.zeros(batch, turns, max_candidates, dtype=torch.bool)
    for b, trellis in enumerate(trellises):
        for t, turn in enumerate(trellis):
            for m, candidate in enumerate(turn):
                scores[b, t, m] = candidate.normalized_score
                mask[b, t, m] = True
                if t:
                    for j, previous in enumerate(trellis[t - 1]):
                        distances[b, t - 1, j, m] = graph.distance(previous.chunk_id, candidate.chunk_id)
    return trellises, graph, scores, distances, mask


class TestStandaloneParity:
    """Paths, committed turns and float64 scores equal the standalone decoder's (==)."""

    @pytest.mark.parametrize("integer", [True, False], ids=["integer", "float"])
    @pytest.mark.parametrize("seed", range(3))
    def test_decode_matches_standalone(self, seed, integer):
        rng = random.Random(100 * seed + integer)
        decoder = StandaloneDecoder()
        trellises, graph, scores, distances, mask = _parity_batch(rng, 6, 5, 3, integer)
        turns = mask.shape[1]
        for lam, beta in ((1.0, 1.0), (0.5, 0.25), (2.0, 0.0), (0.0, 3.0), (1.3, 0.7)):
            model = MapMatchedModel(lam, beta)
            for lag in [None] + list(range(0, turns + 2)):
                decoded = model.decode(scores, distances, mask, fixed_lag=lag)
                ranked_alphas = None
                if beta != 0.0:
                    emissions, transitions = model.emissions(scores, mask), model.transitions(distances, mask)
                    ranked_alphas = forward_scores(emissions, transitions, mask, getattr(decoded, "locks", None))
                for b, trellis in enumerate(trellises):
                    path, ranking = decoder.decode_ranked(
                        trellis, graph, emission_weight=lam, transition_weight=beta, fixed_lag=lag
                    )
                    chosen = decoded.paths[b].tolist()
                    assert tuple(trellis[t][chosen[t]].chunk_id for t in range(len(trellis))) == path.chunk_ids
                    assert all(index == -1 for index in chosen[len(trellis) :])
                    assert decoded.scores[b].item() == path.total_score
                    if lag is not None:
                        committed = decoded.committed_through[b].item()
                        assert (None if committed < 0 else committed) == path.committed_through_index
                    if ranked_alphas is not None:
                        finals = ranked_alphas[b, len(trellis) - 1].tolist()
                        ours = sorted(
                            ((trellis[-1][m].chunk_id, s) for m, s in enumerate(finals[: len(trellis[-1])]) if s > -math.inf),
                            key=lambda item: (-item[1], item[0]),
                        )
                        assert ours == [(item.chunk_id, item.trajectory_score) for item in ranking]

    def test_single_turn_single_candidate_and_repeated_ids(self):
        decoder = StandaloneDecoder()
        graph = DictGraph({("a", "b"): 2.0, ("b", "a"): 1.0}, maximum_distance=4.0)
        trellis = [[DecoderCandidate("a", 1.0, 0.5)], [DecoderCandidate("b", 1.0, 0.25), DecoderCandidate("a", 0.0, 0.0)]]
        scores = torch.tensor([[[0.5, math.nan], [0.25, 0.0]]], dtype=torch.float64)
        distances = torch.tensor([[[[2.0, 0.0], [math.nan, math.nan]]]], dtype=torch.float64)
        mask = torch.tensor([[[True, False], [True, True]]])
        for lag in (None, 0, 1, 2):
            expected = decoder.decode(trellis, graph, emission_weight=1.0, transition_weight=0.5, fixed_lag=lag)
            decoded = MapMatchedModel(1.0, 0.5).decode(scores, distances, mask, fixed_lag=lag)
            assert decoded.paths.tolist() == [[0, 1]] and expected.chunk_ids == ("a", "a")
            assert decoded.scores.item() == expected.total_score
        single = decoder.decode([[DecoderCandidate("z", 0.0, 0.0)]], graph)
        decoded = MapMatchedModel().decode(
            torch.zeros(1, 1, 1, dtype=torch.float64),
            torch.empty(1, 0, 1, 1, dtype=torch.float64),
            torch.ones(1, 1, 1, dtype=torch.bool),
        )
        assert decoded.paths.tolist() == [[0]] and decoded.scores.item() == single.total_score


def test_log_likelihood_bool_gold_equals_index_gold():
    generator = torch.Generator().manual_seed(17)
    emissions = torch.randn(3, 4, 3, generator=generator, dtype=torch.float64)
    transitions = torch.randn(3, 3, 3, 3, generator=generator, dtype=torch.float64)
    mask = torch.ones(3, 4, 3, dtype=torch.bool)
    gold = torch.tensor([[0, -1, 2, 1], [2, 2, -1, -1], [-1, -1, -1, 0]])
    one_hot = torch.nn.functional.one_hot(gold.clamp_min(0), 3).bool() & (gold >= 0).unsqueeze(-1)
    expected = log_likelihood(emissions, transitions, mask, gold)
    assert torch.allclose(log_likelihood(emissions, transitions, mask, one_hot), expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="mask's shape"):
        log_likelihood(emissions, transitions, mask, one_hot[:, :2])


@pytest.mark.slow
def test_compiled_max_plus_step_is_bit_identical():
    from mapmatched_torch.kernels.chain import use_compiled_kernels

    generator = torch.Generator().manual_seed(23)
    for dtype in (torch.float64, torch.float32):
        emissions = torch.randint(-2, 3, (64, 6, 5), generator=generator).to(dtype)  # integers: many exact ties
        transitions = torch.randint(-3, 1, (64, 5, 5, 5), generator=generator).to(dtype)
        mask = torch.rand(64, 6, 5, generator=generator) < 0.8
        mask[:, 0] = True
        mask[:, :, 0] = True
        eager = viterbi(emissions, transitions, mask), fixed_lag_viterbi(emissions, transitions, mask, 1)
        use_compiled_kernels(True)
        try:
            fused = viterbi(emissions, transitions, mask), fixed_lag_viterbi(emissions, transitions, mask, 1)
        finally:
            use_compiled_kernels(False)
        for a, b in zip(eager, fused):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
