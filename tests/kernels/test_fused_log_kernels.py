"""The fused log-semiring kernels: log Z and marginals against the torch path and brute force.

Not bit for bit (the kernels' ``exp`` is their own): float64 agrees to about 1e-15
relative, float32 to float32 rounding. What *is* exact: a conversation's result does not
depend on the batch around it, its padding or the thread count.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.autograd import forward_ad

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.kernels import decode, fused
from mapmatched_torch.testing import BREAKAGES, broken_trellis, fused_kernels_off, enumerate_paths, random_trellis

numba = pytest.importorskip("numba")

from mapmatched_torch.kernels import fused_log_kernels  # noqa: E402  (needs numba)

#: (log Z relative, marginals absolute) agreement with the torch path and brute force
TOLERANCE = {torch.float64: (1e-13, 1e-12), torch.float32: (2e-6, 2e-5)}


torch_path = fused_kernels_off  # decode with the torch path inside the block


def reference(emissions, transitions, mask):
    with torch_path():
        return decode.log_partition(emissions, transitions, mask), decode.marginals(emissions, transitions, mask)


def fused_both(emissions, transitions, mask):
    log_z = fused.log_partition(emissions, transitions, mask)
    posterior = fused.marginals(emissions, transitions, mask)
    assert log_z is not None and posterior is not None
    return log_z, posterior


def assert_close(actual, expected, dtype):
    log_z_rtol, marginal_atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual[0], expected[0], rtol=log_z_rtol, atol=log_z_rtol)
    torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=marginal_atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("integer", [True, False])
def test_equal_to_the_torch_path_on_random_trellises(dtype, integer):
    generator = torch.Generator().manual_seed(5)
    for _ in range(12):
        batch, turns, candidates = (int(torch.randint(1, high, (), generator=generator)) for high in (40, 8, 9))
        trellis = random_trellis(batch, turns, candidates, generator=generator, dtype=dtype, integer=integer)
        transitions = -trellis.distances
        actual = fused_both(trellis.emissions, transitions, trellis.mask)
        assert_close(actual, reference(trellis.emissions, transitions, trellis.mask), dtype)
        # the public functions take the kernel (no gradient asked for)
        assert torch.equal(decode.log_partition(trellis.emissions, transitions, trellis.mask), actual[0])
        assert torch.equal(decode.marginals(trellis.emissions, transitions, trellis.mask), actual[1])


@pytest.mark.parametrize("integer", [True, False])
def test_reaches_brute_force_enumeration(integer):
    generator = torch.Generator().manual_seed(6)
    trellis = random_trellis(30, 4, 3, generator=generator, integer=integer)
    log_z, posterior = fused_both(trellis.emissions, -trellis.distances, trellis.mask)
    for b in range(30):
        truth = enumerate_paths(trellis.emissions[b], -trellis.distances[b], trellis.mask[b])
        assert log_z[b].item() == pytest.approx(truth.log_partition, rel=1e-14, abs=1e-14)
        torch.testing.assert_close(posterior[b], truth.marginals, rtol=0, atol=1e-13)


def test_a_conversation_does_not_depend_on_its_batch_padding_or_threads():
    generator = torch.Generator().manual_seed(7)
    trellis = random_trellis(64, 6, 5, generator=generator)
    emissions, transitions, mask = trellis.emissions, -trellis.distances, trellis.mask
    log_z, posterior = fused_both(emissions, transitions, mask)  # 64 rows: the parallel kernel
    # wider padding (NaN garbage) in turns and candidates
    wide_e = torch.full((64, 8, 7), float("nan"), dtype=torch.float64)
    wide_tr = torch.full((64, 7, 7, 7), float("inf"), dtype=torch.float64)
    wide_mask = torch.zeros(64, 8, 7, dtype=torch.bool)
    index = torch.tensor([0, 2, 3, 5, 6])  # the real candidates spread out, in their order
    wide_e[:, :6, index] = emissions
    wide_tr[:, :5, index[:, None], index[None, :]] = transitions
    wide_mask[:, :6, index] = mask
    wide_log_z, wide_posterior = fused_both(wide_e, wide_tr, wide_mask)
    assert torch.equal(wide_log_z, log_z)
    assert torch.equal(wide_posterior[:, :6, index], posterior)
    assert not wide_posterior[:, 6:].any() and not wide_posterior[:, :, [1, 4]].any()
    for b in (0, 17, 63):  # one row: the serial kernel
        alone = fused_both(emissions[b : b + 1], transitions[b : b + 1], mask[b : b + 1])
        assert torch.equal(alone[0], log_z[b : b + 1]) and torch.equal(alone[1], posterior[b : b + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = fused_both(emissions, transitions, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread[0], log_z) and torch.equal(one_thread[1], posterior)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wide_score_spreads_take_the_exact_column_sums(dtype):
    """Forward scores far apart and transitions far from 0: the one-pass sums leave their
    window (underflow or clamped terms) and the exact two-pass sums take over."""
    generator = torch.Generator().manual_seed(8)
    spread = 60.0 if dtype == torch.float32 else 900.0
    emissions = (torch.rand(24, 5, 6, generator=generator, dtype=torch.float64) * 2 - 1) * spread
    transitions = (torch.rand(24, 4, 6, 6, generator=generator, dtype=torch.float64) * 2 - 1) * spread
    transitions[:4] += spread  # every move strongly positive: clamped terms
    transitions[4:8] -= 2 * spread  # every move strongly negative: underflowed terms
    mask = torch.rand(24, 5, 6, generator=generator) < 0.8
    mask[:, :, 0] = True
    emissions, transitions = emissions.to(dtype), transitions.to(dtype)
    actual = fused_both(emissions, transitions, mask)
    expected = reference(emissions, transitions, mask)
    scale = expected[0].abs().clamp_min(1)
    assert ((actual[0] - expected[0]).abs() / scale).max() < TOLERANCE[dtype][0] * 4
    torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=TOLERANCE[dtype][1] * 4)
    if dtype == torch.float64:
        for b in range(0, 24, 5):
            truth = enumerate_paths(emissions[b], transitions[b], mask[b])
            assert actual[0][b].item() == pytest.approx(truth.log_partition, rel=1e-14)


def test_one_turn_one_candidate_and_empty_batch():
    emissions = torch.tensor([[[1.5]], [[-2.0]]], dtype=torch.float64)
    mask = torch.ones(2, 1, 1, dtype=torch.bool)
    log_z, posterior = fused_both(emissions, torch.zeros(2, 0, 1, 1, dtype=torch.float64), mask)
    assert log_z.tolist() == [1.5, -2.0] and posterior.tolist() == [[[1.0]], [[1.0]]]
    emissions = torch.tensor([[[2.0], [3.0]]])
    log_z, posterior = fused_both(emissions, torch.zeros(1, 1, 1, 1), torch.ones(1, 2, 1, dtype=torch.bool))
    assert log_z.tolist() == [5.0] and posterior.tolist() == [[[1.0], [1.0]]]
    log_z, posterior = fused_both(torch.zeros(0, 3, 2), torch.zeros(0, 2, 2, 2), torch.zeros(0, 3, 2, dtype=torch.bool))
    assert log_z.shape == (0,) and posterior.shape == (0, 3, 2)


def _message(function):
    with pytest.raises(MapMatchedValueError) as caught:
        function()
    return str(caught.value)


@pytest.mark.parametrize("entry", ["log_partition", "marginals"])
@pytest.mark.parametrize("breakage", BREAKAGES)
def test_invalid_trellises_raise_the_torch_paths_message(breakage, entry):
    emissions, transitions, mask = broken_trellis(breakage)
    public = getattr(decode, entry)
    with torch_path():
        expected = _message(lambda: public(emissions, transitions, mask))
    assert _message(lambda: getattr(fused, entry)(emissions, transitions, mask)) == expected
    assert _message(lambda: public(emissions, transitions, mask)) == expected


def test_masked_garbage_never_flags_or_changes_a_result():
    emissions = torch.tensor([[[1.0, float("inf")], [0.0, float("nan")]]], dtype=torch.float64)
    transitions = torch.tensor([[[[0.5, float("nan")], [float("-inf"), float("inf")]]]], dtype=torch.float64)
    mask = torch.tensor([[[True, False], [True, False]]])
    log_z, posterior = fused_both(emissions, transitions, mask)
    assert log_z.tolist() == [1.5] and posterior.tolist() == [[[1.0, 0.0], [1.0, 0.0]]]


def test_finite_weights_whose_sum_overflows_stay_in_the_kernel():
    """Found by fuzzing: a finiteness check that summed the weights overflowed on finite
    ones (-3e38 each) and sent the whole batch to the torch path, changing the other
    rows' bits. The check cannot overflow now."""
    generator = torch.Generator().manual_seed(17)
    emissions = torch.randn(40, 2, 3, generator=generator)
    transitions = -torch.rand(40, 1, 3, 3, generator=generator)
    transitions[5, 0, :, 0] = -3e38
    mask = torch.ones(40, 2, 3, dtype=torch.bool)
    log_z = fused.log_partition(emissions, transitions, mask)
    assert log_z is not None
    torch.testing.assert_close(log_z, reference(emissions, transitions, mask)[0], rtol=2e-6, atol=2e-6)
    assert torch.equal(fused.log_partition(emissions[:1], transitions[:1], mask[:1]), log_z[:1])


