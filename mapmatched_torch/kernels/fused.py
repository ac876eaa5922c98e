"""Fused decode kernels behind one dispatch: the default wherever they apply.

:func:`~mapmatched_torch.kernels.decode.viterbi` and
:func:`~mapmatched_torch.kernels.decode.fixed_lag_viterbi` ask :func:`max_plus` first;
it returns None when no fused kernel applies, and the caller runs the torch path
(:mod:`.chain`), which stays the reference and the fallback. A fused kernel applies
when

- it is enabled (default; :func:`use_fused_kernels` or the environment variable
  ``MAPMATCHED_TORCH_FUSED=0`` turn it off),
- the tensors are on the CPU, float32 or float64, and none requires a gradient,
- numba is installed (the ``numba`` extra).

CPU kernel (:mod:`.fused_cpu_kernels`): one thread decodes one conversation at a time,
its whole trellis in one pass over its transitions, with the forward scores and
backpointers in thread-local buffers (``T x M``). That replaces the torch path's
T-step loop of (B, M, M) temporaries, masking and stacking. Checks are fused too:
the kernel flags a row that breaks a rule of
:func:`~mapmatched_torch.kernels.checks.prepare`, and only then are the torch checks run,
to raise their exact message; overflow raises the same message as the torch path.

Results equal the torch path bit for bit (paths, scores, locks; ties to the first
index; errors): the recursion is evaluated in the same order with additions,
comparisons and selects only. ``tests/kernels/test_fused.py`` checks this on
randomized and adversarial trellises.

Threads: ``torch.get_num_threads()`` (so ``OMP_NUM_THREADS`` and
``torch.set_num_threads`` apply), serial below 32 conversations
(:mod:`.numba_runtime`). The first call in a process with a cold numba cache compiles
the kernel for its dtype (a few seconds); numba's on-disk cache keeps it for later
processes.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from . import numba_runtime
from .checks import prepare, raise_if_nonfinite

__all__ = ["use_fused_kernels", "fused_kernels_enabled", "applies", "max_plus"]

_STATE = {"enabled": os.environ.get("MAPMATCHED_TORCH_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")}

_DTYPES = (torch.float32, torch.float64)


def use_fused_kernels(enabled: bool = True) -> None:
    """Turn the fused decode kernels on (the default) or off (the torch path everywhere).

    Results are the same either way; only speed differs.
    """
    _STATE["enabled"] = bool(enabled)


def fused_kernels_enabled() -> bool:
    """Whether the fused kernels are enabled (they still apply only where :func:`applies`)."""
    return _STATE["enabled"]


def applies(*tensors: Tensor) -> bool:
    """Whether a fused kernel can decode these (already shape-checked) tensors."""
    if not _STATE["enabled"] or not numba_runtime.available():
        return False
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in _DTYPES:
        return False
    return not any(tensor.requires_grad for tensor in tensors)


def _kernels():
    from . import fused_cpu_kernels

    return fused_cpu_kernels


def _array(tensor: Tensor) -> np.ndarray:
    """A C-contiguous numpy view (a copy only when the tensor is not contiguous)."""
    return tensor.detach().contiguous().numpy()


def max_plus(
    emissions: Tensor, transitions: Tensor, mask: Tensor, lag: Optional[int]
) -> Optional[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Viterbi (``lag`` None) or fixed-lag decoding with a fused kernel, or None.

    Args:
        emissions: ``(B, T, M)`` float32/float64 weighted emissions (shape-checked).
        transitions: ``(B, T-1, M, M)`` weighted transitions ``[b, t, from, to]``, same
            dtype (shape-checked).
        mask: ``(B, T, M)`` bool real candidates.
        lag: None (full Viterbi) or the fixed lag L >= 0.

    Returns:
        None when no fused kernel applies (run the torch path), else
        ``(paths (B, T) long, scores (B,) dtype, locks (B, T) long, lengths (B,) long)``
        exactly as the torch path computes them (``locks`` all -1 without a lag).

    Raises:
        MapMatchedValueError: the torch checks' message for an invalid trellis, or the
            overflow message, as the torch path raises them.
    """
    if not applies(emissions, transitions, mask):
        return None
    kernels = _kernels()
    batch, turns, _ = emissions.shape
    paths = torch.empty((batch, turns), dtype=torch.long)
    locks = torch.empty((batch, turns), dtype=torch.long)
    scores = torch.empty((batch,), dtype=emissions.dtype)
    status = torch.empty((batch,), dtype=torch.int8)
    arguments = (
        _array(emissions),
        _array(transitions),
        _array(mask),
        -1 if lag is None else int(lag),
        paths.numpy(),
        scores.numpy(),
        locks.numpy(),
        status.numpy(),
    )
    blocks = numba_runtime.blocks_for(torch.get_num_threads(), batch)
    numba_runtime.call(kernels.decode, kernels.decode_serial, arguments, blocks)
    if bool((status == kernels.INVALID).any()):
        prepare(emissions, transitions, mask, max_plus=True)  # raises the torch path's message
        return None  # unreachable unless the kernel and the checks disagree: the torch path decides
    raise_if_nonfinite(status == kernels.OVERFLOW)
    lengths = (paths >= 0).sum(dim=1)
    return paths, scores, locks, lengths
