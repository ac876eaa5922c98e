"""Reports: strict JSON with sorted keys, the markdown tables, PNG plots."""

from __future__ import annotations

import json
import math

import pytest

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.plots import plot_beta_sweep, plot_split, write_plots
from mapmatched_torch.eval.report import sanitize, to_json, to_json_dict, to_markdown, write_json, write_markdown
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
