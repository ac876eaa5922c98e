"""INSCIT's original split files (``train.json`` / ``dev.json`` / ``test.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ...core.errors import MapMatchedValueError
from .._jsonio import (
    PathLike,
    as_str,
    read_json,
    require,
)
from .._jsonio import wrap as _wrap
from ..data import Conversation, Dataset, Passage, Turn

__all__ = ["load_inscit"]


def _inscit_doc(passage_id: str, titles: Sequence[str]) -> Tuple[str, Optional[int]]:
    """(doc_id, position) of an INSCIT passage ID ``"Article title:position"``."""
    head, sep, tail = passage_id.rpartition(":")
    if sep and tail.isdigit() and head:
        return head, int(tail)
    return (titles[0] if titles else passage_id), None


def _inscit_evidence(item: Any, at: str) -> Passage:
    passage_id = as_str(require(item, "passage_id", at), "passage_id", at, allow_empty=False)
    text = item.get("passage_text", "")
    text = "" if text is None else as_str(text, "passage_text", at)
    titles_value = item.get("passage_titles") or []
    if isinstance(titles_value, str):
        titles_value = [titles_value]
    if not isinstance(titles_value, list):
        raise MapMatchedValueError(f"{at}: passage_titles must be a list of strings, got {titles_value!r}")
    titles = tuple(as_str(title, "passage_titles entry", at) for title in titles_value)
    doc_id, position = _inscit_doc(passage_id, titles)
    return Passage(passage_id, text, doc_id=doc_id, position=position, title=titles[0] if titles else doc_id,
                   section_path=titles)


def load_inscit(dev_json_path: PathLike, *, name: str = "inscit", id_prefix: str = "inscit-") -> Dataset:
    """Load INSCIT's original split file (e.g. ``data/dev.json`` of the INSCIT repository).

    Assumed structure (that of INSCIT's ``train.json``/``dev.json``/``test.json``)::

        {"<dialogue id>": {
            "seedArticle": {"title", "topic", "level"},          # optional
            "turns": [{
                "context": [str, ...],      # the dialogue so far, user and agent turns
                                            # alternating; the LAST one is this turn's
                                            # user question
                "prevEvidence": [[evidence, ...], ...],           # optional
                "labels": [{                # one per annotator response
                    "responseType": str, "response": str,
                    "evidence": [{"passage_id": "Article:position",
                                  "passage_text": str,
                                  "passage_titles": [article, section, ...]}]}]}]}}

    Mapping to the normalized form (it reproduces ``shared/data/inscit_dev`` exactly):

    - conversation_id = ``id_prefix + dialogue id``; metadata ``{"seed": seedArticle}``.
    - query = ``context[-1]``; rewrite = None; turn = the turn's position.
    - qrels = every ``passage_id`` cited as evidence by any label, grade 1.0, in order
      of first citation (a turn with no evidence is unlabelled).
    - topic_switch = the turn has evidence and its set of articles (``doc_id``) shares
      none with that of the most recent earlier turn that had evidence; False on the
      first turn and on turns without evidence.
    - passages = every evidence passage (labels and prevEvidence), first text wins:
      id = passage_id, doc_id/position from ``"Article:position"``, title =
      ``passage_titles[0]`` (else doc_id), section_path = ``passage_titles``.

    Args:
        dev_json_path: the JSON file (``.gz`` allowed).
        name: dataset name for reports.
        id_prefix: prefix of conversation IDs.

    Raises:
        MapMatchedValueError: invalid JSON or a field of the wrong type or missing (the
            message names the file, dialogue and turn).
    """
    path = Path(dev_json_path)
    document = read_json(path)
    if not isinstance(document, Mapping):
        raise MapMatchedValueError(f"{path}: expected a JSON object of dialogue id -> dialogue, got {type(document).__name__}")
    passages: Dict[str, Passage] = {}
    conversations: List[Conversation] = []
    for key, dialogue in document.items():
        where = f"{path}: dialogue {key!r}"
        turns_value = require(dialogue, "turns", where)
        if not isinstance(turns_value, list):
            raise MapMatchedValueError(f"{where}: turns must be a list")
        turns: List[Turn] = []
        previous_docs: Optional[set] = None
        for position, turn_row in enumerate(turns_value):
            at = f"{where} turn {position}"
            context = require(turn_row, "context", at)
            if not isinstance(context, list) or not context:
                raise MapMatchedValueError(f"{at}: context must be a non-empty list of utterances")
            query = as_str(context[-1], "context[-1]", at)
            labels = turn_row.get("labels") or []
            if not isinstance(labels, list):
                raise MapMatchedValueError(f"{at}: labels must be a list")
            qrels: Dict[str, float] = {}
            for label_index, label in enumerate(labels):
                evidence = (label or {}).get("evidence") if isinstance(label, Mapping) else None
                if evidence is None:
                    continue
                if not isinstance(evidence, list):
                    raise MapMatchedValueError(f"{at} label {label_index}: evidence must be a list")
                for item_index, item in enumerate(evidence):
                    passage = _wrap(f"{at} label {label_index} evidence {item_index}",
                                    lambda: _inscit_evidence(item, f"{at} label {label_index} evidence {item_index}"))
                    passages.setdefault(passage.id, passage)
                    qrels.setdefault(passage.id, 1.0)
            for group in turn_row.get("prevEvidence") or []:
                for item in group if isinstance(group, list) else []:
                    if isinstance(item, Mapping) and isinstance(item.get("passage_id"), str) and item["passage_id"]:
                        passage = _wrap(f"{at} prevEvidence", lambda: _inscit_evidence(item, f"{at} prevEvidence"))
                        passages.setdefault(passage.id, passage)
            docs = {passages[pid].doc_id for pid in qrels}
            switch = bool(docs) and previous_docs is not None and not (docs & previous_docs)
            if docs:
                previous_docs = docs
            turns.append(Turn(position, query, None, qrels, switch))
        metadata = {"seed": dialogue["seedArticle"]} if "seedArticle" in dialogue else {}
        conversations.append(_wrap(where, lambda: Conversation(f"{id_prefix}{key}", tuple(turns), metadata)))
    return Dataset(name, tuple(conversations), tuple(passages.values()))
