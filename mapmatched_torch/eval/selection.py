"""The report's headline method, chosen without the test data, and repeated cross-fitting.

**Cross-fitted selection** (:func:`cross_fitted_selection`). The conversations are split
into selection folds (:func:`~mapmatched_torch.eval.methods.cross_fitting_folds`, the
run's seed; ``EvalConfig.selection_folds``, default 5, at most one per conversation).
Using more folds than the learned methods' 2 is what keeps the headline stable on small
sets: with 2 folds each choice was made on half the conversations, the folds of a
60-conversation set often picked different near-tied methods, and each fold tended to
get the one that was worse on it (``benchmarks/headline_stability.py``). With 5 folds
each choice reads 80% of the data. For each fold, the candidate method with the best mean
of the selection metric (nDCG@3) over the labelled turns of the *other* folds is
chosen, and the fold's turns are scored with that method's rankings. With preferred
methods (``EvalConfig.selection_preference``, default ``("mixed",)``, and
``selection_margin``, default 1.0), a fold takes the first preferred method whose mean
on the other folds trails the best by at most that many standard errors of the paired
difference (:func:`paired_gap`, conversations as units), and the best only when the
other folds show every preferred one worse. Why: when the best methods nearly tie,
a plain best-of-the-other-folds choice changes method from fold to fold, and a fold
whose own turns favour A is the fold whose removal makes B win, so each fold tends to
get the method that is worse on it. Over 10 random 60-conversation subsets of INSCIT
dev (``benchmarks/headline_stability.py``) the headline keeps 100% of the best single
method's lift on average (min 96%), the plain choice 89% (min 50%; 73% before the
recurrent mix), docs/experiment_log.md. The preference was chosen on that dataset; a
held-out set where another method is clearly better still gets that method. The result is one
more ranking, ``cross-fitted primary``: no conversation is scored by a choice its own
labels took part in, so its interval and lift are honest estimates of "pick the best
method on held-out data", and the report says ``selected_on_data: false``.

The candidates are every method the run has except those that read what a deployed
system does not have (:data:`SELECTION_EXCLUDED`: the resolved-query oracle reads the
rewrites). Ties go to the earlier candidate in report order (pointwise first, so a
tie keeps the baseline).

One caveat, inherent to selecting among methods that are themselves cross-fitted
without nesting a second split: the training-fold values of a cross-fitted method
(fitted, gated, ...) come from models fitted on the other folds, which include the
held-out one. The choice among a handful of candidates is a weak channel; the
held-out fold's *scores* never come from a model or a choice fitted on it.

**Repeated cross-fitting** (:func:`repeat_summaries`): the same evaluation with R
different conversation-to-fold assignments (seeds ``seed, seed + 1, ...``); for each
cross-fitted ranking (its params carry ``"folds"``) and slice, the mean and the range
(min, max) of its slice means and of its lift over pointwise across the R splits. The
bootstrap interval answers "how much do the conversations move it", the range "how
much does the fold split move it".

Example:
    >>> import torch
    >>> per_turn = {"pointwise": {"ndcg@3": torch.tensor([0.5, 0.5, 0.5, 0.5], dtype=torch.float64)},
    ...             "better": {"ndcg@3": torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)}}
    >>> conversation = torch.tensor([0, 1, 2, 3])
    >>> fold = torch.tensor([0, 0, 1, 1])
    >>> chosen = cross_fitted_selection(per_turn, ["pointwise", "better"], conversation,
    ...                                 torch.ones(4, dtype=torch.bool), fold)
    >>> chosen.choices, chosen.metrics["ndcg@3"].tolist()
    (('better', 'pointwise'), [1.0, 0.0, 0.5, 0.5])
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, NamedTuple, Sequence, Tuple

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from .turn_values import PerTurnMetrics

__all__ = [
    "SELECTION_KEY_FORMAT",
    "SELECTION_METHOD",
    "SELECTION_TITLE",
    "SELECTION_EXCLUDED",
    "Selection",
    "RepeatRange",
    "selection_candidates",
    "cross_fitted_selection",
    "is_cross_fitted",
    "repeat_summaries",
]

#: The method name of the cross-fitted selection in reports (not a registered method).
SELECTION_METHOD = "cross-fitted-primary"
#: Its title in reports.
SELECTION_TITLE = "cross-fitted primary (best method of the other folds, per fold)"
#: Its report key, formatted with the number of folds.
SELECTION_KEY_FORMAT = "cross-fitted primary ({folds}-fold selection)"
#: Methods the selection never picks: they read what a deployed system does not have.
SELECTION_EXCLUDED = ("resolved-query-oracle",)


class Selection(NamedTuple):
    """The outcome of :func:`cross_fitted_selection`.

    Attributes:
        metrics: metric -> (N,) float64 per-turn values (each turn: its fold's choice).
        choices: F method keys, the choice of each fold.
        training_means: F floats, the chosen method's selection-metric mean on the
            other folds' eligible turns.
        candidates: the keys it chose from, in tie-break order.
        preferred: the keys it preferred, in order (those among the candidates).
        margin: the standard errors a preferred key may trail the best by.
    """

    metrics: Dict[str, Tensor]
    choices: Tuple[str, ...]
    training_means: Tuple[float, ...]
    candidates: Tuple[str, ...]
    preferred: Tuple[str, ...] = ()
    margin: float = 0.0

    def params(self, metric: str) -> Dict[str, Any]:
        """JSON-friendly parameters of the selection (its report row's params)."""
        criterion = "all labelled turns of the other folds"
        if self.preferred:
            criterion += (f"; the first of {list(self.preferred)} within {self.margin:g} standard errors "
                          "(conversations as units) of the best there, else the best")
        return {
            "folds": len(self.choices), "metric": metric, "criterion": criterion,
            "choices": [{"fold": fold, "method": key, "training_mean": mean}
                        for fold, (key, mean) in enumerate(zip(self.choices, self.training_means))],
            "candidates": list(self.candidates),
        }


def selection_candidates(described: Mapping[str, Tuple[str, Mapping[str, Any]]]) -> List[str]:
    """The report keys the selection may pick, in report order (:data:`SELECTION_EXCLUDED` left out).

    Args:
        described: report key -> (method name, params), in report order.
    """
    return [key for key, (method, _) in described.items()
            if method not in SELECTION_EXCLUDED and method != SELECTION_METHOD]


def cross_fitted_selection(
    per_turn: Mapping[str, Mapping[str, Tensor]],
    candidates: Sequence[str],
    conversation: Tensor,
    eligible: Tensor,
    fold: Tensor,
    metric: str = "ndcg@3",
    preferred: Sequence[str] = (),
    margin: float = 0.0,
) -> Selection:
    """Per fold, the candidate with the best mean ``metric`` on the other folds (or a
    preferred one they do not show worse); its values on the fold.

    Args:
        per_turn: report key -> metric -> (N,) float per-turn values (every candidate
            has every metric of the first one).
        candidates: C report keys, in tie-break order (the first of equal means wins).
        conversation: (N,) long conversation index of each turn.
        eligible: (N,) bool turns the selection reads (the labelled ones).
        fold: (B,) long fold of each conversation, values 0..F-1.
        metric: the selection metric.
        preferred: candidate keys in order of preference (others are ignored): a fold
            takes the first whose training mean is below the best one's by at most
            ``margin`` standard errors (:func:`paired_gap`), else the best.
        margin: standard errors (>= 0; 0 with no ``preferred``: the plain best).

    Returns:
        The :class:`Selection`. A fold whose other folds have no eligible turn keeps
        the first candidate (its training mean NaN). The training means are exact
        (``math.fsum`` of the values over the count), so the choice does not depend
        on the order of the turns or the number of torch threads.

    Raises:
        MapMatchedValueError: no candidate, a candidate without ``metric``, or a
            negative margin.
    """
    if not (isinstance(margin, (int, float)) and not isinstance(margin, bool) and margin >= 0
            and math.isfinite(margin)):
        raise MapMatchedValueError(f"the selection margin must be a finite number >= 0, got {margin!r}")
    if not candidates:
        raise MapMatchedValueError("the cross-fitted selection needs at least one candidate method")
    missing = [key for key in candidates if metric not in per_turn.get(key, {})]
    if missing:
        raise MapMatchedValueError(f"the cross-fitted selection's candidates {missing} have no {metric!r} values")
    coded = PerTurnMetrics.of(per_turn)
    fold = fold.to(conversation.device)
    # shape: (N,) fold of each turn
    turn_fold = fold[conversation]
    folds = int(fold.max()) + 1 if fold.numel() else 0
    names = list(coded.columns(candidates[0]))
    first = coded.column(candidates[0], metric)
    metrics = {name: torch.empty(len(first), dtype=torch.float64, device=first.device) for name in names}
    choices: List[str] = []
    means: List[float] = []
    for held_out in range(folds):
        train = eligible & (turn_fold != held_out)
        count = int(train.sum())
        if count:
            # exact sums (order-free); max keeps the first of equal means
            scores = [coded.column(key, metric).masked_sum(train) / count for key in candidates]
            best = max(range(len(scores)), key=lambda index: (scores[index], -index))
            best = _preferred_choice(coded, candidates, metric, best, preferred, margin, conversation, train)
            means.append(scores[best])
        else:
            best = 0
            means.append(math.nan)
        key = candidates[best]
        choices.append(key)
        rows = turn_fold == held_out
        for name in names:
            metrics[name][rows] = coded[key][name][rows]
    kept = tuple(key for key in preferred if key in candidates)
    return Selection(metrics, tuple(choices), tuple(means), tuple(candidates), kept, float(margin))


def paired_gap(best: Tensor, other: Tensor, conversation: Tensor, rows: Tensor) -> Tuple[float, float]:
    """``(gap, standard error)``: the mean of ``best - other`` over ``rows``, and its
    standard error with conversations as the units (their turns are not independent).

    Args:
        best, other: (N,) float per-turn values. conversation: (N,) long. rows: (N,) bool.

    Returns:
        ``gap = sum_c S_c / n`` (``S_c`` the sum of the differences over conversation
        c's rows, n the rows) and ``std_c(S_c C / n) / sqrt(C)`` over the C
        conversations with rows (0.0 for one conversation).
    """
    count = int(rows.sum())
    if not count:
        return 0.0, 0.0
    present, inverse = torch.unique(conversation[rows], return_inverse=True)
    sums = torch.zeros(len(present), dtype=torch.float64, device=best.device)
    sums.index_add_(0, inverse, (best[rows] - other[rows]).to(torch.float64))
    units = len(present)
    scaled = sums * units / count
    gap = math.fsum(sums.tolist()) / count
    spread = float(scaled.std()) / math.sqrt(units) if units > 1 else 0.0
    return gap, spread


def _preferred_choice(coded: Any, candidates: Sequence[str], metric: str, best: int, preferred: Sequence[str],
                      margin: float, conversation: Tensor, train: Tensor) -> int:
    """The index of the first of ``preferred`` (among ``candidates``) whose gap to the
    best on ``train`` is at most ``margin`` standard errors (:func:`paired_gap`); else ``best``."""
    top = coded.column(candidates[best], metric).decode()
    for key in preferred:
        if key not in candidates:
            continue
        index = candidates.index(key)
        if index == best:
            return best
        gap, spread = paired_gap(top, coded.column(key, metric).decode(), conversation, train)
        if gap <= margin * spread:
            return index
    return best


def is_cross_fitted(params: Mapping[str, Any]) -> bool:
    """Whether a ranking depends on the fold split: its params carry ``"folds"`` (fitted, gated, the selection)."""
    return "folds" in params


class RepeatRange(NamedTuple):
    """One value over R fold splits.

    Attributes:
        mean: its mean over the splits. low, high: its min and max. values: per split
            (the first is the reported evaluation's own split). NaN where undefined.
    """

    mean: float
    low: float
    high: float
    values: Tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> "RepeatRange":
        """The range of ``values`` (NaN entries ignored; all NaN gives NaN)."""
        finite = [v for v in values if not math.isnan(v)]
        if not finite:
            return cls(math.nan, math.nan, math.nan, tuple(values))
        return cls(math.fsum(finite) / len(finite), min(finite), max(finite), tuple(values))

    def to_dict(self) -> Dict[str, Any]:
        """``{"mean", "min", "max", "values"}``."""
        return {"mean": self.mean, "min": self.low, "max": self.high, "values": list(self.values)}


def repeat_summaries(
    runs: Sequence[Mapping[str, Tuple[Mapping[str, Any], Mapping[str, float]]]],
    baseline: str = "pointwise",
) -> Dict[str, Dict[str, Dict[str, RepeatRange]]]:
    """Mean and range of every cross-fitted ranking's slice means (and lifts) over R fold splits.

    Args:
        runs: R evaluations, each report key -> (params, slice -> mean of the primary
            metric); the baseline must be in each.
        baseline: the key lifts are measured against (fold-independent).

    Returns:
        key -> ``{"mean": slice -> RepeatRange, "lift": slice -> RepeatRange}`` for the
        keys whose params say they are cross-fitted (:func:`is_cross_fitted`) and that
        every run has, in the first run's order.
    """
    if not runs:
        return {}
    first = runs[0]
    out: Dict[str, Dict[str, Dict[str, RepeatRange]]] = {}
    for key, (params, slices) in first.items():
        if not is_cross_fitted(params) or not all(key in run for run in runs):
            continue
        means: Dict[str, RepeatRange] = {}
        lifts: Dict[str, RepeatRange] = {}
        for name in slices:
            values = [run[key][1].get(name, math.nan) for run in runs]
            bases = [run[baseline][1].get(name, math.nan) for run in runs]
            means[name] = RepeatRange.of(values)
            lifts[name] = RepeatRange.of([v - b for v, b in zip(values, bases)])
        out[key] = {"mean": means, "lift": lifts}
    return out
