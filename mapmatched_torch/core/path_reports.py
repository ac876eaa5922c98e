"""From chosen candidate indices to the reported path (docs/spec.md section 5).

Shared by every decoder (standalone and tensor) so that the reported numbers are
computed by one piece of code, in one order, and agree bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

from .errors import MapMatchedValueError
from .models import CandidateScore, DecodedPath, DecodedStep, DecoderCandidate, trusted_constructor
from .settings import DecodeSettings

__all__ = ["report_path", "rank_final_candidates", "committed_through", "NONFINITE_MESSAGE"]

#: The message of the ValueError raised when the max-plus accumulation overflows.
NONFINITE_MESSAGE = "decoder accumulation produced a nonfinite score"

_candidate_score = trusted_constructor(CandidateScore)


def committed_through(turn_count: int, fixed_lag: Optional[int]) -> Optional[int]:
    """``T - L - 1`` when a lag is set and that is >= 0, else None."""
    if fixed_lag is None:
        return None
    index = turn_count - fixed_lag - 1
    return index if index >= 0 else None


def report_path(
    trellis: Sequence[Sequence[DecoderCandidate]],
    chosen: Sequence[int],
    step_distance: Callable[[int], float],
    settings: DecodeSettings,
    *,
    reuse: Sequence[DecodedStep] = (),
    step_cost: Optional[Callable[[int], float]] = None,
) -> DecodedPath:
    """Build the :class:`DecodedPath` for chosen candidate indices.

    Args:
        trellis: T turns of candidates.
        chosen: T candidate indices, one per turn.
        step_distance: ``step_distance(t)`` for t >= 1 gives the graph distance from
            the chosen candidate of turn t-1 to that of turn t. It is not called when
            ``transition_weight`` is 0 (distances are then reported as 0.0).
        settings: lambda and beta weigh the steps (beta through
            :meth:`~mapmatched_torch.core.settings.DecodeSettings.transition_cost`); the
            lag is recorded on the path with the committed boundary.
        reuse: the steps of an earlier decode of a prefix of this trellis (streaming).
            Step t depends only on the chosen chunks of turns 0..t, so the longest
            prefix whose chunk IDs agree is kept as is (same objects) and only the rest
            is computed; ``step_distance`` is not called for the kept turns.
        step_cost: a learned transition model's cost of the move into turn t along the
            path (the negated transition the decoder added), or None for the fixed
            model's ``beta * d``. Given, distances are always reported.

    The cumulative score follows the decoder's recursion exactly:
    ``cumulative_t = (cumulative_{t-1} - beta * d_t) + lambda * s_t``, so the total
    equals the max-plus forward score of the path bit for bit.
    """
    emission_weight, fixed_lag = settings.emission_weight, settings.fixed_lag
    weighs_transitions = settings.transition_weight != 0.0 or step_cost is not None
    steps: List[DecodedStep] = []
    for step, turn, index in zip(reuse, trellis, chosen):
        if step.chunk_id != turn[index].chunk_id:
            break
        steps.append(step)
    cumulative = steps[-1].cumulative_score if steps else 0.0
    for turn_index in range(len(steps), len(chosen)):
        candidate = trellis[turn_index][chosen[turn_index]]
        emission = emission_weight * candidate.normalized_score
        if turn_index == 0:
            distance = 0.0
            transition = 0.0
            cumulative = emission
        else:
            distance = step_distance(turn_index) if weighs_transitions else 0.0
            transition = settings.transition_cost(distance) if step_cost is None else step_cost(turn_index)
            cumulative = (cumulative - transition) + emission
        if not math.isfinite(cumulative):
            raise MapMatchedValueError(f"{NONFINITE_MESSAGE} at turn {turn_index}")
        steps.append(
            DecodedStep(
                turn_index=turn_index,
                chunk_id=candidate.chunk_id,
                raw_emission_score=candidate.raw_score,
                normalized_emission_score=candidate.normalized_score,
                weighted_emission_score=emission,
                graph_distance=distance,
                weighted_transition_cost=transition,
                cumulative_score=cumulative,
            )
        )
    return DecodedPath(
        steps=tuple(steps),
        chunk_ids=tuple(step.chunk_id for step in steps),
        total_score=cumulative,
        fixed_lag=fixed_lag,
        committed_through_index=committed_through(len(steps), fixed_lag),
    )


def rank_final_candidates(
    final_turn: Sequence[DecoderCandidate], final_scores: Sequence[Optional[float]]
) -> Tuple[CandidateScore, ...]:
    """Final-turn candidates with a finite forward score, sorted by (-score, chunk ID).

    ``final_scores[i]`` is the best trajectory score ending at candidate i (None or a
    non-finite value for a candidate a lock excluded).
    """
    ranked = [
        _candidate_score(candidate.chunk_id, float(score))  # a candidate's ID, a finite score: valid
        for candidate, score in zip(final_turn, final_scores)
        if score is not None and math.isfinite(score)
    ]
    ranked.sort(key=lambda item: (-item.trajectory_score, item.chunk_id))
    return tuple(ranked)