def test_gradients_and_other_dtypes_take_the_torch_path():
    generator = torch.Generator().manual_seed(9)
    trellis = random_trellis(5, 4, 3, generator=generator)
    emissions = trellis.emissions.clone().requires_grad_(True)
    transitions, mask = -trellis.distances, trellis.mask
    assert fused.log_partition(emissions, transitions, mask) is None
    assert fused.log_partition(emissions.detach().half(), transitions.half(), mask) is None
    with torch_path():
        assert fused.marginals(emissions.detach(), transitions, mask) is None
    # with a gradient: the torch path, differentiable (and its gradient is the kernel's marginals)
    log_z = decode.log_partition(emissions, transitions, mask)
    (grad,) = torch.autograd.grad(log_z.sum(), emissions)
    torch.testing.assert_close(grad, fused.marginals(emissions.detach(), transitions, mask), rtol=0, atol=1e-12)
    # grad mode off: the kernel, even for inputs that require a gradient
    with torch.no_grad():
        assert torch.equal(decode.log_partition(emissions, transitions, mask),
                           fused.log_partition(emissions.detach(), transitions, mask))
        assert torch.equal(decode.marginals(emissions, transitions, mask),
                           fused.marginals(emissions.detach(), transitions, mask))
    assert decode.marginals(emissions, transitions, mask).requires_grad  # still double-backward capable


