"""Paired bootstrap confidence intervals over conversations, and the pass/fail verdict.

Turns of one conversation are not independent, so the resampling unit is the
conversation (a cluster bootstrap): draw C conversations with replacement from the C
that have at least one turn in the slice, recompute the statistic, repeat.

Two statistics (``weighting``):

- ``"turn"`` (default): the mean over the slice's turns, i.e. per-conversation
  *sums* of the per-turn values divided by the per-conversation turn counts, both
  summed over the resample. Its point estimate is the plain mean over the slice's
  turns (the number a metrics table shows).
- ``"conversation"``: the mean over conversations of each conversation's *mean*
  over its slice turns (every conversation weighs the same).

The interval is the percentile interval: the ``(1 - confidence) / 2`` and
``(1 + confidence) / 2`` quantiles of the resampled statistics (linear
interpolation). The point estimate (:attr:`BootstrapResult.mean`) is the statistic
on the original sample, not the mean of the resamples.

Determinism: a ``torch.Generator`` seeded with ``seed`` on the inputs' device draws
the resamples in chunks whose size depends only on the number of conversations, so
the same inputs, seed and device give the same interval (CPU and CUDA generators
differ, so the two devices give different, equally valid, intervals).

Every sum over conversations (the point estimate and each resample's) is a fixed
pairwise tree of elementwise additions, so an interval does not depend on the number
of torch threads (a long ``tensor.sum()`` does, in its last bits), and a distributed
evaluation's report equals the one-process report. :func:`bootstrap_means` bootstraps
many columns over one slice with one set of resamples (the harness's path: every
ranking's interval and lift per slice), each equal to its own :func:`bootstrap_mean`.

Cost: O(n_resamples * C) time per column; memory O(min(n_resamples * C, 2**24)) per
chunk plus (C,) per column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch

from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError

__all__ = [
    "WEIGHTINGS",
    "BootstrapResult",
    "Verdict",
    "bootstrap_mean",
    "bootstrap_means",
    "paired_difference",
    "paired_bootstrap",
    "verdict",
]

#: The accepted values of ``weighting``.
WEIGHTINGS = ("turn", "conversation")

# Most resample indices drawn at once (rows x conversations).
_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True, slots=True)
class BootstrapResult:
    """A bootstrap estimate with its percentile interval.

    Attributes:
        mean: the statistic on the original sample (NaN when the slice is empty).
        low: lower end of the interval (NaN when the slice is empty).
        high: upper end of the interval (NaN when the slice is empty).
        n: conversations with at least one turn in the slice (the resampling units).
        n_turns: turns in the slice.
        confidence: the interval's nominal coverage, e.g. 0.95.
        n_resamples: bootstrap resamples drawn.
        weighting: ``"turn"`` or ``"conversation"``.
        seed: the generator seed.
    """

    mean: float
    low: float
    high: float
    n: int
    n_turns: int
    confidence: float
    n_resamples: int
    weighting: str
    seed: int

    def contains(self, value: float) -> bool:
        """Whether ``low <= value <= high``."""
        return self.low <= value <= self.high

    def to_dict(self) -> Dict[str, Any]:
        """The fields as a plain dict (NaN stays NaN: serialize it as null yourself)."""
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of :func:`verdict`.

    Attributes:
        passed: ``followup_ok and standalone_ok``.
        followup_ok: the follow-up lift's lower bound is > 0.
        standalone_ok: the standalone change's lower bound is >= -tolerance.
        tolerance: the standalone tolerance used (metric units).
        reason: a one-line explanation with the bounds.
    """

    passed: bool
    followup_ok: bool
    standalone_ok: bool
    tolerance: float
    reason: str

    def __bool__(self) -> bool:
        return self.passed


