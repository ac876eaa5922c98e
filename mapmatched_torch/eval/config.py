"""What an evaluation is run with: :class:`EvalConfig`, the slices and the primary
metric, and whether the harness shows its progress (:func:`progress_enabled`)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch

from ..core.checks import check_positive_int
from ..core.errors import MapMatchedValueError
from .distributed import main_process
from .methods import DEFAULT_METHODS, METHODS, Setting, settings_grid

__all__ = ["SLICES", "PRIMARY_METRIC", "EvalConfig", "progress_enabled"]

#: Slice names, in report order.
SLICES = ("all", "follow-up", "standalone", "topic-switch", "same-topic")
#: The metric with intervals, lifts and verdicts.
PRIMARY_METRIC = "ndcg@3"

Device = Union[str, torch.device, None]



@dataclass(frozen=True)
class EvalConfig:
    """Options of :func:`evaluate`.

    Attributes:
        lambdas, betas, lags: the map-matching grid (lag None = full decoding).
        methods: registry names to run, in report order (default: all).
        relevance_weight: the Maximal Marginal Relevance lambda (1 = pure relevance).
        ks: cut-offs of nDCG@k and Recall@k.
        n_bootstrap: bootstrap resamples (0 skips the intervals: NaN bounds).
        confidence: interval coverage. seed: bootstrap seed.
        tolerance: the verdict's standalone tolerance (nDCG@3 units).
        entropy_threshold: a fixed follow-up threshold in nats (None: the median).
        slice_emission_weight: lambda of the slicing entropy.
        score_normalization: ``"zscore"``, ``"center"`` or ``"none"``.
        exact_normalization: bit-exact (Python) normalization, else tensor sums.
        fit_folds: cross-fitting folds of the fitted method (>= 2).
        selection_folds: folds of the headline's cross-fitted selection (>= 2,
            default 5; at most one per conversation): each is ranked by the method
            best on the other selection folds. More folds than ``fit_folds`` make each
            choice on most of the data, so the folds agree on small sets
            (:mod:`~mapmatched_torch.eval.selection`).
        selection_preference: registry method names the selection prefers, in order
            (default ``("mixed",)``; ``()``: always the best on the other folds): a fold
            keeps the first one the other folds do not show worse than their best by
            more than ``selection_margin`` standard errors (conversations as units).
        selection_margin: that margin (>= 0, default 1.0).
        fold_repeats: R >= 1 fold splits (seeds ``seed .. seed + R - 1``): with R > 1
            the cross-fitted rankings' slice means are also reported as a mean and
            range over R splits (:attr:`EvalResult.repeats`; the extra runs skip the bootstrap).
        method_options: free-form options of registered methods
            (:attr:`~mapmatched_torch.eval.methods.MethodOptions.extra`, e.g.
            ``{"gated_calibrate": True}``).
        primary: a map-matched setting as the headline verdict and the split plot
            (None: the headline is the cross-fitted selection,
            :mod:`~mapmatched_torch.eval.selection`; the split plot takes the grid's
            best setting on the data).
        split_conversation: conversation index of the split plot (None: automatic).
        batch_size: conversations per chunk (None: from ``memory_budget``).
        memory_budget: bytes of stacked transitions per chunk (default 256 MiB).
        device: where the work runs (None: where the inputs are).
        progress: progress bars (None: only on a terminal).
    """

    lambdas: Tuple[float, ...] = (1.0,)
    betas: Tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
    lags: Tuple[Optional[int], ...] = (None,)
    methods: Tuple[str, ...] = DEFAULT_METHODS
    relevance_weight: float = 0.7
    ks: Tuple[int, ...] = (3, 5, 10)
    n_bootstrap: int = 1000
    confidence: float = 0.95
    seed: int = 0
    tolerance: float = 0.01
    entropy_threshold: Optional[float] = None
    slice_emission_weight: float = 1.0
    score_normalization: str = "zscore"
    exact_normalization: bool = True
    fit_folds: int = 2
    selection_folds: int = 5
    selection_preference: Tuple[str, ...] = ("mixed",)
    selection_margin: float = 1.0
    fold_repeats: int = 1
    method_options: Mapping[str, Any] = field(default_factory=dict)
    primary: Optional[Setting] = None
    split_conversation: Optional[int] = None
    batch_size: Optional[int] = None
    memory_budget: int = 256 << 20
    device: Device = None
    progress: Optional[bool] = None

    @property
    def settings(self) -> Tuple[Setting, ...]:
        """The validated grid."""
        return settings_grid(self.lambdas, self.betas, self.lags)

    def check(self) -> "EvalConfig":
        """Validate every option; returns ``self``.

        Raises:
            MapMatchedValueError: naming the bad option.
        """
        self.settings  # noqa: B018 (validates the grid)
        unknown = [name for name in self.methods if name not in METHODS]
        if unknown:
            raise MapMatchedValueError(f"unknown method(s) {unknown} (registered: {', '.join(METHODS)})")
        if "pointwise" not in self.methods:
            raise MapMatchedValueError("the methods must include pointwise (the baseline of every lift)")
        for k in self.ks:
            check_positive_int(k, "k")
        if PRIMARY_METRIC.split("@")[1] not in {str(k) for k in self.ks}:
            raise MapMatchedValueError(f"ks must include {PRIMARY_METRIC.split('@')[1]} (the primary metric)")
        if isinstance(self.n_bootstrap, bool) or not isinstance(self.n_bootstrap, int) or self.n_bootstrap < 0:
            raise MapMatchedValueError(f"n_bootstrap must be an int >= 0, got {self.n_bootstrap!r}")
        if not 0.0 < float(self.confidence) < 1.0:
            raise MapMatchedValueError(f"confidence must be in (0, 1), got {self.confidence!r}")
        if not math.isfinite(float(self.tolerance)) or self.tolerance < 0:
            raise MapMatchedValueError(f"tolerance must be finite and nonnegative, got {self.tolerance!r}")
        if not 0.0 <= float(self.relevance_weight) <= 1.0:
            raise MapMatchedValueError(f"the Maximal Marginal Relevance lambda must be in [0, 1], got {self.relevance_weight!r}")
        if self.batch_size is not None:
            check_positive_int(self.batch_size, "batch_size")
        check_positive_int(self.memory_budget, "memory_budget")
        if isinstance(self.fit_folds, bool) or not isinstance(self.fit_folds, int) or self.fit_folds < 2:
            raise MapMatchedValueError(f"fit_folds must be an int >= 2, got {self.fit_folds!r}")
        if isinstance(self.selection_folds, bool) or not isinstance(self.selection_folds, int) \
                or self.selection_folds < 2:
            raise MapMatchedValueError(f"selection_folds must be an int >= 2, got {self.selection_folds!r}")
        if isinstance(self.selection_preference, str) or not all(
                isinstance(name, str) for name in self.selection_preference):
            raise MapMatchedValueError(f"selection_preference must be a sequence of method names, got "
                                       f"{self.selection_preference!r}")
        unknown = [name for name in self.selection_preference if name not in METHODS]
        if unknown:
            raise MapMatchedValueError(f"selection_preference names unknown methods {unknown}; known: {sorted(METHODS)}")
        if isinstance(self.selection_margin, bool) or not isinstance(self.selection_margin, (int, float)) or not (
                math.isfinite(self.selection_margin) and self.selection_margin >= 0):
            raise MapMatchedValueError(f"selection_margin must be a finite number >= 0, got {self.selection_margin!r}")
        if isinstance(self.fold_repeats, bool) or not isinstance(self.fold_repeats, int) or self.fold_repeats < 1:
            raise MapMatchedValueError(f"fold_repeats must be an int >= 1 (1 = one fold split), got {self.fold_repeats!r}")
        return self

    def to_dict(self) -> Dict[str, Any]:
        """The options as plain JSON-friendly values."""
        return {
            "lambdas": list(self.lambdas), "betas": list(self.betas), "lags": list(self.lags),
            "methods": list(self.methods), "maximal_marginal_relevance_lambda": self.relevance_weight,
            "ks": list(self.ks), "n_bootstrap": self.n_bootstrap, "confidence": self.confidence,
            "seed": self.seed, "tolerance": self.tolerance, "entropy_threshold": self.entropy_threshold,
            "slice_emission_weight": self.slice_emission_weight, "score_normalization": self.score_normalization,
            "exact_normalization": self.exact_normalization, "fit_folds": self.fit_folds,
            "selection_folds": self.selection_folds, "selection_preference": list(self.selection_preference),
            "selection_margin": self.selection_margin, "fold_repeats": self.fold_repeats, "method_options": dict(self.method_options),
            "primary": None if self.primary is None else self.primary.to_dict(),
            "device": None if self.device is None else str(self.device),
        }


def progress_enabled(progress: Optional[bool]) -> bool:
    """Whether to show the phase lines (``eval: embedding ...``) on stderr.

    The loops' progress (``mapmatched_torch.core.progress``) shows with None on the main
    process wherever stderr goes: a bar on a terminal, else a plain line every 10 s.

    Args:
        progress: True or False decide; None: only when stderr is a terminal and
            this is the :func:`main_process`.
    """
    if progress is not None:
        return bool(progress)
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) and main_process()


def _phase(show: bool, message: str) -> None:
    """One progress line on stderr (a phase without a bar of its own)."""
    if show:
        print(f"eval: {message}", file=sys.stderr, flush=True)
