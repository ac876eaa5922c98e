"""The Triton kernels equal the torch path: max-plus bit for bit, the log semiring
within the stated bounds.

Without a GPU they run under Triton's interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported); with one, the same tests run the
compiled kernels on CUDA tensors. The interpreter runs program instances one after
another in numpy, so the trellises here are small.
"""

from __future__ import annotations

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.kernels import decode, fused
from mapmatched_torch.kernels.backend import use_backend
from mapmatched_torch.testing import BREAKAGES, broken_trellis, enumerate_paths, random_slot_run, random_trellis

pytest.importorskip("triton")
# the interpreter evaluates masked-out lanes too (NaN garbage, -inf - -inf) and numpy warns
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

LAGS = (None, 0, 1, 3)
#: |triton - torch path| <= TOLERANCE * (1 + |torch path|) for the log semiring
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5}


@pytest.fixture
def kernels(monkeypatch):
    """Run the block's kernels on the Triton backend, counting the launches of its
    max-plus and log kernels (a test that fell back to the torch path would not count)."""
    from mapmatched_torch.kernels import _triton_log, _triton_max_plus

    launches = {"max_plus": 0, "log": 0}

    def counted(module, name, key):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            launches[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(_triton_max_plus, "decode", "max_plus")
    counted(_triton_max_plus, "forward_scores", "max_plus")
    counted(_triton_log, "log_partition", "log")
    counted(_triton_log, "marginals", "log")
    with use_backend("triton"):
        yield launches


def torch_path(function, *args):
    with use_backend("torch"):
        return function(*args)


def decoded(emissions, transitions, mask, lag):
    if lag is None:
        result = decode.viterbi(emissions, transitions, mask)
        return result.paths, result.scores, None
    result = decode.fixed_lag_viterbi(emissions, transitions, mask, lag)
    return result.paths, result.scores, result.locks


def assert_decodes_like_the_torch_path(emissions, transitions, mask, lag):
    """Paths, scores (bit for bit, signs of zero too) and, with a lag, locks equal the torch path's."""
    paths, scores, locks = decoded(emissions, transitions, mask, lag)
    expected_paths, expected_scores, expected_locks = torch_path(decoded, emissions, transitions, mask, lag)
    assert torch.equal(paths, expected_paths)
    same_bits(scores, expected_scores)
    if lag is not None:
        assert torch.equal(locks, expected_locks)


def same_bits(actual, expected):
    """Equal values, -inf at the same places, and the same signs of zero."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.device == expected.device
    assert torch.equal(actual, expected)
    assert torch.equal(torch.signbit(actual), torch.signbit(expected))


def close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    bound = TOLERANCE[dtype] * (1 + expected.abs())
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(actual))
    assert bool(((actual - expected).abs()[finite] <= bound[finite]).all()), (actual - expected).abs().max()


def trellis(seed, device, dtype, *, batch=12, turns=5, candidates=5, integer=True):
    """A padded batch (NaN garbage at padding), with exact ties when ``integer``."""
    generator = torch.Generator().manual_seed(seed)
    made = random_trellis(batch, turns, candidates, generator=generator, dtype=dtype, device=device, integer=integer)
    return made.emissions, -made.distances, made.mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("integer", [True, False])
def test_viterbi_and_fixed_lag_equal_the_torch_path_bit_for_bit(kernels, device, dtype, integer):
    for seed in range(3):
        emissions, transitions, mask = trellis(seed, device, dtype, integer=integer, candidates=3 + 2 * seed)
        for lag in LAGS:
            assert_decodes_like_the_torch_path(emissions, transitions, mask, lag)
    assert kernels["max_plus"] == 3 * len(LAGS)


def test_ties_go_to_the_first_index_and_zeros_keep_their_sign(kernels, device):
    """Every score equal: each turn's first candidate wins; -0.0 + -0.0 stays -0.0."""
    emissions = torch.full((2, 4, 6), -0.0, dtype=torch.float64, device=device)
    transitions = torch.full((2, 3, 6, 6), -0.0, dtype=torch.float64, device=device)
    mask = torch.ones(2, 4, 6, dtype=torch.bool, device=device)
    mask[1, :, 0] = False
    for lag in LAGS:
        paths, scores, _ = decoded(emissions, transitions, mask, lag)
        assert paths.tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
        same_bits(scores, torch_path(decoded, emissions, transitions, mask, lag)[1])
        assert bool(torch.signbit(scores).all())


@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 1, 4), (2, 5, 1), (1, 3, 33), (0, 3, 2)])
def test_one_turn_one_candidate_odd_and_empty_shapes(kernels, device, shape):
    batch, turns, candidates = shape
    generator = torch.Generator().manual_seed(5)
    emissions = torch.randn(batch, turns, candidates, generator=generator).to(device)
    transitions = -torch.rand(batch, max(turns - 1, 0), candidates, candidates, generator=generator).to(device)
    mask = torch.ones(batch, turns, candidates, dtype=torch.bool, device=device)
    for lag in (None, 0, 2):
        assert_decodes_like_the_torch_path(emissions, transitions, mask, lag)


