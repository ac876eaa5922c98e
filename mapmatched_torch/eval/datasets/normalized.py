"""The normalized JSON Lines format (the one of ``shared/data/inscit_dev``), and the
``--data`` folder that holds it: one conversations file and one passages file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ...core.errors import MapMatchedValueError
from .._jsonio import (
    PathLike,
    as_grade,
    as_int,
    as_optional_bool,
    as_optional_int,
    as_optional_str,
    as_str,
    iter_jsonl,
    require,
)
from .._jsonio import wrap as _wrap
from ..data import Conversation, Dataset, Passage, Turn

__all__ = ["read_passages", "load_normalized", "load_directory"]


def _passage_from_row(row: Any, where: str) -> Passage:
    section_path = row.get("section_path") if isinstance(row, Mapping) else None
    if section_path is None:
        section_path = ()
    elif not isinstance(section_path, list):
        raise MapMatchedValueError(f"{where}: section_path must be a list of strings, got {section_path!r}")
    passage_id = as_str(require(row, "id", where), "id", where, allow_empty=False)
    text = as_str(require(row, "text", where), "text", where)
    doc_id = as_optional_str(row.get("doc_id"), "doc_id", where)
    position = as_optional_int(row.get("position"), "position", where)
    title = as_optional_str(row.get("title"), "title", where)
    path = tuple(as_str(part, "section_path entry", where) for part in section_path)
    return _wrap(where, lambda: Passage(passage_id, text, doc_id, position, title, path))


def read_passages(path: PathLike) -> Tuple[Passage, ...]:
    """Read a normalized passages JSON Lines file.

    One object per line: ``{"id", "text", "doc_id"?, "position"?, "title"?,
    "section_path"?: [str, ...]}``; other fields are ignored.

    Raises:
        MapMatchedValueError: a malformed line or a duplicate ID (naming file and line).
    """
    passages: List[Passage] = []
    seen: Dict[str, str] = {}
    for where, row in iter_jsonl(path):
        passage = _passage_from_row(row, where)
        if passage.id in seen:
            raise MapMatchedValueError(f"{where}: duplicate passage id {passage.id!r} (first at {seen[passage.id]})")
        seen[passage.id] = where
        passages.append(passage)
    return tuple(passages)


def _qrels_from(value: Any, where: str) -> Dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MapMatchedValueError(f"{where}: qrels must be an object of passage_id -> grade, got {value!r}")
    return {
        as_str(key, "qrels key", where, allow_empty=False): as_grade(grade, f"qrels grade of {key!r}", where)
        for key, grade in value.items()
    }


def _normalized_turn(row: Any, position: int, where: str) -> Turn:
    at = f"{where}: turn {position}"
    query = as_str(require(row, "query", at), "query", at)
    number = as_int(row.get("turn", position), "turn", at)
    rewrite = as_optional_str(row.get("rewrite"), "rewrite", at)
    qrels = _qrels_from(row.get("qrels"), at)
    switch = as_optional_bool(row.get("topic_switch"), "topic_switch", at)
    return _wrap(at, lambda: Turn(number, query, rewrite, qrels, switch))


def _dataset_name(path: Path, suffix: str) -> str:
    name = path.name
    for ending in (suffix + ".gz", suffix):
        if name.endswith(ending):
            return name[: -len(ending)] or path.stem
    return path.stem


def load_normalized(
    conversations_path: PathLike, passages_path: Optional[PathLike] = None, *, name: Optional[str] = None
) -> Dataset:
    """Load the normalized JSON Lines format (the one of ``shared/data/inscit_dev``).

    Conversations file, one object per line::

        {"conversation_id": str, "turns": [{"turn": int, "query": str,
          "rewrite": str | null, "qrels": {passage_id: grade}, "topic_switch": bool | null,
          ...}], ...}

    ``turn`` defaults to the turn's position, ``rewrite``/``topic_switch`` to null,
    ``qrels`` to {}; other turn fields (e.g. ``response_types``) are ignored; other
    conversation fields (e.g. ``seed``) go to :attr:`Conversation.metadata`. The
    passages file is read by :func:`read_passages`.

    Args:
        conversations_path: the ``*.conversations.jsonl`` file (``.gz`` allowed).
        passages_path: the ``*.passages.jsonl`` file, or None for no corpus.
        name: dataset name; default: the file name without ``.conversations.jsonl``.

    Returns:
        The :class:`Dataset`.

    Raises:
        MapMatchedValueError: a missing file, invalid JSON, a missing or mistyped
            field, or a duplicate ID; the message names the file and line.
    """
    conversations: List[Conversation] = []
    seen: Dict[str, str] = {}
    for where, row in iter_jsonl(conversations_path):
        conversation_id = as_str(require(row, "conversation_id", where), "conversation_id", where, allow_empty=False)
        if conversation_id in seen:
            raise MapMatchedValueError(f"{where}: duplicate conversation_id {conversation_id!r} (first at {seen[conversation_id]})")
        seen[conversation_id] = where
        turns_value = require(row, "turns", where)
        if not isinstance(turns_value, list):
            raise MapMatchedValueError(f"{where}: turns must be a list, got {type(turns_value).__name__}")
        turns = tuple(_normalized_turn(turn, position, where) for position, turn in enumerate(turns_value))
        metadata = {key: value for key, value in row.items() if key not in ("conversation_id", "turns")}
        conversations.append(_wrap(where, lambda: Conversation(conversation_id, turns, metadata)))
    passages = read_passages(passages_path) if passages_path is not None else ()
    dataset_name = name or _dataset_name(Path(conversations_path), ".conversations.jsonl")
    return Dataset(dataset_name, tuple(conversations), passages)


def load_directory(directory: PathLike, *, name: Optional[str] = None) -> Dataset:
    """Load a directory holding exactly one ``*.conversations.jsonl`` and one ``*.passages.jsonl``.

    (``.jsonl.gz`` variants count too.) See :func:`load_normalized` for the format.

    Raises:
        MapMatchedValueError: the path is not a directory, or it holds zero or several
            files of either kind (the message lists what was found).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise MapMatchedValueError(f"{directory}: not a directory")

    def one(kind: str) -> Path:
        found = sorted(
            path for path in directory.iterdir()
            if path.is_file() and (path.name.endswith(f".{kind}.jsonl") or path.name.endswith(f".{kind}.jsonl.gz"))
        )
        if len(found) != 1:
            listing = ", ".join(path.name for path in found) or "none"
            raise MapMatchedValueError(
                f"{directory}: expected exactly one *.{kind}.jsonl file, found {len(found)} ({listing})"
            )
        return found[0]

    return load_normalized(one("conversations"), one("passages"), name=name)
