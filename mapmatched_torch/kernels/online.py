"""Online dynamic programs: turn t's scores from turns 0..t only, for every t at once.

What a streaming session ranks turn t's candidates by, computed on whole
conversations: the max-plus forward scores (:func:`online_forward_scores`, with or
without a fixed lag), the log-semiring filtering scores (:func:`online_filtering_scores`)
and the lexicographic geodesic order (:func:`geodesic_online_order`); :func:`rank_slots`
turns scores into each turn's slot order. The evaluation methods
(:mod:`mapmatched_torch.eval.methods`) rank by them.

Transitions are (B, T-1, M, M) indexed ``[b, t, from, to]``; masks are (B, T, M) bool.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from . import chain, fused
from .decode import fixed_lag_viterbi, forward_scores
from .semiring import LEXICOGRAPHIC

__all__ = ["rank_slots", "online_forward_scores", "online_filtering_scores", "geodesic_online_order"]

_INF = float("inf")


def rank_slots(values: Tensor, mask: Tensor) -> Tensor:
    """Order each turn's candidate slots by decreasing value; ties and -inf by slot; padding last.

    Args:
        values: (..., M) float scores (-inf allowed at real candidates, e.g. locked out).
        mask: (..., M) bool real candidates.

    Returns:
        (..., M) long slot indices (a permutation per turn). Cost: two stable sorts.

    Example:
        >>> rank_slots(torch.tensor([[1.0, 3.0, 1.0, 0.0]]), torch.tensor([[True, True, True, False]])).tolist()
        [[1, 0, 2, 3]]
    """
    keyed = torch.where(mask, values.to(torch.float64), -_INF)
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices
    # padding after every real candidate (a real -inf ties with padding above)
    padding = (~mask.gather(-1, order)).to(torch.uint8)
    return order.gather(-1, torch.sort(padding, dim=-1, stable=True).indices)


def online_forward_scores(emissions: Tensor, transitions: Tensor, mask: Tensor, lag: Optional[int] = None) -> Tensor:
    """The forward scores a streaming session ranks turn t's candidates by, for every t at once.

    Args:
        emissions: (B, T, M) float weighted emissions.
        transitions: (B, T-1, M, M) weighted transitions ``[b, t, from, to]``.
        mask: (B, T, M) bool.
        lag: None (full decoding: :func:`~mapmatched_torch.kernels.decode.forward_scores`) or
            L >= 0 (fixed lag: the forward scores of turn t - L under the locks of
            ``fixed_lag_viterbi``, then L unlocked max-plus steps; turns t < L are
            unlocked).

    Returns:
        (B, T, M) forward scores; -inf at padding and at candidates a lock excludes.
        Bit for bit what the session computes (same recursion, same order of
        operations: predecessor plus transition, max, plus emission).

    Cost: O(B T M^2) without a lag; O(B T (L + 1) M^2) with one with the fused kernel
    (:func:`mapmatched_torch.kernels.fused.online_forward_scores`, the default on the
    CPU with numba: one pass per conversation), O(B T (2 L + 2) M^2) on the torch path.
    """
    fused_scores = fused.online_forward_scores(emissions, transitions, mask, lag)
    if fused_scores is not None:
        return fused_scores
    if lag is None:
        return forward_scores(emissions, transitions, mask)
    locks = fixed_lag_viterbi(emissions, transitions, mask, lag).locks
    # shape: (B, T, M): at turn s, the forward scores under the locks of turns <= s
    scores = forward_scores(emissions, transitions, mask, locks)
    if lag == 0 or emissions.shape[1] == 1:
        return scores
    # shape: (B, 1, M): turn 0 without a lock (the session before its first commit)
    first = torch.where(mask[:, :1], emissions[:, :1], -_INF)
    # shape: (B, T-1, M_from, 1): padding never meets its (possibly NaN) transitions
    real_from = mask[:, :-1, :, None]
    for _ in range(lag):
        # shape: (B, T-1, M_to): one unlocked step from every turn to the next (first maximum)
        moves = torch.where(real_from, scores[:, :-1, :, None] + transitions, -_INF)
        stepped = moves.max(dim=2).values + emissions[:, 1:]
        scores = torch.cat([first, torch.where(mask[:, 1:], stepped, -_INF)], dim=1)
    return scores


def online_filtering_scores(emissions: Tensor, transitions: Tensor, mask: Tensor) -> Tensor:
    """Log-semiring forward scores: turn t's log filtering marginals up to a per-turn constant.

    ``alpha[t, i] = logsumexp_j (alpha[t-1, j] + trans[t-1, j, i]) + e[t, i]``: the log
    total weight of all paths over turns 0..t that end at candidate i, so ranking turn
    t's candidates by it ranks them by ``p(x_t = i | turns 0..t)`` (online, like
    :func:`online_forward_scores`, which takes the best path instead of the sum).

    Args:
        emissions: (B, T, M) weighted emissions. transitions: (B, T-1, M, M)
            ``[b, t, from, to]``. mask: (B, T, M) bool.

    Returns:
        (B, T, M) float; -inf at padding. Cost: O(B T M^2). The fused log-semiring
        kernel's forward pass computes them where it applies (to a few ulps of the
        torch path, :mod:`mapmatched_torch.kernels.fused`).
    """
    from .checks import prepare
    from .semiring import LOG

    differentiable = fused.gradient_wanted(emissions, transitions)
    kept = None if differentiable else fused.log_partition_states(*fused.check_shapes(emissions, transitions, mask))
    if kept is not None:
        return torch.where(mask, kept.scores, -_INF)
    prepared = prepare(emissions, transitions, mask)
    alphas = chain.forward(LOG, prepared.emissions, prepared.pairwise, mask).alphas
    return torch.where(mask, alphas, -_INF)


def geodesic_online_order(emissions: Tensor, distances: Tensor, mask: Tensor) -> Tensor:
    """Online geodesic-bound ranking: least total distance to each candidate, then most emission.

    Turn t's candidates are ordered by the lexicographic max-plus forward score
    ``(-total distance, total emission)`` of the best path over turns 0..t ending at
    them (the semiring of :func:`~mapmatched_torch.kernels.decode.geodesic_viterbi`, whose
    prefix decode at turn t picks the first of this order), ties by slot.

    Args:
        emissions: (B, T, M) float weighted emissions. distances: (B, T-1, M, M)
            nonnegative raw distances ``[b, t, from, to]``. mask: (B, T, M) bool.

    Returns:
        (B, T, M) long slot order. Cost: O(B T M^2), twice the memory of Viterbi.
    """
    if bool((~torch.isfinite(distances) | (distances < 0)).any()):
        raise MapMatchedValueError("geodesic ranking needs finite nonnegative distances")
    clean = torch.where(mask, emissions, 0.0)
    # shape: (B, T, M, 2) and (B, T-1, M, M, 2)
    pair_emissions = torch.stack((torch.zeros_like(clean), clean), dim=-1)
    pair_transitions = torch.stack((-distances, torch.zeros_like(distances)), dim=-1)
    alphas = chain.forward(LEXICOGRAPHIC, pair_emissions, pair_transitions, mask).alphas
    secondary = rank_slots(alphas[..., 1], mask)
    primary = torch.where(mask, alphas[..., 0], -_INF).gather(-1, secondary)
    # a stable sort on the primary keeps the secondary order among equal distances
    order = torch.sort(primary, dim=-1, descending=True, stable=True).indices
    merged = secondary.gather(-1, order)
    padding = (~mask.gather(-1, merged)).to(torch.uint8)
    return merged.gather(-1, torch.sort(padding, dim=-1, stable=True).indices)
