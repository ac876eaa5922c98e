"""The one chain dynamic program (kernels/chain.py) on clean inputs, against brute force.

These call :mod:`mapmatched_torch.kernels.chain` directly (no validation layer):
forward / backtrack in max-plus and log, fixed-lag commitment against the lock
procedure done by enumeration, commit_tail, compact, and inactive turns.
"""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.kernels import chain
from mapmatched_torch.kernels.semiring import LEXICOGRAPHIC, LOG, MAX_PLUS
from mapmatched_torch.testing import enumerate_paths, random_trellis

# shapes of the small trellises: (B, T, M)
SHAPES = [(6, 1, 3), (8, 4, 3), (5, 5, 2), (4, 3, 4)]


def clean_case(batch, turns, width, seed, integer=True):
    """A padded random trellis with 0.0 written at masked positions (the chain's contract)."""
    generator = torch.Generator().manual_seed(seed)
    case = random_trellis(batch, turns, width, generator=generator, integer=integer, fill=0.0)
    return case.emissions, -case.distances, case.mask


def decode(emissions, transitions, mask, lag=None):
    """forward + backtrack of the max-plus chain -> (paths (B, T), scores (B,), Forward)."""
    out = chain.forward(MAX_PLUS, emissions, transitions, mask, lag=lag)
    final, last = MAX_PLUS.sum(out.alphas[:, -1], dim=1)
    return chain.backtrack(out.backpointers, mask.any(dim=-1), last), final, out


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_backtrack_find_the_brute_force_best_path(shape):
    emissions, transitions, mask = clean_case(*shape, seed=sum(shape))
    paths, final, out = decode(emissions, transitions, mask)
    assert not bool(out.nonfinite.any()) and out.locks is None
    for b in range(shape[0]):
        oracle = enumerate_paths(emissions[b], transitions[b], mask[b])
        length = len(oracle.path)
        assert final[b].item() == oracle.score  # bit for bit
        assert paths[b, :length].tolist() == list(oracle.path)  # integer inputs: the tie rule too
        assert paths[b, length:].tolist() == [-1] * (shape[1] - length)


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_in_the_log_semiring_gives_the_brute_force_partition(shape):
    emissions, transitions, mask = clean_case(*shape, seed=10 + sum(shape), integer=False)
    out = chain.forward(LOG, emissions, transitions, mask)
    assert out.backpointers is None
    log_z, _ = LOG.sum(out.alphas[:, -1], dim=1)
    expected = [enumerate_paths(emissions[b], transitions[b], mask[b]).log_partition for b in range(shape[0])]
    assert log_z.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def brute_force_locks(emissions, transitions, mask, lag):
    """docs/spec.md section 5's lock procedure, by enumeration: after turn t >= lag,
    turn t - lag is locked to the best path of turns 0..t under the earlier locks."""
    length = int(mask.any(dim=-1).sum())
    allowed, locks = mask.clone(), [-1] * mask.shape[0]
    for t in range(lag, length):
        prefix = allowed.clone()
        prefix[t + 1 :] = False
        locks[t - lag] = enumerate_paths(emissions, transitions, prefix).path[t - lag]
        allowed[t - lag] = False
        allowed[t - lag, locks[t - lag]] = True
    return locks, enumerate_paths(emissions, transitions, allowed)


@pytest.mark.parametrize("lag", [0, 1, 2, 5])
def test_fixed_lag_forward_commits_what_the_lock_procedure_commits(lag):
    emissions, transitions, mask = clean_case(7, 5, 3, seed=20 + lag)
    paths, final, out = decode(emissions, transitions, mask, lag=lag)
    for b in range(7):
        locks, oracle = brute_force_locks(emissions[b], transitions[b], mask[b], lag)
        assert out.locks[b].tolist() == locks
        assert final[b].item() == oracle.score
        assert paths[b, : len(oracle.path)].tolist() == list(oracle.path)


def test_commit_tail_without_commit_changes_nothing():
    emissions, transitions, mask = clean_case(3, 3, 3, seed=30, integer=False)
    out = chain.forward(MAX_PLUS, emissions, transitions, mask)
    alphas, backpointers = list(out.alphas.unbind(1)), list(out.backpointers.unbind(1))
    commit = torch.tensor([False, True, False])
    tail = chain.commit_tail(
        MAX_PLUS, alphas, backpointers, emissions.unbind(1), transitions.unbind(1), mask.unbind(1), commit
    )
    assert tail.lock[0].item() == tail.lock[2].item() == -1 and tail.lock[1].item() >= 0
    for slot in range(3):
        for b in (0, 2):
            assert torch.equal(tail.alphas[slot][b], alphas[slot][b])
            assert torch.equal(tail.backpointers[slot][b], backpointers[slot][b])
    assert torch.equal(tail.allowed[0], mask[0, 0]) and int(tail.allowed[1].sum()) == 1
    # the committed row's newest forward scores: those of the trellis with slot 0 locked
    locked = mask[1].clone()
    locked[0] = False
    locked[0, tail.lock[1]] = True
    again = chain.forward(MAX_PLUS, emissions[1:2], transitions[1:2], locked.unsqueeze(0))
    assert torch.equal(tail.alphas[-1][1], again.alphas[0, -1])


