"""TREC CAsT: topics JSON, TREC qrels lines and an optional passages file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple, Union

from ...core.errors import MapMatchedValueError
from .._jsonio import (
    PathLike,
    as_int,
    as_optional_str,
    as_str,
    iter_lines,
    read_json,
    require,
)
from .._jsonio import wrap as _wrap
from ..data import Conversation, Dataset, Passage, Turn
from .normalized import read_passages

__all__ = ["load_trec_cast"]


def _read_trec_qrels(path: PathLike) -> Dict[str, Dict[str, float]]:
    """``qid -> {docid: grade}`` from TREC qrels lines ``qid iter docid rel`` (last one wins)."""
    qrels: Dict[str, Dict[str, float]] = {}
    for number, line in iter_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        fields = line.split()
        if len(fields) != 4:
            raise MapMatchedValueError(f"{where}: expected 4 columns 'qid Q0 docid rel', got {len(fields)}: {line.strip()!r}")
        qid, _, docid, rel = fields
        try:
            grade = float(rel)
        except ValueError:
            raise MapMatchedValueError(f"{where}: relevance must be a number, got {rel!r}") from None
        if not math.isfinite(grade):
            raise MapMatchedValueError(f"{where}: relevance must be finite, got {rel!r}")
        qrels.setdefault(qid, {})[docid] = grade
    return qrels


def load_trec_cast(
    topics_path: PathLike,
    qrels_path: Optional[PathLike] = None,
    passages: Union[None, PathLike, Iterable[Passage]] = None,
    *,
    name: str = "trec-cast",
    rewrite_field: str = "manual_rewritten_utterance",
) -> Dataset:
    """Load TREC CAsT topics (JSON) with TREC qrels.

    Topics file: a JSON array of topics::

        [{"number": int | str, "title"?: str, "description"?: str,
          "turn": [{"number": int (1-based), "raw_utterance": str,
                    "manual_rewritten_utterance"?: str, ...}]}]

    (``"turns"`` is accepted for ``"turn"``, ``"utterance"`` for ``"raw_utterance"``.)
    Qrels file: whitespace-separated lines ``qid Q0 docid rel`` with qid
    ``"<topic number>_<turn number>"``; qrels of qids that match no topic turn are
    ignored; a repeated (qid, docid) keeps the last grade.

    Mapping: conversation_id = ``str(topic number)``; turn = turn number - 1; query =
    raw utterance; rewrite = ``turn[rewrite_field]`` when present; topic_switch = None
    (CAsT does not label it); metadata = the topic's title and description.

    Args:
        topics_path: the topics JSON file.
        qrels_path: the qrels file, or None for unlabelled turns.
        passages: None (the corpus lives elsewhere: :attr:`Dataset.passages` is
            empty), a normalized passages JSON Lines path, or Passage objects.
        name: dataset name for reports.
        rewrite_field: the turn field read as the rewrite.

    Raises:
        MapMatchedValueError: a malformed topic or qrels line (naming file and place).
    """
    path = Path(topics_path)
    topics = read_json(path)
    if not isinstance(topics, list):
        raise MapMatchedValueError(f"{path}: expected a JSON array of topics, got {type(topics).__name__}")
    qrels = _read_trec_qrels(qrels_path) if qrels_path is not None else {}
    conversations: List[Conversation] = []
    for index, topic in enumerate(topics):
        where = f"{path}: topic {index}"
        number = require(topic, "number", where)
        if isinstance(number, bool) or not isinstance(number, (int, str)) or number == "":
            raise MapMatchedValueError(f"{where}: number must be an int or a non-empty string, got {number!r}")
        topic_id = str(number)
        where = f"{path}: topic {topic_id}"
        turns_value = topic.get("turn", topic.get("turns"))
        if not isinstance(turns_value, list):
            raise MapMatchedValueError(f"{where}: missing field 'turn' (a list of turns)")
        turns: List[Turn] = []
        for position, turn_row in enumerate(turns_value):
            at = f"{where} turn {position}"
            turn_number = as_int(require(turn_row, "number", at), "number", at)
            if turn_number < 1:
                raise MapMatchedValueError(f"{at}: number must be >= 1 (1-based), got {turn_number}")
            utterance = turn_row.get("raw_utterance", turn_row.get("utterance"))
            if utterance is None:
                raise MapMatchedValueError(f"{at}: missing field 'raw_utterance'")
            query = as_str(utterance, "raw_utterance", at)
            rewrite = as_optional_str(turn_row.get(rewrite_field), rewrite_field, at)
            turn_qrels = qrels.get(f"{topic_id}_{turn_number}", {})
            turns.append(_wrap(at, lambda: Turn(turn_number - 1, query, rewrite, turn_qrels, None)))
        metadata = {key: topic[key] for key in ("title", "description") if key in topic}
        conversations.append(_wrap(where, lambda: Conversation(topic_id, tuple(turns), metadata)))
    if passages is None:
        corpus: Tuple[Passage, ...] = ()
    elif isinstance(passages, (str, Path)) or hasattr(passages, "__fspath__"):
        corpus = read_passages(passages)  # type: ignore[arg-type]
    else:
        corpus = tuple(passages)  # type: ignore[arg-type]
        for item in corpus:
            if not isinstance(item, Passage):
                raise MapMatchedValueError(f"passages must be Passage objects, got {type(item).__name__}")
    return Dataset(name, tuple(conversations), corpus)
