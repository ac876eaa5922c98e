"""Per-turn score normalization and the per-turn diagnostics of docs/spec.md sections 2-3.

Plain Python (``math.fsum`` for every sum, so results do not depend on summation order).
"""

from __future__ import annotations

import math
from typing import Iterable, List, Literal, Optional, Sequence, Tuple

from .checks import check_choice, duplicate_ids_error
from .errors import MapMatchedValueError
from .models import DecoderCandidate, ScoredCandidate

__all__ = [
    "ScoreNormalization",
    "SCORE_NORMALIZATIONS",
    "check_score_normalization",
    "normalize_scores",
    "normalize_candidates",
    "softmax_entropy",
    "runner_up_index",
    "normalized_margin",
]

#: The accepted values of ``score_normalization``.
SCORE_NORMALIZATIONS = ("zscore", "center", "none")

#: The type of ``score_normalization`` / ``method`` (upstream ``mapmatched``'s alias):
#: one of :data:`SCORE_NORMALIZATIONS`.
ScoreNormalization = Literal["zscore", "center", "none"]


def check_score_normalization(method: object) -> str:
    """Return ``method`` if it names a normalization, else raise ValueError.

    The message is SPEC's, listing the choices (:func:`~mapmatched_torch.core.checks.check_choice`):
    ``"unsupported score normalization: X (expected one of 'zscore', 'center', 'none')"``.
    """
    return check_choice("score normalization", method, SCORE_NORMALIZATIONS)


def normalize_scores(scores: Sequence[float], method: str = "zscore") -> List[float]:
    """Normalize one turn's raw scores.

    Args:
        scores: the turn's raw scores (finite floats), any length (empty gives []).
        method: ``"zscore"`` (default): ``(r - mean) / std`` with the population std
            (divide by n); all 0.0 when the std is exactly 0. ``"center"``:
            ``r - mean``. ``"none"``: unchanged.

    Returns:
        A list of floats, one per score, in input order. ``mean = fsum(r) / n`` and
        ``std = sqrt(fsum((r - mean)**2) / n)``. ValueError ("scores too large to
        normalize") when a sum overflows the float range: the exact sum of the scores,
        or (``"zscore"``) that of their squared deviations, including a square that is
        itself too large (deviations beyond about 1.3e154); never a silent all-zero turn.
    """
    method = check_score_normalization(method)
    values = [float(value) for value in scores]
    if method == "none" or not values:
        return values
    mean = _exact_sum(values) / len(values)
    centered = [value - mean for value in values]
    if method == "center":
        return centered
    squares = _exact_sum([value * value for value in centered], "the sum of their squared deviations")
    if math.isinf(squares):  # a square overflowed to inf: the std would be inf, every z-score 0
        raise _too_large("the sum of their squared deviations")
    std = math.sqrt(squares / len(values))
    if std == 0.0:
        return [0.0] * len(values)
    return [value / std for value in centered]


def _exact_sum(values: List[float], what: str = "their exact sum") -> float:
    """``math.fsum``, whose overflow (finite values summing past the float range) is
    SPEC section 8's ValueError rather than a bare OverflowError (``what`` names the sum)."""
    try:
        return math.fsum(values)
    except OverflowError:
        raise _too_large(what) from None


def _too_large(what: str) -> MapMatchedValueError:
    return MapMatchedValueError(
        f"scores too large to normalize: {what} overflows the float range "
        "(scale the retriever's scores down, or use score_normalization='none')"
    )


def normalize_candidates(
    candidates: Iterable[ScoredCandidate], method: str = "zscore", *, turn_index: Optional[int] = None
) -> Tuple[DecoderCandidate, ...]:
    """Turn a provider's :class:`ScoredCandidate` list into trellis states.

    Args:
        candidates: one turn's candidates, in provider order (any objects with
            ``chunk_id`` and ``score``).
        method: see :func:`normalize_scores`.
        turn_index: the turn the candidates belong to, only to name it in messages.

    Returns:
        One :class:`DecoderCandidate` per input (same order), keeping both the raw and
        the normalized score.

    Raises:
        ValueError: no candidates (``candidate set must not be empty``), a chunk ID
            listed twice (``candidate chunk_ids must be unique within a turn``), both
            checked before ``method``; an unsupported ``method``; a normalized score
            that is not finite (e.g. overflow of ``r - mean``). As mapmatched 0.1.0
            words them, with the turn and the ID after its text.
    """
    candidates = tuple(candidates)
    where = "the turn" if turn_index is None else f"turn {turn_index}"
    if not candidates:
        raise MapMatchedValueError(
            "candidate set must not be empty" + ("" if turn_index is None else f" (turn {turn_index})")
        )
    seen = set()
    for candidate in candidates:
        if candidate.chunk_id in seen:
            raise MapMatchedValueError(
                f"candidate chunk_ids must be unique within a turn: {duplicate_ids_error(where, candidate.chunk_id)}"
            )
        seen.add(candidate.chunk_id)
    normalized = normalize_scores([candidate.score for candidate in candidates], method)
    return tuple(
        DecoderCandidate(candidate.chunk_id, candidate.score, value)
        for candidate, value in zip(candidates, normalized)
    )


def softmax_entropy(scores: Sequence[float]) -> float:
    """Shannon entropy (nats) of ``softmax(scores)``.

    Args:
        scores: one or more finite numbers (e.g. ``lambda * normalized`` of a turn).

    Returns:
        A float >= 0: ``log Z - E[shifted]`` after subtracting the max (so large finite
        inputs are safe); 0.0 for a single score.

    Raises:
        ValueError: no scores (``entropy requires at least one score``) or a NaN or
            infinite one (``entropy scores must be finite``), as mapmatched 0.1.0.
    """
    values = [float(value) for value in scores]
    if not values:
        raise MapMatchedValueError("entropy requires at least one score")
    for position, value in enumerate(values):
        if not math.isfinite(value):
            raise MapMatchedValueError(f"entropy scores must be finite (score {position} is {value!r})")
    if len(values) == 1:
        return 0.0
    top = max(values)
    shifted = [value - top for value in values]
    weights = [math.exp(value) for value in shifted]
    total = math.fsum(weights)
    # H = log Z - E[shifted], with Z = sum(exp(shifted)) >= 1.
    expected = math.fsum(weight * value for weight, value in zip(weights, shifted)) / total
    return max(0.0, math.log(total) - expected)


def runner_up_index(normalized_scores: Sequence[float], chosen: int) -> Optional[int]:
    """Index of the best candidate other than ``chosen`` (ties to the earlier one).

    Returns None when the turn has a single candidate.
    """
    best: Optional[int] = None
    for index, value in enumerate(normalized_scores):
        if index == chosen:
            continue
        if best is None or value > normalized_scores[best]:
            best = index
    return best


def normalized_margin(normalized_scores: Sequence[float], chosen: int) -> float:
    """Normalized score of ``chosen`` minus the best other candidate's (0.0 when alone).

    Unweighted; negative when graph coherence overruled the pointwise winner.
    """
    other = runner_up_index(normalized_scores, chosen)
    if other is None:
        return 0.0
    return normalized_scores[chosen] - normalized_scores[other]
