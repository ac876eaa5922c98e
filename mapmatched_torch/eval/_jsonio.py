"""Reading JSON and JSON Lines files with error messages that name the file and line.

Private helpers of the dataset loaders (:mod:`mapmatched_torch.eval.datasets`). Every error is a
:class:`~mapmatched_torch.core.errors.MapMatchedValueError` (a ``ValueError``) whose message
starts with ``"<path>:<line>: "`` (JSON Lines) or ``"<path>: <where>: "`` (JSON).
Files ending in ``.gz`` are read through gzip.
"""

from __future__ import annotations

import gzip
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Optional, Tuple, TypeVar, Union

from ..core.errors import MapMatchedValueError

__all__ = [
    "PathLike",
    "wrap",
    "iter_lines",
    "iter_jsonl",
    "read_json",
    "read_json_rows",
    "require",
    "as_str",
    "as_optional_str",
    "as_int",
    "as_optional_int",
    "as_grade",
    "as_optional_bool",
]

PathLike = Union[str, "os.PathLike[str]"]


def _path(path: PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise MapMatchedValueError(f"{path}: no such file")
    if not path.is_file():
        raise MapMatchedValueError(f"{path}: not a file")
    return path


def _open_bytes(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _decode(path: Path, data: bytes, line: int = 1) -> str:
    """``data`` (which starts on line ``line`` of ``path``) as UTF-8 text.

    Raises:
        MapMatchedValueError: ``"<path>:<line>: not UTF-8 (...)"`` naming the line and
            the byte that does not decode.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line += data.count(b"\n", 0, exc.start)
        raise MapMatchedValueError(
            f"{path}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x} at byte {exc.start - line_start + 1} of the "
            f"line: {exc.reason}); re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from None


def iter_lines(path: PathLike) -> Iterator[Tuple[int, str]]:
    """Yield ``(line number, text)`` (1-based) for every line of a UTF-8 text file (``.gz`` read through gzip).

    Raises:
        MapMatchedValueError: a missing file, or a line that is not UTF-8 (the message
            names the file and line).
    """
    path = _path(path)
    with _open_bytes(path) as handle:
        for number, raw in enumerate(handle, start=1):
            yield number, _decode(path, raw, number)


def iter_jsonl(path: PathLike) -> Iterator[Tuple[str, Any]]:
    """Yield ``(where, value)`` for every non-blank line of a JSON Lines file.

    ``where`` is ``"<path>:<line>"`` (1-based), ready to prefix an error message.

    Raises:
        MapMatchedValueError: a missing file or a line that is not UTF-8 or not valid
            JSON (the message names the file and line).
    """
    path = _path(path)
    for number, line in iter_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MapMatchedValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
        yield where, value


def read_json(path: PathLike) -> Any:
    """Parse a whole JSON file; a syntax error names the file, line and column."""
    path = _path(path)
    with _open_bytes(path) as handle:
        text = _decode(path, handle.read())
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MapMatchedValueError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from exc


def read_json_rows(path: PathLike) -> Iterator[Tuple[str, Any]]:
    """Rows of a file that is either one JSON array or JSON Lines (told apart by its first character).

    Yields ``(where, row)``: ``"<path>:<line>"`` for JSON Lines, ``"<path>: row <i>"``
    (0-based) for a JSON array.

    Raises:
        MapMatchedValueError: invalid JSON (naming the file and line), or a top-level
            JSON value that is neither an array nor one object per line.
    """
    path = _path(path)
    with _open_bytes(path) as handle:
        head = handle.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from iter_jsonl(path)
        return
    rows = read_json(path)
    if not isinstance(rows, list):  # pragma: no cover - "[" always parses to a list
        raise MapMatchedValueError(f"{path}: expected a JSON array of rows")
    for index, row in enumerate(rows):
        yield f"{path}: row {index}", row


def require(row: Any, key: str, where: str) -> Any:
    """``row[key]``, or an error naming the missing field."""
    if not isinstance(row, Mapping):
        raise MapMatchedValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if key not in row:
        raise MapMatchedValueError(f"{where}: missing field {key!r}")
    return row[key]


def as_str(value: Any, what: str, where: str, *, allow_empty: bool = True) -> str:
    """A ``str`` (numbers are not converted), or an error naming the field."""
    if not isinstance(value, str):
        raise MapMatchedValueError(f"{where}: {what} must be a string, got {value!r}")
    if not allow_empty and not value:
        raise MapMatchedValueError(f"{where}: {what} must be non-empty")
    return value


def as_optional_str(value: Any, what: str, where: str) -> Optional[str]:
    """None or a ``str``."""
    return None if value is None else as_str(value, what, where)


def as_int(value: Any, what: str, where: str) -> int:
    """An ``int`` (an integral float such as ``3.0`` or a decimal string such as ``"3"`` is accepted)."""
    if isinstance(value, bool):
        raise MapMatchedValueError(f"{where}: {what} must be an integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    raise MapMatchedValueError(f"{where}: {what} must be an integer, got {value!r}")


def as_optional_int(value: Any, what: str, where: str) -> Optional[int]:
    """None or an ``int`` (see :func:`as_int`)."""
    return None if value is None else as_int(value, what, where)


def as_grade(value: Any, what: str, where: str) -> float:
    """A finite relevance grade as ``float`` (bools and non-numbers rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MapMatchedValueError(f"{where}: {what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise MapMatchedValueError(f"{where}: {what} must be finite, got {value!r}")
    return value


def as_optional_bool(value: Any, what: str, where: str) -> Optional[bool]:
    """None or a ``bool`` (0/1 integers are not accepted, to catch swapped columns)."""
    if value is None or isinstance(value, bool):
        return value
    raise MapMatchedValueError(f"{where}: {what} must be true, false or null, got {value!r}")


_T = TypeVar("_T")


def wrap(where: str, build: Callable[[], _T]) -> _T:
    """Run ``build()``; prefix a dataclass validation error with ``where``."""
    try:
        return build()
    except MapMatchedValueError as exc:
        if str(exc).startswith(where):
            raise
        raise MapMatchedValueError(f"{where}: {exc}") from exc
