"""The fused decode kernels equal the torch path bit for bit (paths, scores, locks, errors)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.kernels import decode, fused
from mapmatched_torch.testing import BREAKAGES, broken_trellis, fused_kernels_off

pytest.importorskip("numba")

LAGS = (None, 0, 1, 2, 5)


torch_path = fused_kernels_off  # decode with the torch path inside the block


def reference(emissions, transitions, mask, lag):
    with torch_path():
        if lag is None:
            result = decode.viterbi(emissions, transitions, mask)
            return result.paths, result.scores, None
        result = decode.fixed_lag_viterbi(emissions, transitions, mask, lag)
        return result.paths, result.scores, result.locks


def random_trellis(generator, dtype, *, integer=True, garbage=float("nan")):
    """A padded batch with holes, varied lengths, NaN garbage at padding and, with
    ``integer``, many exact ties."""
    batch = int(torch.randint(1, 40, (), generator=generator))
    turns = int(torch.randint(1, 7, (), generator=generator))
    candidates = int(torch.randint(1, 6, (), generator=generator))
    if integer:
        emissions = torch.randint(-3, 3, (batch, turns, candidates), generator=generator).to(dtype)
        transitions = -torch.randint(0, 3, (batch, turns - 1, candidates, candidates), generator=generator).to(dtype)
    else:
        emissions = torch.randn(batch, turns, candidates, generator=generator, dtype=dtype)
        transitions = -torch.rand(batch, turns - 1, candidates, candidates, generator=generator, dtype=dtype)
    mask = torch.rand(batch, turns, candidates, generator=generator) < 0.75
    mask[:, :, 0] |= torch.rand(batch, turns, generator=generator) < 0.5
    lengths = torch.randint(1, turns + 1, (batch,), generator=generator)
    mask &= torch.arange(turns)[None, :, None] < lengths[:, None, None]
    mask[:, 0, 0] |= ~mask[:, 0].any(dim=1)
    # real turns first: cut each row at its first empty turn
    alive = mask.any(dim=-1).long().cumprod(dim=1).bool()
    mask &= alive.unsqueeze(-1)
    emissions = torch.where(mask, emissions, garbage)
    pairs = mask[:, :-1, :, None] & mask[:, 1:, None, :]
    transitions = torch.where(pairs, transitions, garbage)
    return emissions, transitions, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("integer", [True, False])
def test_fused_equals_torch_path_on_random_trellises(dtype, integer):
    generator = torch.Generator().manual_seed(7 + integer)
    for _ in range(40):
        emissions, transitions, mask = random_trellis(generator, dtype, integer=integer)
        for lag in LAGS:
            paths, scores, locks, lengths = fused.max_plus(emissions, transitions, mask, lag)
            expected_paths, expected_scores, expected_locks = reference(emissions, transitions, mask, lag)
            assert torch.equal(paths, expected_paths)
            assert torch.equal(scores, expected_scores)
            assert torch.equal(lengths, mask.any(dim=-1).sum(dim=1))
            if lag is None:
                assert bool((locks == -1).all())
            else:
                assert torch.equal(locks, expected_locks)


def test_fused_reaches_the_brute_force_optimum():
    """Small trellises: the score is the best of all M^T paths and the path attains it
    (parity with the standalone decoder runs through the default path in test_decode)."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(30):
        emissions = torch.randint(-2, 3, (1, 4, 3), generator=generator).double()
        distances = torch.randint(0, 3, (1, 3, 3, 3), generator=generator).double()
        mask = torch.ones(1, 4, 3, dtype=torch.bool)
        paths, scores, _, _ = fused.max_plus(emissions, -distances, mask, None)

        def total(path):
            emission = sum(emissions[0, t, path[t]].item() for t in range(4))
            return emission - sum(distances[0, t, path[t], path[t + 1]].item() for t in range(3))

        assert scores.item() == max(total(path) for path in itertools.product(range(3), repeat=4))
        assert total(paths[0].tolist()) == scores.item()


def test_one_turn_one_candidate_and_empty_batch():
    for batch, turns, candidates in ((1, 1, 1), (3, 1, 4), (0, 3, 2), (2, 5, 1)):
        emissions = torch.randn(batch, turns, candidates)
        transitions = torch.randn(batch, turns - 1, candidates, candidates)
        mask = torch.ones(batch, turns, candidates, dtype=torch.bool)
        for lag in LAGS:
            paths, scores, locks, _ = fused.max_plus(emissions, transitions, mask, lag)
            expected_paths, expected_scores, expected_locks = reference(emissions, transitions, mask, lag)
            assert torch.equal(paths, expected_paths) and torch.equal(scores, expected_scores)
            if lag is not None:
                assert torch.equal(locks, expected_locks)


def _message(function):
    with pytest.raises(MapMatchedValueError) as caught:
        function()
    return str(caught.value)


