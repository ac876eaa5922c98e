"""Progress of the long loops (evaluation, fitting, embedding, graph building, contexts).

:func:`progress_bar` is the one entry point. On a terminal it is a tqdm bar, as before.
When stderr is not a terminal (a log file, a pipe, a CI job), a tqdm bar writes
``\\r``-joined redraws or nothing at all, so a long run looked dead; there it prints a
plain line instead, at most every :data:`INTERVAL` seconds::

    evaluating inscit_dev: 120/500 conv (24%), 3.1 conv/s, ETA 2 min 3 s

and, if it printed any, one last line when the loop ends. Loops shorter than
:data:`INTERVAL` print nothing. Disabled, it is a no-op with the same methods.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, Optional

from tqdm.auto import tqdm

__all__ = ["progress_bar", "progress_wanted", "INTERVAL"]

#: Seconds between two plain progress lines (stderr not a terminal).
INTERVAL = 10.0

_clock = time.monotonic  # tests replace it


def progress_wanted(progress: Optional[bool], main: bool = True) -> bool:
    """Whether a loop shows progress: True or False decide; None: on the main process
    (rank 0), as a bar on a terminal and as plain lines elsewhere (:func:`progress_bar`)."""
    return main if progress is None else bool(progress)


def _terminal() -> bool:
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


class _Lines:
    """The tqdm methods the package uses (iteration, update, set_postfix, close, with),
    printing a plain line to stderr at most every ``interval`` seconds."""

    def __init__(self, iterable: Optional[Iterable[Any]], total: Optional[int], desc: str, unit: str,
                 interval: float) -> None:
        if total is None and iterable is not None:
            total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
        self.iterable, self.total, self.desc, self.unit, self.interval = iterable, total, desc, unit, interval
        self.n, self.postfix, self.printed, self.closed = 0, "", False, False
        self.start = self.last = _clock()

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> "_Lines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_postfix(self, **values: Any) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = _clock()
        if now - self.last >= self.interval:
            self.last = now
            self._print(now, final=False)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.printed:
                self._print(_clock(), final=True)

    def _print(self, now: float, final: bool) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.n / elapsed
        done = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        parts = [f"{self.desc}: {done} {self.unit}"]
        if self.total:
            parts[0] += f" ({100.0 * self.n / self.total:.0f}%)"
        if final:
            parts.append(f"done in {_duration(elapsed)}")
        parts.append(f"{rate:.3g} {self.unit}/s")
        if not final and self.total is not None and rate > 0:
            parts.append(f"ETA {_duration(max(self.total - self.n, 0) / rate)}")
        if self.postfix:
            parts.append(self.postfix)
        print(", ".join(parts), file=sys.stderr, flush=True)
        self.printed = True


def progress_bar(iterable: Optional[Iterable[Any]] = None, *, total: Optional[int] = None, desc: str, unit: str,
                 show: bool, leave: bool = True, interval: Optional[float] = None) -> Any:
    """Progress of a loop over ``iterable`` or of ``total`` steps (``update(n)``).

    Args:
        iterable: iterate over the returned object instead of calling ``update``.
        total: the number of steps (``len(iterable)`` when omitted).
        desc, unit: what is counted, for the bar or line.
        show: False: a disabled bar (nothing printed).
        leave: keep the finished tqdm bar on the terminal.
        interval: seconds between plain lines (default :data:`INTERVAL`).

    Returns:
        A tqdm bar (stderr a terminal, or ``show`` False: disabled) or a plain-lines
        object with the same methods (stderr not a terminal).
    """
    if show and not _terminal():
        return _Lines(iterable, total, desc, unit, INTERVAL if interval is None else interval)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not show, leave=leave)
