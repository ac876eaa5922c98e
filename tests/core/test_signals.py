"""deferred_sigint: SIGINT inside the block arrives after it, once, through the previous handler."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from mapmatched_torch.core.signals import deferred_sigint


def test_sigint_inside_the_block_is_raised_after_the_block_and_nothing_in_between(python_sigint):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("first")
            with deferred_sigint():  # nested: delivered at the end of the outermost
                done.append("second")
            done.append("third")
    assert done == ["first", "second", "third"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_custom_handler_gets_the_deferred_signal_and_other_threads_are_untouched():
    got = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: got.append(number))
    try:
        with deferred_sigint():
            os.kill(os.getpid(), signal.SIGINT)
            assert got == []
        assert got == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(deferred_sigint().__enter__() is None))
    thread.start()
    thread.join()
    assert seen == [True]