@pytest.mark.parametrize("lag", [None, 1])
@pytest.mark.parametrize("breakage", BREAKAGES)
def test_invalid_trellises_raise_the_torch_paths_message(breakage, lag):
    emissions, transitions, mask = broken_trellis(breakage)
    with torch_path():
        expected = _message(lambda: reference(emissions, transitions, mask, lag))
    assert _message(lambda: fused.max_plus(emissions, transitions, mask, lag)) == expected


def test_masked_garbage_never_flags_or_changes_a_result():
    emissions = torch.tensor([[[1.0, float("inf")], [0.0, float("nan")]]])
    transitions = torch.tensor([[[[0.0, float("nan")], [float("-inf"), float("inf")]]]])
    mask = torch.tensor([[[True, False], [True, False]]])
    paths, scores, _, _ = fused.max_plus(emissions, transitions, mask, None)
    assert paths.tolist() == [[0, 0]] and scores.tolist() == [1.0]


def test_does_not_apply_to_gradients_other_dtypes_or_when_disabled():
    emissions = torch.zeros(2, 3, 2, requires_grad=True)
    transitions = torch.zeros(2, 2, 2, 2)
    mask = torch.ones(2, 3, 2, dtype=torch.bool)
    assert fused.max_plus(emissions, transitions, mask, None) is None
    assert fused.max_plus(emissions.detach().half(), transitions.half(), mask, None) is None
    with torch_path():
        assert fused.max_plus(emissions.detach(), transitions, mask, None) is None
    assert fused.max_plus(emissions.detach(), transitions, mask, None) is not None


def test_non_contiguous_inputs_and_torch_threads_are_kept():
    generator = torch.Generator().manual_seed(11)
    emissions = torch.randn(64, 5, 3, generator=generator)
    distances = torch.rand(5, 3, 3, generator=generator)
    transitions = (-distances)[None, :4].expand(64, 4, 3, 3)  # a broadcast table: stride 0
    mask = torch.ones(64, 5, 3, dtype=torch.bool)
    threads = torch.get_num_threads()
    paths, scores, _, _ = fused.max_plus(emissions.transpose(0, 0), transitions, mask, None)
    assert torch.get_num_threads() == threads
    expected_paths, expected_scores, _ = reference(emissions, transitions.contiguous(), mask, None)
    assert torch.equal(paths, expected_paths) and torch.equal(scores, expected_scores)


# --------------------------------------------------------------------- forward scores


def reference_forward(emissions, transitions, mask, locks=None):
    with torch_path():
        return decode.forward_scores(emissions, transitions, mask, locks)


def reference_online(emissions, transitions, mask, lag):
    from mapmatched_torch.eval.methods import online_forward_scores

    with torch_path():
        return online_forward_scores(emissions, transitions, mask, lag)


def random_locks(generator, mask):
    """(B, T) locks: -1 or a real candidate at real turns, garbage after the end."""
    batch, turns, candidates = mask.shape
    picks = torch.rand(batch, turns, candidates, generator=generator).masked_fill(~mask, -1.0).argmax(dim=-1)
    locked = torch.rand(batch, turns, generator=generator) < 0.4
    locks = torch.where(locked, picks, -1)
    return torch.where(mask.any(dim=-1), locks, 99)  # padding turns: ignored, even out of range


def same_bits(actual, expected):
    """Equal values, -inf at the same places, and the same signs of zero."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected)
    assert torch.equal(torch.signbit(actual), torch.signbit(expected))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("integer", [True, False])
def test_fused_forward_scores_equal_the_torch_path(dtype, integer):
    """Randomized, padded (NaN garbage), ties (integer scores), with and without locks."""
    generator = torch.Generator().manual_seed(17 + integer)
    for _ in range(40):
        emissions, transitions, mask = random_trellis(generator, dtype, integer=integer)
        for locks in (None, random_locks(generator, mask)):
            scores = fused.max_plus_forward(emissions, transitions, mask, locks)
            same_bits(scores, reference_forward(emissions, transitions, mask, locks))
            same_bits(decode.forward_scores(emissions, transitions, mask, locks), scores)  # the default dispatch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("integer", [True, False])
def test_fused_online_scores_equal_the_torch_path(dtype, integer):
    """The harness's online rankings: fixed-lag locks, locked scores, L unlocked steps, in one pass."""
    from mapmatched_torch.eval.methods import online_forward_scores

    generator = torch.Generator().manual_seed(29 + integer)
    for _ in range(40):
        emissions, transitions, mask = random_trellis(generator, dtype, integer=integer)
        for lag in LAGS:
            scores = fused.online_forward_scores(emissions, transitions, mask, lag)
            same_bits(scores, reference_online(emissions, transitions, mask, lag))
            same_bits(online_forward_scores(emissions, transitions, mask, lag), scores)