def test_log_likelihood_without_a_gradient_uses_the_kernel():
    generator = torch.Generator().manual_seed(10)
    trellis = random_trellis(20, 5, 4, generator=generator)
    transitions = -trellis.distances
    gold = torch.where(trellis.mask.any(dim=-1), trellis.mask.long().argmax(dim=-1), -1)
    fast = decode.log_likelihood(trellis.emissions, transitions, trellis.mask, gold)
    with torch_path():
        slow = decode.log_likelihood(trellis.emissions, transitions, trellis.mask, gold)
    torch.testing.assert_close(fast, slow, rtol=1e-13, atol=1e-13)


def test_non_contiguous_inputs_and_torch_threads_are_kept():
    generator = torch.Generator().manual_seed(11)
    emissions = torch.randn(64, 5, 3, generator=generator, dtype=torch.float64)
    distances = torch.rand(5, 3, 3, generator=generator, dtype=torch.float64)
    transitions = (-distances)[None, :4].expand(64, 4, 3, 3)  # a broadcast table: stride 0
    mask = torch.ones(64, 5, 3, dtype=torch.bool)
    threads = torch.get_num_threads()
    actual = fused_both(emissions, transitions, mask)
    assert torch.get_num_threads() == threads
    assert_close(actual, reference(emissions, transitions.contiguous(), mask), torch.float64)


