"""TopiOCQA's rows (a JSON array, or JSON Lines): one row per turn."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from ...core.errors import MapMatchedValueError
from .._jsonio import (
    PathLike,
    as_int,
    as_str,
    read_json_rows,
    require,
)
from ..data import Conversation, Dataset, Passage, Turn

__all__ = ["load_topiocqa"]


def _topic_of(title: str) -> str:
    """The article part of a TopiOCQA title (``"Article [SEP] Section"`` -> ``"Article"``)."""
    return title.split(" [SEP] ")[0].strip()


def load_topiocqa(path: PathLike, *, name: str = "topiocqa") -> Dataset:
    """Load TopiOCQA rows (a JSON array, or JSON Lines).

    Each row is one turn::

        {"Conversation_no": int, "Turn_no": int (1-based), "Question": str,
         "Gold_passage": {"id": str | int, "title": str, "text": str} | null,
         "Additional_answers": [{"Answer", "Topic", ...}, ...], ...}

    Mapping: conversation_id = ``str(Conversation_no)`` (conversations in order of
    first appearance; rows sorted by Turn_no); turn = ``Turn_no - 1``; query =
    Question; qrels = ``{str(Gold_passage.id): 1.0}``. ``Additional_answers`` must be
    a list when present but adds no qrels (its entries name no passage).
    topic_switch compares the gold passage's article (the title before ``" [SEP] "``,
    i.e. the whole title when there is none) with that of the most recent earlier
    turn that had a gold passage: False on the first turn, None on a turn without a
    gold passage. The corpus is the set of gold passages (doc_id = article, title =
    the full title, section_path = the title split on ``" [SEP] "``).

    Raises:
        MapMatchedValueError: a malformed row or a duplicate (Conversation_no,
            Turn_no); the message names the file and line (or row).
    """
    grouped: Dict[str, List[Tuple[int, str, Turn, Optional[str]]]] = {}
    passages: Dict[str, Passage] = {}
    for where, row in read_json_rows(path):
        conversation = str(as_int(require(row, "Conversation_no", where), "Conversation_no", where))
        number = as_int(require(row, "Turn_no", where), "Turn_no", where)
        if number < 1:
            raise MapMatchedValueError(f"{where}: Turn_no must be >= 1 (1-based), got {number}")
        question = as_str(require(row, "Question", where), "Question", where)
        additional = row.get("Additional_answers")
        if additional is not None and not isinstance(additional, list):
            raise MapMatchedValueError(f"{where}: Additional_answers must be a list, got {type(additional).__name__}")
        gold = row.get("Gold_passage")
        qrels: Dict[str, float] = {}
        topic: Optional[str] = None
        if gold is not None:
            if not isinstance(gold, Mapping):
                raise MapMatchedValueError(f"{where}: Gold_passage must be an object with id, title, text")
            raw_id = require(gold, "id", where + " Gold_passage")
            if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or raw_id == "":
                raise MapMatchedValueError(f"{where}: Gold_passage id must be a non-empty string or int, got {raw_id!r}")
            title = as_str(gold.get("title") or "", "Gold_passage title", where)
            text = as_str(gold.get("text") or "", "Gold_passage text", where)
            topic = _topic_of(title)
            passage_id = str(raw_id)
            passages.setdefault(passage_id, Passage(
                passage_id, text, doc_id=topic or None, title=title or None,
                section_path=tuple(part.strip() for part in title.split(" [SEP] ")) if title else (),
            ))
            qrels[passage_id] = 1.0
        turns = grouped.setdefault(conversation, [])
        if any(existing[0] == number for existing in turns):
            raise MapMatchedValueError(f"{where}: duplicate Turn_no {number} in conversation {conversation}")
        turns.append((number, where, Turn(number - 1, question, None, qrels, None), topic))
    conversations: List[Conversation] = []
    for conversation_id, rows in grouped.items():
        rows.sort(key=lambda item: item[0])
        turns: List[Turn] = []
        previous: Optional[str] = None
        for _, _, turn, topic in rows:
            if topic is None:
                switch: Optional[bool] = None
            else:
                switch = previous is not None and topic != previous
                previous = topic
            turns.append(Turn(turn.turn, turn.query, None, turn.qrels, switch))
        conversations.append(Conversation(conversation_id, tuple(turns)))
    return Dataset(name, tuple(conversations), tuple(passages.values()))
