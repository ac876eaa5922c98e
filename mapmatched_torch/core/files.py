"""Output files written atomically: a temporary file beside the target, renamed over it.

Every file the package writes for the user (the evaluation's markdown, JSON and plots,
``fit``'s weights, a saved server state) goes through :func:`atomic_path`: the bytes
are written into a temporary file in the target's directory, flushed to disk, and
renamed over the target with :func:`os.replace` (atomic on POSIX and Windows within one
file system). An interruption leaves the old file or the new one, never a torn one, and
the temporary file is removed.

Inside :func:`output_group` the renames wait until the block ends, and then happen
together, with SIGINT held back until the last one is done: files written as one
report (markdown, JSON, plots) are all new or all old, never a new markdown beside an
old JSON. An exception inside the block renames nothing.

Example:
    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> with output_group():
    ...     _ = write_text_atomic(folder / "a.md", "# a\\n")
    ...     (folder / "a.md").exists()  # not renamed yet
    False
    >>> (folder / "a.md").read_text()
    '# a\\n'
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Iterator, List, Optional, Tuple, Union

__all__ = ["atomic_path", "output_group", "write_text_atomic"]

PathLike = Union[str, "os.PathLike[str]"]

# The open output_group's (temporary, target) pairs, or None outside any group.
_GROUP: contextvars.ContextVar[Optional[List[Tuple[str, str]]]] = contextvars.ContextVar("_GROUP", default=None)


def _fsync(path: str) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def _discard(temporary: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(temporary)


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """Yield the name of a temporary file beside ``path``; on success rename it over ``path``.

    The caller writes the temporary file (any writer that takes a file name: ``open``,
    ``torch.save``, ``Figure.savefig``). Parents of ``path`` are created. On an
    exception (KeyboardInterrupt included) the temporary file is removed and ``path`` is
    untouched. Inside :func:`output_group` the rename waits for the end of the group.

    Args:
        path: the file to write.

    Yields:
        The temporary file's name (same directory, so the rename stays on one file system).
    """
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", suffix=".tmp", dir=directory)
    os.close(handle)
    try:
        yield temporary
        _fsync(temporary)
        group = _GROUP.get()
        if group is None:
            os.replace(temporary, target)
        else:
            group.append((temporary, target))
    except BaseException:
        _discard(temporary)
        raise


def write_text_atomic(path: PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_path`; returns ``Path(path)``."""
    with atomic_path(path) as temporary:
        with open(temporary, "w", encoding="utf-8") as stream:
            stream.write(text)
    return Path(path)


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """SIGINT during the block is delivered (as KeyboardInterrupt) when it ends; only on
    the main thread with Python's default handler, else nothing is changed."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: List[int] = []
    signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def output_group() -> Iterator[None]:
    """Files written by :func:`atomic_path` inside the block are renamed together at its end.

    On an exception inside the block (KeyboardInterrupt included) no target is replaced
    and every temporary file is removed. The renames run with SIGINT held back, so an
    interrupt cannot land between two of them. Groups nest: an inner group's files
    join the outer one.
    """
    if _GROUP.get() is not None:
        yield
        return
    pending: List[Tuple[str, str]] = []
    token = _GROUP.set(pending)
    try:
        yield
    except BaseException:
        for temporary, _ in pending:
            _discard(temporary)
        raise
    finally:
        _GROUP.reset(token)
    with _sigint_held():
        for index, (temporary, target) in enumerate(pending):
            try:
                os.replace(temporary, target)
            except BaseException:
                for left, _ in pending[index:]:
                    _discard(left)
                raise
