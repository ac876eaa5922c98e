"""Fits on one torch thread, so that their sums do not depend on the thread count.

A CPU reduction of a tensor larger than torch's grain size (32768 elements) to a
0-d value is split over the intra-op threads, and the partial sums are added in an
order that depends on how many there are. The gradient of a 0-d weight (lambda,
beta, a gate's bias) is such a reduction, so a fit on two threads can end one bit away
from the same fit on one thread, which is what every process of a ``torchrun`` run
uses. :func:`one_thread` runs a fit on one thread whatever the process's setting: the
fitted weights are then the same bit for bit in a plain run and under ``torchrun``,
for any ``OMP_NUM_THREADS``.

Example:
    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with one_thread():
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["one_thread"]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(1)``; restore the thread count after it.

    Cost: the block runs on one intra-op thread (the fits are small dynamic programs
    over (B, T, M, M) tensors; under torchrun every process already runs on one).
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
