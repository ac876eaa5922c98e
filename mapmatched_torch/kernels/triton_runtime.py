"""How the package imports Triton and launches its kernels: compiled on CUDA tensors,
under Triton's interpreter on CPU tensors.

Triton decides at its first import whether its kernels compile (for a GPU) or run
under its interpreter (``TRITON_INTERPRET=1``: each program instance runs one after
another in numpy, on CPU tensors). One process cannot have both. So:

- in a process without a CUDA device, :func:`import_triton` sets ``TRITON_INTERPRET=1``
  before the first import of triton (unless the variable is already set), and the
  Triton kernels run on CPU tensors, exactly and slowly: this is how the tests prove
  them in CI;
- in a process with a CUDA device, triton compiles; a Triton kernel asked to run on
  CPU tensors there raises a clear error (set ``TRITON_INTERPRET=1`` before anything
  imports triton to use the interpreter instead).

Where the interpreter and compiled kernels may differ (see the kernels' docstrings):
``tl.exp`` / ``tl.log`` are numpy's under the interpreter and the GPU's (libdevice in
float64, hardware approximations in float32) when compiled, so the log-semiring
kernels agree to a stated ulp bound, not bit for bit; max-plus kernels only add,
compare and select, so they are exact in both.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch

from ..core.errors import MapMatchedValueError
from ..core.optional import has_module, import_optional

__all__ = ["available", "import_triton", "interpreted", "check_device", "block_for", "warps_for"]


def available() -> bool:
    """Whether triton is installed (imports it, as :func:`import_triton` would)."""
    if "triton" not in sys.modules:
        _choose_mode()
    return has_module("triton")


def _choose_mode() -> None:
    if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def import_triton() -> ModuleType:
    """The ``triton`` module, imported in the mode this process can run (see above).

    Raises:
        MissingDependencyError: triton is not installed (an ``ImportError`` naming the
            ``triton`` extra).
    """
    if "triton" not in sys.modules:
        _choose_mode()
    return import_optional("triton", "triton", "the Triton kernels")


def interpreted() -> bool:
    """Whether this process's Triton kernels run under the interpreter."""
    import_triton()
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def check_device(tensor: torch.Tensor) -> None:
    """Raise unless a Triton kernel can run on ``tensor``'s device in this process."""
    if tensor.device.type == "cpu" and not interpreted():
        raise MapMatchedValueError(
            "Triton kernels run on CPU tensors only under Triton's interpreter: set TRITON_INTERPRET=1 "
            "before anything imports triton, or move the tensors to the GPU, or choose another kernel backend "
            "(mapmatched_torch.kernels.use_backend)"
        )


def block_for(candidates: int) -> int:
    """The power-of-two block (at least 2) that holds ``candidates`` lanes."""
    block = 2
    while block < candidates:
        block *= 2
    return block


def warps_for(block: int) -> int:
    """Warps per program for an ``(block, block)`` tile: one warp up to 32 x 32."""
    return 1 if block <= 32 else (2 if block <= 64 else 4)
