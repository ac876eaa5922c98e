"""kernels/fused_step.py: the fused incremental step equals the torch step bit for bit."""

from __future__ import annotations

import pytest
import torch

from mapmatched_torch.kernels.slot_decoder import SlotDecoder
from mapmatched_torch.kernels.numba_runtime import available
from mapmatched_torch.testing import fused_kernels_off, random_slot_run

pytestmark = pytest.mark.skipif(not available(), reason="numba is not installed")


def run(fused, dtype, lag, beta, seed, slots=6):
    """Every state tensor and step output of a random run, fused or not."""
    return random_slot_run("auto" if fused else "torch", dtype, lag, beta, seed, slots=slots)


def same_bits(a, b):
    if a.dtype.is_floating_point:
        return torch.equal(a.view(torch.int64 if a.dtype == torch.float64 else torch.int32),
                           b.view(torch.int64 if b.dtype == torch.float64 else torch.int32))
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lag", [None, 0, 2])
@pytest.mark.parametrize("beta", [1.0, 0.0, 2.5])
@pytest.mark.parametrize("slots", [6, 21])  # 21: backtrack groups of 8, the last partial
def test_the_fused_step_equals_the_torch_step_bit_for_bit(dtype, lag, beta, slots):
    for seed in range(4):
        fused_out, fused_state = run(True, dtype, lag, beta, seed, slots=slots)
        torch_out, torch_state = run(False, dtype, lag, beta, seed, slots=slots)
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
    with fused_kernels_off():
        decoder.step(slot, torch.tensor([[1.0, 0.0]]), torch.tensor([[True, True]]), torch.zeros(1, 2, 2))
        assert calls[-1] is None


@pytest.mark.parametrize("backend", ["numba", "triton"])
@pytest.mark.parametrize("poison", [None, "nan_transition", "inf_from_minus_inf", "nan_predecessor"])
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_the_fused_step_reads_negative_zero_and_infinite_scores_as_the_torch_step(poison, backend):
    """Predecessors at -0.0 (0.0 + -0.0 is +0.0), at -inf (locked out) and disallowed
    ones, ties between them, and a first turn (no predecessor); and NaN sums from a
    predecessor after the first, which ``torch.max`` carries forward (found by fuzzing).
    On both kernel backends (Triton under its interpreter without a GPU)."""
    from mapmatched_torch.kernels import fused_step, use_backend

    if backend == "triton":
        pytest.importorskip("triton")

    previous = torch.tensor([[-0.0, 0.0, -float("inf"), 1.0], [2.0, 2.0, -0.0, -float("inf")]])
    allowed = torch.tensor([[True, True, True, False], [True, True, False, True]])
    emissions = torch.tensor([[0.0, -0.0, 1.0, 0.5], [-0.0, 0.0, 0.0, 3.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, True, True]])
    distances = torch.tensor([[0.0, 1.0, 0.0, 2.0], [1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 1.0, 0.0]])
    distances = torch.stack([distances, distances.t()]).double()
    if poison == "nan_predecessor":
        previous[1, 1] = float("nan")
    for started in ([True, True], [False, True]):
        started = torch.tensor(started)
        for dtype in (torch.float32, torch.float64):
            for beta in (0.0, 1.0):
                args = (previous.to(dtype), allowed, started, emissions.to(dtype), mask)
                transitions = (distances * -beta).to(dtype)
                if poison == "nan_transition":
                    transitions[0, 1, 0] = float("nan")
                elif poison == "inf_from_minus_inf":
                    transitions[0, 2, 1] = float("inf")  # predecessor 2 is at -inf
                with use_backend(backend):
                    outs = [fused_step.max_plus_step(*args, transitions, distances)]
                    if poison is None or poison == "nan_predecessor":  # weighed distances are finite
                        outs.append(fused_step.max_plus_step(*args, None, distances, beta))
                assert all(out is not None for out in outs)
                with fused_kernels_off():
                    decoder_free = torch_step(*args, transitions, distances)
                for out in outs:
                    assert all(same_bits(a, b) for a, b in zip(out, decoder_free)), (poison, out, decoder_free)


