"""The cross-fitted "gated" evaluation method: its feature, its gold sets, its folds, its runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mapmatched_torch.eval.candidates import Candidates, normalize_candidate_scores
from mapmatched_torch.eval.data import load_directory
from mapmatched_torch.eval.embedders import HashEmbedder
from mapmatched_torch.eval.methods import (
    DEFAULT_METHODS,
    METHODS,
    MethodOptions,
    cross_fitting_folds,
    gate_features,
    relevant_candidates,
    settings_grid,
)
from mapmatched_torch.eval.runner import EvalConfig, evaluate, inputs_from_dataset, inputs_from_synthetic
from mapmatched_torch.eval.synthetic import make_synthetic
from mapmatched_torch.kernels.ranking_metrics import SparseQrels
from mapmatched_torch.kernels.transitions import query_source_cosine

KEY = "gated (2-fold cross-fitted)"


@pytest.fixture(scope="module")
def synthetic_inputs():
    return inputs_from_synthetic(make_synthetic(n_conversations=40, turns=5, candidates=6, seed=2, topics=12,
                                                passages_per_topic=5))


def _options(**extra) -> MethodOptions:
    return MethodOptions(settings_grid((1.0,), (0.5,)), extra={"gated_iterations": 30, **extra})


def _tiny() -> Candidates:
    index = torch.tensor([[[3, 5, 7], [5, 2, -1], [9, -1, -1]]])
    scores = torch.tensor([[[3.0, 2.0, 1.0], [4.0, 1.0, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    return Candidates(index, scores, index >= 0)


def test_the_score_level_feature_is_the_next_turns_score_of_the_source_passage():
    cands = _tiny()
    normalized = normalize_candidate_scores(cands.scores, cands.mask)
    features = gate_features(cands, normalized)
    assert features.shape == (1, 2, 3, 1)
    # turn 1 retrieved passage 5 (normalized +1) but not 3 or 7 (its lowest score, -1)
    assert features[0, 0, :, 0].tolist() == [-1.0, 1.0, -1.0]
    # turn 2 has one candidate (normalized 0); the padded source slot of turn 1 reads 0
    assert features[0, 1, :, 0].tolist() == [0.0, 0.0, 0.0]


def test_the_embedding_feature_is_the_query_source_cosine_of_the_candidates_passages():
    cands = _tiny()
    generator = torch.Generator().manual_seed(0)
    queries = torch.randn(1, 3, 4, generator=generator, dtype=torch.float64)
    passages = torch.randn(10, 4, generator=generator, dtype=torch.float64)
    features = gate_features(cands, normalize_candidate_scores(cands.scores, cands.mask), queries, passages, chunk=1)
    expected = query_source_cosine(queries, passages[cands.index.clamp_min(0)])
    expected[0, 1, 2] = 0.0  # the move out of the padding slot of turn 1
    assert torch.equal(features, expected)
    with pytest.raises(ValueError, match="both the query and the passage embeddings"):
        gate_features(cands, cands.scores, queries, None)


def test_relevant_candidates_are_the_positive_graded_real_candidates():
    cands = _tiny()
    qrels = SparseQrels(torch.tensor([[7, 3], [2, -1], [4, -1]]),
                        torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0]], dtype=torch.float64))
    relevant = relevant_candidates(cands, qrels)
    assert relevant.tolist() == [[[False, False, True], [False, True, False], [False, False, False]]]


def test_gated_is_registered_and_a_default_method():
    assert "gated" in METHODS and "gated" in DEFAULT_METHODS
    assert METHODS["gated"].needs_distances


def test_each_folds_model_is_fitted_only_on_the_other_folds(synthetic_inputs):
    """By construction: change the scores of fold 0's conversations and erase their labels
    after turn 0; the model that ranks fold 0 (fitted on fold 1) stays the same bit for bit, fold 1's changes."""
    prepare = METHODS["gated"].prepare
    state = prepare(synthetic_inputs, _options())
    batch = synthetic_inputs.candidates.shape[0]
    assert torch.equal(state.fold, cross_fitting_folds(batch, 2, 0))  # the fitted method's folds
    held = state.fold == 0
    cands = synthetic_inputs.candidates
    noise = torch.rand(cands.scores.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    scores = torch.where(held[:, None, None], noise * 5.0, cands.scores)
    # the flat qrels rows of fold 0's real turns after turn 0
    later = torch.arange(cands.shape[1]) > 0
    turn_of_held = (held[:, None] & later[None, :])[cands.valid]
    grades = synthetic_inputs.qrels.grades.masked_fill(turn_of_held[:, None], 0.0)
    changed = dataclasses.replace(synthetic_inputs, candidates=Candidates(cands.index, scores, cands.mask),
                                  qrels=SparseQrels(synthetic_inputs.qrels.ids, grades))
    again = prepare(changed, _options())
    assert again.params[0] == state.params[0]
    assert again.params[1] != state.params[1]


def test_gated_runs_on_the_synthetic_benchmark_deterministically(synthetic_inputs):
    config = EvalConfig(methods=("pointwise", "gated"), betas=(0.5,), n_bootstrap=0, progress=False)
    first, second = evaluate(synthetic_inputs, config), evaluate(synthetic_inputs, config)
    gated = first.method(KEY)
    assert gated.method == "gated" and gated.params["folds"] == 2
    assert gated.params["feature"] == "score-level query-source match"
    weights = gated.params["weights"]
    assert len(weights) == 2 and all(w["lambda"] >= 0 and w["beta"] >= 0 for w in weights)
    assert {"gate_bias", "gate_weight", "feature_mean", "feature_std"} <= set(weights[0]) and "cap" not in weights[0]
    assert second.method(KEY).params == gated.params
    for metric, values in first.per_turn[KEY].items():
        assert torch.equal(values, second.per_turn[KEY][metric])
    # map-matching gains on this benchmark's follow-ups; the fitted gate keeps most of it
    follow_up = gated.slices["follow-up"].means["ndcg@3"]
    assert follow_up > first.method("pointwise").slices["follow-up"].means["ndcg@3"]


def test_gated_with_calibration_reports_the_fitted_cap(synthetic_inputs):
    state = METHODS["gated"].prepare(synthetic_inputs, _options(gated_calibrate=True))
    assert all(p["cap"] > 0 for p in state.params)


def test_gated_uses_the_query_embeddings_of_a_dataset(fixtures):
    inputs = inputs_from_dataset(load_directory(fixtures / "normalized"), HashEmbedder(dim=64), graph="knn", k=2,
                                 candidates=3)
    assert inputs.query_embeddings.shape[:2] == inputs.candidates.shape[:2]
    assert bool((inputs.query_embeddings[~inputs.candidates.valid] == 0).all())
    result = evaluate(inputs, EvalConfig(methods=("pointwise", "gated"), betas=(0.5,), n_bootstrap=0, progress=False))
    assert result.method(KEY).params["feature"] == "query-source cosine"


def _one_turn_outside_fold_zero(inputs):
    """The same conversations, but those outside fold 0 keep only their first turn."""
    cands = inputs.candidates
    fold = cross_fitting_folds(cands.shape[0], 2, 0)
    keep = (fold == 0)[:, None, None] | (torch.arange(cands.shape[1]) == 0)[None, :, None]
    mask = cands.mask & keep
    truncated = Candidates(cands.index.masked_fill(~mask, -1), cands.scores.masked_fill(~mask, 0.0), mask)
    rows = truncated.valid[cands.valid]  # the qrels rows of the turns that stay
    qrels = SparseQrels(inputs.qrels.ids[rows], inputs.qrels.grades[rows])
    return dataclasses.replace(inputs, candidates=truncated, qrels=qrels)


def test_a_fold_whose_training_conversations_all_have_one_turn_skips_the_method(synthetic_inputs):
    # fold 0 is fitted on fold 1, which has no move left: the method is skipped with the
    # reason (it used to stop the whole evaluation with standardize_'s error)
    inputs = _one_turn_outside_fold_zero(synthetic_inputs)
    config = EvalConfig(methods=("pointwise", "gated"), betas=(0.5,), n_bootstrap=0, progress=False)
    result = evaluate(inputs, config)
    assert "gated" in result.skipped and "has no move to learn from" in result.skipped["gated"]
    assert "pointwise" in [m.method for m in result.methods]
