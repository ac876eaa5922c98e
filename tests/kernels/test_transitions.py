"""kernels/transitions.py: the fixed model's arithmetic bit for bit, the one choice of
decoder, the one dispatch, the TransitionModel seam, and that no other module weights
distances or chooses the decoder on its own."""

from __future__ import annotations

import ast
import math
import random
from pathlib import Path

import pytest
import torch

import mapmatched_torch
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.kernels.decode import fixed_lag_viterbi, pointwise_decode, viterbi
from mapmatched_torch.kernels.transitions import (
    DecodingMode,
    FixedWeight,
    GatedTransitions,
    as_transition_model,
    decode_weighted,
    decoding_mode,
    query_source_cosine,
    weighted_transitions,
)
from mapmatched_torch.testing import random_trellis

PACKAGE_DIR = Path(mapmatched_torch.__file__).resolve().parent


def distances_with_edge_values():
    generator = torch.Generator().manual_seed(3)
    distances = 10.0 * torch.rand(2, 3, 4, 4, generator=generator, dtype=torch.float64)
    distances[0, 0, 0] = torch.tensor([0.0, math.inf, 1e-320, 1e308], dtype=torch.float64)
    return distances


def same_bits(a, b):
    """Equal values and signs (signed zeros included); NaN where the other has NaN."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    a, b = a[~nan], b[~nan]
    return torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


# ----------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0, 2.5, 1e-300, 7.0e300])
def test_weighted_transitions_are_minus_beta_times_d_bit_for_bit(beta):
    distances = distances_with_edge_values()
    assert same_bits(weighted_transitions(distances, beta), -(beta * distances))
    tensor_beta = torch.tensor(beta, dtype=torch.float64)
    assert same_bits(weighted_transitions(distances, tensor_beta), -(tensor_beta * distances))
    # the cast comes after the float64 arithmetic, as in the decoders
    assert same_bits(weighted_transitions(distances, beta, torch.float32), (-(beta * distances)).to(torch.float32))


def test_weighted_transitions_broadcast_a_stack_of_betas():
    distances = distances_with_edge_values()
    betas = torch.tensor([0.0, 0.25, 3.0], dtype=torch.float64).view(3, 1, 1, 1, 1)
    stacked = weighted_transitions(distances.unsqueeze(0), betas)
    assert stacked.shape == (3,) + distances.shape
    for s, beta in enumerate(betas.flatten().tolist()):
        assert same_bits(stacked[s], -(beta * distances))


def test_adding_them_is_the_standalone_decoders_subtraction():
    # the reference computes (previous - beta * d); the tensor paths add the transitions
    rng = random.Random(5)
    for _ in range(2000):
        previous, distance = rng.uniform(-50, 50), rng.choice([rng.uniform(0, 9), 0.1 + 0.2, 0.0, 3.0])
        beta = rng.choice([rng.uniform(0, 3), 0.1, 1.0 / 3.0])
        transition = weighted_transitions(torch.tensor([distance], dtype=torch.float64), beta)
        assert (torch.tensor([previous], dtype=torch.float64) + transition).item() == previous - beta * distance


def test_gradients_reach_a_tensor_beta():
    distances = torch.rand(2, 2, 3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    beta = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    weighted_transitions(distances, beta).sum().backward()
    assert beta.grad is not None and torch.allclose(beta.grad, -distances.sum(), rtol=0, atol=1e-12)


# ------------------------------------------------------------ the one choice


def test_decoding_mode():
    assert decoding_mode(0.0) is DecodingMode.POINTWISE
    assert decoding_mode(0.0, 3) is DecodingMode.POINTWISE  # the lag then only names committed turns
    assert decoding_mode(0.5) is DecodingMode.VITERBI
    assert decoding_mode(0.5, 0) is DecodingMode.FIXED_LAG
    assert decoding_mode(torch.tensor(0.0)) is DecodingMode.POINTWISE
    assert decoding_mode(torch.tensor(1e-300, dtype=torch.float64), 2) is DecodingMode.FIXED_LAG
    assert not DecodingMode.POINTWISE.uses_distances
    assert DecodingMode.VITERBI.uses_distances and DecodingMode.FIXED_LAG.uses_distances
    with pytest.raises(MapMatchedValueError, match="fixed_lag"):
        decoding_mode(0.5, -1)
    for bad in ("0.5", True, None):
        with pytest.raises(MapMatchedValueError, match="transition weight must be"):
            decoding_mode(bad)


def test_decode_weighted_runs_the_decoder_the_mode_names():
    generator = torch.Generator().manual_seed(11)
    for _ in range(6):
        emissions, distances, mask = random_trellis(4, 4, 3, generator=generator)
        for beta in (0.0, 0.75, torch.tensor(0.75, dtype=torch.float64)):
            transitions = -(beta * distances)
            for lag in (None, 0, 1, 3):
                got = decode_weighted(emissions, distances, mask, beta, lag)
                if float(beta) == 0.0:
                    expected = pointwise_decode(emissions, mask, fixed_lag=lag)
                elif lag is None:
                    expected = viterbi(emissions, transitions, mask)
                else:
                    expected = fixed_lag_viterbi(emissions, transitions, mask, lag)
                assert type(got) is type(expected)
                for a, b in zip(got, expected):
                    assert torch.equal(a, b)
                kept = decode_weighted(emissions, None, mask, beta, lag, transitions=transitions)
                for a, b in zip(kept, expected):
                    assert torch.equal(a, b)


def test_decode_weighted_reads_no_distances_at_beta_zero_and_needs_them_otherwise():
    emissions, distances, mask = random_trellis(2, 3, 2, generator=torch.Generator().manual_seed(2))
    expected = pointwise_decode(emissions, mask)
    assert torch.equal(decode_weighted(emissions, None, mask, 0.0).paths, expected.paths)
    garbage = torch.full_like(distances, math.nan)  # never read
    assert torch.equal(decode_weighted(emissions, garbage, mask, 0.0).paths, expected.paths)
    with pytest.raises(MapMatchedValueError, match="distances are required"):
        decode_weighted(emissions, None, mask, 0.5, 1)


class _Calibrated:
    """A stand-in learned model: beta * d + a per-pair offset, as one transition tensor."""

    def __init__(self, beta, offset):
        self.beta, self.offset = beta, offset

    @property
    def is_zero(self):
        return False

    def __call__(self, distances, dtype=None):
        transitions = weighted_transitions(distances, self.beta) - self.offset
        return transitions if dtype is None else transitions.to(dtype)


def test_a_transition_model_plugs_into_the_one_dispatch():
    emissions, distances, mask = random_trellis(3, 4, 3, generator=torch.Generator().manual_seed(4))
    model = _Calibrated(0.5, 0.25)
    for lag in (None, 1):
        got = decode_weighted(emissions, distances, mask, model, lag)
        transitions = -(0.5 * distances) - 0.25
        expected = viterbi(emissions, transitions, mask) if lag is None else fixed_lag_viterbi(
            emissions, transitions, mask, lag
        )
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
    assert as_transition_model(model) is model
    fixed = as_transition_model(0.5)
    assert isinstance(fixed, FixedWeight) and not fixed.is_zero and FixedWeight(0.0).is_zero
    assert same_bits(fixed(distances), -(0.5 * distances))


# ---------------------------------------------- nobody else weights or chooses


def _source(node, text):
    return ast.get_source_segment(text, node) or ""


def _mentions_beta(source):
    return "beta" in source or "transition_weight" in source


def _is_label(node):
    """A report's params dict read by key (``params["beta"]``, ``params.get("beta")``): a
    label of a finished result, not a decoder's configuration."""
    return any(isinstance(part, ast.Constant) and part.value == "beta" for part in ast.walk(node))


