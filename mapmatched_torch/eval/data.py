"""Evaluation data: passages, conversations with graded qrels, and the dataset that holds them.

The in-memory form is the normalized one of ``shared/data/inscit_dev`` (see
:func:`~mapmatched_torch.eval.datasets.normalized.load_normalized`): a :class:`Dataset`
holds :class:`Conversation` objects (each a tuple of :class:`Turn` with a query, an
optional rewrite, graded qrels and an optional topic-switch label) and the corpus
:class:`Passage` objects. The loaders live in :mod:`mapmatched_torch.eval.datasets`, one
module per format (normalized JSONL and the ``--data`` folder, INSCIT, TopiOCQA, TREC
CAsT); they read paths the user gives and produce this form. Each loader is still
importable from here (``from mapmatched_torch.eval.data import load_inscit``), outside
``__all__``.

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
from typing import (
    Any,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Tuple,
    Union,
)

import torch

from ..core.errors import MapMatchedValueError
from .._lazy import lazy_attributes

__all__ = [
    "Passage",
    "Turn",
    "Conversation",
    "Dataset",
    "TurnTable",
]

#: The loaders, moved to :mod:`.datasets` (one module per format): still importable from
#: here, on first use (they import this module's types, so not at its import).
_LAZY = {
    "read_passages": ".datasets.normalized",
    "load_normalized": ".datasets.normalized",
    "load_directory": ".datasets.normalized",
    "load_inscit": ".datasets.inscit",
    "load_topiocqa": ".datasets.topiocqa",
    "load_trec_cast": ".datasets.trec_cast",
}
__getattr__ = lazy_attributes(__package__, _LAZY, globals())

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
