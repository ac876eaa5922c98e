"""The baselines: history concatenation, Maximal Marginal Relevance, the
resolved-query oracle and the geodesic bound."""

from __future__ import annotations

from typing import Any, List

import torch
from torch import Tensor

from ...core.errors import MapMatchedValueError
from ...kernels.online import geodesic_online_order, rank_slots
from .registry import MethodBatch, MethodOptions, MethodOutput, MethodUnavailable, _ranked

__all__ = [
    "history_concatenation_scores",
    "similarity_from_embeddings",
    "similarity_from_distances",
    "maximal_marginal_relevance_order",
]

_INF = float("inf")


def history_concatenation_scores(normalized: Tensor, index: Tensor, mask: Tensor) -> Tensor:
    """Score-level history concatenation: each candidate's mean normalized score over turns 0..t.

    For turn t and candidate passage p: the mean over u = 0..t of turn u's normalized
    score of p, where a turn u that did not retrieve p contributes its lowest real
    candidate score (everything outside the top M scored at most that).

    Args:
        normalized: (B, T, M) float normalized scores. index: (B, T, M) long passage
            indices (-1 padding). mask: (B, T, M) bool.

    Returns:
        (B, T, M) float64 (0.0 at padding). Cost: O(B T^2 M^2) time and memory.
    """
    values = normalized.to(torch.float64)
    batch, turns, width = mask.shape
    # shape: (B, T): each turn's floor, +inf on padded turns (never averaged)
    floor = torch.where(mask, values, _INF).amin(dim=-1)
    # shape: (B, T_now, M_now, T_then, M_then)
    same = (index[:, :, :, None, None] == index[:, None, None, :, :]) & mask[:, None, None, :, :]
    then = torch.where(same, values[:, None, None, :, :], -_INF).amax(dim=-1)
    # shape: (B, T_now, M_now, T_then)
    then = torch.where(torch.isfinite(then), then, floor[:, None, None, :])
    steps = torch.arange(turns, device=mask.device)
    # shape: (B, T_now, 1, T_then): real earlier-or-same turns
    counted = (steps[None, :, None] >= steps[None, None, :]) & mask.any(dim=-1)[:, None, :]
    counted = counted.unsqueeze(2)
    total = torch.where(counted, then, 0.0).sum(dim=-1)
    mean = total / counted.sum(dim=-1).clamp(min=1).to(torch.float64)
    return torch.where(mask, mean, 0.0)


def similarity_from_embeddings(index: Tensor, embeddings: Tensor) -> Tensor:
    """(B, T, M, M) cosine similarity between each turn's candidates (unit or zero rows; padding 0)."""
    # shape: (B, T, M, D)
    vectors = embeddings[index.clamp(min=0)].to(torch.float64)
    vectors = torch.where((index >= 0).unsqueeze(-1), vectors, 0.0)
    return vectors @ vectors.transpose(-1, -2)


def similarity_from_distances(distances: Tensor, maximum_distance: float) -> Tensor:
    """(B, T, M, M) ``1 - d / maximum_distance`` from within-turn graph distances (in [0, 1])."""
    return 1.0 - distances.to(torch.float64) / float(maximum_distance)


def maximal_marginal_relevance_order(
    scores: Tensor, similarity: Tensor, mask: Tensor, relevance_weight: float = 0.7
) -> Tensor:
    """Greedy Maximal Marginal Relevance re-ranking of each turn's candidates.

    At each step the next passage maximizes ``lambda * relevance - (1 - lambda) *
    max similarity to the passages ranked so far`` (the first step: relevance alone);
    ties go to the earlier slot. Relevance is the raw score min-max scaled to [0, 1]
    over the turn's real candidates (all 1 when they are equal).

    Args:
        scores: (B, T, M) float raw scores.
        similarity: (B, T, M, M) float pairwise similarity of each turn's candidates.
        mask: (B, T, M) bool.
        relevance_weight: Carbonell and Goldstein's lambda in [0, 1] (default 0.7;
            1 gives the pointwise ranking).

    Returns:
        (B, T, M) long slot order. Cost: O(B T M^2).
    """
    if isinstance(relevance_weight, bool) or not 0.0 <= float(relevance_weight) <= 1.0:
        raise MapMatchedValueError(
            f"the Maximal Marginal Relevance lambda must be in [0, 1], got {relevance_weight!r}"
        )
    weight = float(relevance_weight)
    values = scores.to(torch.float64)
    low = torch.where(mask, values, _INF).amin(dim=-1, keepdim=True)
    high = torch.where(mask, values, -_INF).amax(dim=-1, keepdim=True)
    spread = high - low
    relevance = torch.where(spread > 0, (values - low) / torch.where(spread > 0, spread, 1.0), 1.0)
    relevance = torch.where(mask, relevance, 0.0)
    similarity = similarity.to(torch.float64)
    width = mask.shape[-1]
    taken = torch.zeros_like(mask)
    penalty = torch.zeros_like(relevance)
    picks: List[Tensor] = []
    for step in range(width):
        score = weight * relevance - (1.0 - weight) * penalty if step else relevance
        available = mask & ~taken
        # shape: (...,): the best available slot, else the first slot not yet taken (padding)
        best = torch.where(available, score, -_INF).argmax(dim=-1)
        fallback = (~taken).to(torch.uint8).argmax(dim=-1)
        pick = torch.where(available.any(dim=-1), best, fallback)
        picks.append(pick)
        taken = taken.scatter(-1, pick.unsqueeze(-1), True)
        # shape: (..., M): similarity of every slot to the new pick
        row = similarity.gather(-2, pick[..., None, None].expand(*pick.shape, 1, width)).squeeze(-2)
        penalty = row if step == 0 else torch.maximum(penalty, row)
    return torch.stack(picks, dim=-1)


def _run_history(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    retrieved = batch.alternatives.get("history")
    if retrieved is not None:
        return [MethodOutput("history concatenation", "history-concatenation", {"level": "query text"}, retrieved.index)]
    cands = batch.candidates
    order = rank_slots(history_concatenation_scores(batch.normalized, cands.index, cands.mask), cands.mask)
    return [MethodOutput("history concatenation", "history-concatenation", {"level": "candidate scores"},
                         _ranked(batch, order))]


def _run_maximal_marginal_relevance(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    if batch.similarity is None:
        raise MapMatchedValueError("Maximal Marginal Relevance needs the within-turn similarity")
    cands = batch.candidates
    order = maximal_marginal_relevance_order(cands.scores, batch.similarity, cands.mask, options.relevance_weight)
    key = f"Maximal Marginal Relevance lambda={options.relevance_weight:g}"
    return [MethodOutput(key, "maximal-marginal-relevance", {"lambda": options.relevance_weight},
                         _ranked(batch, order))]


def _prepare_oracle(inputs: Any, options: MethodOptions) -> None:
    if "rewrite" not in getattr(inputs, "alternatives", {}):
        raise MethodUnavailable("the dataset has no rewrites (or no embedder to retrieve with them)")


def _run_oracle(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    return [MethodOutput("resolved-query oracle", "resolved-query-oracle", {}, batch.alternatives["rewrite"].index)]


def _run_geodesic(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    if batch.distances is None:
        raise MapMatchedValueError("the geodesic bound needs the graph distances")
    order = geodesic_online_order(batch.normalized, batch.distances, batch.candidates.mask)
    return [MethodOutput("geodesic bound", "geodesic", {}, _ranked(batch, order))]
