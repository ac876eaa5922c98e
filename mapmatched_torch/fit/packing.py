"""Labelled conversations, validated, normalized and padded into tensors for a fit.

A conversation is a list of turns ``(candidates, relevant)``: ``candidates`` a sequence
of :class:`~mapmatched_torch.core.models.ScoredCandidate` (provider order), ``relevant``
a collection of relevant chunk IDs (empty when the turn is unlabelled). A turn is

- *usable* when at least one relevant chunk is among its candidates;
- *gold-missing* when it has relevant chunks but none among its candidates;
- *unlabelled* when ``relevant`` is empty.

Gold-missing and unlabelled turns constrain nothing in the loss
(:mod:`~mapmatched_torch.fit.loss`); they are counted (:class:`TurnCounts`, and
:class:`~mapmatched_torch.fit.fitting.FitResult`), never dropped silently.
:func:`pack_conversations` turns conversations into one :class:`LabelledBatch`: the
normalized scores, the graph distances and the relevance masks, computed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, FrozenSet, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..core.checks import check_chunk_id, check_finite, duplicate_ids_error
from ..core.errors import MapMatchedValueError
from ..core.models import DecoderCandidate, trusted_constructor
from ..core.protocols import CorpusGraph
from ..core.scoring import check_score_normalization, normalize_scores
from ..kernels.ranking_metrics import SparseQrels
from ..retrieval.trellis import consecutive_distances, pack_trellises

__all__ = ["TurnCounts", "LabelledBatch", "pack_conversations"]

_candidate = trusted_constructor(DecoderCandidate)


@dataclass(frozen=True)
class TurnCounts:
    """How many conversations and turns a set holds, by label status.

    Attributes:
        conversations: number of conversations.
        turns: number of turns.
        labelled: turns with at least one relevant chunk ID (usable + gold-missing).
        gold_missing: labelled turns none of whose relevant chunks is a candidate.
        unlabelled: turns without relevant chunk IDs (``turns - labelled``).
    """

    conversations: int = 0
    turns: int = 0
    labelled: int = 0
    gold_missing: int = 0
    unlabelled: int = 0

    @property
    def usable(self) -> int:
        """Turns that constrain the loss: ``labelled - gold_missing``."""
        return self.labelled - self.gold_missing

    def __add__(self, other: "TurnCounts") -> "TurnCounts":
        return TurnCounts(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> Tuple[int, ...]:
        return (self.conversations, self.turns, self.labelled, self.gold_missing, self.unlabelled)


class _Checked(NamedTuple):
    """One validated conversation: normalized trellis and relevant ID sets per turn."""

    trellis: Tuple[Tuple[DecoderCandidate, ...], ...]
    relevant: Tuple[FrozenSet[str], ...]

    def counts(self) -> TurnCounts:
        labelled = [bool(ids) for ids in self.relevant]
        missing = sum(
            1 for turn, ids in zip(self.trellis, self.relevant) if ids and not any(c.chunk_id in ids for c in turn)
        )
        return TurnCounts(1, len(labelled), sum(labelled), missing, labelled.count(False))


def _check_relevant(relevant: Any, where: str) -> FrozenSet[str]:
    if relevant is None:
        return frozenset()
    if isinstance(relevant, (str, bytes)) or not isinstance(relevant, Iterable):
        raise MapMatchedValueError(
            f"{where}: relevant must be a collection of chunk IDs (e.g. a set), got {type(relevant).__name__}"
        )
    ids = frozenset(relevant)
    for chunk_id in ids:
        if not isinstance(chunk_id, str) or not chunk_id:
            raise MapMatchedValueError(f"{where}: relevant chunk IDs must be non-empty strings, got {chunk_id!r}")
    return ids


def _check_candidates(candidates: Any, where: str, method: str) -> Tuple[DecoderCandidate, ...]:
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Iterable):
        raise MapMatchedValueError(f"{where}: candidates must be a sequence of ScoredCandidate")
    candidates = tuple(candidates)
    if not candidates:
        raise MapMatchedValueError(f"{where} has no candidates (every turn needs at least one)")
    ids = [check_chunk_id(getattr(c, "chunk_id", None), f"{where} candidate {m} chunk ID") for m, c in enumerate(candidates)]
    raw = [check_finite(getattr(c, "score", None), f"{where} candidate {m} ({ids[m]!r}) score")
           for m, c in enumerate(candidates)]
    normalized = [check_finite(value, f"{where} candidate {m} ({ids[m]!r}) normalized score")
                  for m, value in enumerate(normalize_scores(raw, method))]
    if len(set(ids)) != len(ids):
        duplicate = next(chunk_id for chunk_id in ids if ids.count(chunk_id) > 1)
        raise duplicate_ids_error(where, duplicate)
    return tuple(map(_candidate, ids, raw, normalized))  # every field checked just above


def _check_conversation(conversation: Any, index: int, method: str) -> _Checked:
    """Validate and normalize one conversation; errors name it (and the turn)."""
    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Iterable):
        raise MapMatchedValueError(f"conversation {index} must be a sequence of (candidates, relevant) turns")
    turns = tuple(conversation)
    if not turns:
        raise MapMatchedValueError(f"conversation {index} has no turns")
    trellis, relevant = [], []
    for t, turn in enumerate(turns):
        where = f"conversation {index} turn {t}"
        if isinstance(turn, (str, bytes)) or not isinstance(turn, Sequence) or len(turn) != 2:
            raise MapMatchedValueError(f"{where} must be a pair (candidates, relevant)")
        trellis.append(_check_candidates(turn[0], where, method))
        relevant.append(_check_relevant(turn[1], where))
    return _Checked(tuple(trellis), tuple(relevant))


class LabelledBatch(NamedTuple):
    """A padded batch of labelled conversations, ready for the loss and the metric.

    Attributes:
        scores: ``(B, T, M)`` normalized scores (0 at padding), in the fit's dtype.
        distances: ``(B, T-1, M, M)`` raw graph distances ``[b, t, from, to]``.
        mask: ``(B, T, M)`` bool real candidates.
        relevant: ``(B, T, M)`` bool, the candidate is relevant.
        labelled: ``(B, T)`` bool, the turn has relevant chunk IDs (maybe not among
            its candidates).
        qrels: :class:`~mapmatched_torch.kernels.ranking_metrics.SparseQrels` of the B*T turns
            (row ``b * T + t``): ids are candidate indices within the turn, ``-1`` (grade
            1) for a relevant chunk that is not a candidate.
        chunk_ids: B tuples of turns of candidate chunk IDs.
        n_usable: the number of usable turns (a relevant chunk among the candidates),
            counted once at packing so that the loss never synchronizes for it.
    """

    scores: Tensor
    distances: Tensor
    mask: Tensor
    relevant: Tensor
    labelled: Tensor
    qrels: SparseQrels
    chunk_ids: Tuple[Tuple[Tuple[str, ...], ...], ...]
    n_usable: int

    @property
    def usable(self) -> Tensor:
        """``(B, T)`` bool: a relevant chunk is among the turn's candidates."""
        return (self.mask & self.relevant).any(dim=-1)


