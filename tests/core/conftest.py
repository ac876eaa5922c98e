"""The core tests' shared fixture: Python's own SIGINT handler, whatever the shell gave.

A shell's background job (``cmd &``) starts with SIGINT ignored, and Python then keeps it
ignored; the tests of the SIGINT hold-back (``core/signals.py``, ``core/files.py``) need
the interpreter's ``default_int_handler``, so they get it here and the previous handler
comes back afterwards.
"""

from __future__ import annotations

import signal

import pytest


@pytest.fixture
def python_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
