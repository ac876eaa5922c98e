"""MapMatchedModel: weights, exact weighting, decode dispatch, log Z / marginals / NLL
and their gradients in lambda and beta."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.fit.model import MapMatchedModel
from mapmatched_torch.kernels.decode import fixed_lag_viterbi, log_partition, marginals, pointwise_decode, viterbi
from mapmatched_torch.testing import enumerate_paths, random_trellis


def batch(seed=0, b=4, turns=4, candidates=3, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    return random_trellis(b, turns, candidates, generator=generator, **kwargs)


def gold_labels(mask, seed=0, labelled=0.6):
    """The last real candidate at a random subset of real turns, -1 elsewhere."""
    generator = torch.Generator().manual_seed(seed)
    last_real = mask.shape[2] - 1 - mask.flip(-1).to(torch.long).argmax(dim=-1)
    keep = (torch.rand(last_real.shape, generator=generator) < labelled) & mask.any(-1)
    return torch.where(keep, last_real, -1)


# ------------------------------------------------------------------ parameters


def test_parameters_and_validation():
    model = MapMatchedModel(0.5, 2.0)
    assert model.emission_weight.dtype == torch.float64 and model.emission_weight.item() == 0.5
    assert model.transition_weight.item() == 2.0
    assert {name for name, _ in model.named_parameters()} == {"emission_weight", "transition_weight"}
    assert "emission_weight=0.5" in repr(model)
    assert MapMatchedModel(dtype=torch.float32).transition_weight.dtype == torch.float32
    for bad in (-1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(MapMatchedValueError, match="finite and nonnegative"):
            MapMatchedModel(bad, 1.0)
        with pytest.raises(ValueError, match="transition_weight"):
            MapMatchedModel(1.0, bad)


def test_effective_weights_and_projection():
    model = MapMatchedModel(1.0, 1.0)
    with torch.no_grad():
        model.emission_weight.fill_(-0.25)
        model.transition_weight.fill_(0.3)
    assert model.effective_emission_weight.item() == 0.0
    assert model.effective_transition_weight.item() == 0.3
    assert model.project_() is model
    assert model.emission_weight.item() == 0.0 and model.transition_weight.item() == 0.3


def test_weighting_is_the_standalone_arithmetic():
    scores, distances, mask = batch()
    model = MapMatchedModel(0.7, 1.3)
    assert torch.equal(model.emissions(scores, mask), torch.where(mask, 0.7 * scores, 0.0))
    pairs = mask[:, :-1, :, None] & mask[:, 1:, None, :]
    expected = torch.where(pairs, -(1.3 * distances), -0.0)
    assert torch.equal(model.transitions(distances, mask), expected)
    # without a mask: plain products (padding garbage stays garbage)
    assert torch.isnan(model.emissions(scores)).any()


# --------------------------------------------------------------------- decoding


def test_decode_dispatch():
    scores, distances, mask = batch(1, integer=True)
    model = MapMatchedModel(1.0, 0.5)
    emissions, transitions = model.emissions(scores, mask), model.transitions(distances, mask)
    for got, expected in zip(model.decode(scores, distances, mask), viterbi(emissions, transitions, mask)):
        assert torch.equal(got, expected)
    for got, expected in zip(
        model.decode(scores, distances, mask, fixed_lag=1), fixed_lag_viterbi(emissions, transitions, mask, 1)
    ):
        assert torch.equal(got, expected)
    decoded = model.decode(scores, distances, mask)
    assert not decoded.scores.requires_grad


def test_decode_with_zero_beta_is_pointwise():
    scores = torch.tensor([[[1e16, 0.0], [0.5, 1.0]]], dtype=torch.float64)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    model = MapMatchedModel(1.0, 0.0)
    assert model.decode(scores, None, mask).paths.tolist() == [[0, 1]]
    lagged = model.decode(scores, torch.zeros(1, 1, 2, 2, dtype=torch.float64), mask, fixed_lag=0)
    assert lagged.paths.tolist() == [[0, 1]] and lagged.committed_through.tolist() == [1]
    assert lagged.locks.tolist() == [[0, 1]]
    assert torch.equal(lagged.scores, pointwise_decode(scores, mask).scores)
    with pytest.raises(MapMatchedValueError, match="distances are required"):
        MapMatchedModel(1.0, 0.5).decode(scores, None, mask)
    with pytest.raises(MapMatchedValueError, match="fixed_lag"):
        model.decode(scores, None, mask, fixed_lag=-1)


def test_shape_errors_name_the_model_arguments():
    scores, distances, mask = batch()
    model = MapMatchedModel()
    with pytest.raises(MapMatchedValueError, match="distances must have shape"):
        model.log_partition(scores, distances[:, :1], mask)
    with pytest.raises(MapMatchedValueError, match="does not match scores shape"):
        model.nll(scores, distances, mask[:, :, :1], gold_labels(mask))
    with pytest.raises(MapMatchedValueError, match="scores must be a floating-point"):
        model.marginals(scores.long(), distances, mask)


@pytest.mark.parametrize("bad", [-0.5, math.nan])
@pytest.mark.parametrize("method", ["decode", "log_partition", "marginals", "nll", "transitions"])
def test_negative_or_nan_distances_are_refused_where_they_enter(bad, method):
    # a negative distance would reward the jump (-(beta * d) > 0) and was silently used
    scores, distances, mask = batch(pad=False)
    distances = distances.clone()
    distances[1, 2, 0, 2] = bad
    model = MapMatchedModel(1.0, 0.5)
    calls = {
        "decode": lambda: model.decode(scores, distances, mask),
        "log_partition": lambda: model.log_partition(scores, distances, mask),
        "marginals": lambda: model.marginals(scores, distances, mask),
        "nll": lambda: model.nll(scores, distances, mask, gold_labels(mask)),
        "transitions": lambda: model.transitions(distances, mask),
    }
    expected = rf"^distances must be nonnegative graph distances \(not NaN\) between real candidates: " \
        rf"distances\[b=1, t=2, from=0, to=2\] = {bad!r} \(the move from turn 2 to turn 3\)$"
    with pytest.raises(MapMatchedValueError, match=expected):
        calls[method]()


def test_distance_checks_ignore_padding_and_keep_the_zero_beta_shortcut():
    scores, distances, mask = batch(seed=3)  # NaN at every masked position
    assert mask.logical_not().any()
    model = MapMatchedModel(1.0, 0.5)
    expected = model.log_partition(scores, distances, mask)
    moved = distances.clone()
    touches_padding = ~(mask[:, :-1, :, None] & mask[:, 1:, None, :])
    moved[touches_padding] = -7.0  # garbage next to padding is never read
    assert torch.equal(model.log_partition(scores, moved, mask), expected)
    # beta = 0 decodes pointwise: the distances are not used, so not checked
    assert MapMatchedModel(1.0, 0.0).decode(scores, -distances.abs() - 1.0, mask).paths.shape == mask.shape[:2]
    # an infinite distance is not a graph distance either (unreachable pairs cost the
    # graph's maximum_distance): the decoders refuse the -inf move, as before
    full_scores, full, full_mask = batch(pad=False)
    full = full.clone()
    full[0, 0, 0, 0] = math.inf
    with pytest.raises(MapMatchedValueError, match="must be finite"):
        model.log_partition(full_scores, full, full_mask)


# ------------------------------------------------------------ likelihood and grads


def test_log_partition_marginals_and_nll_match_brute_force():
    scores, distances, mask = batch(2, b=3, turns=4, candidates=3)
    model = MapMatchedModel(0.8, 0.6)
    gold = gold_labels(mask, seed=2)
    log_z = model.log_partition(scores, distances, mask)
    posterior = model.marginals(scores, distances, mask)
    nll = model.nll(scores, distances, mask, gold)
    emissions, transitions = model.emissions(scores, mask).detach(), model.transitions(distances, mask).detach()
    for b in range(mask.shape[0]):
        truth = enumerate_paths(emissions[b], transitions[b], mask[b])
        restricted = mask[b].clone()
        for t, g in enumerate(gold[b].tolist()):
            if g >= 0:
                restricted[t] = False
                restricted[t, g] = True
        gold_truth = enumerate_paths(emissions[b], transitions[b], restricted)
        assert log_z[b].item() == pytest.approx(truth.log_partition, abs=1e-12)
        torch.testing.assert_close(posterior[b].detach(), truth.marginals, rtol=0, atol=1e-12)
        assert nll[b].item() == pytest.approx(truth.log_partition - gold_truth.log_partition, abs=1e-12)
    assert (nll >= -1e-12).all()
    assert torch.equal(model(scores, distances, mask, gold), nll.mean())
    # nothing labelled: the loss is exactly 0
    assert (model.nll(scores, distances, mask, torch.full_like(gold, -1)) == 0).all()


class _Method(torch.nn.Module):
    """``forward`` = one method of the wrapped model (so functional_call can swap weights)."""

    def __init__(self, model, method):
        super().__init__()
        self.model, self.method = model, method

    def forward(self, *args):
        return getattr(self.model, self.method)(*args)


def _with_weights(model, lam, beta, method, *args):
    """``model.<method>(*args)`` with lambda and beta replaced by the given tensors."""
    weights = {"model.emission_weight": lam, "model.transition_weight": beta}
    return functional_call(_Method(model, method), weights, args, strict=True)


def _weights():
    return (
        torch.tensor(0.9, dtype=torch.float64, requires_grad=True),
        torch.tensor(0.4, dtype=torch.float64, requires_grad=True),
    )


@pytest.mark.parametrize("method", ["log_partition", "nll", "marginals"])
def test_gradcheck_in_lambda_and_beta(method):
    scores, distances, mask = batch(3, b=3, turns=3, candidates=3)
    model = MapMatchedModel()
    gold = gold_labels(mask, seed=3)
    args = (scores, distances, mask, gold) if method == "nll" else (scores, distances, mask)
    assert torch.autograd.gradcheck(
        lambda lam, beta: _with_weights(model, lam, beta, method, *args), _weights(), atol=1e-7, rtol=1e-6
    )


def test_gradients_reach_both_weights_and_are_finite_with_padding():
    scores, distances, mask = batch(4, b=6, turns=5, candidates=4)
    assert torch.isnan(scores).any() and torch.isnan(distances).any()
    model = MapMatchedModel(1.0, 0.5)
    loss = model(scores, distances, mask, gold_labels(mask, seed=4))
    loss.backward()
    for parameter in (model.emission_weight, model.transition_weight):
        assert parameter.grad is not None and torch.isfinite(parameter.grad) and parameter.grad != 0
    # beta = 0 is on the boundary: clamp_min still passes the gradient
    model = MapMatchedModel(1.0, 0.0)
    model(scores, distances, mask, gold_labels(mask, seed=4)).backward()
    assert torch.isfinite(model.transition_weight.grad) and model.transition_weight.grad != 0


def test_marginals_without_grad():
    scores, distances, mask = batch(5)
    model = MapMatchedModel(1.0, 0.5)
    with torch.no_grad():
        posterior = model.marginals(scores, distances, mask)
    assert not posterior.requires_grad
    sums = posterior.sum(-1)[mask.any(-1)]
    torch.testing.assert_close(sums, torch.ones_like(sums))
    emissions, transitions = model.emissions(scores, mask).detach(), model.transitions(distances, mask).detach()
    assert not marginals(emissions, transitions, mask).requires_grad
    assert model.marginals(scores, distances, mask).requires_grad


def test_a_few_optimizer_steps_reduce_the_loss():
    scores, distances, mask = batch(6, b=16, turns=5, candidates=4)
    model = MapMatchedModel(0.2, 2.0)
    gold = model.__class__(1.5, 0.3).decode(scores, distances, mask).paths  # labels from other weights
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = model(scores, distances, mask, gold)
        loss.backward()
        optimizer.step()
        model.project_()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.emission_weight.item() >= 0 and model.transition_weight.item() >= 0


def test_model_on_device(device):
    scores, distances, mask = batch(7)
    model = MapMatchedModel(1.0, 0.5)
    moved = MapMatchedModel(1.0, 0.5, device=device)
    args = [x.to(device) for x in (scores, distances, mask)]
    gold = gold_labels(mask, seed=7)
    for a, b in zip(model.decode(scores, distances, mask, fixed_lag=1), moved.decode(*args, fixed_lag=1)):
        assert torch.equal(a, b.cpu())
    torch.testing.assert_close(moved.nll(*args, gold.to(device)).cpu(), model.nll(scores, distances, mask, gold))
    emissions, transitions = moved.emissions(args[0], args[2]), moved.transitions(args[1], args[2])
    assert log_partition(emissions, transitions, args[2]).device.type == device.type


# ------------------------------------------------- a learned transition model inside the module


def test_fitting_recovers_the_gate_and_lambda_from_data_sampled_from_the_model():
    """Sample gold paths from a gated model, then fit lambda, beta and the gate by the
    CRF negative log-likelihood from neutral starting values: the fit lands near the
    truth (the likelihood is the model's own, so this is a check of the gradients and
    of identifiability, not of retrieval quality)."""
    from mapmatched_torch.kernels.sampling import sample_paths
    from mapmatched_torch.kernels.transitions import GatedTransitions

    generator = torch.Generator().manual_seed(0)
    batch, turns, candidates = 1500, 5, 4
    scores = torch.randn(batch, turns, candidates, generator=generator, dtype=torch.float64)
    distances = torch.rand(batch, turns - 1, candidates, candidates, generator=generator, dtype=torch.float64) * 3
    features = torch.randn(batch, turns - 1, candidates, 1, generator=generator, dtype=torch.float64)
    mask = torch.ones(batch, turns, candidates, dtype=torch.bool)
    truth = MapMatchedModel(1.5, transition_model=GatedTransitions(1.2, num_features=1))
    with torch.no_grad():
        truth.transition_model.gate_bias.fill_(-0.4)
        truth.transition_model.gate_weights.fill_(1.1)
        gold = sample_paths(
            truth.emissions(scores), truth.transitions(distances, mask, features), mask, generator=generator
        )[0]

    model = MapMatchedModel(1.0, transition_model=GatedTransitions(1.0, num_features=1))
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = model(scores, distances, mask, gold, features=features)
        loss.backward()
        return loss

    optimizer.step(closure)
    gate = model.transition_model
    assert model.emission_weight.item() == pytest.approx(1.5, abs=0.12)
    assert model.transition_weight.item() == pytest.approx(1.2, abs=0.15)
    assert gate.gate_weights.item() == pytest.approx(1.1, abs=0.2)
    assert gate.gate_bias.item() == pytest.approx(-0.4, abs=0.2)
    assert model.transition_weight is gate.transition_weight  # one beta


def test_a_gated_model_at_neutral_values_decodes_like_the_fixed_model():
    from mapmatched_torch.kernels.transitions import GatedTransitions

    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(6, 4, 3, generator=generator, dtype=torch.float64)
    distances = torch.randint(0, 3, (6, 3, 3, 3), generator=generator).double()
    features = torch.full((6, 3, 3, 2), float("nan"), dtype=torch.float64)
    mask = torch.ones(6, 4, 3, dtype=torch.bool)
    mask[0, 3] = False
    features[:, :, :, :] = torch.randn(6, 3, 3, 2, generator=generator, dtype=torch.float64)
    features[0, 2] = float("nan")  # the moves out of a padded turn: never read
    fixed = MapMatchedModel(1.0, 0.7)
    gated = MapMatchedModel(1.0, 0.7, transition_model=GatedTransitions(0.7, num_features=2))
    for lag in (None, 1):
        expected = fixed.decode(scores, distances, mask, lag)
        decoded = gated.decode(scores, distances, mask, lag, features=features)
        assert torch.equal(decoded.paths, expected.paths) and torch.equal(decoded.scores, expected.scores)
    loss = gated(scores, distances, mask, torch.zeros(6, 4, dtype=torch.long), features=features)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in gated.parameters())