def _check_slice(conversation: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The slice's (N,) bool mask (every turn for None), after checking ``conversation`` and ``mask``."""
    if not isinstance(conversation, torch.Tensor) or conversation.dim() != 1:
        raise MapMatchedValueError(
            f"conversation must be a (N,) tensor, got {getattr(conversation, 'shape', type(conversation))}")
    if conversation.is_floating_point() or conversation.dtype == torch.bool:
        raise MapMatchedValueError(f"conversation must hold integer conversation indices, got {conversation.dtype}")
    if mask is None:
        return torch.ones_like(conversation, dtype=torch.bool)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != conversation.shape:
        raise MapMatchedValueError(f"mask must be a bool tensor of shape {tuple(conversation.shape)}")
    return mask


def _check_column(values: torch.Tensor, conversation: torch.Tensor) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 1:
        raise MapMatchedValueError(f"per-turn values must be a (N,) tensor, got {getattr(values, 'shape', type(values))}")
    if conversation.shape != values.shape:
        raise MapMatchedValueError(f"conversation must be a (N,) tensor of shape {tuple(values.shape)}")


def _check_options(n_resamples: int, confidence: float, weighting: str) -> None:
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples <= 0:
        raise MapMatchedValueError(f"n_resamples must be a positive int, got {n_resamples!r}")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise MapMatchedValueError(f"confidence must be in (0, 1), got {confidence!r}")
    check_choice("weighting", weighting, WEIGHTINGS)


def bootstrap_mean(
    values: torch.Tensor,
    conversation: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    weighting: str = "turn",
) -> BootstrapResult:
    """Bootstrap interval of the mean of per-turn values over the turns in ``mask``.

    Args:
        values: (N,) float per-turn values (e.g. a metric, or a paired difference).
        conversation: (N,) integer conversation index of each turn (any integers;
            equal values = same conversation).
        mask: (N,) bool, the slice; None = every turn.
        n_resamples: number of bootstrap resamples (default 1000).
        confidence: nominal coverage of the interval, in (0, 1) (default 0.95).
        seed: seed of the generator.
        weighting: ``"turn"`` (default) or ``"conversation"`` (see the module docstring).

    Returns:
        :class:`BootstrapResult`; NaN mean and bounds with n = 0 for an empty slice.

    Raises:
        MapMatchedValueError: bad shapes or options, or a non-finite value in the slice.
    """
    return bootstrap_means([values], conversation, mask, n_resamples=n_resamples, confidence=confidence, seed=seed,
                           weighting=weighting)[0]


def bootstrap_means(
    columns: Iterable[torch.Tensor],
    conversation: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    weighting: str = "turn",
) -> List[BootstrapResult]:
    """:func:`bootstrap_mean` of several per-turn columns over one slice, with one set of resamples.

    Every column's result equals :func:`bootstrap_mean` of that column alone (the
    generator is seeded the same and draws the same conversations), but the slice's
    conversations are grouped once and each chunk of resamples is drawn once for all
    columns. ``columns`` is consumed one column at a time (a generator that decodes or
    computes each column is fine): only each column's (C,) per-conversation sums are
    kept, not the (N,) columns.

    Args:
        columns: (N,) float per-turn tensors (see :func:`bootstrap_mean`).
        conversation, mask, n_resamples, confidence, seed, weighting: as in :func:`bootstrap_mean`.

    Returns:
        One :class:`BootstrapResult` per column, in order.

    Raises:
        MapMatchedValueError: bad shapes or options, or a non-finite value in the slice.
    """
    _check_options(n_resamples, confidence, weighting)
    mask = _check_slice(conversation, mask)
    _, groups = torch.unique(conversation[mask], return_inverse=True)
    count = int(groups.max()) + 1 if groups.numel() else 0
    device = conversation.device
    # shape: (C,) per column, per-conversation sums
    sums: List[torch.Tensor] = []
    for values in columns:
        _check_column(values, conversation)
        selected = values[mask].to(torch.float64)
        if selected.numel() and not bool(torch.isfinite(selected).all()):
            raise MapMatchedValueError("per-turn values in the slice must be finite")
        sums.append(torch.zeros(count, dtype=torch.float64, device=device).index_add_(0, groups, selected))
    n_turns = int(groups.numel())
    if count == 0:
        nan = math.nan
        return [BootstrapResult(nan, nan, nan, 0, 0, float(confidence), n_resamples, weighting, seed) for _ in sums]
    # shape: (C,) turns per conversation
    turns = torch.bincount(groups, minlength=count).to(torch.float64)
    if weighting == "turn":
        total_turns = _ordered_sum(turns)
        points = [float(_ordered_sum(column) / total_turns) for column in sums]
    else:
        sums = [column / turns for column in sums]  # per-conversation means
        points = [float(_ordered_sum(column) / count) for column in sums]

    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed))
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // count)
    statistics: List[List[torch.Tensor]] = [[] for _ in sums]
    for start in range(0, n_resamples, rows_per_chunk):
        rows = min(rows_per_chunk, n_resamples - start)
        # shape: (rows, C) resampled conversation indices
        drawn = torch.randint(0, count, (rows, count), generator=generator, device=device)
        denominator = _ordered_sum(turns[drawn]) if weighting == "turn" else float(count)
        for column, kept in zip(sums, statistics):
            kept.append(_ordered_sum(column[drawn]) / denominator)
    alpha = (1.0 - float(confidence)) / 2.0
    levels = torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64, device=device)
    results = []
    for point, kept in zip(points, statistics):
        # shape: (n_resamples,)
        bounds = torch.quantile(torch.cat(kept), levels)
        results.append(BootstrapResult(point, float(bounds[0]), float(bounds[1]), count, n_turns, float(confidence),
                                       n_resamples, weighting, int(seed)))
    return results


