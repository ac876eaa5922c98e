"""The validation metric of a fit: nDCG@3 of the decoded path.

Each turn's ranking is its decoded chunk first, then the turn's other candidates by
decreasing normalized score (ties to provider order); gain 1 for a relevant chunk; the
ideal DCG counts all of the turn's relevant chunks, also those missing from its
candidates (:func:`~mapmatched_torch.kernels.ranking_metrics.ndcg_at_k`'s trec_eval
convention). The mean runs over the labelled validation turns (gold-missing ones
included: they score 0 before and after).
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from ..kernels.ranking_metrics import ndcg_at_k
from .model import MapMatchedModel
from .packing import LabelledBatch

__all__ = ["decoded_ndcg_per_turn", "decoded_ndcg"]

#: The cut-off of the validation metric.
NDCG_K = 3


def _decoded_first(paths: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
    """``(B, T, M)`` candidate indices per turn: the decoded one, then the others by
    decreasing score (stable: ties to provider order); -1 at padding."""
    candidates = torch.arange(mask.shape[2], device=mask.device)
    # shape: (B, T, M) sort keys
    keys = torch.where(mask, scores, -math.inf)
    keys = torch.where(candidates == paths.unsqueeze(2), math.inf, keys)
    order = torch.sort(keys, dim=2, descending=True, stable=True).indices
    return torch.where(mask.gather(2, order), order, -1)


@torch.no_grad()
def decoded_ndcg_per_turn(model: MapMatchedModel, batch: LabelledBatch, k: int = NDCG_K) -> Tensor:
    """``(B, T)`` float64 nDCG@k of the decoded path, turn by turn.

    Each turn's ranking is its decoded (Viterbi) candidate first, then its other
    candidates by decreasing normalized score (ties to provider order); gain 1 per
    relevant chunk, ideal DCG over all the turn's relevant chunks (see the module
    docstring). 0.0 at unlabelled turns and padding: average over ``batch.labelled``.

    Cost: one Viterbi decode, O(B T M^2), plus O(B T M log M).
    """
    paths = model.decode(batch.scores, batch.distances, batch.mask).paths
    ranked = _decoded_first(paths, batch.scores, batch.mask)
    batch_size, turns, width = ranked.shape
    return ndcg_at_k(ranked.reshape(batch_size * turns, width), batch.qrels, k).reshape(batch_size, turns)


def decoded_ndcg(model: MapMatchedModel, batch: LabelledBatch, k: int = NDCG_K) -> Tuple[float, int]:
    """nDCG@k of the decoded path, summed over the batch's labelled turns.

    Returns:
        ``(sum of nDCG@k over labelled turns, number of labelled turns)``; divide for
        the mean. See :func:`decoded_ndcg_per_turn`.
    """
    values = decoded_ndcg_per_turn(model, batch, k)
    return float(values[batch.labelled].sum()), int(batch.labelled.sum())