def test_no_module_weights_distances_or_chooses_the_decoder_on_its_own():
    """``-(beta * d)`` and ``beta == 0`` belong to kernels/transitions.py. The plain-Python
    parts (core, standalone: the reference and its reports) keep their own float
    arithmetic, which this module reproduces bit for bit; a finished result's params
    dict may still be read by key for its report."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        if relative == "kernels/transitions.py" or relative.split("/")[0] in ("core", "standalone"):
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            weighting = (
                isinstance(node, ast.UnaryOp)
                and isinstance(node.op, ast.USub)
                and isinstance(node.operand, ast.BinOp)
                and isinstance(node.operand.op, ast.Mult)
            ) or (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, ast.Mult)
                and any(isinstance(side, ast.UnaryOp) and isinstance(side.op, ast.USub) for side in (node.left, node.right))
            )
            choosing = (
                isinstance(node, ast.Compare)
                and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
                and any(isinstance(side, ast.Constant) and side.value == 0 for side in node.comparators)
                and not _is_label(node.left)
            )
            if (weighting or choosing) and _mentions_beta(_source(node, text)):
                found.append(f"{relative}:{node.lineno}: {_source(node, text)}")
    assert found == []


# ------------------------------------------------------------- the learned (gated) model


def _gated_inputs(seed, batch=3, turns=4, candidates=3, features=2):
    generator = torch.Generator().manual_seed(seed)
    distances = torch.randint(0, 4, (batch, turns - 1, candidates, candidates), generator=generator).double()
    move_features = torch.randn(batch, turns - 1, candidates, features, generator=generator, dtype=torch.float64)
    return distances, move_features


def test_gated_model_at_its_initial_values_is_the_fixed_model_bit_for_bit():
    distances, features = _gated_inputs(0)
    for beta in (0.0, 0.3, 1.0, 2.5):
        fixed = weighted_transitions(distances, beta)
        assert same_bits(GatedTransitions(beta)(distances), fixed)
        assert same_bits(GatedTransitions(beta, num_features=2)(distances, features), fixed)


class _PairTable:
    """A graph answering d(a, b) from a table (the standalone decoder's view of a matrix)."""

    maximum_distance = 1e9

    def __init__(self, table):
        self.table = table

    def distance(self, a, b):
        return self.table[(a, b)]

    def neighborhood(self, chunk_id, radius):
        return ()


def test_gated_transitions_decode_as_the_standalone_decoder_given_the_same_matrix():
    from mapmatched_torch.core.models import DecoderCandidate
    from mapmatched_torch.standalone import StandaloneDecoder

    model = GatedTransitions(0.8, num_features=2, calibrate=True, cap=2.5)
    with torch.no_grad():
        model.gate_bias.fill_(0.4)
        model.gate_weights.copy_(torch.tensor([1.3, -0.7]))
    for seed in range(4):
        distances, features = _gated_inputs(seed)
        transitions = model(distances, features).detach()
        batch, turns, candidates = distances.shape[0], distances.shape[1] + 1, distances.shape[2]
        scores = torch.randint(-2, 3, (batch, turns, candidates), generator=torch.Generator().manual_seed(seed)).double()
        mask = torch.ones(batch, turns, candidates, dtype=torch.bool)
        for lag in (None, 1):
            decoded = decode_weighted(scores, None, mask, model.bind(features), lag, transitions=transitions)
            for b in range(batch):
                trellis = [[DecoderCandidate(f"{t}:{m}", 0.0, scores[b, t, m].item()) for m in range(candidates)]
                           for t in range(turns)]
                table = {(f"{t}:{j}", f"{t + 1}:{i}"): -transitions[b, t, j, i].item()
                         for t in range(turns - 1) for j in range(candidates) for i in range(candidates)}
                path = StandaloneDecoder().decode(trellis, _PairTable(table), emission_weight=1.0,
                                                  transition_weight=1.0, fixed_lag=lag)
                chosen = decoded.paths[b].tolist()
                assert tuple(f"{t}:{chosen[t]}" for t in range(turns)) == path.chunk_ids
                assert decoded.scores[b].item() == path.total_score


def test_gated_transitions_gradcheck():
    """Analytic gradients of log Z through the module equal finite differences, for
    every parameter (beta, gate bias, gate weights, the saturation)."""
    from torch.func import functional_call

    from mapmatched_torch.kernels.decode import log_partition

    distances, features = _gated_inputs(1, batch=2, turns=3, candidates=2, features=1)
    scores = torch.randn(2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 3, 2, dtype=torch.bool)
    mask[1, 2, 1] = False
    model = GatedTransitions(0.7, num_features=1, calibrate=True, cap=3.0)
    names = ("transition_weight", "gate_bias", "gate_weights", "cap_parameter")
    start = (torch.tensor(0.7), torch.tensor(0.3), torch.tensor([0.9]), torch.tensor(1.2))
    inputs = tuple(value.double().requires_grad_(True) for value in start)

    def log_z(*values):
        transitions = functional_call(model, dict(zip(names, values)), (distances, features))
        return log_partition(scores, torch.where(mask[:, :-1, :, None] & mask[:, 1:, None, :], transitions, 0.0), mask)

    assert torch.autograd.gradcheck(log_z, inputs)


def test_calibration_bounds_a_far_jump_and_keeps_near_moves():
    model = GatedTransitions(1.0, calibrate=True, cap=3.0)
    distances = torch.tensor([[[[0.0, 0.01], [10.0, 1e6]]]], dtype=torch.float64)
    transitions = model(distances).detach()
    assert transitions[0, 0, 0, 0].item() == 0.0
    assert transitions[0, 0, 0, 1].item() == pytest.approx(-0.01, rel=1e-2)
    assert -3.0 <= transitions[0, 0, 1, 1].item() < transitions[0, 0, 1, 0].item() < 0.0


def test_gated_model_standardizes_from_training_features_and_checks_its_inputs():
    _, features = _gated_inputs(2, features=2)
    model = GatedTransitions(1.0, num_features=2).standardize_(features)
    flat = features.reshape(-1, 2)
    assert torch.allclose(model.feature_mean, flat.mean(0)) and torch.allclose(model.feature_std, flat.std(0, unbiased=False))
    distances = torch.zeros(3, 3, 3, 3, dtype=torch.float64)
    with pytest.raises(MapMatchedValueError, match="gates on 2 feature"):
        model(distances)
    with pytest.raises(MapMatchedValueError, match="num_features=2"):
        model(distances, features[..., :1])
    with pytest.raises(MapMatchedValueError, match="cap must be > 0"):
        GatedTransitions(1.0, calibrate=True, cap=0.0)
    assert decoding_mode(GatedTransitions(0.0, num_features=2).bind(features)) is DecodingMode.POINTWISE


def test_query_source_cosine_is_the_new_querys_cosine_to_each_previous_candidate():
    queries = torch.tensor([[[1.0, 0.0], [0.0, 2.0]]])
    candidates = torch.tensor([[[[3.0, 0.0], [0.0, 1.0], [1.0, 1.0]], [[0.0, 0.0]] * 3]])
    cosine = query_source_cosine(queries, candidates)
    assert cosine.shape == (1, 1, 3, 1)
    assert torch.allclose(cosine[0, 0, :, 0], torch.tensor([0.0, 1.0, 2**-0.5]))
