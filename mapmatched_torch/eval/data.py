"""Evaluation data: passages, conversations with graded qrels, and their loaders.

The in-memory form is the normalized one of ``shared/data/inscit_dev`` (see
:func:`load_normalized`): a :class:`Dataset` holds :class:`Conversation` objects (each
a tuple of :class:`Turn` with a query, an optional rewrite, graded qrels and an
optional topic-switch label) and the corpus :class:`Passage` objects. Loaders for the
original formats of INSCIT, TopiOCQA and TREC CAsT read paths the user gives and
produce the same form.

Conventions:
    - Turn numbers (:attr:`Turn.turn`) are 0-based in every loader (1-based source
      numbers are shifted down by one). A turn's *position* is its index in
      :attr:`Conversation.turns`; slices use the position ("turn 0" = first turn).
    - A turn is *labelled* when at least one qrel grade is > 0. Grades <= 0 (judged
      non-relevant) are kept in :attr:`Turn.qrels` but count as non-relevant.
    - Malformed input raises :class:`~mapmatched_torch.core.errors.MapMatchedValueError` (a
      ``ValueError``) whose message starts with the file and line (JSON Lines) or the
      file and the place in the JSON document.

Example:
    >>> ds = Dataset("tiny", (Conversation("c0", (Turn(0, "what is a cat?", qrels={"cat:1": 1.0}),)),),
    ...              (Passage("cat:1", "Cats are small carnivores."),))
    >>> ds.num_turns, ds.labelled_turn_count, ds.passage("cat:1").text
    (1, 1, 'Cats are small carnivores.')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import torch

from ..core.errors import MapMatchedValueError
from ._jsonio import (
    PathLike,
    as_grade,
    as_int,
    as_optional_bool,
    as_optional_int,
    as_optional_str,
    as_str,
    iter_jsonl,
    iter_lines,
    read_json,
    read_json_rows,
    require,
)

__all__ = [
    "Passage",
    "Turn",
    "Conversation",
    "Dataset",
    "TurnTable",
    "load_normalized",
    "load_directory",
    "load_inscit",
    "load_topiocqa",
    "load_trec_cast",
    "read_passages",
]

_T = TypeVar("_T")


# --------------------------------------------------------------------------- types


@dataclass(frozen=True, slots=True)
class Passage:
    """One corpus passage.

    Attributes:
        id: non-empty passage ID (the chunk ID used by graphs and decoders).
        text: the passage text.
        doc_id: the document (article) it belongs to, if known.
        position: its position in the document, if known.
        title: the document title, if known.
        section_path: section titles from the document down to the passage.
    """

    id: str
    text: str
    doc_id: Optional[str] = None
    position: Optional[int] = None
    title: Optional[str] = None
    section_path: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise MapMatchedValueError(f"passage id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.text, str):
            raise MapMatchedValueError(f"passage {self.id!r} text must be a string, got {type(self.text).__name__}")
        for name in ("doc_id", "title"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise MapMatchedValueError(f"passage {self.id!r} {name} must be a string or None, got {value!r}")
        if self.position is not None and (isinstance(self.position, bool) or not isinstance(self.position, int)):
            raise MapMatchedValueError(f"passage {self.id!r} position must be an int or None, got {self.position!r}")
        path = tuple(self.section_path)
        if not all(isinstance(part, str) for part in path):
            raise MapMatchedValueError(f"passage {self.id!r} section_path must hold strings, got {path!r}")
        object.__setattr__(self, "section_path", path)


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn of a conversation.

    Attributes:
        turn: the 0-based turn number (strictly increasing within a conversation).
        query: the raw user utterance.
        rewrite: a self-contained rewrite of the query (e.g. a manual rewrite), if any.
        qrels: graded relevance, passage ID -> finite grade; > 0 means relevant.
        topic_switch: whether the gold topic changed from the previous turn; None
            when the dataset does not say.
    """

    turn: int
    query: str
    rewrite: Optional[str] = None
    qrels: Dict[str, float] = field(default_factory=dict)
    topic_switch: Optional[bool] = None

    def __post_init__(self) -> None:
        if isinstance(self.turn, bool) or not isinstance(self.turn, int) or self.turn < 0:
            raise MapMatchedValueError(f"turn number must be a nonnegative int, got {self.turn!r}")
        if not isinstance(self.query, str):
            raise MapMatchedValueError(f"turn {self.turn} query must be a string, got {type(self.query).__name__}")
        if self.rewrite is not None and not isinstance(self.rewrite, str):
            raise MapMatchedValueError(f"turn {self.turn} rewrite must be a string or None, got {self.rewrite!r}")
        if self.topic_switch is not None and not isinstance(self.topic_switch, bool):
            raise MapMatchedValueError(f"turn {self.turn} topic_switch must be a bool or None, got {self.topic_switch!r}")
        if not isinstance(self.qrels, Mapping):
            raise MapMatchedValueError(f"turn {self.turn} qrels must be a mapping, got {type(self.qrels).__name__}")
        qrels: Dict[str, float] = {}
        for passage_id, grade in self.qrels.items():
            if not isinstance(passage_id, str) or not passage_id:
                raise MapMatchedValueError(f"turn {self.turn} qrels key must be a non-empty string, got {passage_id!r}")
            if isinstance(grade, bool) or not isinstance(grade, (int, float)) or not math.isfinite(grade):
                raise MapMatchedValueError(f"turn {self.turn} qrels grade of {passage_id!r} must be finite, got {grade!r}")
            qrels[passage_id] = float(grade)
        object.__setattr__(self, "qrels", qrels)

    @property
    def labelled(self) -> bool:
        """Whether some passage has a grade > 0."""
        return any(grade > 0.0 for grade in self.qrels.values())

    @property
    def relevant_ids(self) -> Tuple[str, ...]:
        """IDs with grade > 0, in qrels order."""
        return tuple(passage_id for passage_id, grade in self.qrels.items() if grade > 0.0)


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation: an ID, its turns in order, and free-form metadata.

    Raises:
        MapMatchedValueError: an empty ID, no turns, or turn numbers that do not
            strictly increase.
    """

    conversation_id: str
    turns: Tuple[Turn, ...]
    metadata: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.conversation_id, str) or not self.conversation_id:
            raise MapMatchedValueError(f"conversation_id must be a non-empty string, got {self.conversation_id!r}")
        turns = tuple(self.turns)
        if not turns:
            raise MapMatchedValueError(f"conversation {self.conversation_id!r} has no turns")
        for position, turn in enumerate(turns):
            if not isinstance(turn, Turn):
                raise MapMatchedValueError(
                    f"conversation {self.conversation_id!r} turn {position} must be a Turn, got {type(turn).__name__}"
                )
            if position and turn.turn <= turns[position - 1].turn:
                raise MapMatchedValueError(
                    f"conversation {self.conversation_id!r}: turn numbers must strictly increase, "
                    f"got {turns[position - 1].turn} then {turn.turn}"
                )
        object.__setattr__(self, "turns", turns)
        object.__setattr__(self, "metadata", dict(self.metadata))

    def __len__(self) -> int:
        return len(self.turns)


class TurnTable(NamedTuple):
    """Every turn of a :class:`Dataset` flattened in (conversation, position) order.

    N = the dataset's number of turns. All tensors are on the requested device.

    Attributes:
        conversation: (N,) long, the conversation index of each turn.
        position: (N,) long, the turn's index within its conversation (0 = first).
        labelled: (N,) bool, the turn has a qrel grade > 0.
        topic_switch: (N,) int8: 1 switch, 0 same topic, -1 not labelled.
    """

    conversation: torch.Tensor
    position: torch.Tensor
    labelled: torch.Tensor
    topic_switch: torch.Tensor


@dataclass(frozen=True)
class Dataset:
    """Conversations plus the passage corpus they are judged against.

    Attributes:
        name: a short name for reports.
        conversations: the conversations, in order (unique IDs).
        passages: the corpus (unique IDs); may be empty when the corpus lives
            elsewhere (e.g. TREC CAsT without a passage file).

    Raises:
        MapMatchedValueError: duplicate conversation or passage IDs.
    """

    name: str
    conversations: Tuple[Conversation, ...]
    passages: Tuple[Passage, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "conversations", tuple(self.conversations))
        object.__setattr__(self, "passages", tuple(self.passages))
        seen = set()
        for conversation in self.conversations:
            if conversation.conversation_id in seen:
                raise MapMatchedValueError(f"dataset {self.name!r}: duplicate conversation_id {conversation.conversation_id!r}")
            seen.add(conversation.conversation_id)
        if len(self.passage_index) != len(self.passages):
            counts: Dict[str, int] = {}
            for passage in self.passages:
                counts[passage.id] = counts.get(passage.id, 0) + 1
            duplicate = next(key for key, count in counts.items() if count > 1)
            raise MapMatchedValueError(f"dataset {self.name!r}: duplicate passage id {duplicate!r}")

    @cached_property
    def passage_index(self) -> Dict[str, int]:
        """Passage ID -> its index in :attr:`passages` (the int64 node index of the corpus)."""
        return {passage.id: index for index, passage in enumerate(self.passages)}

    def passage(self, passage_id: str) -> Passage:
        """The passage with this ID.

        Raises:
            KeyError: the ID is not in the corpus.
        """
        try:
            return self.passages[self.passage_index[passage_id]]
        except KeyError:
            raise KeyError(f"passage {passage_id!r} is not in dataset {self.name!r}") from None

    @property
    def passage_ids(self) -> Tuple[str, ...]:
        """Passage IDs in corpus order."""
        return tuple(passage.id for passage in self.passages)

    @property
    def passage_texts(self) -> List[str]:
        """Passage texts in corpus order (what an embedder encodes)."""
        return [passage.text for passage in self.passages]

    def __len__(self) -> int:
        return len(self.conversations)

    @property
    def num_turns(self) -> int:
        """Number of turns over all conversations."""
        return sum(len(conversation.turns) for conversation in self.conversations)

    @property
    def labelled_turn_count(self) -> int:
        """Number of turns with at least one qrel grade > 0."""
        return sum(turn.labelled for conversation in self.conversations for turn in conversation.turns)

    def iter_turns(self) -> Iterator[Tuple[int, int, Turn]]:
        """Yield ``(conversation_index, position, turn)`` for every turn, in flat order."""
        for index, conversation in enumerate(self.conversations):
            for position, turn in enumerate(conversation.turns):
                yield index, position, turn

    def turn_qrels(self) -> List[Dict[str, float]]:
        """The qrels of every turn, in flat order (feed to :func:`~mapmatched_torch.kernels.ranking_metrics.pack_qrels`)."""
        return [turn.qrels for _, _, turn in self.iter_turns()]

    def turn_table(self, device: Union[str, torch.device, None] = None) -> TurnTable:
        """The flat per-turn index tensors (see :class:`TurnTable`)."""
        conversation: List[int] = []
        position: List[int] = []
        labelled: List[bool] = []
        switch: List[int] = []
        for index, pos, turn in self.iter_turns():
            conversation.append(index)
            position.append(pos)
            labelled.append(turn.labelled)
            switch.append(-1 if turn.topic_switch is None else int(turn.topic_switch))
        return TurnTable(
            torch.tensor(conversation, dtype=torch.long, device=device),
            torch.tensor(position, dtype=torch.long, device=device),
            torch.tensor(labelled, dtype=torch.bool, device=device),
            torch.tensor(switch, dtype=torch.int8, device=device),
        )

    def missing_qrel_ids(self) -> Tuple[str, ...]:
        """Relevant (grade > 0) passage IDs that are not in the corpus, sorted."""
        index = self.passage_index
        return tuple(sorted({pid for _, _, turn in self.iter_turns() for pid in turn.relevant_ids if pid not in index}))

    def gold_coverage(self) -> Dict[str, int]:
        """How much of the gold lies outside the corpus (what ``--qrels in-corpus`` would drop).

        Returns:
            ``{"missing_ids"``: distinct relevant (grade > 0) IDs not in the corpus,
            ``"missing_judgements"``: (turn, relevant ID) pairs outside the corpus,
            ``"labelled_turns_with_missing"``: labelled turns with at least one,
            ``"labelled_turns_without_gold_in_corpus"``: labelled turns with none in
            the corpus (they score 0 under ``all`` and become unjudged under
            ``in-corpus``)``}``.
        """
        index = self.passage_index
        judgements = some = none = 0
        for _, _, turn in self.iter_turns():
            relevant = turn.relevant_ids
            outside = sum(passage_id not in index for passage_id in relevant)
            judgements += outside
            some += bool(outside)
            none += bool(relevant) and outside == len(relevant)
        return {"missing_ids": len(self.missing_qrel_ids()), "missing_judgements": judgements,
                "labelled_turns_with_missing": some, "labelled_turns_without_gold_in_corpus": none}

    def qrels_in_corpus(self) -> "Dataset":
        """The dataset with every qrel entry whose passage is not in the corpus dropped (any grade).

        A turn left without a relevant passage becomes unjudged (it drops out of every
        slice); the conversations, turns, topic labels and corpus stay as they are.
        """
        index = self.passage_index

        def kept(turn: Turn) -> Turn:
            qrels = {pid: grade for pid, grade in turn.qrels.items() if pid in index}
            return turn if len(qrels) == len(turn.qrels) else replace(turn, qrels=qrels)

        conversations = tuple(
            replace(c, turns=tuple(kept(turn) for turn in c.turns)) for c in self.conversations
        )
        return Dataset(self.name, conversations, self.passages)

    def select(self, indices: Iterable[int], name: Optional[str] = None) -> "Dataset":
        """A dataset with the conversations at ``indices`` (in that order) and the same corpus."""
        return Dataset(name or self.name, tuple(self.conversations[i] for i in indices), self.passages)

    def summary(self) -> Dict[str, Any]:
        """Counts for reports: name, conversations, turns, labelled turns, passages."""
        return {
            "name": self.name,
            "conversations": len(self.conversations),
            "turns": self.num_turns,
            "labelled_turns": self.labelled_turn_count,
            "passages": len(self.passages),
        }


# --------------------------------------------------------------------------- normalized JSONL


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


def _wrap(where: str, build: Callable[[], _T]) -> _T:
    """Run ``build()``; prefix a dataclass validation error with ``where``."""
    try:
        return build()
    except MapMatchedValueError as exc:
        if str(exc).startswith(where):
            raise
        raise MapMatchedValueError(f"{where}: {exc}") from exc


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


# --------------------------------------------------------------------------- INSCIT


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


# --------------------------------------------------------------------------- TopiOCQA


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


# --------------------------------------------------------------------------- TREC CAsT


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