def test_brute_force_optimum_and_partition(kernels, device):
    """Tiny trellises: the decoded score is the best of all paths and the path attains
    it; log Z and the marginals are those of the enumeration."""
    for seed in range(4):
        emissions, transitions, mask = trellis(seed, device, torch.float64, batch=3, turns=4, candidates=3)
        viterbi = decode.viterbi(emissions, transitions, mask)
        log_z = decode.log_partition(emissions, transitions, mask)
        posteriors = decode.marginals(emissions, transitions, mask)
        for b in range(3):
            brute = enumerate_paths(emissions[b], transitions[b], mask[b])
            assert viterbi.scores[b].item() == brute.score
            length = len(brute.path)
            assert tuple(viterbi.paths[b, :length].tolist()) == brute.path
            assert abs(log_z[b].item() - brute.log_partition) <= 1e-12 * (1 + abs(brute.log_partition))
            assert torch.allclose(posteriors[b].cpu(), brute.marginals, rtol=0, atol=1e-12)
    assert kernels["max_plus"] == 4 and kernels["log"] == 4 * 3  # marginals runs log_partition first


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_scores_under_locks_and_online_equal_the_torch_path(kernels, device, dtype):
    from mapmatched_torch.eval.methods import online_forward_scores

    generator = torch.Generator().manual_seed(9)
    emissions, transitions, mask = trellis(2, device, dtype)
    batch, turns, candidates = mask.shape
    picks = torch.rand(batch, turns, candidates, generator=generator).to(device).masked_fill(~mask, -1.0).argmax(-1)
    locks = torch.where(torch.rand(batch, turns, generator=generator).to(device) < 0.4, picks, -1)
    locks = torch.where(mask.any(dim=-1), locks, 99)  # padding turns: ignored, even out of range
    same_bits(decode.forward_scores(emissions, transitions, mask, locks),
              torch_path(decode.forward_scores, emissions, transitions, mask, locks))
    for lag in (None, 0, 2):
        same_bits(online_forward_scores(emissions, transitions, mask, lag),
                  torch_path(online_forward_scores, emissions, transitions, mask, lag))
    assert kernels["max_plus"] == 4


@pytest.mark.parametrize("lag", [None, 1])
@pytest.mark.parametrize("breakage", BREAKAGES)
def test_invalid_trellises_raise_the_torch_paths_message(kernels, device, breakage, lag):
    emissions, transitions, mask = (tensor.to(device) for tensor in broken_trellis(breakage))

    def message():
        with pytest.raises(MapMatchedValueError) as caught:
            decoded(emissions, transitions, mask, lag)
        return str(caught.value)

    with use_backend("torch"):
        expected = message()
    assert message() == expected