def test_forward_one_turn_one_candidate_and_empty_batch():
    generator = torch.Generator().manual_seed(5)
    for batch, turns, candidates in ((1, 1, 1), (3, 1, 4), (0, 3, 2), (2, 5, 1), (40, 1, 1)):
        emissions = torch.randn(batch, turns, candidates, generator=generator, dtype=torch.float64)
        transitions = torch.randn(batch, turns - 1, candidates, candidates, generator=generator, dtype=torch.float64)
        mask = torch.ones(batch, turns, candidates, dtype=torch.bool)
        locks = torch.zeros(batch, turns, dtype=torch.long)
        for given in (None, locks):
            same_bits(fused.max_plus_forward(emissions, transitions, mask, given),
                      reference_forward(emissions, transitions, mask, given))
        for lag in LAGS:
            same_bits(fused.online_forward_scores(emissions, transitions, mask, lag),
                      reference_online(emissions, transitions, mask, lag))


def test_forward_reaches_the_brute_force_optimum_under_locks():
    """alpha[t, i] is the best score of a prefix path ending at i that passes every lock."""
    generator = torch.Generator().manual_seed(13)
    for _ in range(20):
        emissions = torch.randint(-2, 3, (1, 4, 3), generator=generator).double()
        transitions = -torch.randint(0, 3, (1, 3, 3, 3), generator=generator).double()
        mask = torch.ones(1, 4, 3, dtype=torch.bool)
        locks = torch.tensor([[-1, 2, -1, 0]])
        scores = fused.max_plus_forward(emissions, transitions, mask, locks)
        for t in range(4):
            for i in range(3):
                totals = []
                for path in itertools.product(range(3), repeat=t + 1):
                    if path[-1] != i or any(locks[0, s] >= 0 and path[s] != locks[0, s] for s in range(t + 1)):
                        continue
                    total = emissions[0, 0, path[0]].item()
                    for s in range(1, t + 1):
                        total = (total + transitions[0, s - 1, path[s - 1], path[s]].item()) + emissions[0, s, path[s]].item()
                    totals.append(total)
                assert scores[0, t, i].item() == (max(totals) if totals else -float("inf"))


@pytest.mark.parametrize("breakage", BREAKAGES + ("lock_out_of_range", "lock_masked"))
def test_forward_invalid_inputs_raise_the_torch_paths_message(breakage):
    emissions, transitions, mask = broken_trellis(None if breakage.startswith("lock") else breakage)
    locks = torch.full((3, 4), -1, dtype=torch.long)
    if breakage == "lock_out_of_range":
        locks[2, 3] = 2
    elif breakage == "lock_masked":
        mask[0, 1, 1] = False
        locks[0, 1] = 1
    expected = _message(lambda: reference_forward(emissions, transitions, mask, locks))
    assert _message(lambda: fused.max_plus_forward(emissions, transitions, mask, locks)) == expected
    if not breakage.startswith("lock"):
        for lag in (None, 0, 1):
            expected = _message(lambda: reference_online(emissions, transitions, mask, lag))
            assert _message(lambda: fused.online_forward_scores(emissions, transitions, mask, lag)) == expected


def test_overflow_at_a_locked_out_candidate_is_ignored_like_the_torch_path():
    emissions = torch.tensor([[[0.0, 3e38], [0.0, 3e38]]])
    transitions = torch.zeros(1, 1, 2, 2)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    locks = torch.tensor([[0, 0]])
    scores = fused.max_plus_forward(emissions, transitions, mask, locks)
    same_bits(scores, reference_forward(emissions, transitions, mask, locks))
    assert scores.tolist() == [[[0.0, -float("inf")], [0.0, -float("inf")]]]


def test_forward_leaves_bad_lock_tensors_and_gradients_to_the_torch_path():
    emissions = torch.zeros(2, 3, 2)
    transitions = torch.zeros(2, 2, 2, 2)
    mask = torch.ones(2, 3, 2, dtype=torch.bool)
    assert fused.max_plus_forward(emissions, transitions, mask, torch.zeros(2, 3)) is None  # float locks
    assert fused.max_plus_forward(emissions, transitions, mask, torch.zeros(2, 2, dtype=torch.long)) is None
    assert fused.max_plus_forward(emissions.requires_grad_(), transitions, mask) is None
    with torch_path():
        assert fused.online_forward_scores(emissions.detach(), transitions, mask, 1) is None
    with pytest.raises(MapMatchedValueError, match="fixed_lag"):
        fused.online_forward_scores(emissions.detach(), transitions, mask, -1)


def test_a_cpu_server_starts_numba_when_built():
    """numba_runtime.warm(): a fresh process's server pays numba's start when built, once."""
    import subprocess
    import sys

    pytest.importorskip("numba")
    code = (
        "from mapmatched_torch.kernels import numba_runtime\n"
        "from mapmatched_torch.graph import TensorCorpusGraph\n"
        "from mapmatched_torch.serving import MapMatchedServer\n"
        "assert not numba_runtime._warmed\n"
        "MapMatchedServer(TensorCorpusGraph.from_edges([('a', 'b', 0.5)]), candidate_limit=2)\n"
        "assert numba_runtime._warmed\n"
        "assert numba_runtime.warm() is True\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
