"""Reports: strict JSON with sorted keys, the markdown tables, PNG plots."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.bootstrap import BootstrapResult, verdict
from mapmatched_torch.eval.plots import plot_beta_sweep, plot_split, write_plots
from mapmatched_torch.eval.report import (
    judge,
    report_warnings,
    sanitize,
    to_json,
    to_json_dict,
    to_markdown,
    write_json,
    write_markdown,
)
from mapmatched_torch.eval.runner import EvalConfig, evaluate, inputs_from_synthetic
from mapmatched_torch.eval.synthetic import make_synthetic

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result():
    inputs = inputs_from_synthetic(make_synthetic(n_conversations=16, turns=4, candidates=6, seed=2, topics=12,
                                                  passages_per_topic=5))
    config = EvalConfig(methods=("pointwise", "map-matched", "history-concatenation", "maximal-marginal-relevance",
                                 "resolved-query-oracle", "geodesic"),
                        betas=(0.0, 0.5, 1.0), lags=(None, 1), n_bootstrap=30, progress=False)
    return evaluate(inputs, config)


def _reject_constant(name):
    raise AssertionError(f"non-standard JSON constant {name}")


def test_json_is_strict_sorted_and_complete(result, tmp_path):
    text = to_json(result)
    data = json.loads(text, parse_constant=_reject_constant)
    assert text == json.dumps(data, sort_keys=True, allow_nan=False, indent=2)  # keys sorted at every level
    assert [m["key"] for m in data["methods"]] == [m.key for m in result.methods]
    pointwise = data["methods"][0]
    assert pointwise["verdict"] is None and pointwise["slices"]["all"]["lift"] is None
    assert set(pointwise["slices"]) == {"all", "follow-up", "standalone", "topic-switch", "same-topic"}
    assert data["entropy_threshold"]["value"] == result.threshold
    assert data["skipped"]["resolved-query-oracle"]
    assert data["split"]["conversation_id"] == result.split.conversation_id
    path = write_json(result, tmp_path / "out" / "report.json")
    assert json.loads(path.read_text()) == data


def test_nan_becomes_null():
    assert sanitize({"a": math.nan, "b": [math.inf, 1.5], "c": (True, None)}) == {"a": None, "b": [None, 1.5],
                                                                                  "c": [True, None]}
    with pytest.raises(MapMatchedValueError):
        sanitize(object())


def test_empty_slice_is_null_in_json(result):
    data = to_json_dict(result)
    assert json.dumps(data, allow_nan=False)  # would raise on NaN
    # every interval field is a number or null, never NaN
    for method in data["methods"]:
        for piece in method["slices"].values():
            assert all(v is None or isinstance(v, (int, float, str)) for v in piece["interval"].values())


def test_markdown_tables(result, tmp_path):
    text = to_markdown(result)
    assert text.startswith("# Map-matched retrieval evaluation: synthetic")
    assert "## nDCG@3 by slice" in text and "## Verdict" in text
    assert "| method | all | follow-up | standalone | topic switch | same topic | verdict |" in text
    assert "| method | nDCG@3 | lift | MRR | Recall@10 | n |" in text
    for method in result.methods:
        assert f"| {method.key} |" in text
    assert "Maximal Marginal Relevance" in text and "MMR" not in text
    assert f"> {result.threshold:.3f} nats" in text
    assert "Skipped: resolved-query-oracle" in text
    primary = result.method(result.primary).verdict
    assert f"**Verdict** for {result.primary}" in text and primary.reason in text  # also when it fails
    assert write_markdown(result, tmp_path / "r.md").read_text() == text


def test_plots_are_written(result, tmp_path):
    paths = write_plots(result, tmp_path / "plots")
    assert [p.name for p in paths] == ["ndcg_vs_beta.png", "emission_transition_split.png"]
    for path in paths:
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000
    assert plot_split(result.split, tmp_path / "one.png").exists()


def test_beta_sweep_needs_a_positive_beta(tmp_path):
    inputs = inputs_from_synthetic(make_synthetic(n_conversations=4, turns=3, candidates=4, seed=1, topics=6,
                                                  passages_per_topic=4))
    flat = evaluate(inputs, EvalConfig(methods=("pointwise", "map-matched"), betas=(0.0,), n_bootstrap=5,
                                       progress=False))
    assert flat.split is None
    assert write_plots(flat, tmp_path) == []
    with pytest.raises(MapMatchedValueError, match="beta > 0"):
        plot_beta_sweep(flat, tmp_path / "x.png")


# --------------------------------------------------------------------------- judging the verdicts


def _lift(mean, low, high, n=20):
    return BootstrapResult(mean, low, high, n, 5 * n, 0.95, 100, "turn", 0)


def _judged_method(result, followup, standalone):
    method = result.method(result.primary)
    slices = dict(method.slices)
    slices["follow-up"] = replace(slices["follow-up"], lift=followup)
    slices["standalone"] = replace(slices["standalone"], lift=standalone)
    return replace(method, slices=slices, verdict=verdict(followup, standalone, 0.01))


def test_judge_passes_fails_and_refuses_a_zero_width_pass(result):
    flat = _lift(0.0, -0.004, 0.003)
    assert judge(_judged_method(result, _lift(0.05, 0.02, 0.08), flat)).status == "PASS"
    assert judge(_judged_method(result, _lift(0.01, -0.02, 0.04), flat)).status == "FAIL"
    zero_width = judge(_judged_method(result, _lift(0.05, 0.05, 0.05), flat))
    assert zero_width.status == "UNJUDGED" and "zero-width" in zero_width.reason
    one = judge(_judged_method(result, _lift(0.05, 0.05, 0.05, n=1), _lift(0.0, 0.0, 0.0, n=1)))
    assert one.status == "UNJUDGED"
    assert "the follow-up and standalone slices have labelled turns in only 1 conversation" in one.reason
    nan = math.nan
    empty = judge(_judged_method(result, BootstrapResult(nan, nan, nan, 0, 0, 0.95, 100, "turn", 0), flat))
    assert empty.status == "UNJUDGED" and "the follow-up slice is empty" in empty.reason


def test_bootstrap_0_is_unjudged_not_fail():
    inputs = inputs_from_synthetic(make_synthetic(n_conversations=8, turns=3, candidates=4, seed=1, topics=6,
                                                  passages_per_topic=4))
    flat = evaluate(inputs, EvalConfig(methods=("pointwise", "map-matched"), betas=(0.0, 0.5), n_bootstrap=0,
                                       progress=False))
    judged = judge(flat.method("map-matched lambda=1 beta=0.5 full"))
    assert judged.status == "UNJUDGED" and judged.reason.startswith("UNJUDGED: no intervals (--bootstrap 0);")
    assert report_warnings(flat) == list(flat.warnings)  # asked for: no warning of its own
    text = to_markdown(flat)
    headline = judge(flat.method(flat.primary))  # the verdict line is the headline's
    assert headline.status == "UNJUDGED"
    assert "FAIL" not in text and "beyond tolerance" not in text and f"{headline.reason}." in text


def test_baselines_and_statuses_in_json_and_markdown(result):
    data = to_json_dict(result)
    statuses = {m["key"]: m["status"] for m in data["methods"]}
    assert statuses["pointwise"] == statuses["map-matched lambda=1 beta=0 full"] == "baseline"
    assert data["methods"][1]["verdict"] is None  # beta = 0: no verdict, like pointwise
    assert set(statuses.values()) <= {"baseline", "PASS", "FAIL", "UNJUDGED"}
    for method in data["methods"]:
        if method["verdict"] is not None:
            assert method["verdict"]["status"] == method["status"]
            assert method["verdict"]["passed"] == (method["status"] == "PASS")
    assert "| map-matched lambda=1 beta=0 full |" in to_markdown(result)


def test_warnings_are_recorded_in_json_and_markdown(result):
    noisy = replace(result, warnings=("the follow-up slice is empty (no labelled turn): ...",))
    assert to_json_dict(noisy)["warnings"][0].startswith("the follow-up slice is empty")
    assert "## Warnings\n\n- the follow-up slice is empty" in to_markdown(noisy)
    assert "## Warnings" not in to_markdown(replace(result, warnings=()))
