"""Shared fixtures: the device parametrization (CPU always, CUDA when present)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton decides at its first import whether kernels compile or run under its
# interpreter; without a GPU, the Triton kernels' tests run them interpreted on CPU
# tensors (mapmatched_torch.kernels.triton_runtime does the same outside the tests).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mapmatched_torch.testing import DEVICES, device_available


@pytest.fixture(params=[pytest.param(name, marks=[pytest.mark.cuda] if name == "cuda" else []) for name in DEVICES])
def device(request) -> torch.device:
    """Every device the tests can run on; CUDA skips (not fails) without a GPU."""
    if not device_available(request.param):
        pytest.skip(f"{request.param} is not available on this machine")
    return torch.device(request.param)


@pytest.fixture(autouse=True, scope="session")
def single_intra_op_thread():
    """The suite's tensors are tiny: on a 2-core machine intra-op threads only add
    synchronization overhead (up to 40x on a busy machine), so tests run on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