def _qrels_rows(checked: Sequence[_Checked], turns: int) -> SparseQrels:
    """Per-turn qrels in candidate-index space, rows ``b * T + t``."""
    rows: List[List[int]] = []
    for conversation in checked:
        for t in range(turns):
            if t >= len(conversation.trellis):
                rows.append([])
                continue
            ids = conversation.relevant[t]
            hits = [m for m, c in enumerate(conversation.trellis[t]) if c.chunk_id in ids]
            rows.append(hits + [-1] * (len(ids) - len(hits)))
    width = max([1] + [len(row) for row in rows])
    ids = [row + [-1] * (width - len(row)) for row in rows]
    grades = [[1.0] * len(row) + [0.0] * (width - len(row)) for row in rows]
    return SparseQrels(torch.tensor(ids, dtype=torch.long).reshape(len(rows), width),
                       torch.tensor(grades, dtype=torch.float64).reshape(len(rows), width))


def _pack(checked: Sequence[_Checked], graph: CorpusGraph, dtype: torch.dtype, device: torch.device) -> LabelledBatch:
    """Pad validated conversations into a :class:`LabelledBatch` (one distance query)."""
    packed = pack_trellises([c.trellis for c in checked], dtype=dtype, device=device)
    batch, turns, width = packed.shape
    relevant = [[[False] * width for _ in range(turns)] for _ in checked]
    labelled = [[False] * turns for _ in checked]
    for b, conversation in enumerate(checked):
        for t, (turn, ids) in enumerate(zip(conversation.trellis, conversation.relevant)):
            labelled[b][t] = bool(ids)
            for m, candidate in enumerate(turn):
                relevant[b][t][m] = candidate.chunk_id in ids
    distances = consecutive_distances(packed.chunk_ids, graph, turns=turns, width=width, device=device)
    return LabelledBatch(
        scores=packed.scores,
        distances=distances.to(dtype),
        mask=packed.mask,
        relevant=torch.tensor(relevant, dtype=torch.bool, device=device).reshape(batch, turns, width),
        labelled=torch.tensor(labelled, dtype=torch.bool, device=device).reshape(batch, turns),
        qrels=_qrels_rows(checked, turns).to(device),
        chunk_ids=packed.chunk_ids,
        n_usable=sum(c.counts().usable for c in checked),
    )


def pack_conversations(
    conversations: Sequence[Any],
    graph: CorpusGraph,
    *,
    score_normalization: str = "zscore",
    dtype: torch.dtype = torch.float64,
    device: Optional[Union[str, torch.device]] = None,
) -> LabelledBatch:
    """Validate, normalize and pad labelled conversations into one :class:`LabelledBatch`.

    Args:
        conversations: B >= 1 conversations, each a non-empty list of turns
            ``(candidates, relevant)`` (see the module docstring).
        graph: the corpus graph (``CorpusGraph``; a tensor graph's batched distance
            search is used when present).
        score_normalization: ``"zscore"`` (default), ``"center"`` or ``"none"``,
            applied per turn to the raw scores.
        dtype: floating dtype of scores and distances. device: where they live.

    Returns:
        A :class:`LabelledBatch`.

    Raises:
        MapMatchedValueError: an empty conversation or turn, a non-finite score,
            duplicate chunk IDs in a turn, a malformed turn (naming conversation and
            turn), or a bad option.

    Cost: O(B T M) Python work plus the distance queries (O(B T M^2) pairs).
    """
    method = check_score_normalization(score_normalization)
    conversations = list(conversations)
    if not conversations:
        raise MapMatchedValueError("need at least one conversation")
    checked = [_check_conversation(c, i, method) for i, c in enumerate(conversations)]
    return _pack(checked, graph, _check_dtype(dtype), torch.device(device or "cpu"))


def _check_dtype(dtype: Any) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise MapMatchedValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return dtype
