"""``mapmatched-torch fit --method ...``: one servable model fitted on all conversations, and its metrics.

The methods are the evaluation's learned ones, fitted once on every labelled
conversation instead of per fold (the same fitting code as
:mod:`mapmatched_torch.eval.methods`):

- ``map-matched``: lambda and beta by :func:`mapmatched_torch.fit.fit_weights` (the
  evaluation's ``fitted`` method; the CLI runs it with its validation options);
- ``gated``: a :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` model
  (:func:`~mapmatched_torch.eval.methods.gated.fit_gated_rows`);
- ``mixed``: the query-mixing gate (:func:`~mapmatched_torch.eval.methods.mixed.fit_mixing_rows`),
  ranked pointwise (lambda 1, beta 0);
- ``mixed+gated``: the gate, then a gated model on the mixed candidates;
- ``auto``: the method the evaluation's selection picks among these (and pointwise),
  pooled: :func:`choose_method`.

The metrics of a model (:func:`cross_fitted_metrics`) are the evaluation's
cross-fitted ones (each conversation ranked by a model fitted without it), so they
estimate how the model does on conversations it has not seen.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from ..core.errors import MapMatchedValueError
from ..core.settings import DecodeSettings
from .methods import MethodOptions, MethodUnavailable
from .methods.gated import fit_gated_rows, gated_trellis
from .methods.mixed import fit_mixing_rows

__all__ = ["FIT_METHODS", "EVAL_METHODS", "FittedModel", "cross_fitted_metrics", "choose_method", "fit_learned",
           "fit_map_matched", "fit_notes", "pointwise_model", "learned_payload", "online_scores", "online_rankings"]

#: ``fit --method``'s choices.
FIT_METHODS = ("map-matched", "gated", "mixed", "mixed+gated", "auto")
#: The evaluation's method of each servable model (``map-matched`` fits as ``fitted`` does).
EVAL_METHODS = {"pointwise": "pointwise", "map-matched": "fitted", "gated": "gated", "mixed": "mixed",
                "mixed+gated": "mixed+gated"}
_METRIC = "ndcg@3"


class FittedModel(NamedTuple):
    """A model fitted on every conversation, ready for :func:`~mapmatched_torch.fit.artifacts.save_model`.

    Attributes:
        method: the artifact's method. model: the :class:`~mapmatched_torch.fit.model.MapMatchedModel`.
        settings: the decode settings a session applies. mixing: query-mixing values or None.
        feature: the gate's feature name or None.
    """

    method: str
    model: torch.nn.Module
    settings: DecodeSettings
    mixing: Optional[Dict[str, Any]]
    feature: Optional[str]


def cross_fitted_metrics(inputs: Any, methods: Sequence[str], *, seed: int = 0, fit_folds: int = 2,
                         score_normalization: str = "zscore",
                         method_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The evaluation's cross-fitted nDCG@3 of each method and of pointwise.

    Args:
        inputs: :class:`~mapmatched_torch.eval.inputs.EvalInputs`.
        methods: names of :data:`EVAL_METHODS` (``"map-matched"``, ``"gated"``, ...).
        seed, fit_folds, score_normalization, method_options: as the evaluation's.

    Returns:
        ``{"metric": "ndcg@3", "methods": {name: {"all", "follow-up", "standalone",
        "follow-up lift"}}, "skipped": {name: why}}`` (means over the labelled turns of
        each slice; lift: minus pointwise's).
    """
    from .runner import EvalConfig, evaluate

    names = ["pointwise", *[m for m in methods if m != "pointwise"]]
    config = EvalConfig(methods=tuple(EVAL_METHODS[m] for m in names), betas=(0.0,), n_bootstrap=0, seed=seed,
                        fit_folds=fit_folds, score_normalization=score_normalization,
                        method_options=dict(method_options or {}), progress=False)
    result = evaluate(inputs, config)
    by_method = {row.method: row for row in result.methods}
    base = by_method["pointwise"].slices
    out: Dict[str, Any] = {}
    skipped: Dict[str, str] = {}
    for name in names:
        row = by_method.get(EVAL_METHODS[name])
        if row is None:
            skipped[name] = result.skipped.get(EVAL_METHODS[name], "not run")
            continue
        means = {slice_name: _number(row.slices[slice_name].means[_METRIC])
                 for slice_name in ("all", "follow-up", "standalone") if slice_name in row.slices}
        if "follow-up" in row.slices:
            means["follow-up lift"] = _number(row.slices["follow-up"].means[_METRIC]
                                              - base["follow-up"].means[_METRIC])
        out[name] = means
    return {"metric": _METRIC, "criterion": "cross-fitted: each conversation ranked by a model fitted without it "
            f"({fit_folds} folds)", "methods": out, "skipped": skipped}