def torch_step(previous, allowed, started, emissions, mask, transitions, distances):
    """The slot decoder's torch-path step (chain_step) on the same inputs."""
    from mapmatched_torch.kernels import chain, fused_step
    from mapmatched_torch.kernels.semiring import MAX_PLUS
    from mapmatched_torch.kernels.slot_decoder import _links

    pairs = allowed.unsqueeze(2) & mask.unsqueeze(1)
    alpha = torch.where(started.unsqueeze(1), torch.where(allowed, previous, -float("inf")), 0.0)
    weighted = torch.where(mask, emissions, 0.0)
    chained = chain.chain_step(MAX_PLUS, alpha, started, weighted, torch.where(pairs, transitions, 0.0), mask)
    return fused_step.FusedStep(chained.alpha, chained.backpointers, _links(distances, chained.backpointers),
                                chained.nonfinite)


@pytest.mark.parametrize("limit", [None, 0, 1, 5, 40])
def test_first_occurrences_equal_the_torch_path(limit):
    from mapmatched_torch.serving.session_store import _first_occurrences

    generator = torch.Generator().manual_seed(3)
    for rows, neighbours, candidates, codes in ((1, 0, 1, 3), (9, 4, 6, 8), (40, 12, 32, 30), (0, 3, 4, 5)):
        chunks = torch.randint(-1, codes, (rows,), generator=generator)
        around = torch.randint(-1, codes, (rows, neighbours), generator=generator)
        turn = torch.randint(-1, codes, (rows, candidates), generator=generator)
        got = _first_occurrences(chunks, around, turn, limit)
        with fused_kernels_off():
            want = _first_occurrences(chunks, around, turn, limit)
        assert got.dtype == want.dtype and torch.equal(got, want)
        for row, kept in zip(torch.cat([chunks.unsqueeze(1), around, turn], 1).tolist(), got.tolist()):
            expected = list(dict.fromkeys(code for code in row if code >= 0))[:limit]
            assert [code for code in kept if code >= 0] == expected


def test_first_occurrences_of_nothing_listed():
    from mapmatched_torch.kernels import fused_step

    assert fused_step.first_occurrences(torch.full((3, 4), -1), None).shape == (3, 0)


def test_the_code_stamps_are_kept_across_calls_and_grow_once():
    """No (N,) scratch per call: stamps from earlier calls never read as this call's."""
    from mapmatched_torch.kernels import fused_step

    listed = torch.tensor([[3, 1, 3, -1], [1, 1, 2, 3]])
    first = fused_step.first_occurrences(listed, None)
    array = fused_step._STAMPS.array
    for _ in range(3):  # the same codes again: earlier stamps must not hide them
        assert torch.equal(fused_step.first_occurrences(listed, None), first)
        assert fused_step._STAMPS.array is array
    assert first.tolist() == [[3, 1, -1], [1, 2, 3]]
    wide = torch.tensor([[array.shape[0] + 5, 0, array.shape[0] + 5]])
    assert fused_step.first_occurrences(wide, None).tolist() == [[array.shape[0] + 5, 0]]
    assert fused_step._STAMPS.array.shape[0] >= array.shape[0] + 6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lag", [None, 1])
@pytest.mark.parametrize("learned", ["gated", "calibrated"])
def test_a_learned_models_moves_made_in_the_kernel_equal_the_torch_step(dtype, lag, learned):
    """A GatedTransitions' per-move factors -(beta * gate) weighed in the numba kernel
    (no lag; with one, its transitions are given): every output, the learned costs along
    the paths and the final table, bit for bit."""
    for seed in range(3):
        fused = random_slot_run("auto", dtype, lag, 0.8, seed, learned=learned)
        reference = random_slot_run("torch", dtype, lag, 0.8, seed, learned=learned)
        for got, want in zip(fused[0], reference[0]):
            assert all(same_bits(a, b) for a, b in zip(got, want))
        assert all(same_bits(fused[1][name], reference[1][name]) for name in reference[1])
        assert "link_transitions" in reference[1]
