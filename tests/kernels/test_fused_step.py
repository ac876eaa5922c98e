"""kernels/fused_step.py: the fused incremental step equals the torch step bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from mapmatched_torch.kernels.fused import use_fused_kernels
from mapmatched_torch.kernels.slot_decoder import SlotDecoder
from mapmatched_torch.kernels.numba_runtime import available

pytestmark = pytest.mark.skipif(not available(), reason="numba is not installed")


def run(fused, dtype, lag, beta, seed, width=5, slots=6, turns=7):
    """Every state tensor and step output of a random run, fused or not."""
    use_fused_kernels(fused)
    try:
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        decoder = SlotDecoder(width, transition_weight=beta, fixed_lag=lag, capacity=2, dtype=dtype)
        table = [decoder.allocate() for _ in range(slots)]
        outputs = []
        for turn in range(turns):
            picked = torch.tensor(sorted(rng.sample(table, rng.randint(1, slots))))
            count = picked.shape[0]
            mask = torch.rand(count, width, generator=generator) < 0.7
            mask[:, 0] |= ~mask.any(1)
            if rng.random() < 0.3:  # exact ties: integer scores and distances
                scores = torch.randint(-2, 3, (count, width), generator=generator).double()
                distances = torch.randint(0, 3, (count, width, width), generator=generator).double()
            else:
                scores = torch.randn(count, width, generator=generator, dtype=torch.float64)
                distances = torch.rand(count, width, width, generator=generator, dtype=torch.float64) * 3
            if rng.random() < 0.1:  # an overflowing row
                scores[0] = 1e308 if dtype == torch.float64 else 1e38
            step = decoder.step(picked, scores, mask, distances)
            outputs.append(tuple(step))
            if rng.random() < 0.2:
                released = rng.choice(table)
                decoder.release(released)
                table[table.index(released)] = decoder.allocate()
        return outputs, decoder.state_dict()["tensors"]
    finally:
        use_fused_kernels(True)


def same_bits(a, b):
    if a.dtype.is_floating_point:
        return torch.equal(a.view(torch.int64 if a.dtype == torch.float64 else torch.int32),
                           b.view(torch.int64 if b.dtype == torch.float64 else torch.int32))
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lag", [None, 0, 2])
@pytest.mark.parametrize("beta", [1.0, 0.0, 2.5])
def test_the_fused_step_equals_the_torch_step_bit_for_bit(dtype, lag, beta):
    for seed in range(4):
        fused_out, fused_state = run(True, dtype, lag, beta, seed)
        torch_out, torch_state = run(False, dtype, lag, beta, seed)
        for got, want in zip(fused_out, torch_out):
            assert all(same_bits(a, b) for a, b in zip(got, want))
        assert all(same_bits(fused_state[name], torch_state[name]) for name in torch_state)


def test_the_fused_step_is_what_runs_and_the_torch_path_is_the_fallback(monkeypatch):
    from mapmatched_torch.kernels import fused_step

    calls = []
    original = fused_step.max_plus_step
    monkeypatch.setattr(fused_step, "max_plus_step", lambda *a: calls.append(original(*a)) or calls[-1])
    decoder = SlotDecoder(2)
    slot = torch.tensor([decoder.allocate()])
    decoder.step(slot, torch.tensor([[1.0, 0.0]]), torch.tensor([[True, True]]))
    assert calls and calls[-1] is not None
    use_fused_kernels(False)
    try:
        decoder.step(slot, torch.tensor([[1.0, 0.0]]), torch.tensor([[True, True]]), torch.zeros(1, 2, 2))
        assert calls[-1] is None
    finally:
        use_fused_kernels(True)