@numba.njit
def _elementwise(values, out, which):
    for k in range(values.shape[0]):
        out[k] = fused_log_kernels.exp_shifted(values[k]) if which == 0 else fused_log_kernels.log_positive(values[k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernels_exp_and_log_are_within_a_few_ulps(dtype):
    low = -87.0 if dtype == torch.float32 else -708.0
    generator = torch.Generator().manual_seed(12)
    points = torch.cat([torch.rand(200_000, generator=generator, dtype=torch.float64) * (low - 10),
                        torch.tensor([0.0, -0.0, low, low - 1e-3, -1e-30, 0.5, 1.0, 5.0, -float("inf")])])
    values = points.to(dtype)
    out = torch.empty_like(values)
    _elementwise(values.numpy(), out.numpy(), 0)
    exact = values.double().exp()
    above = values.double() >= low
    ulps = (out.double() - exact).abs() / torch.from_numpy(np.spacing(exact.to(dtype).numpy())).double()
    assert ulps[above].max() <= 2.0
    assert not out[~above].any()  # exactly 0 below the cut, -inf included
    assert out[-9].item() == out[-8].item() == out[-5].item() == 1.0  # exp(0), exp(-0), exp(-1e-30)
    positives = torch.exp(torch.rand(200_000, generator=generator, dtype=torch.float64) * 2 * (-low - 5) + low + 5)
    positives = torch.cat([positives, torch.tensor([1.0, 2.0, 0.5, math.sqrt(2.0)])]).to(dtype)
    out = torch.empty_like(positives)
    _elementwise(positives.numpy(), out.numpy(), 1)
    exact = positives.double().log()
    spacing = torch.from_numpy(np.spacing(exact.abs().to(dtype).numpy())).double()
    nonzero = exact != 0
    assert ((out.double() - exact).abs()[nonzero] / spacing[nonzero]).max() <= 4.0
    assert out[-4].item() == 0.0


@pytest.mark.parametrize("dtype, big", [(torch.float32, 2e38), (torch.float64, 1e308)])
def test_marginals_do_not_overflow_where_the_forward_scores_do_not(dtype, big):
    """Found by fuzzing: a backward recursion of beta scores overflowed here (marginals
    of 5e34 without an error); the local shares cannot."""
    emissions = torch.tensor([[[-1.7 * big], [big], [big]]], dtype=dtype)
    mask = torch.ones(1, 3, 1, dtype=torch.bool)
    log_z, posterior = fused_both(emissions, torch.zeros(1, 2, 1, 1, dtype=dtype), mask)
    assert torch.isfinite(log_z).all() and posterior.tolist() == [[[1.0], [1.0], [1.0]]]


@pytest.mark.parametrize("dtype, scale", [(torch.float32, 300.0), (torch.float64, 1e4)])
def test_marginals_keep_their_accuracy_when_scores_grow_large(dtype, scale):
    """Found by fuzzing: ``exp(alpha + beta - log Z)`` loses ulp(|alpha| + |beta|) of
    absolute accuracy; the local shares are as accurate as the torch path's autograd."""
    generator = torch.Generator().manual_seed(13)
    emissions = ((torch.rand(4, 30, 3, generator=generator, dtype=torch.float64) * 2 - 1) * scale).to(dtype)
    transitions = ((torch.rand(4, 29, 3, 3, generator=generator, dtype=torch.float64) * 2 - 1) * 20).to(dtype)
    mask = torch.ones(4, 30, 3, dtype=torch.bool)
    _, posterior = fused_both(emissions, transitions, mask)
    _, expected = reference(emissions, transitions, mask)
    if dtype == torch.float64:
        torch.testing.assert_close(posterior, expected, rtol=0, atol=1e-13)
    else:  # float32 rounding of scores near 1e3 costs both paths about 1e-4: no worse than the torch path
        _, truth = reference(emissions.double(), transitions.double(), mask)
        ours, theirs = ((found.double() - truth).abs().max().item() for found in (posterior, expected))
        assert ours <= 1.5 * theirs + 1e-6
    one = fused_both(emissions[:, :, :1].contiguous(), transitions[:, :, :1, :1].contiguous(), mask[:, :, :1])[1]
    assert (one == 1).all()  # one candidate per turn: every marginal exactly 1


# --------------------------------------------------------------------- gradients


def _gradients(function, emissions, transitions, mask, *extra):
    emissions = emissions.clone().requires_grad_(True)
    transitions = transitions.clone().requires_grad_(True)
    value = function(emissions, transitions, mask, *extra)
    weights = torch.linspace(0.5, 1.5, value.numel(), dtype=value.dtype)
    return value.detach(), torch.autograd.grad((value * weights).sum(), (emissions, transitions))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_come_from_the_kernels_and_equal_the_torch_paths(dtype, monkeypatch):
    generator = torch.Generator().manual_seed(14)
    trellis = random_trellis(40, 6, 5, generator=generator, dtype=dtype)  # NaN garbage at padding
    transitions = -trellis.distances
    calls = []
    original = fused.log_partition_gradients
    monkeypatch.setattr(fused, "log_partition_gradients", lambda *a, **k: calls.append(k) or original(*a, **k))
    value, (grad_e, grad_tr) = _gradients(decode.log_partition, trellis.emissions, transitions, trellis.mask)
    assert [call["pairs"] for call in calls] == [True]
    assert calls[0]["states"] is not None  # the backward pass reuses the forward pass
    with torch_path():
        expected_value, (expected_e, expected_tr) = _gradients(
            decode.log_partition, trellis.emissions, transitions, trellis.mask
        )
    log_z_rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(value, expected_value, rtol=log_z_rtol, atol=log_z_rtol)
    torch.testing.assert_close(grad_e, expected_e, rtol=0, atol=atol * 2)
    torch.testing.assert_close(grad_tr, expected_tr, rtol=0, atol=atol * 2)
    pairs = trellis.mask[:, :-1, :, None] & trellis.mask[:, 1:, None, :]
    assert not grad_e[~trellis.mask].any() and not grad_tr[~pairs].any()  # exactly 0 at padding, never NaN


def test_log_likelihood_gradients_take_the_kernels(monkeypatch):
    generator = torch.Generator().manual_seed(15)
    trellis = random_trellis(20, 5, 4, generator=generator)
    gold = torch.where(trellis.mask.any(dim=-1), trellis.mask.long().argmax(dim=-1), -1)
    calls = []
    original = fused.log_partition_gradients
    monkeypatch.setattr(fused, "log_partition_gradients", lambda *a, **k: calls.append(k) or original(*a, **k))
    value, grads = _gradients(decode.log_likelihood, trellis.emissions, -trellis.distances, trellis.mask, gold)
    assert len(calls) == 2  # log Z(gold) and log Z
    with torch_path():
        expected_value, expected = _gradients(decode.log_likelihood, trellis.emissions, -trellis.distances,
                                              trellis.mask, gold)
    torch.testing.assert_close(value, expected_value, rtol=1e-13, atol=1e-13)
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_gradcheck_and_double_backward():
    generator = torch.Generator().manual_seed(16)
    trellis = random_trellis(3, 4, 3, generator=generator, fill=0.0)
    emissions = trellis.emissions.clone().requires_grad_(True)
    transitions = (-trellis.distances).clone().requires_grad_(True)

    def log_z(e, tr):
        return decode.log_partition(e, tr, trellis.mask)

    assert torch.autograd.gradcheck(log_z, (emissions, transitions))
    assert torch.autograd.gradgradcheck(log_z, (emissions, transitions))  # the torch path's create_graph
    # only the emissions asked for: no transition gradient is made
    (grad,) = torch.autograd.grad(log_z(emissions, transitions.detach()).sum(), (emissions,))
    torch.testing.assert_close(grad, fused.marginals(emissions.detach(), transitions.detach(), trellis.mask),
                               rtol=0, atol=0)


def test_one_turn_gradients_behave_as_the_torch_paths():
    """Found by fuzzing: with one turn log Z does not depend on the (empty) transitions;
    a double backward crashed, and the transitions got a zero gradient where the torch
    path's graph has none."""
    emissions = torch.randn(2, 1, 3, dtype=torch.float64, requires_grad=True)
    transitions = torch.zeros(2, 0, 3, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 3, dtype=torch.bool)
    (grad,) = torch.autograd.grad(decode.log_partition(emissions, transitions, mask).sum(), (emissions,),
                                  create_graph=True)
    (second,) = torch.autograd.grad((grad * torch.arange(3.0, dtype=torch.float64)).sum(), (emissions,))
    decode.marginals(emissions, transitions, mask).pow(2).sum().backward()
    with torch_path():
        (expected,) = torch.autograd.grad(decode.log_partition(emissions, transitions, mask).sum(), (emissions,),
                                          create_graph=True)
        (expected_second,) = torch.autograd.grad((expected * torch.arange(3.0, dtype=torch.float64)).sum(),
                                                 (emissions,))
    torch.testing.assert_close(grad, expected)
    torch.testing.assert_close(second, expected_second)
    assert not decode.log_partition(emissions.detach(), transitions, mask).requires_grad


def test_forward_mode_tangents_and_torch_func_take_the_torch_path():
    """Found by fuzzing: a kernel reading a dual tensor's values dropped its tangent."""
    generator = torch.Generator().manual_seed(18)
    trellis = random_trellis(2, 3, 3, generator=generator, fill=0.0)
    tangent = torch.randn(trellis.emissions.shape, generator=generator, dtype=torch.float64)
    with torch_path(), forward_ad.dual_level():
        expected = forward_ad.unpack_dual(
            decode.log_partition(forward_ad.make_dual(trellis.emissions, tangent), -trellis.distances, trellis.mask)
        ).tangent
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(trellis.emissions, tangent)
        for grad_mode in (torch.enable_grad, torch.no_grad):
            with grad_mode():
                found = forward_ad.unpack_dual(decode.log_partition(dual, -trellis.distances, trellis.mask)).tangent
                torch.testing.assert_close(found, expected)
                found = forward_ad.unpack_dual(decode.viterbi(dual, -trellis.distances, trellis.mask).scores).tangent
                assert found is not None
    grad = torch.func.grad(lambda e: decode.log_partition(e, -trellis.distances, trellis.mask).sum())(
        trellis.emissions
    )
    torch.testing.assert_close(grad, fused.marginals(trellis.emissions, -trellis.distances, trellis.mask), rtol=0,
                               atol=1e-12)
