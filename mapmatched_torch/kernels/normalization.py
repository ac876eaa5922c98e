"""docs/spec.md section 2's per-turn score normalization for many turns at once, bit for bit.

:func:`~mapmatched_torch.core.scoring.normalize_scores` normalizes one turn in plain Python
(``math.fsum`` sums). A server normalizing a thousand turns per step spends most of
that time in per-value Python; here only the two sums per turn stay in Python (they
must be ``math.fsum``: exactly rounded, so independent of order), and every elementwise
step (``r - mean``, ``c * c``, ``c / std``) is one tensor operation. Each is a single
IEEE-754 operation on float64, rounded the same way in torch as in Python, so every
value equals :func:`~mapmatched_torch.core.scoring.normalize_scores`'s exactly (tested bit
for bit).
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch
from torch import Tensor

from ..core.scoring import check_score_normalization

__all__ = ["normalize_score_rows"]


def normalize_score_rows(raw: Tensor, counts: Sequence[int], method: str = "zscore") -> Tensor:
    """Normalize every row's leading scores, as :func:`~mapmatched_torch.core.scoring.normalize_scores`.

    Args:
        raw: ``(R, K)`` float64 CPU tensor of raw scores; row ``r``'s turn is
            ``raw[r, :counts[r]]`` (finite values; the rest is ignored).
        counts: ``R`` ints in ``[0, K]``.
        method: ``"zscore"`` (default), ``"center"`` or ``"none"``.

    Returns:
        ``(R, K)`` float64: ``normalize_scores(raw[r, :counts[r]], method)`` in each
        row's first ``counts[r]`` entries, 0.0 after them. A row where
        ``normalize_scores`` raises ValueError (an exact sum overflows: of the scores,
        or of their squared deviations, a square overflowing included) is NaN: callers
        report it as a non-finite normalized score.
    """
    method = check_score_normalization(method)
    counts = [int(count) for count in counts]
    # shape: (R, K) the real entries of each row
    real = torch.arange(raw.shape[1]).unsqueeze(0) < torch.tensor(counts, dtype=torch.long).view(-1, 1)
    zero = torch.zeros((), dtype=torch.float64)
    if method == "none":
        return torch.where(real, raw, zero)
    means = _row_sums(raw.tolist(), counts)
    # shape: (R, 1)
    mean = torch.tensor([total / count if count else 0.0 for total, count in zip(means, counts)], dtype=torch.float64)
    centered = torch.where(real, raw - mean.unsqueeze(1), zero)
    if method == "center":
        return centered
    squares = _row_sums((centered * centered).tolist(), counts)
    std = torch.tensor(
        [math.sqrt(total / count) if count else 0.0 for total, count in zip(squares, counts)], dtype=torch.float64
    ).unsqueeze(1)
    # a row whose std is exactly 0 is all 0.0 (NaN std: the overflowed rows stay NaN)
    return torch.where(real & (std != 0.0), centered / std, zero)


def _row_sums(rows: List[List[float]], counts: List[int]) -> List[float]:
    """``math.fsum`` of each row's leading ``count`` values; NaN where it overflows or
    is infinite (a square that overflowed), the rows ``normalize_scores`` refuses."""
    sums = []
    for row, count in zip(rows, counts):
        try:
            total = math.fsum(row[:count])
        except OverflowError:
            total = math.nan
        sums.append(total if not math.isinf(total) else math.nan)
    return sums
