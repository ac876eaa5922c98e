"""One call at a time: the decorator that runs a server method holding its lock."""

from __future__ import annotations

from functools import wraps

__all__ = ["serialized"]


def serialized(method):
    """Run ``method`` holding the server's lock: one call at a time (see the class docstring)."""

    @wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


#: Above this |normalized score| (times lambda when lambda > 1) a trace's margin or
#: entropy could overflow, so the session's results are built during the step.