def _number(value: float) -> Optional[float]:
    return None if math.isnan(value) else float(value)


def choose_method(metrics: Mapping[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """``fit --method auto``'s choice: the method with the best cross-fitted mean nDCG@3 over all
    labelled turns (the evaluation's selection criterion, pooled over the folds: one model is
    served), ties to the earlier in :data:`EVAL_METHODS` order (pointwise first, so a tie keeps
    the baseline).

    Returns:
        ``(name, why)``: ``why`` records the candidates' means, the skipped ones and the rule.
    """
    candidates = {name: values.get("all") for name, values in metrics["methods"].items()}
    scored = [(name, value) for name, value in candidates.items() if value is not None]
    if not scored:
        raise MapMatchedValueError("fit --method auto: no method could be evaluated (no labelled turn)")
    best = max(value for _, value in scored)
    chosen = next(name for name, value in scored if value == best)
    why = {"chosen": chosen, "rule": "best cross-fitted mean nDCG@3 over all labelled turns (ties: the earlier of "
           + ", ".join(EVAL_METHODS) + ")", "candidates": candidates, "skipped": dict(metrics.get("skipped", {}))}
    return chosen, why


def fit_learned(inputs: Any, method: str, *, seed: int = 0, score_normalization: str = "zscore",
                method_options: Optional[Mapping[str, Any]] = None) -> FittedModel:
    """Fit ``gated``, ``mixed`` or ``mixed+gated`` on every conversation of ``inputs``.

    Raises:
        MapMatchedValueError: the method cannot be fitted on these inputs (the
            evaluation's reason: no embeddings, one-turn conversations, no relevant
            candidate, a failed fit).
    """
    from ..fit.model import MapMatchedModel

    options = MethodOptions(settings=(), score_normalization=score_normalization, seed=seed,
                            extra=dict(method_options or {}))
    cands = inputs.candidates
    every = torch.ones(cands.shape[0], dtype=torch.bool, device=cands.mask.device)
    try:
        if cands.shape[1] < 2:
            raise MethodUnavailable(f"the {method} method needs conversations of at least 2 turns")
        mixing = None
        if method in ("mixed", "mixed+gated"):
            if getattr(inputs, "query_embeddings", None) is None or inputs.passage_embeddings is None:
                raise MethodUnavailable("query mixing needs query and passage embeddings (a dataset with an embedder)")
            fit, mixed = fit_mixing_rows(inputs, options, every, "the query-mixing fit")
            mixing = {**fit.mixing.to_dict()}
            if method == "mixed":
                model = MapMatchedModel(1.0, 0.0)
                return FittedModel(method, model, DecodeSettings(1.0, 0.0, None, score_normalization), mixing, None)
            from dataclasses import replace

            inputs = replace(inputs, candidates=mixed)
        trellis = gated_trellis(inputs, options)
        model = fit_gated_rows(trellis, every.nonzero().flatten(), options, f"the {method} fit")
    except MethodUnavailable as error:
        raise MapMatchedValueError(f"fit --method {method}: {error}") from None
    settings = DecodeSettings(float(model.effective_emission_weight), float(model.effective_transition_weight),
                              None, score_normalization)
    return FittedModel(method, model, settings, mixing, trellis.feature)


def online_scores(inputs: Any, model: Any) -> Tuple[Any, torch.Tensor]:
    """The evaluation's online scores of a loaded model: what it ranks each turn's candidates by.

    A session (and the server) over the same corpus, provider and model returns, at turn t, these
    scores of turn t's candidates as its ``candidate_ranking`` (sorted by (-score, chunk ID)) and
    their first maximum (in candidate order) as its chunk; ``rank_slots(scores, mask)`` is the
    evaluation's order (ties by candidate order).

    Args:
        inputs: :class:`~mapmatched_torch.eval.inputs.EvalInputs` (passage and query
            embeddings for a mixed model).
        model: a :class:`~mapmatched_torch.retrieval.pretrained.LoadedModel` of the
            ``map-matched`` or ``mixed`` method (the gated ones need sessions with learned
            transitions: issue 33 item 2).

    Returns:
        ``(candidates, scores)``: the turns' :class:`~mapmatched_torch.eval.candidates.Candidates`
        (B, T, M) (for ``mixed`` retrieved again online with the model's gate, each query
        mixed with the passage decoded at the previous turn, as the ``mixed`` method
        does) and the (B, T, M) float64 max-plus forward scores
        (:func:`~mapmatched_torch.kernels.online.online_forward_scores` of ``lambda * s`` and
        ``-(beta * d)``; ``lambda * s`` at beta = 0), -inf at padding.
    """
    from ..kernels.online import online_forward_scores
    from ..providers.dense import DenseProvider
    from ..providers.query_mixing import QueryMixing
    from .candidates import normalize_candidate_scores, retrieve_online
    from .distances import CorpusDistances
    from .methods.map_matched import weighted_trellis
    from .methods.mixed import _pointwise_decoded
    from .methods.registry import Setting

    if model.config.get("transitions") is not None:
        raise MapMatchedValueError(f"online_scores: a {model.method!r} model needs learned transitions in sessions "
                                   "(issue 33 item 2)")
    cands = inputs.candidates
    if model.mixing is not None:
        provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, metric="inner_product",
                                 device=cands.mask.device)
        cands = retrieve_online(inputs.query_embeddings, cands.valid, provider, cands.shape[2],
                                QueryMixing(**model.mixing), inputs.passage_embeddings, _pointwise_decoded)
    settings = model.settings
    normalized = normalize_candidate_scores(cands.scores, cands.mask, settings.score_normalization)
    setting = Setting(settings.emission_weight, settings.transition_weight, settings.fixed_lag)
    distances = CorpusDistances(inputs.graph, inputs.passage_ids).consecutive(cands.index)
    scores = online_forward_scores(*weighted_trellis(normalized, distances, setting), cands.mask, settings.fixed_lag)
    return cands, torch.where(cands.mask, scores, -math.inf)


def pointwise_model(normalization: str) -> FittedModel:
    """``auto``'s model when pointwise wins: map-matching with lambda 1 and beta 0."""
    from ..fit.model import MapMatchedModel

    return FittedModel("map-matched", MapMatchedModel(1.0, 0.0), DecodeSettings(1.0, 0.0, None, normalization),
                       None, None)


def learned_payload(inputs: Any, fitted: FittedModel, *, seed: int,
                    method_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """``fit --json``'s summary of a model fitted by :func:`fit_learned` (or :func:`pointwise_model`):
    lambda, beta, the mixing gates, the gate's values."""
    from ..fit.artifacts import transitions_config

    transitions = transitions_config(fitted.model, fitted.feature)
    if transitions is not None:
        gate = fitted.model.transition_model
        transitions.update({"gate_bias": float(gate.gate_bias), "gate_weights": gate.gate_weights.tolist(),
                            "feature_mean": gate.feature_mean.tolist(), "feature_std": gate.feature_std.tolist()})
    return {"lambda": fitted.settings.emission_weight, "beta": fitted.settings.transition_weight,
            "mixing": fitted.mixing, "transitions": transitions, "data": inputs.name, "info": dict(inputs.info),
            "options": {"score_normalization": fitted.settings.score_normalization, "seed": seed,
                        "method_options": dict(method_options or {})}}


def fit_map_matched(inputs: Any, *, optimizer: str, max_iterations: int, validation_fraction: float, patience: int,
                    score_normalization: str, seed: int, device: Any, progress: Optional[bool],
                    status: Callable[[str], None]) -> Tuple[FittedModel, Dict[str, Any], Tuple[str, ...]]:
    """``--method map-matched``: :func:`mapmatched_torch.fit.fit_weights` on the labelled
    conversations with a validation split for early stopping.

    Returns:
        ``(FittedModel, fit --json's summary, warnings)`` (a warning when early stopping
        kept the starting point: :func:`fit_notes`).
    """
    from .. import fit
    from .distributed import world_size
    from .methods import labelled_conversations

    conversations = labelled_conversations(inputs)
    status(f"fitting lambda and beta on {len(conversations)} conversations ({optimizer}, "
           + (f"{validation_fraction:g} held out for early stopping)" if validation_fraction else
              "no validation split: fitted to convergence)"))
    result = fit.fit_weights(conversations, inputs.graph, score_normalization=score_normalization,
                             optimizer=optimizer, max_iterations=max_iterations,
                             validation_fraction=validation_fraction, patience=patience, seed=seed, device=device,
                             progress=progress)
    notes = fit_notes(result, patience)
    gold = (inputs.info.get("gold_missing") or {}).get("labelled_turns_without_gold_in_corpus", 0)
    payload = {
        "lambda": result.emission_weight,
        "beta": result.transition_weight,
        "data": inputs.name,
        "info": dict(inputs.info),
        "options": {"optimizer": optimizer, "max_iterations": max_iterations,
                    "validation_fraction": validation_fraction, "patience": patience,
                    "score_normalization": score_normalization, "seed": seed},
        "n_conversations": result.n_conversations, "n_turns": result.n_turns,
        "n_labelled_turns": result.n_labelled_turns,
        # one name per count: gold outside the candidates (the fit cannot use the turn), of which gold outside
        # the corpus (info.gold_missing, what --qrels in-corpus drops)
        "n_gold_not_among_candidates": result.n_gold_missing, "n_gold_not_in_corpus": gold,
        "kept_starting_point": result.best_iteration == 0, "warnings": list(notes),
        "n_train_conversations": result.n_train_conversations,
        "n_validation_conversations": result.n_validation_conversations,
        "validation_ndcg_before": result.validation_ndcg_before,
        "validation_ndcg_after": result.validation_ndcg_after,
        "best_iteration": result.best_iteration, "stopped": result.stopped,
        "world_size": world_size(),
    }
    payload["validation"] = {key: payload[key] for key in (
        "n_validation_conversations", "validation_ndcg_before", "validation_ndcg_after", "best_iteration", "stopped")}
    settings = DecodeSettings(result.emission_weight, result.transition_weight, None, score_normalization)
    model = fit.MapMatchedModel(result.emission_weight, result.transition_weight)
    return FittedModel("map-matched", model, settings, None, None), payload, notes


def fit_notes(result: Any, patience: int) -> Tuple[str, ...]:
    """What ``fit`` warns about: a fit that returned its starting point (best iteration 0)."""
    if result.best_iteration != 0:
        return ()
    how = (f"the validation loss of the {result.n_validation_conversations} held-out conversations never improved "
           f"on the starting point's within --patience {patience} iterations" if result.stopped == "early_stopping"
           else f"the fit stopped at once ({result.stopped})")
    return (f"the fitted weights are the starting point (lambda={result.emission_weight:g}, "
            f"beta={result.transition_weight:g}): {how}; nothing was learned. Try --validation-fraction 0 (fit to "
            "convergence on every conversation), a larger --patience, or more conversations",)


def online_rankings(inputs: Any, model: Any) -> Dict[Tuple[int, int], Tuple[str, List[Tuple[str, float]]]]:
    """:func:`online_scores` as a session reports them: for every real turn ``(conversation, turn)``,
    the chunk the evaluation ranks first (the first maximum in candidate order, the decoded chunk)
    and its ``(chunk ID, forward score)`` list sorted by (-score, chunk ID), a session's
    ``candidate_ranking`` order (the evaluation breaks exact score ties by candidate order instead)."""
    from ..kernels.online import rank_slots

    cands, scores = online_scores(inputs, model)
    order = rank_slots(scores, cands.mask)
    ids = inputs.passage_ids
    out: Dict[Tuple[int, int], Tuple[str, List[Tuple[str, float]]]] = {}
    for b, t in cands.valid.nonzero().tolist():
        pairs = [(ids[i], s) for i, s, keep in
                 zip(cands.index[b, t].tolist(), scores[b, t].tolist(), cands.mask[b, t].tolist()) if keep]
        out[b, t] = (ids[int(cands.index[b, t, order[b, t, 0]])], sorted(pairs, key=lambda p: (-p[1], p[0])))
    return out