def _ordered_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension by a fixed pairwise tree of elementwise additions.

    ``tensor.sum()`` splits a long reduction across threads, so its last bits depend on
    the number of torch threads (torchrun runs one per process by default, a plain run
    all cores). Here every addition is elementwise and the pairing depends only on the
    length, so the result does too: the same on any thread count, shard layout or device.

    Args:
        values: (..., K) float tensor.

    Returns:
        (...,) tensor (zeros for K = 0).
    """
    x = values
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        head = x[..., :half] + x[..., half:2 * half]
        x = head if x.shape[-1] % 2 == 0 else torch.cat([head, x[..., 2 * half:]], dim=-1)
    return x[..., 0] if x.shape[-1] else x.new_zeros(x.shape[:-1])


def paired_bootstrap(
    treatment: torch.Tensor,
    baseline: torch.Tensor,
    conversation: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    n_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    weighting: str = "turn",
) -> BootstrapResult:
    """Paired bootstrap interval of ``treatment - baseline`` (per turn) over the slice.

    Both methods are scored on the same turns, so the per-turn differences are
    resampled by conversation (see :func:`bootstrap_mean` for the arguments). A
    positive mean is a lift of the treatment over the baseline.

    Example:
        >>> import torch
        >>> treatment = torch.tensor([1.0, 1.0, 0.5, 1.0], dtype=torch.float64)
        >>> baseline = torch.tensor([0.5, 1.0, 0.0, 1.0], dtype=torch.float64)
        >>> conversation = torch.tensor([0, 0, 1, 2])
        >>> result = paired_bootstrap(treatment, baseline, conversation, n_resamples=200)
        >>> result.mean, result.n, result.n_turns
        (0.25, 3, 4)
    """
    return bootstrap_mean(paired_difference(treatment, baseline), conversation, mask, n_resamples=n_resamples,
                          confidence=confidence, seed=seed, weighting=weighting)


def paired_difference(treatment: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """(N,) float64 ``treatment - baseline``, the per-turn values :func:`paired_bootstrap` resamples.

    Raises:
        MapMatchedValueError: not two tensors of one shape.
    """
    if not isinstance(treatment, torch.Tensor) or not isinstance(baseline, torch.Tensor):
        raise MapMatchedValueError("treatment and baseline must be tensors")
    if treatment.shape != baseline.shape:
        raise MapMatchedValueError(f"treatment {tuple(treatment.shape)} and baseline {tuple(baseline.shape)} differ in shape")
    return treatment.to(torch.float64) - baseline.to(torch.float64)


def verdict(followup_ci: BootstrapResult, standalone_ci: BootstrapResult, tolerance: float = 0.0) -> Verdict:
    """Pass when map-matching lifts follow-ups without hurting standalone turns beyond ``tolerance``.

    Precisely: ``passed = followup_ci.low > 0 and standalone_ci.low >= -tolerance``,
    where both results are paired differences (map-matched minus pointwise) of the
    same metric, and ``tolerance >= 0`` is in that metric's units (e.g. 0.01 = one
    nDCG point). The follow-up bound is strict (a lift must be shown); the
    standalone bound is not (a loss of exactly ``tolerance`` is allowed). An empty
    slice has NaN bounds and fails its condition.

    Example:
        >>> lift = BootstrapResult(0.05, 0.02, 0.08, 40, 200, 0.95, 1000, "turn", 0)
        >>> flat = BootstrapResult(-0.002, -0.009, 0.004, 80, 300, 0.95, 1000, "turn", 0)
        >>> verdict(lift, flat, tolerance=0.01).passed, verdict(lift, flat, tolerance=0.005).passed
        (True, False)
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0:
        raise MapMatchedValueError(f"tolerance must be finite and nonnegative, got {tolerance!r}")
    tolerance = float(tolerance)
    followup_ok = bool(followup_ci.low > 0.0)  # False for NaN
    standalone_ok = bool(standalone_ci.low >= -tolerance)
    passed = followup_ok and standalone_ok
    reason = (
        f"{'PASS' if passed else 'FAIL'}: follow-up lift {followup_ci.mean:+.4f} "
        f"[{followup_ci.low:+.4f}, {followup_ci.high:+.4f}] ({'lower bound > 0' if followup_ok else 'lower bound not > 0'}); "
        f"standalone change {standalone_ci.mean:+.4f} [{standalone_ci.low:+.4f}, {standalone_ci.high:+.4f}] "
        f"({'within' if standalone_ok else 'beyond'} tolerance {tolerance:g})"
    )
    return Verdict(passed, followup_ok, standalone_ok, tolerance, reason)
