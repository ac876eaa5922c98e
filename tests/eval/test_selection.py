"""The cross-fitted headline (chosen per fold on the other folds) and repeated cross-fitting."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.methods import cross_fitting_folds
from mapmatched_torch.eval.report import to_json, to_json_dict, to_markdown
from mapmatched_torch.eval.runner import EvalConfig, evaluate, inputs_from_synthetic
from mapmatched_torch.eval.selection import (
    RepeatRange,
    cross_fitted_selection,
    repeat_summaries,
    selection_candidates,
)
from mapmatched_torch.eval.synthetic import make_synthetic

KEY = "cross-fitted primary (5-fold selection)"


def _values(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_each_fold_takes_the_method_best_on_the_other_folds():
    # conversations 0, 1 in fold 0; 2, 3 in fold 1; one turn each, plus an unlabelled turn of conversation 3
    conversation = torch.tensor([0, 1, 2, 3, 3])
    fold = torch.tensor([0, 0, 1, 1])
    eligible = torch.tensor([True, True, True, True, False])
    per_turn = {
        "pointwise": {"ndcg@3": _values(0.5, 0.5, 0.5, 0.5, 0.5), "mrr": _values(1, 1, 1, 1, 1)},
        # best on fold 1 only: chosen for fold 0 (and scored there, where it is bad)
        "a": {"ndcg@3": _values(0.0, 0.0, 1.0, 1.0, 0.0), "mrr": _values(2, 2, 2, 2, 2)},
        # best on fold 0 only, and by far over all turns (what a choice on the data would take)
        "b": {"ndcg@3": _values(1.0, 1.0, 0.6, 0.6, 9.0), "mrr": _values(3, 3, 3, 3, 3)},
    }
    chosen = cross_fitted_selection(per_turn, ["pointwise", "a", "b"], conversation, eligible, fold)
    assert chosen.choices == ("a", "b")
    assert chosen.training_means == (1.0, 1.0)
    assert chosen.metrics["ndcg@3"].tolist() == [0.0, 0.0, 0.6, 0.6, 9.0]  # every metric from the fold's choice
    assert chosen.metrics["mrr"].tolist() == [2, 2, 3, 3, 3]
    # the unlabelled turn is never read by the choice: 9.0 on it does not make b win fold 0's training data
    params = chosen.params("ndcg@3")
    assert params["folds"] == 2 and [c["method"] for c in params["choices"]] == ["a", "b"]
    # ties keep the earlier candidate (pointwise first: a tie keeps the baseline)
    tie = {"pointwise": per_turn["pointwise"], "same": per_turn["pointwise"]}
    assert cross_fitted_selection(tie, ["pointwise", "same"], conversation, eligible, fold).choices == (
        "pointwise", "pointwise")
    with pytest.raises(MapMatchedValueError, match="at least one candidate"):
        cross_fitted_selection(per_turn, [], conversation, eligible, fold)
    with pytest.raises(MapMatchedValueError, match="no 'ndcg@5' values"):
        cross_fitted_selection(per_turn, ["a"], conversation, eligible, fold, "ndcg@5")


def test_the_oracle_is_never_a_candidate():
    described = {"pointwise": ("pointwise", {}), "resolved-query oracle": ("resolved-query-oracle", {}),
                 "gated (2-fold cross-fitted)": ("gated", {"folds": 2}), KEY: ("cross-fitted-primary", {"folds": 2})}
    assert selection_candidates(described) == ["pointwise", "gated (2-fold cross-fitted)"]


@pytest.fixture(scope="module")
def inputs():
    return inputs_from_synthetic(make_synthetic(n_conversations=16, turns=4, candidates=6, seed=5, topics=10,
                                                passages_per_topic=4))


def _config(**options):
    defaults = dict(methods=("pointwise", "map-matched", "geodesic", "gated"), betas=(0.0, 0.5, 2.0),
                    n_bootstrap=20, progress=False)
    defaults.update(options)
    return EvalConfig(**defaults)


def test_the_headline_is_cross_fitted_not_chosen_on_the_data(inputs):
    result = evaluate(inputs, _config())
    assert result.primary == KEY and result.primary_selected_on_data is False
    row = result.method(KEY)
    assert row.verdict is not None and row.slices["follow-up"].lift is not None
    # recompute: each fold's choice is the best candidate on the other folds' labelled turns
    fold = cross_fitting_folds(16, 5, 0)[result.conversation]  # the selection folds
    eligible = result.slice_masks["all"]
    candidates = [m.key for m in result.methods if m.key != KEY]
    for choice in row.params["choices"]:
        train = eligible & (fold != choice["fold"])
        means = [float(result.per_turn[key]["ndcg@3"][train].mean()) for key in candidates]
        assert choice["method"] == candidates[means.index(max(means))]
        held_out = fold == choice["fold"]
        assert torch.equal(result.per_turn[KEY]["ndcg@3"][held_out],
                           result.per_turn[choice["method"]]["ndcg@3"][held_out])
    document = json.loads(to_json(result))
    assert document["primary"]["selected_on_data"] is False and document["primary"]["cross_fitted"] is True
    assert [c["method"] for c in document["primary"]["choices"]] == [c["method"] for c in row.params["choices"]]
    assert "cross-fitted, not chosen on the data it is scored on" in to_markdown(result)
    # a configured setting stays the headline (no selection row)
    configured = evaluate(inputs, _config(primary=result.split.setting, methods=("pointwise", "map-matched")))
    assert configured.primary.startswith("map-matched") and not configured.primary_selected_on_data
    assert KEY not in [m.key for m in configured.methods]


def test_repeated_fold_splits_report_mean_and_range(inputs):
    result = evaluate(inputs, _config(fold_repeats=3))
    repeats = result.repeats
    assert repeats["seeds"] == [0, 1, 2] and len(repeats["primary_choices"]) == 3
    # only the rankings that depend on the fold split
    assert list(repeats["methods"]) == ["gated (2-fold cross-fitted)", KEY]
    second = evaluate(inputs, _config(seed=1, n_bootstrap=0))
    for key, summary in repeats["methods"].items():
        for name, spread in summary["mean"].items():
            first = result.method(key).slices[name].means["ndcg@3"]
            assert spread.values[0] == first and spread.values[1] == second.method(key).slices[name].means["ndcg@3"]
            assert spread.low <= spread.mean <= spread.high and len(spread.values) == 3
            pointwise = result.method("pointwise").slices[name].means["ndcg@3"]
            assert summary["lift"][name].values[0] == pytest.approx(first - pointwise, abs=0)
    assert result.config["fold_repeats"] == 3
    # the first split is the plain evaluation (same bootstrap, same numbers)
    plain = evaluate(inputs, _config())
    assert result.method(KEY).slices["all"].interval == plain.method(KEY).slices["all"].interval
    document = to_json_dict(result)
    assert document["repeats"]["methods"][KEY]["lift"]["follow-up"]["min"] <= \
        document["repeats"]["methods"][KEY]["lift"]["follow-up"]["max"]
    assert "## Repeated cross-fitting (3 fold splits, seeds 0..2)" in to_markdown(result)
    assert to_json_dict(plain)["repeats"] is None
    with pytest.raises(MapMatchedValueError, match="fold_repeats must be an int >= 1"):
        evaluate(inputs, _config(fold_repeats=0))


def test_repeat_range_ignores_nan():
    assert RepeatRange.of([1.0, math.nan, 3.0])[:3] == (2.0, 1.0, 3.0)
    assert all(math.isnan(v) for v in RepeatRange.of([math.nan])[:3])
    runs = [{"pointwise": ({}, {"all": 0.5}), "x": ({"folds": 2}, {"all": 0.7}), "y": ({}, {"all": 0.9})},
            {"pointwise": ({}, {"all": 0.5}), "x": ({"folds": 2}, {"all": 0.6}), "y": ({}, {"all": 0.9})}]
    summary = repeat_summaries(runs)
    assert list(summary) == ["x"]
    assert summary["x"]["lift"]["all"].low == pytest.approx(0.1) and summary["x"]["lift"]["all"].high == pytest.approx(0.2)


def _quality_table_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_table.py"
    spec = importlib.util.spec_from_file_location("quality_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quality_table_reads_the_report_and_stands_beside_the_readme_table(inputs, tmp_path):
    from pathlib import Path

    table = _quality_table_module()
    report = to_json_dict(evaluate(inputs, _config(fold_repeats=2)))
    lines, headline = table._block(report, "hash", "synthetic")
    text = "\n".join(lines)
    assert f"| **{KEY}** |" in text and "| gated (2-fold cross-fitted) |" in text
    assert "selected_on_data: false" in text and headline["spread"] is not None
    summary = table._summary([headline])
    assert summary[2].startswith("| hash x synthetic |") and summary[2].endswith(("| yes |", "| no |"))
    # --readme replaces only the marked block
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{table.START}\nold\n{table.END}\nafter\n")
    table._readme(readme, "new\n")
    assert readme.read_text() == f"before\n{table.START}\nnew\n{table.END}\nafter\n"
    # the project's evaluation guide: the table's block starts with the command that produced it
    project = (Path(__file__).resolve().parents[2] / "docs" / "evaluation.md").read_text()
    block = project.split(table.START, 1)[1].split(table.END, 1)[0]
    assert block.lstrip().startswith("Produced by:") and "python benchmarks/quality_table.py --data" in block


def test_a_preferred_method_is_kept_unless_the_other_folds_show_it_worse_by_the_margin():
    from mapmatched_torch.eval.selection import paired_gap

    # six conversations, two turns each; folds {0, 1, 2} and {3, 4, 5}
    conversation = torch.arange(6).repeat_interleave(2)
    fold = torch.tensor([0, 0, 0, 1, 1, 1])
    eligible = torch.ones(12, dtype=torch.bool)
    noisy = _values(0.9, 0.7, 0.2, 0.4, 0.8, 0.6, 0.9, 0.7, 0.2, 0.4, 0.8, 0.6)
    per_turn = {"pointwise": {"ndcg@3": torch.full((12,), 0.5, dtype=torch.float64)},
                "best": {"ndcg@3": noisy + 0.05}, "liked": {"ndcg@3": noisy}}
    keys = ["pointwise", "best", "liked"]
    assert cross_fitted_selection(per_turn, keys, conversation, eligible, fold).choices == ("best", "best")
    # "liked" trails by a constant 0.05: zero spread, so any margin keeps the best
    assert cross_fitted_selection(per_turn, keys, conversation, eligible, fold, preferred=["liked"],
                                  margin=5.0).choices == ("best", "best")
    # a gap that varies by conversation: kept within its margin, not beyond it
    jitter = _values(0.1, 0.1, -0.1, -0.1, 0.15, 0.15, 0.1, 0.1, -0.1, -0.1, 0.15, 0.15)
    per_turn["liked"] = {"ndcg@3": noisy + 0.05 - jitter}
    rows = fold[conversation] != 0
    gap, spread = paired_gap(per_turn["best"]["ndcg@3"], per_turn["liked"]["ndcg@3"], conversation, rows)
    sums = torch.tensor([0.2, -0.2, 0.3], dtype=torch.float64)  # conversations 3, 4, 5: two turns each
    assert math.isclose(gap, 0.3 / 6) and math.isclose(spread, float((sums * 3 / 6).std()) / math.sqrt(3))
    assert cross_fitted_selection(per_turn, keys, conversation, eligible, fold, preferred=["liked"],
                                  margin=gap / spread * 1.01).choices == ("liked", "liked")
    chosen = cross_fitted_selection(per_turn, keys, conversation, eligible, fold, preferred=["gone", "liked"],
                                    margin=gap / spread * 0.99)
    assert chosen.choices == ("best", "best") and chosen.preferred == ("liked",)
    assert "within" in chosen.params("ndcg@3")["criterion"]
    with pytest.raises(MapMatchedValueError, match="margin"):
        cross_fitted_selection(per_turn, keys, conversation, eligible, fold, preferred=["liked"], margin=-1.0)


def test_the_selection_preference_and_margin_are_checked_and_reported():
    with pytest.raises(MapMatchedValueError, match="unknown methods"):
        EvalConfig(selection_preference=("nope",)).check()
    with pytest.raises(MapMatchedValueError, match="method names"):
        EvalConfig(selection_preference="mixed").check()
    with pytest.raises(MapMatchedValueError, match="selection_margin"):
        EvalConfig(selection_margin=math.inf).check()
    config = EvalConfig(selection_preference=("gated", "mixed"), selection_margin=0.5).check()
    assert config.to_dict()["selection_preference"] == ["gated", "mixed"]
    assert config.to_dict()["selection_margin"] == 0.5
