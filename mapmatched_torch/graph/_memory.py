"""Memory budgets of the search engines: how many sources' (N,) rows fit at once."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from ..core.errors import MapMatchedValueError

__all__ = [
    "DEFAULT_MEMORY_BUDGET", "budget", "rows_per_chunk", "empty_in_huge_pages", "available_bytes", "prefault",
    "load_vector",
]

#: Default bytes of search state per chunk of sources (torch workspace, scipy output).
DEFAULT_MEMORY_BUDGET = 1 << 30


def budget(memory_budget: Optional[int]) -> int:
    """The memory budget in bytes (:data:`DEFAULT_MEMORY_BUDGET` when None)."""
    return DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)


def rows_per_chunk(nodes: int, count: int, memory_budget: Optional[int], bytes_per_entry: int = 8) -> int:
    """How many of ``count`` sources' (N,) rows of ``bytes_per_entry`` fit in the budget (in ``[1, count]``)."""
    return max(1, min(count, budget(memory_budget) // (bytes_per_entry * max(nodes, 1))))


#: Tables at least this large are placed in transparent huge pages where possible.
HUGE_PAGE_MIN_BYTES = 64 << 20
_HUGE_PAGE = 1 << 21
_MADV_HUGEPAGE = 14


def empty_in_huge_pages(shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose memory is advised for transparent huge pages.

    A gather of a million random entries from a multi-GB table is bound by TLB misses
    with 4 KiB pages: measured here, 8-32 ms per million from a 3 GB table, 6 ms with
    2 MiB pages. On Linux the memory is aligned to 2 MiB and ``madvise(MADV_HUGEPAGE)``
    is called before the first touch, so the kernel backs it with huge pages when it
    can (``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``madvise`` or
    ``always``). Elsewhere, below :data:`HUGE_PAGE_MIN_BYTES`, or when the call fails,
    this is ``torch.empty``. Values are unaffected either way.
    """
    count = 1
    for size in shape:
        count *= int(size)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    try:
        base = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
        start = (base.data_ptr() + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
        advised = ctypes.CDLL(None, use_errno=True).madvise(
            ctypes.c_void_p(start), ctypes.c_size_t(nbytes & ~(_HUGE_PAGE - 1)), _MADV_HUGEPAGE
        )
        if advised != 0:
            return torch.empty(shape, dtype=dtype)
        offset = start - base.data_ptr()
        return base[offset:offset + nbytes].view(dtype).view(shape)
    except (OSError, AttributeError, RuntimeError):
        return torch.empty(shape, dtype=dtype)


def available_bytes() -> Optional[int]:
    """The memory the OS says is available (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


#: The page size whose every page :func:`prefault` reads (4 KiB: the smallest on Linux).
_PAGE = 4096


def prefault(tensors: "list[torch.Tensor]") -> int:
    """Read one value from every 4 KiB page of ``tensors`` (memory-mapped CPU tensors), so
    that the OS maps their pages now rather than on the queries' first touches; returns
    the bytes covered.

    A memory-mapped array's page is mapped into the process on its first read: on the
    1M-node ball table (1.65 GB) the first serving step of 1,024 sessions took 107-132 ms
    against 34-40 ms for the next, and 49 ms after this 0.25 s read (docs/scale.md).
    """
    covered = 0
    for tensor in tensors:
        flat = tensor.numpy().reshape(-1)
        if flat.size:
            step = max(1, _PAGE // flat.itemsize)
            flat[::step].sum()  # the strided read faults each page in once
        covered += flat.size * flat.itemsize
    return covered


def load_vector(path: Path, mmap: bool, dtypes: Sequence[Any], what: str) -> torch.Tensor:
    """A 1-D ``.npy`` file of one of ``dtypes`` as a CPU tensor, memory-mapped
    copy-on-write when ``mmap`` (the file is never written), else read.

    Raises:
        MapMatchedValueError: an unreadable file, or another dtype or shape (``what``
            names the structure in the message, e.g. "graph artifact").
    """
    try:
        array = np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
    except (ValueError, OSError) as error:
        raise MapMatchedValueError(f"{what}: {path.name} is not a readable array ({error})") from None
    allowed = [np.dtype(dtype) for dtype in dtypes]
    if array.dtype not in allowed or array.ndim != 1:
        expected = " or ".join(str(dtype) for dtype in allowed)
        raise MapMatchedValueError(f"{what}: {path.name} holds {array.dtype} {array.shape}, expected 1-D {expected}")
    return torch.from_numpy(array)