def test_inactive_steps_carry_the_scores_and_backtrack_skips_them():
    """Conversations advancing at different steps (streaming): an empty step is a no-op."""
    emissions, transitions, mask = clean_case(4, 3, 3, seed=40)
    gaps = torch.tensor([[True, False, True, True, False], [False, True, True, True, True],
                         [True, True, True, False, False], [True, False, True, False, True]])
    lengths = mask.any(dim=-1).sum(dim=1)
    advanced = gaps & (gaps.cumsum(dim=1) <= lengths.unsqueeze(1))
    # spread each row's turns over the steps where it advances; transitions follow the turns
    turn_of = torch.cumsum(advanced, dim=1) - 1
    steps = advanced.shape[1]
    spread_e = torch.zeros(4, steps, 3, dtype=torch.float64)
    spread_m = torch.zeros(4, steps, 3, dtype=torch.bool)
    spread_t = torch.zeros(4, steps - 1, 3, 3, dtype=torch.float64)
    for b in range(4):
        for s in range(steps):
            if advanced[b, s]:
                spread_e[b, s], spread_m[b, s] = emissions[b, turn_of[b, s]], mask[b, turn_of[b, s]]
                if turn_of[b, s] > 0:
                    spread_t[b, s - 1] = transitions[b, turn_of[b, s] - 1]
    out = chain.forward(MAX_PLUS, spread_e, spread_t, spread_m)
    for b, s in (~advanced[:, 1:]).nonzero().tolist():
        assert torch.equal(out.alphas[b, s + 1], out.alphas[b, s])  # carried unchanged
    _, last = MAX_PLUS.sum(out.alphas[:, -1], dim=1)
    per_step = chain.backtrack(out.backpointers, advanced, last)
    assert bool(((per_step == -1) == ~advanced).all())
    paths, _, _ = decode(emissions, transitions, mask)
    assert torch.equal(chain.compact(per_step, advanced)[:, :3], paths)


def test_chain_step_flags_an_overflow_and_leaves_inactive_rows_alone():
    alpha = torch.tensor([[1e308, 0.0], [5.0, 6.0]], dtype=torch.float64)
    started = torch.tensor([True, True])
    emissions_t = torch.tensor([[1e308, 0.0], [9.0, 9.0]], dtype=torch.float64)
    transitions_t = torch.zeros(2, 2, 2, dtype=torch.float64)
    allowed = torch.tensor([[True, False], [False, False]])  # row 1 has no candidate: inactive
    step = chain.chain_step(MAX_PLUS, alpha, started, emissions_t, transitions_t, allowed)
    assert step.nonfinite.tolist() == [True, False]
    assert step.alpha[0].tolist() == [math.inf, -math.inf] and step.alpha[1].tolist() == [5.0, 6.0]
    # a first turn: no transitions, backpointers 0, the conversation starts
    first = chain.chain_step(MAX_PLUS, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([False]),
                             torch.tensor([[1.0, 2.0]], dtype=torch.float64), None, torch.tensor([[True, True]]))
    assert first.alpha.tolist() == [[1.0, 2.0]] and first.backpointers.tolist() == [[0, 0]] and bool(first.started[0])


def test_forward_runs_the_lexicographic_semiring_on_pairs():
    # primary = -distance, secondary = emission: least distance first, then most emission
    emissions = torch.tensor([[[[0.0, 1.0], [0.0, 5.0]], [[0.0, 0.0], [0.0, 0.0]]]], dtype=torch.float64)
    moves = torch.tensor([[[[[0.0, 0.0], [-1.0, 0.0]], [[-1.0, 0.0], [0.0, 0.0]]]]], dtype=torch.float64)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    out = chain.forward(LEXICOGRAPHIC, emissions, moves, mask)
    value, last = LEXICOGRAPHIC.sum(out.alphas[:, -1], dim=1)
    assert value.tolist() == [[0.0, 5.0]]
    assert chain.backtrack(out.backpointers, mask.any(dim=-1), last).tolist() == [[1, 1]]


def test_compact_moves_advanced_entries_to_the_front_in_order():
    per_step = torch.tensor([[-1, 4, -1, 7, 2], [3, -1, -1, -1, -1], [-1, -1, -1, -1, -1]])
    advanced = per_step >= 0
    expected = [[v for v in row if v >= 0] + [-1] * sum(v < 0 for v in row) for row in per_step.tolist()]
    assert chain.compact(per_step, advanced).tolist() == expected


def test_lift_appends_singleton_dimensions():
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert chain.lift(mask, torch.zeros(2, 3, 2)).shape == (2, 3, 1)
    assert chain.lift(mask, torch.zeros(2, 3)) is mask
