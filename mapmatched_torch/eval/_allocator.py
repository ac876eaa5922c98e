"""Give the C allocator's free memory back to the operating system between phases.

glibc's ``malloc`` serves allocations below its (adaptive, up to 32 MiB) mmap threshold
from its heap, and a heap page is returned only when everything on it is free. The
harness's gather and summary make many tens-of-megabyte temporaries next to what they
keep, so the freed ones stayed resident: rank 0 of a two-process run over 200k
conversations grew by 0.42 GiB while receiving 0.12 GB of coded metrics.
:func:`trim_heap` calls ``malloc_trim(0)``, which releases every free page of the heap
(``madvise``), after each such phase step; elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any, Optional

__all__ = ["trim_heap"]


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[Any]:
    """glibc, loaded once; None elsewhere (or without ``malloc_trim``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def trim_heap() -> None:
    """Release the C heap's free pages to the OS (``malloc_trim(0)`` on glibc; a no-op elsewhere)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
