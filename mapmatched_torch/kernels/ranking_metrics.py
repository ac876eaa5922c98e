"""Ranking metrics on tensors, batched over turns: nDCG@k, Recall@k, reciprocal rank.

Inputs, for N turns:

- ``ranked``: (N, K) long, passage indices (corpus order, e.g.
  :attr:`Dataset.passage_index <mapmatched_torch.eval.data.Dataset.passage_index>`)
  in rank order; any negative value is padding (``-1``) and earns nothing. A passage
  that appears more than once in a row counts only at its first (best) rank.
- ``qrels``: graded relevance in one of two forms:

  * dense: a (N, P) float tensor, ``qrels[n, p]`` = grade of passage p for turn n;
  * sparse: a :class:`SparseQrels` of (N, R) ``ids`` (long) and ``grades`` (float64),
    built by :func:`pack_qrels`; ``grades <= 0`` entries are padding or judged
    non-relevant. An id of ``-1`` with a positive grade is a relevant passage that is
    not in the corpus: it counts in the ideal DCG and the recall denominator but can
    never be retrieved (trec_eval's convention).

A passage is *relevant* when its grade is > 0. Outputs are (N,) float64 on the
device of ``ranked``; a turn without relevant passages scores 0.0 in every metric:
exclude such turns with :func:`labelled` (the mean over labelled turns is the usual
figure).

nDCG uses the linear gain ``gain = grade`` (trec_eval's ``ndcg_cut``; with binary
qrels it equals the exponential gain ``2**grade - 1``; pass ``gain="exponential"``
for the latter) and the discount ``1 / log2(rank + 1)`` (rank 1-based). The ideal DCG
sorts all of the turn's positive grades (not only the retrieved ones) in decreasing
order.

nDCG is a ratio, so it is computed on gains scaled per turn, which cannot overflow for
any finite grade (a grade of 1e308 used to make nDCG NaN; a perfect ranking now
scores 1.0 whatever the grades):

* linear gain: every grade of a turn is divided by ``2**e``, with ``e >= 0`` the
  binary exponent of the turn's largest grade (:func:`torch.frexp`), so the scaled
  grades are below 1. Dividing by a power of two is exact, so nDCG is bit for bit the
  unscaled one whenever that was finite; grades more than about ``2**1000`` times
  smaller than the turn's largest are lost to underflow (their share of nDCG is
  below ``1e-300``).
* exponential gain: the turn's gains are multiplied by ``2**-s`` with
  ``s = max(0, largest grade - 1000)``: ``2**(grade - s) - 2**-s``. Turns whose grades
  are all <= 1000 (``s = 0``) use ``2**grade - 1`` unchanged.

:func:`dcg_at_k` returns the unscaled DCG, which is ``inf`` for such grades. Dense
qrels must be finite (refused otherwise, as :func:`pack_qrels` refuses a non-finite
grade).

Cost: O(N K R) time and memory for the sparse form (O(N K) gathers for the dense
form) plus O(N K log K) for duplicate removal.

Example:
    >>> import torch
    >>> ranked = torch.tensor([[3, 1, 2], [0, 2, -1]])
    >>> qrels = pack_qrels([{"b": 1.0}, {"a": 1.0, "c": 1.0}], {"a": 0, "b": 1, "c": 2, "d": 3})
    >>> reciprocal_rank(ranked, qrels).tolist()
    [0.5, 1.0]
    >>> recall_at_k(ranked, qrels, 1).tolist()
    [0.0, 0.5]
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError

__all__ = [
    "SparseQrels",
    "Qrels",
    "GAINS",
    "pack_qrels",
    "pack_rankings",
    "dense_qrels",
    "labelled",
    "dcg_at_k",
    "ndcg_at_k",
    "recall_at_k",
    "reciprocal_rank",
    "ranking_metrics",
]

#: The accepted values of ``gain``.
GAINS = ("linear", "exponential")


class SparseQrels(NamedTuple):
    """Graded relevance of N turns, padded to R entries per turn.

    Attributes:
        ids: (N, R) long, passage indices; ``-1`` for padding and for relevant
            passages missing from the corpus.
        grades: (N, R) float64; 0.0 for padding.
    """

    ids: torch.Tensor
    grades: torch.Tensor

    def to(self, device: Union[str, torch.device]) -> "SparseQrels":
        """Both tensors on ``device``."""
        return SparseQrels(self.ids.to(device), self.grades.to(device))

    def select(self, rows: Union[torch.Tensor, slice]) -> "SparseQrels":
        """The qrels of some turns: ``rows`` is a (N,) bool mask, an index tensor or a slice."""
        return SparseQrels(self.ids[rows], self.grades[rows])


#: Either qrels form.
Qrels = Union[torch.Tensor, SparseQrels]


def pack_qrels(
    qrels: Sequence[Mapping[str, float]],
    index: Mapping[str, int],
    *,
    unknown: str = "keep",
    device: Union[str, torch.device, None] = None,
) -> SparseQrels:
    """Pack per-turn qrels dicts into a :class:`SparseQrels`.

    Args:
        qrels: one ``{passage_id: grade}`` per turn (e.g. ``Dataset.turn_qrels()``).
        index: passage ID -> corpus index (e.g. ``Dataset.passage_index``).
        unknown: what to do with an ID missing from ``index``: ``"keep"`` (default;
            stored as id -1, so it lowers recall and nDCG like trec_eval does),
            ``"drop"`` (ignored), or ``"error"``.
        device: where to put the tensors.

    Returns:
        SparseQrels with R = the largest number of kept entries of a turn (at least 1).

    Raises:
        MapMatchedValueError: a bad ``unknown`` value, a non-finite grade, or (with
            ``unknown="error"``) an unknown ID (naming the turn).
    """
    check_choice("unknown-id policy", unknown, ("keep", "drop", "error"))
    rows: list = []
    columns: list = []
    ids: list = []
    grades: list = []
    width = 1
    turns = 0
    for turn, entries in enumerate(qrels):
        turns += 1
        column = 0
        for passage_id, grade in entries.items():
            grade = float(grade)
            if not math.isfinite(grade):
                raise MapMatchedValueError(f"turn {turn}: grade of {passage_id!r} must be finite, got {grade!r}")
            position = index.get(passage_id)
            if position is None:
                if unknown == "error":
                    raise MapMatchedValueError(f"turn {turn}: qrels passage {passage_id!r} is not in the corpus")
                if unknown == "drop":
                    continue
                position = -1
            rows.append(turn)
            columns.append(column)
            ids.append(position)
            grades.append(grade)
            column += 1
        width = max(width, column)
    out_ids = torch.full((turns, width), -1, dtype=torch.long)
    out_grades = torch.zeros((turns, width), dtype=torch.float64)
    if rows:
        where = (torch.tensor(rows, dtype=torch.long), torch.tensor(columns, dtype=torch.long))
        out_ids[where] = torch.tensor(ids, dtype=torch.long)
        out_grades[where] = torch.tensor(grades, dtype=torch.float64)
    return SparseQrels(out_ids.to(device), out_grades.to(device))


def pack_rankings(
    rankings: Sequence[Sequence[str]],
    index: Mapping[str, int],
    k: Optional[int] = None,
    *,
    device: Union[str, torch.device, None] = None,
) -> torch.Tensor:
    """Ranked passage-ID lists -> an (N, K) long tensor of corpus indices.

    IDs missing from ``index`` become -1 (they earn nothing). K = ``k`` when given
    (longer lists are cut, shorter padded with -1), else the longest list (at least 1).
    """
    width = k if k is not None else max([1] + [len(row) for row in rankings])
    if width <= 0:
        raise MapMatchedValueError(f"k must be positive, got {width}")
    out = torch.full((len(rankings), width), -1, dtype=torch.long)
    for row, ids in enumerate(rankings):
        values = [index.get(passage_id, -1) for passage_id in list(ids)[:width]]
        if values:
            out[row, : len(values)] = torch.tensor(values, dtype=torch.long)
    return out.to(device)


def dense_qrels(qrels: SparseQrels, num_passages: int) -> torch.Tensor:
    """The (N, P) float64 dense form of sparse qrels (entries with id -1 are lost)."""
    dense = torch.zeros((qrels.ids.shape[0], num_passages), dtype=torch.float64, device=qrels.ids.device)
    keep = qrels.ids >= 0
    rows = torch.arange(qrels.ids.shape[0], device=qrels.ids.device).unsqueeze(1).expand_as(qrels.ids)
    dense[rows[keep], qrels.ids[keep]] = qrels.grades[keep].to(torch.float64)
    return dense


def labelled(qrels: Qrels) -> torch.Tensor:
    """(N,) bool: the turn has at least one grade > 0 (the turns a metric mean should cover)."""
    grades = qrels.grades if isinstance(qrels, SparseQrels) else qrels
    return (grades > 0).any(dim=1)


# --------------------------------------------------------------------------- internals


def _check_ranked(ranked: torch.Tensor, qrels: Qrels) -> None:
    if not isinstance(ranked, torch.Tensor) or ranked.dim() != 2:
        raise MapMatchedValueError(f"ranked must be an (N, K) tensor, got {getattr(ranked, 'shape', type(ranked))}")
    if ranked.dtype not in (torch.int64, torch.int32):
        raise MapMatchedValueError(f"ranked must hold integer passage indices, got {ranked.dtype}")
    grades = qrels.grades if isinstance(qrels, SparseQrels) else qrels
    if not isinstance(grades, torch.Tensor) or grades.dim() != 2:
        raise MapMatchedValueError("qrels must be a dense (N, P) tensor or a SparseQrels of (N, R) tensors")
    if grades.device != ranked.device or (isinstance(qrels, SparseQrels) and qrels.ids.device != ranked.device):
        raise MapMatchedValueError(f"ranked is on {ranked.device} but qrels is on {grades.device}: move one of them")
    if grades.shape[0] != ranked.shape[0]:
        raise MapMatchedValueError(f"ranked has {ranked.shape[0]} turns but qrels has {grades.shape[0]}")
    if isinstance(qrels, SparseQrels) and qrels.ids.shape != qrels.grades.shape:
        raise MapMatchedValueError(f"qrels ids {tuple(qrels.ids.shape)} and grades {tuple(qrels.grades.shape)} differ in shape")
    if not isinstance(qrels, SparseQrels) and ranked.numel() and int(ranked.max()) >= grades.shape[1]:
        raise MapMatchedValueError(f"ranked holds passage index {int(ranked.max())} but dense qrels has {grades.shape[1]} columns")
    if not isinstance(qrels, SparseQrels) and grades.is_floating_point() and not bool(torch.isfinite(grades).all()):
        row = int((~torch.isfinite(grades)).any(dim=1).nonzero()[0, 0])
        raise MapMatchedValueError(f"qrels grades must be finite: turn {row} has {grades[row][~torch.isfinite(grades[row])][0].item()!r}")


def _cut(ranked: torch.Tensor, k: Optional[int]) -> torch.Tensor:
    ranked = ranked.long()
    if k is None:
        return ranked
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise MapMatchedValueError(f"k must be a positive int, got {k!r}")
    return ranked[:, :k]


def _first_occurrence(ranked: torch.Tensor) -> torch.Tensor:
    """(N, K) bool: a real entry (>= 0) that does not repeat an earlier entry of its row."""
    values, order = torch.sort(ranked, dim=1, stable=True)
    # shape: (N, K), True where the sorted value repeats its left neighbour
    repeat_sorted = torch.zeros_like(values, dtype=torch.bool)
    repeat_sorted[:, 1:] = values[:, 1:] == values[:, :-1]
    repeat = torch.empty_like(repeat_sorted).scatter_(1, order, repeat_sorted)
    return (ranked >= 0) & ~repeat


def _grades_of(ranked: torch.Tensor, qrels: Qrels) -> torch.Tensor:
    """(N, K) float64: the grade of each ranked entry (0 for padding and repeats)."""
    real = _first_occurrence(ranked)
    if isinstance(qrels, SparseQrels):
        # shape: (N, K, R)
        match = (ranked.unsqueeze(2) == qrels.ids.unsqueeze(1)) & (qrels.ids >= 0).unsqueeze(1)
        grades = (match.to(torch.float64) * qrels.grades.to(torch.float64).unsqueeze(1)).sum(dim=2)
    else:
        grades = qrels.to(torch.float64).gather(1, ranked.clamp(min=0))
    return torch.where(real, grades, torch.zeros((), dtype=torch.float64, device=ranked.device))


def _gain(grades: torch.Tensor, gain: str) -> torch.Tensor:
    check_choice("gain", gain, GAINS)
    positive = grades.clamp(min=0.0)
    return positive if gain == "linear" else torch.expm1(positive * math.log(2.0))


#: The largest grade the exponential gain takes unscaled (2**1000 is finite in float64).
_EXPONENTIAL_MAX = 1000.0


def _scaled_gain(grades: torch.Tensor, top: torch.Tensor, gain: str) -> torch.Tensor:
    """``gain(grades)`` times a per-turn factor that keeps the turn's gains finite (see the module docstring).

    Args:
        grades: (N, W) float64 grades to turn into gains.
        top: (N,) float64, the turn's largest grade clamped at 0.

    Returns:
        (N, W) float64 finite gains, each row scaled by the same positive factor.
    """
    check_choice("gain", gain, GAINS)
    positive = grades.clamp(min=0.0)
    if gain == "linear":
        # shape: (N, 1) binary exponent e >= 0 of the largest grade: top / 2**e < 1
        exponent = torch.frexp(top).exponent.clamp(min=0).to(torch.float64).unsqueeze(1)
        return positive * torch.exp2(-exponent)  # exact: 2**-e is a float64 (a subnormal for e > 1022)
    # shape: (N, 1)
    shift = (top - _EXPONENTIAL_MAX).clamp(min=0.0).unsqueeze(1)
    shifted = torch.exp2(positive - shift) - torch.exp2(-shift)
    return torch.where(shift > 0, shifted, torch.expm1(positive * math.log(2.0)))


def _ndcg(grades: torch.Tensor, every: torch.Tensor, k: int, gain: str) -> torch.Tensor:
    """(N,) nDCG@k from the (N, K) grades of the ranked entries and all (N, R) grades."""
    # shape: (N,)
    top = every.clamp(min=0.0).amax(dim=1) if every.shape[1] else torch.zeros(every.shape[0], dtype=torch.float64,
                                                                              device=every.device)
    gains = _scaled_gain(grades[:, :k].contiguous(), top, gain)
    dcg = (gains * _discount(gains.shape[1], grades.device)).sum(dim=1)
    width = min(k, every.shape[1])
    # shape: (N, min(k, R))
    ideal_grades = torch.topk(every.clamp(min=0.0), width, dim=1).values
    ideal = (_scaled_gain(ideal_grades, top, gain) * _discount(width, every.device)).sum(dim=1)
    return torch.where(ideal > 0, dcg / ideal.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(dcg))


def _discount(width: int, device: torch.device) -> torch.Tensor:
    """(width,) float64: 1 / log2(rank + 1) for ranks 1..width."""
    ranks = torch.arange(1, width + 1, dtype=torch.float64, device=device)
    return 1.0 / torch.log2(ranks + 1.0)


def _all_grades(qrels: Qrels) -> torch.Tensor:
    return (qrels.grades if isinstance(qrels, SparseQrels) else qrels).to(torch.float64)


# --------------------------------------------------------------------------- metrics


def dcg_at_k(ranked: torch.Tensor, qrels: Qrels, k: Optional[int] = None, *, gain: str = "linear") -> torch.Tensor:
    """Discounted cumulative gain of the top ``k`` (all of ``ranked`` when None).

    Args:
        ranked: (N, K) long passage indices, -1 padding.
        qrels: dense (N, P) grades or :class:`SparseQrels`.
        k: cut-off (positive int) or None.
        gain: ``"linear"`` (grade) or ``"exponential"`` (2**grade - 1).

    Returns:
        (N,) float64 ``sum_r gain(grade_r) / log2(r + 1)``.
    """
    _check_ranked(ranked, qrels)
    top = _cut(ranked, k)
    # shape: (N, K')
    gains = _gain(_grades_of(top, qrels), gain)
    return (gains * _discount(top.shape[1], ranked.device)).sum(dim=1)


def ndcg_at_k(ranked: torch.Tensor, qrels: Qrels, k: int, *, gain: str = "linear") -> torch.Tensor:
    """Normalized DCG at ``k``: DCG@k / ideal DCG@k (0.0 when the turn has no relevant passage).

    The ideal ranking orders all of the turn's positive grades decreasingly (relevant
    passages missing from the corpus included), so a retriever that cannot reach a
    relevant passage cannot score 1.

    Args:
        ranked: (N, K) long passage indices, -1 padding.
        qrels: dense (N, P) grades or :class:`SparseQrels`.
        k: the cut-off (positive int); a K < k list is scored as if padded.
        gain: ``"linear"`` (default) or ``"exponential"``.

    Returns:
        (N,) float64 in [0, 1], finite for every finite grade (gains scaled per turn;
        see the module docstring).

    Example:
        >>> import torch
        >>> ranked = torch.tensor([[1, 0]])
        >>> qrels = torch.tensor([[1.0, 1.0, 1.0]])  # three relevant, two retrieved: (1 + 1/log2 3) / (1 + 1/log2 3 + 1/2)
        >>> round(float(ndcg_at_k(ranked, qrels, 3)[0]), 6)
        0.765361
    """
    _check_ranked(ranked, qrels)
    top = _cut(ranked, k)
    return _ndcg(_grades_of(top, qrels), _all_grades(qrels), k, gain)


def recall_at_k(ranked: torch.Tensor, qrels: Qrels, k: int) -> torch.Tensor:
    """Fraction of the turn's relevant passages (grade > 0) found in the top ``k``.

    Returns:
        (N,) float64 in [0, 1]; 0.0 when the turn has no relevant passage.
    """
    _check_ranked(ranked, qrels)
    found = (_grades_of(_cut(ranked, k), qrels) > 0).sum(dim=1).to(torch.float64)
    total = (_all_grades(qrels) > 0).sum(dim=1).to(torch.float64)
    return torch.where(total > 0, found / total.clamp(min=1.0), torch.zeros_like(found))


def reciprocal_rank(ranked: torch.Tensor, qrels: Qrels, k: Optional[int] = None) -> torch.Tensor:
    """1 / rank of the first relevant passage within the top ``k`` (whole list when None).

    Its mean over labelled turns is MRR (MRR@k with ``k``).

    Returns:
        (N,) float64; 0.0 when no relevant passage is ranked (within ``k``).
    """
    _check_ranked(ranked, qrels)
    top = _cut(ranked, k)
    hit = _grades_of(top, qrels) > 0
    if top.shape[1] == 0:
        return torch.zeros(top.shape[0], dtype=torch.float64, device=ranked.device)
    # argmax of a bool row returns the first True (0 when there is none: masked below)
    first = hit.to(torch.uint8).argmax(dim=1)
    reciprocal = 1.0 / (first.to(torch.float64) + 1.0)
    return torch.where(hit.any(dim=1), reciprocal, torch.zeros_like(reciprocal))


def ranking_metrics(
    ranked: torch.Tensor, qrels: Qrels, ks: Sequence[int] = (3, 5, 10), *, gain: str = "linear"
) -> Dict[str, torch.Tensor]:
    """``ndcg@k`` and ``recall@k`` for every k, and ``mrr`` (whole list), from one pass over the ranking.

    Equal, bit for bit, to :func:`ndcg_at_k`, :func:`recall_at_k` and
    :func:`reciprocal_rank` called one by one (the grades of the ranked entries, the
    costly part, are found once instead of once per metric).

    Args:
        ranked: (N, K) long passage indices, -1 padding.
        qrels: dense (N, P) grades or :class:`SparseQrels`.
        ks: positive cut-offs.
        gain: the nDCG gain, ``"linear"`` (default) or ``"exponential"``.

    Returns:
        metric name -> (N,) float64: ``ndcg@k`` for each k, then ``recall@k`` for each
        k, then ``mrr``.
    """
    _check_ranked(ranked, qrels)
    for k in ks:
        _cut(ranked, k)  # validates k
    ranked = ranked.long()
    # shape: (N, K) grade of each ranked entry (0 for padding and repeats)
    grades = _grades_of(ranked, qrels)
    every = _all_grades(qrels)
    out: Dict[str, torch.Tensor] = {}
    for k in ks:
        out[f"ndcg@{k}"] = _ndcg(grades, every, k, gain)
    total = (every > 0).sum(dim=1).to(torch.float64)
    for k in ks:
        found = (grades[:, :k] > 0).sum(dim=1).to(torch.float64)
        out[f"recall@{k}"] = torch.where(total > 0, found / total.clamp(min=1.0), torch.zeros_like(found))
    hit = grades > 0
    if ranked.shape[1] == 0:
        out["mrr"] = torch.zeros(ranked.shape[0], dtype=torch.float64, device=ranked.device)
    else:
        first = hit.to(torch.uint8).argmax(dim=1)
        reciprocal = 1.0 / (first.to(torch.float64) + 1.0)
        out["mrr"] = torch.where(hit.any(dim=1), reciprocal, torch.zeros_like(reciprocal))
    return out
