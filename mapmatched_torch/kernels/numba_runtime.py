"""How the package calls numba kernels: one lock, torch's thread count kept, serial below a size.

numba is optional (the ``numba`` extra). Every numba kernel of the package (the fused
decoders of :mod:`.fused`, the compiled shortest-path engine of
:mod:`mapmatched_torch.graph.engines.compiled`) is called through :func:`call`, which

- holds :data:`KERNEL_LOCK`: numba's fallback threading layer (workqueue, used when no
  OpenMP or TBB runtime is found) aborts the process on concurrent parallel calls, and
  each parallel call already uses every thread;
- restores torch's intra-op thread count afterwards: numba's OpenMP layer resets the
  process's shared OpenMP count when it starts and on each parallel call, and calling
  a kernel must never change the threads of the caller's tensor code;
- runs the serial variant when the work has fewer than :data:`SERIAL_BELOW` units:
  starting a parallel region costs more than it saves, and far more when the cores are
  busy elsewhere.

Kernels are compiled on first use and kept in numba's on-disk cache (``cache=True``),
so only the first process on a machine pays the compilation. Every process still pays,
on its first kernel call, numba's start: its CPU target and registries, about 0.5 s
(0.6 s measured on this project's 2-core machine, most of it numba importing scipy's
BLAS). :func:`warm` pays it up front: a server calls it when built, so that its first
step is not half a second late.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch

from ..core.optional import has_module

__all__ = ["available", "KERNEL_LOCK", "SERIAL_BELOW", "torch_threads_kept", "blocks_for", "call", "warm"]

#: Serializes kernel calls (see the module docstring).
KERNEL_LOCK = threading.Lock()

#: Below this many work units (rows, searches) a call runs on the calling thread.
SERIAL_BELOW = 32


def available() -> bool:
    """Whether numba imports (probed once, then cached)."""
    return has_module("numba")


@contextlib.contextmanager
def torch_threads_kept() -> Iterator[None]:
    """Restore torch's intra-op thread count on exit."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def blocks_for(threads: Optional[int], units: int) -> int:
    """Parallel blocks for ``units`` units of work: 1 (serial) below :data:`SERIAL_BELOW`,
    else ``threads`` (None or 0: numba's thread count), at most ``units``."""
    if units < SERIAL_BELOW:
        return 1
    if not threads:
        import numba

        with torch_threads_kept():  # the first call starts numba's thread pool
            threads = numba.get_num_threads()
    return max(1, min(int(threads), units))


_warmed = False


def warm() -> bool:
    """Start numba now (once per process; module docstring): load its CPU target by
    calling the smallest cached kernel. Returns whether numba is there. Thread-safe."""
    global _warmed
    if _warmed or not available():
        return _warmed
    with KERNEL_LOCK, torch_threads_kept():
        if not _warmed:
            import numpy as np

            from . import _numba_warm

            _numba_warm.touch(np.zeros(1))
            _warmed = True
    return True


def call(parallel: Callable[..., Any], serial: Callable[..., Any], args: tuple, blocks: int) -> None:
    """Run ``serial(*args)`` when ``blocks <= 1``, else ``parallel(*args, blocks)``,
    holding :data:`KERNEL_LOCK` and keeping torch's thread count."""
    with KERNEL_LOCK:
        if blocks <= 1:
            serial(*args)
            return
        with torch_threads_kept():
            parallel(*args, blocks)
