"""SIGINT held back while state is committed, delivered when the commit is done.

A commit is a few assignments that must all happen or none (a server's session map and
its slot table, a decoder's storage and its bookkeeping). Python raises
``KeyboardInterrupt`` between any two bytecodes, so Ctrl-C could land between two of
them; inside :func:`deferred_sigint` the signal is recorded instead, and raised (through
the handler that was installed before) once the block ends. Nothing else is deferred:
a failure inside the block is the caller's (a commit is written so that nothing in it
can fail but an interrupt).

Example:
    >>> with deferred_sigint():
    ...     committed = 1 + 1  # an interrupt here arrives after the block
    >>> committed
    2
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, List

__all__ = ["deferred_sigint"]

_depth = threading.local()


@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Hold SIGINT back during the block and deliver it when the block ends (to the
    handler installed before, e.g. as ``KeyboardInterrupt``).

    Only the main thread receives signals, so elsewhere (and where no Python handler is
    installed: ``SIG_IGN``, or a handler set outside Python) nothing is changed. Nested
    blocks deliver at the end of the outermost. Cost: two ``signal.signal`` calls.
    """
    if threading.current_thread() is not threading.main_thread() or getattr(_depth, "value", 0):
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous) and previous != signal.SIG_DFL:
        yield
        return
    caught: List[Any] = []
    signal.signal(signal.SIGINT, lambda number, frame: caught.append((number, frame)))
    _depth.value = 1
    try:
        yield
    finally:
        _depth.value = 0
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(*caught[0])
            else:  # SIG_DFL: what the default does to a Python process that catches nothing
                raise KeyboardInterrupt