def test_masked_garbage_never_flags_or_changes_a_result(kernels, device):
    emissions = torch.tensor([[[1.0, float("inf")], [0.0, float("nan")]]], device=device)
    transitions = torch.tensor([[[[0.0, float("nan")], [float("-inf"), float("inf")]]]], device=device)
    mask = torch.tensor([[[True, False], [True, False]]], device=device)
    paths, scores, _ = decoded(emissions, transitions, mask, None)
    assert paths.tolist() == [[0, 0]] and scores.tolist() == [1.0]
    assert decode.log_partition(emissions, transitions, mask).tolist() == [1.0]
    assert decode.marginals(emissions, transitions, mask).tolist() == [[[1.0, 0.0], [1.0, 0.0]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_partition_marginals_and_pairs_within_bounds(kernels, device, dtype):
    for seed in range(2):
        emissions, transitions, mask = trellis(seed, device, dtype, integer=False, candidates=4 + seed)
        close(decode.log_partition(emissions, transitions, mask),
              torch_path(decode.log_partition, emissions, transitions, mask), dtype)
        close(decode.marginals(emissions, transitions, mask),
              torch_path(decode.marginals, emissions, transitions, mask), dtype)
        log_z, posteriors, pairs = fused.log_partition_gradients(emissions, transitions, mask, pairs=True)
        clean = torch.where(mask[:, :-1, :, None] & mask[:, 1:, None, :], transitions, 0.0)
        with use_backend("torch"):
            shift = clean.clone().requires_grad_()
            (grad,) = torch.autograd.grad(decode.log_partition(emissions, shift, mask).sum(), shift)
        close(pairs, grad, dtype)
        # every real turn's marginals sum to 1; padding is exactly 0
        assert bool((posteriors[~mask] == 0).all())
        totals = posteriors.sum(dim=-1)[mask.any(dim=-1)]
        assert torch.allclose(totals, torch.ones_like(totals), atol=TOLERANCE[dtype] * 10)


def test_gradients_for_fitting_equal_the_torch_path(kernels, device):
    """log_likelihood's gradient in lambda and beta (what fit differentiates) runs the
    Triton forward and backward kernels and equals the torch path's autograd."""
    emissions, transitions, mask = trellis(4, device, torch.float64, integer=False)
    gold = torch.where(mask.any(dim=-1), mask.long().argmax(dim=-1), -1)

    def gradient():
        weights = torch.tensor([0.7, 1.3], dtype=torch.float64, device=device, requires_grad=True)
        clean_e = torch.where(mask, emissions, 0.0)
        clean_t = torch.where(mask[:, :-1, :, None] & mask[:, 1:, None, :], transitions, 0.0)
        loss = decode.log_likelihood(weights[0] * clean_e, weights[1] * clean_t, mask, gold).sum()
        return torch.autograd.grad(loss, weights)[0]

    launched = kernels["log"]
    actual = gradient()
    assert kernels["log"] > launched
    close(actual, torch_path(gradient), torch.float64)


def _bits(tensor):
    if tensor.dtype.is_floating_point:
        return tensor.view(torch.int64 if tensor.dtype == torch.float64 else torch.int32)
    return tensor


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
# (0.7 is not a float32: the weighting must multiply by the float64 beta, as the torch path does)
@pytest.mark.parametrize("lag, beta", [(None, 0.7), (2, 2.5), (0, 0.0)])
def test_the_serving_step_equals_the_torch_step_bit_for_bit(monkeypatch, device, dtype, lag, beta):
    """SlotDecoder steps (weighted in the kernel from distances without a lag, from
    given transitions with one) and backtracks: every output and the final table."""
    from mapmatched_torch.kernels import _triton_step

    launches = []
    original = _triton_step.step
    monkeypatch.setattr(_triton_step, "step", lambda *a: (launches.append(1), original(*a))[1])
    for seed in range(2):
        triton_out, triton_state = random_slot_run("triton", dtype, lag, beta, seed, slots=9, device=device)
        torch_out, torch_state = random_slot_run("torch", dtype, lag, beta, seed, slots=9, device=device)
        for got, want in zip(triton_out, torch_out):
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
        assert all(torch.equal(_bits(triton_state[name]), _bits(torch_state[name])) for name in torch_state)
    assert launches


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("learned", ["gated", "calibrated"])
def test_the_serving_step_with_a_learned_model_equals_the_torch_step_bit_for_bit(monkeypatch, device, dtype, learned):
    """A GatedTransitions' per-move factors weighed in the Triton step (PER_MOVE): every
    output, the learned costs along the paths and the final table."""
    from mapmatched_torch.kernels import _triton_step

    launches = []
    original = _triton_step.step
    monkeypatch.setattr(_triton_step, "step", lambda *a, **k: (launches.append(k.get("factors")), original(*a, **k))[1])
    triton_out, triton_state = random_slot_run("triton", dtype, None, 0.7, 0, slots=5, turns=5, device=device,
                                               learned=learned)
    torch_out, torch_state = random_slot_run("torch", dtype, None, 0.7, 0, slots=5, turns=5, device=device,
                                             learned=learned)
    for got, want in zip(triton_out, torch_out):
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
    assert all(torch.equal(_bits(triton_state[name]), _bits(torch_state[name])) for name in torch_state)
    assert any(factors is not None for factors in launches)
