"""The fitted method: map-matching with lambda and beta fitted by gradient descent, cross-fitted."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Tuple

import torch
from torch import Tensor

from .map_matched import map_matched_orders
from .registry import MethodBatch, MethodOptions, MethodOutput, MethodUnavailable, Setting, _ranked

__all__ = ["FittedState", "labelled_conversations", "cross_fitting_folds"]


class FittedState(NamedTuple):
    """What the fitted method's prepare step leaves for its runs.

    Attributes:
        fold: (B,) long, the cross-fitting fold of each conversation.
        settings: one fitted :class:`Setting` per fold (fitted on the other folds).
        results: the :class:`~mapmatched_torch.fit.FitResult` of each fold.
    """

    fold: Tensor
    settings: Tuple[Setting, ...]
    results: Tuple[Any, ...]


def labelled_conversations(inputs: Any) -> List[List[Tuple[List[Any], frozenset]]]:
    """The inputs as ``fit_weights`` conversations: per turn (ScoredCandidate list, relevant IDs)."""
    from ...core.models import ScoredCandidate

    ids = inputs.passage_ids
    cands = inputs.candidates
    relevant = iter([
        frozenset(ids[i] for i, g in zip(row_ids, row_grades) if g > 0 and i >= 0)
        for row_ids, row_grades in zip(inputs.qrels.ids.tolist(), inputs.qrels.grades.tolist())
    ])
    conversations = []
    for index_rows, score_rows, mask_rows in zip(cands.index.tolist(), cands.scores.tolist(), cands.mask.tolist()):
        turns = []
        for index_row, score_row, mask_row in zip(index_rows, score_rows, mask_rows):
            if not any(mask_row):
                break
            scored = [ScoredCandidate(ids[i], s) for i, s, keep in zip(index_row, score_row, mask_row) if keep]
            turns.append((scored, next(relevant)))
        conversations.append(turns)
    return conversations


def cross_fitting_folds(conversations: int, folds: int, seed: int) -> Tensor:
    """(B,) long: the balanced cross-fitting fold of every conversation (seeded, on the CPU).

    The fitted and the gated methods share it, so both hold out the same conversations.
    """
    generator = torch.Generator().manual_seed(seed)
    fold = torch.empty(conversations, dtype=torch.long)
    fold[torch.randperm(conversations, generator=generator)] = torch.arange(conversations) % folds
    return fold


def _prepare_fitted(inputs: Any, options: MethodOptions) -> FittedState:
    """Cross-fitted weights: ``mapmatched_torch.fit.fit_weights`` on all folds but one, per fold.

    Each conversation is ranked with weights fitted without it (``options.fit_folds``
    balanced folds drawn with ``options.seed``), full decoding (no lag). A fit that
    cannot run (e.g. no training turn whose relevant passage is among its candidates)
    skips the method with fit_weights' message.
    """
    try:
        from ...fit.fitting import fit_weights
    except ImportError:
        raise MethodUnavailable("mapmatched_torch.fit.fit_weights is not available") from None
    folds = options.fit_folds
    batch = inputs.candidates.shape[0]
    if batch < folds:
        raise MethodUnavailable(f"cross-fitting with {folds} folds needs at least {folds} conversations, got {batch}")
    fold = cross_fitting_folds(batch, folds, options.seed)
    conversations = labelled_conversations(inputs)
    settings, results = [], []
    for held_out in range(folds):
        train = [c for c, f in zip(conversations, fold.tolist()) if f != held_out]
        try:
            # no validation split: two weights cannot overfit much, and the folds already hold out
            result = fit_weights(train, inputs.graph, score_normalization=options.score_normalization,
                                 validation_fraction=0.0, seed=options.seed, progress=False)
        except ValueError as error:
            raise MethodUnavailable(f"fit_weights failed on fold {held_out}: {error}") from None
        results.append(result)
        settings.append(Setting(result.emission_weight, result.transition_weight, None))
    return FittedState(fold.to(inputs.candidates.mask.device), tuple(settings), tuple(results))


def _run_fitted(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    state: FittedState = batch.state["fitted"]
    # shape: (B_c,) fold of each conversation of the batch
    fold = state.fold.to(batch.rows.device)[batch.rows]
    mask = batch.candidates.mask
    order = torch.empty_like(batch.candidates.index)
    for held_out, setting in enumerate(state.settings):
        rows = (fold == held_out).nonzero().flatten()
        if rows.numel():
            distances = None if batch.distances is None else batch.distances[rows]
            order[rows] = map_matched_orders(batch.normalized[rows], distances, mask[rows], (setting,))[0]
    params = {"folds": len(state.settings), "weights": [s.to_dict() for s in state.settings]}
    return [MethodOutput(f"fitted ({len(state.settings)}-fold cross-fitted)", "fitted", params, _ranked(batch, order))]
