"""Fixtures of the evaluation tests: fixture paths, the shared INSCIT data, devices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: ``shared/data/inscit_dev`` beside the repository (absent on some machines: tests skip).
INSCIT_DEV = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "inscit_dev"


@pytest.fixture
def fixtures() -> Path:
    """The folder of the hand-written fixture files."""
    return FIXTURES


@pytest.fixture
def inscit_dev() -> Path:
    """The shared normalized INSCIT dev folder, or a skip when it is not there."""
    if not (INSCIT_DEV / "inscit_dev.conversations.jsonl").is_file():
        pytest.skip(f"shared INSCIT data not found at {INSCIT_DEV}")
    return INSCIT_DEV


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def eval_device(request) -> torch.device:
    """CPU always; CUDA when present (skipped, not failed, without a GPU)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    return torch.device(request.param)
