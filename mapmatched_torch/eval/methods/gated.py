"""The gated method: online map-matching whose beta is gated per move, fitted by LBFGS, cross-fitted."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ...core.checks import check_choice
from ...core.errors import MapMatchedValueError
from ...kernels.gate_features import GATE_FEATURE_NAMES
from ...kernels.gate_features import gate_features as shared_gate_features
from ...kernels.online import online_filtering_scores, online_forward_scores, rank_slots
from ..candidates import Candidates, normalize_candidate_scores
from .fitted import cross_fitting_folds
from .registry import MethodBatch, MethodOptions, MethodOutput, MethodUnavailable, _ranked

__all__ = ["relevant_candidates", "gate_features", "GatedState", "GatedTrellis", "gated_trellis", "fit_gated_rows",
           "GATED_RANKINGS"]

def relevant_candidates(candidates: Candidates, qrels: Any) -> Tensor:
    """(B, T, M) bool: the real candidates with a qrel grade > 0 (the gold sets of the CRF likelihood).

    Args:
        candidates: (B, T, M). qrels: the flat :class:`~mapmatched_torch.kernels.ranking_metrics.SparseQrels`
            of the N real turns in (conversation, position) order.
    """
    valid = candidates.valid
    ids = qrels.ids.to(valid.device)
    positive = ids.masked_fill(qrels.grades.to(valid.device) <= 0, -1)
    # shape: (N, M, R) -> (N, M)
    hits = (candidates.index[valid].unsqueeze(-1) == positive.unsqueeze(-2)).any(dim=-1)
    relevant = torch.zeros_like(candidates.mask)
    relevant[valid] = hits & candidates.mask[valid]
    return relevant


def gate_features(
    candidates: Candidates,
    normalized: Tensor,
    query_embeddings: Optional[Tensor] = None,
    passage_embeddings: Optional[Tensor] = None,
    chunk: int = 256,
) -> Tensor:
    """The gated method's per-move feature: :func:`mapmatched_torch.kernels.gate_features.gate_features`
    of the candidates (the one computation sessions and the server share).

    Args:
        candidates: (B, T, M). normalized: (B, T, M) float64 normalized scores.
        query_embeddings: (B, T, D) or None. passage_embeddings: (P, D) or None
            (both or neither).
        chunk: conversations per step of the cosine ((chunk, T, M, D) gathered embeddings).

    Returns:
        (B, T-1, M, 1) float64; 0.0 at moves out of padding.
    """
    index, _, mask = candidates
    return shared_gate_features(index, normalized, mask, query_embeddings, passage_embeddings, chunk)


class GatedState(NamedTuple):
    """What the gated method's prepare step leaves for its runs.

    Attributes:
        fold: (B,) long, the cross-fitting fold of each conversation (the fitted method's).
        features: (B, T-1, M, 1) float64 gate features of every conversation (:func:`gate_features`).
        models: one fitted :class:`~mapmatched_torch.fit.model.MapMatchedModel` per fold
            (fitted on the other folds; its feature standardization too).
        feature: the feature's name for reports.
        params: the fitted values of each fold (JSON-friendly).
    """

    fold: Tensor
    features: Tensor
    models: Tuple[Any, ...]
    feature: str
    params: Tuple[Dict[str, Any], ...]


def _gated_params(model: Any) -> Dict[str, Any]:
    """A fitted gated model's values: lambda, beta, the gate, the standardization, the cap."""
    gate = model.transition_model
    params = {
        "lambda": float(model.effective_emission_weight), "beta": float(model.effective_transition_weight),
        "gate_bias": float(gate.gate_bias), "gate_weight": float(gate.gate_weights[0]),
        "feature_mean": float(gate.feature_mean[0]), "feature_std": float(gate.feature_std[0]),
    }
    if gate.calibrate:
        params["cap"] = float(torch.nn.functional.softplus(gate.cap_parameter))
    return params


def _prepare_gated(inputs: Any, options: MethodOptions) -> GatedState:
    """Cross-fitted gated models: the CRF negative log-likelihood minimized on all folds but one.

    Per held-out fold: a :class:`~mapmatched_torch.fit.model.MapMatchedModel` with a
    one-feature :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` (start:
    lambda = beta = 1, gate 1; ``options.extra["gated_calibrate"]`` (default False)
    also learns the distance saturation) has its feature standardization set from the
    training conversations' real moves, then LBFGS (``options.extra["gated_iterations"]``,
    default 100, strong Wolfe line search) minimizes the mean negative log-likelihood
    that the path meets a relevant candidate at every turn that has one, plus a ridge
    ``options.extra["gated_l2"] * (bias^2 + weight^2)`` (default 0.01) on the gate: beta
    and the gate's bias are nearly redundant (``beta * 2 sigmoid(bias)``), and without
    it the fit drifts along that ridge (beta -> 80, bias -> -5 on the synthetic
    benchmark) instead of keeping the scale in beta. Distances and features are
    computed once for all conversations ((B, T-1, M, M) float64).
    """
    folds = options.fit_folds
    cands = inputs.candidates
    batch = cands.shape[0]
    if batch < folds:
        raise MethodUnavailable(f"cross-fitting with {folds} folds needs at least {folds} conversations, got {batch}")
    if cands.shape[1] < 2:
        raise MethodUnavailable("the gated method needs conversations of at least 2 turns (it gates the moves)")
    fold = cross_fitting_folds(batch, folds, options.seed).to(cands.mask.device)
    trellis = gated_trellis(inputs, options)
    models, params = [], []
    for held_out in range(folds):
        train = (fold != held_out).nonzero().flatten()
        models.append(fit_gated_rows(trellis, train, options, f"the gated fit of fold {held_out}"))
        params.append(_gated_params(models[-1]))
    return GatedState(fold, trellis.features, tuple(models), trellis.feature, tuple(params))


class GatedTrellis(NamedTuple):
    """Every conversation's tensors the gated fit reads (:func:`gated_trellis`).

    Attributes:
        candidates: (B, T, M). normalized: (B, T, M) float64. distances: (B, T-1, M, M)
        float64 ``[b, t, from, to]``. relevant: (B, T, M) bool. features: (B, T-1, M, 1)
        float64 (:func:`gate_features`). maximum_distance: the graph bound. feature: the
        feature's name for reports and model artifacts.
    """

    candidates: Candidates
    normalized: Tensor
    distances: Tensor
    relevant: Tensor
    features: Tensor
    maximum_distance: float
    feature: str


def gated_trellis(inputs: Any, options: MethodOptions) -> GatedTrellis:
    """The gated fit's tensors of every conversation of ``inputs`` (distances and features computed once)."""
    from ..distances import CorpusDistances

    cands = inputs.candidates
    normalized = normalize_candidate_scores(cands.scores, cands.mask, options.score_normalization)
    queries = getattr(inputs, "query_embeddings", None)
    passages = inputs.passage_embeddings if queries is not None else None
    lookup = CorpusDistances(inputs.graph, inputs.passage_ids)
    feature = GATE_FEATURE_NAMES[0] if queries is not None else GATE_FEATURE_NAMES[1]
    return GatedTrellis(cands, normalized, lookup.consecutive(cands.index), relevant_candidates(cands, inputs.qrels),
                        gate_features(cands, normalized, queries, passages), lookup.maximum_distance, feature)


def fit_gated_rows(trellis: GatedTrellis, rows: Tensor, options: MethodOptions, what: str) -> Any:
    """:func:`_fit_gated_model` on the conversations ``rows`` ((R,) long) of a :class:`GatedTrellis`."""
    return _fit_gated_model(trellis.candidates.select(rows), trellis.normalized[rows], trellis.distances[rows],
                            trellis.relevant[rows], trellis.features[rows], trellis.maximum_distance, options, what)


def _fit_gated_model(cands: Candidates, normalized: Tensor, distances: Tensor, relevant: Tensor, features: Tensor,
                     maximum_distance: float, options: MethodOptions, what: str) -> Any:
    """One gated model fitted on training conversations (the gated and mixed+gated methods' fit).

    Args:
        cands: the training conversations' candidates (B_train, T, M); normalized,
            distances (B_train, T-1, M, M), relevant (B_train, T, M) and features
            (B_train, T-1, M, 1) of the same conversations.
        maximum_distance: the graph bound (the initial saturation cap).
        options: ``extra["gated_calibrate"]``, ``["gated_iterations"]``, ``["gated_l2"]``
            as :func:`_prepare_gated` documents. what: names the fit in errors.

    Returns:
        The fitted :class:`~mapmatched_torch.fit.model.MapMatchedModel` (no gradients).
    """
    from ...fit.model import MapMatchedModel
    from ...fit.threads import one_thread
    from ...kernels.transitions import GatedTransitions

    calibrate = bool(options.extra.get("gated_calibrate", False))
    iterations = int(options.extra.get("gated_iterations", 100))
    l2 = float(options.extra.get("gated_l2", 0.01))
    mask = cands.mask
    if int(relevant.any(dim=-1).sum()) == 0:
        raise MethodUnavailable(f"{what} has no training turn with a relevant candidate")
    # shape: (B, T-1, M): the moves the standardization reads (real source, real next turn)
    sources = mask[:, :-1] & mask[:, 1:].any(dim=-1, keepdim=True)
    if not bool(sources.any()):
        raise MethodUnavailable(f"{what} has no move to learn from (every training conversation has one turn)")
    gate = GatedTransitions(1.0, num_features=1, calibrate=calibrate, cap=maximum_distance, device=mask.device)
    gate.standardize_(features, sources)
    model = MapMatchedModel(1.0, transition_model=gate, device=mask.device)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = model(normalized, distances, mask, relevant, features=features) + l2 * (
            gate.gate_bias.square() + gate.gate_weights.square().sum()
        )
        loss.backward()
        return loss

    with one_thread():  # the same fit bit for bit whatever the thread count (torchrun: one per process)
        optimizer.step(closure)
    model.project_()
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        raise MethodUnavailable(f"{what} diverged (a parameter is not finite)")
    model.requires_grad_(False)
    return model


#: The accepted values of ``options.extra["gated_ranking"]``.
GATED_RANKINGS = ("forward", "posterior")


def _gated_order(model: Any, normalized: Tensor, distances: Tensor, mask: Tensor, features: Tensor,
                 ranking: str = "forward") -> Tensor:
    """(B, T, M) online slot order of a fitted gated model (first entry: the decoded chunk at t).

    ``ranking``: ``"forward"`` (the max-plus forward scores, the session's answer) or
    ``"posterior"`` (:func:`online_filtering_scores`, the filtering marginals).
    """
    if model.transition_model.is_zero:
        return rank_slots(model.emissions(normalized, mask), mask)
    with torch.no_grad():
        emissions = model.emissions(normalized, mask)
        transitions = model.transitions(distances, mask, features)
    scores = (online_filtering_scores if ranking == "posterior" else online_forward_scores)(emissions, transitions, mask)
    return rank_slots(scores, mask)


def _gated_ranking(options: MethodOptions) -> str:
    """``options.extra["gated_ranking"]`` (default ``"forward"``), checked."""
    return check_choice("gated_ranking", options.extra.get("gated_ranking", "forward"), GATED_RANKINGS)


def _run_gated(batch: MethodBatch, options: MethodOptions) -> List[MethodOutput]:
    state: GatedState = batch.state["gated"]
    if batch.distances is None:
        raise MapMatchedValueError("the gated method needs the graph distances")
    rows_of_batch = batch.rows.to(state.fold.device)
    # shape: (B_c,) fold of each conversation of the batch; (B_c, T-1, M, 1) their features
    fold = state.fold[rows_of_batch].to(batch.rows.device)
    features = state.features[rows_of_batch].to(batch.normalized.device)
    mask = batch.candidates.mask
    order = torch.empty_like(batch.candidates.index)
    for held_out, model in enumerate(state.models):
        rows = (fold == held_out).nonzero().flatten()
        if rows.numel():
            order[rows] = _gated_order(model, batch.normalized[rows], batch.distances[rows], mask[rows], features[rows],
                                       _gated_ranking(options))
    params = {"folds": len(state.models), "feature": state.feature, "weights": list(state.params)}
    if _gated_ranking(options) != "forward":
        params["ranking"] = _gated_ranking(options)
    key = f"gated ({len(state.models)}-fold cross-fitted)"
    return [MethodOutput(key, "gated", params, _ranked(batch, order))]
