"""The one switch that picks the kernels: ``"torch"``, ``"numba"`` or ``"triton"``.

Every dynamic program of :mod:`mapmatched_torch.kernels` has a torch path (the eager
chain DP of :mod:`.chain`: the reference, and the fallback wherever no kernel applies),
and most have compiled kernels behind :mod:`.fused`:

- ``"numba"``: the CPU kernels (:mod:`.fused_cpu_kernels`, :mod:`.fused_log_kernels`,
  the serving step and the compiled shortest-path engine); CPU tensors only;
- ``"triton"``: the Triton kernels (:mod:`._triton_max_plus`, :mod:`._triton_log`),
  compiled for CUDA tensors; on CPU tensors they run under Triton's interpreter
  (``TRITON_INTERPRET=1``, see :mod:`.triton_runtime`): exact, and slow (for tests);
- ``"torch"``: no compiled kernel anywhere.

The default, ``"auto"``, takes numba for CPU tensors and Triton for CUDA tensors, each
when installed, else the torch path. An explicit choice is strict: asking for
``"numba"`` or ``"triton"`` without the package raises
:class:`~mapmatched_torch.core.errors.MissingDependencyError` naming the extra. Where the
chosen backend has no kernel for a computation (numba on a CUDA tensor; Triton for a
kernel not yet written in Triton), the torch path runs. Results are the same on every
backend (max-plus bit for bit; the log semiring to the ulp bounds of each kernel's
docstring); only speed differs.

Set it for the process with the environment variable ``MAPMATCHED_TORCH_KERNELS``
(``auto``, ``torch``, ``numba``, ``triton``; read once, at import) or in code:

Example:
    >>> from mapmatched_torch.kernels import use_backend, current_backend
    >>> with use_backend("torch"):
    ...     current_backend()
    'torch'
    >>> current_backend()
    'auto'

The setting is process-wide (like ``torch.set_num_threads``), not per thread.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError
from ..core.optional import has_module, import_optional
from . import triton_runtime

__all__ = [
    "BACKENDS",
    "OK",
    "INVALID",
    "OVERFLOW",
    "use_backend",
    "current_backend",
    "backend_for",
]

#: The names :func:`use_backend` takes (besides ``"auto"``).
BACKENDS = ("torch", "numba", "triton")

#: Row status codes that every kernel backend writes, one per conversation.
#: OK: decoded. INVALID: the trellis breaks a rule of
#: :func:`~mapmatched_torch.kernels.checks.prepare` (the caller re-runs the torch checks
#: to raise their exact message). OVERFLOW: a forward score at a real candidate is not
#: finite.
OK = 0
INVALID = 1
OVERFLOW = 2

_ENVIRONMENT = "MAPMATCHED_TORCH_KERNELS"


def _check(name: object) -> str:
    return check_choice("kernel backend", name.strip().lower() if isinstance(name, str) else name,
                        ("auto",) + BACKENDS)


def _from_environment() -> str:
    chosen = os.environ.get(_ENVIRONMENT)
    if chosen is not None and chosen.strip():
        try:
            return _check(chosen)
        except MapMatchedValueError as error:
            raise MapMatchedValueError(f"{_ENVIRONMENT}: {error}") from None
    legacy = os.environ.get("MAPMATCHED_TORCH_FUSED", "1").strip().lower()  # 0.1's off switch
    return "torch" if legacy in ("0", "false", "no", "off") else "auto"


_STATE = {"backend": _from_environment()}


class use_backend:  # noqa: N801 - used like a function, as torch.set_grad_enabled
    """Choose the kernel backend: now, and back to the previous one when used as a
    context manager.

    Args:
        name: ``"auto"`` (numba on CPU tensors, Triton on CUDA tensors, each when
            installed), ``"torch"``, ``"numba"`` or ``"triton"``.

    Raises:
        MapMatchedValueError: an unknown name (nothing changes).
        MissingDependencyError: ``"numba"`` or ``"triton"`` is not installed (an
            ``ImportError`` naming the extra; nothing changes).
    """

    def __init__(self, name: str) -> None:
        chosen = _check(name)
        if chosen == "numba":
            import_optional("numba", "numba", "the numba kernel backend")
        elif chosen == "triton":
            triton_runtime.import_triton()
        self._previous = _STATE["backend"]
        _STATE["backend"] = chosen

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc_info: object) -> None:
        _STATE["backend"] = self._previous


def current_backend() -> str:
    """The chosen backend's name (``"auto"`` unless chosen otherwise)."""
    return _STATE["backend"]


def backend_for(device: torch.device) -> Optional[str]:
    """The kernel backend that runs for tensors on ``device``: ``"numba"``,
    ``"triton"``, or None (the torch path)."""
    chosen = _STATE["backend"]
    if chosen == "torch":
        return None
    if chosen == "auto":
        if device.type == "cpu":
            return "numba" if has_module("numba") else None
        return "triton" if device.type == "cuda" and triton_runtime.available() else None
    if chosen == "numba":
        return "numba" if device.type == "cpu" else None
    return "triton"
