"""Trace building, JSON and rendering (docs/spec.md section 7)."""

from __future__ import annotations

import json

from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.core.trace import DETAIL_COLUMNS, STEP_KEYS, TRACE_COLUMNS
from mapmatched_torch.core.trace_build import classify_move
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph


def run_session(**kwargs):
    graph = InMemoryCorpusGraph.from_edges([("a", "b")], nodes=["far"], maximum_distance=4.0)
    session = MapMatchedRetriever(graph, score_normalization="none", **kwargs).session()
    session.retrieve_candidates([ScoredCandidate("a", 2.0), ScoredCandidate("b", 1.0)])
    session.retrieve_candidates([ScoredCandidate("a", 1.0)])
    session.retrieve_candidates([ScoredCandidate("b", 1.0), ScoredCandidate("x", 0.5)])
    return session.retrieve_candidates([ScoredCandidate("far", 9.0), ScoredCandidate("b", 0.0)])


def test_trace_steps_carry_diagnostics_runner_up_and_move():
    result = run_session()
    steps = result.trace.steps
    assert [s.chunk_id for s in steps] == ["a", "a", "b", "far"]
    assert [s.move for s in steps] == ["start", "stay", "drill", "jump"]
    assert [s.runner_up_chunk_id for s in steps] == ["b", None, "x", "b"]
    assert steps[0].normalized_emission_margin == 1.0
    assert steps[1].normalized_emission_margin == 0.0
    assert steps[1].emission_entropy == 0.0
    assert steps[3].graph_distance == 4.0
    assert result.trace.path_chunk_ids == ("a", "a", "b", "far")


def test_to_dict_and_json_round_trip_with_sorted_keys():
    trace = run_session(fixed_lag=1).trace
    data = trace.to_dict(extended=True)
    assert set(data) == {"steps", "path_chunk_ids", "revised_prior_indices", "fixed_lag", "committed_through_index"}
    assert data["steps"][3]["move"] == "jump"
    assert data["steps"][0]["runner_up_chunk_id"] == "b"
    text = trace.to_json()
    assert json.loads(text) == data  # the JSON keeps the detail keys
    plain = trace.to_dict()
    assert [list(step) for step in plain["steps"]] == [list(STEP_KEYS)] * 4
    assert plain["steps"] == [step.to_dict() for step in trace.steps]
    assert json.loads(trace.to_json(extended=False)) == plain
    keys = list(json.loads(text).keys())
    assert keys == sorted(keys)
    assert "\n" in trace.to_json(indent=2)


def test_render_has_the_header_and_table():
    text = run_session(fixed_lag=1).trace.render()
    lines = text.splitlines()
    assert lines[0] == "path: a -> a -> b -> far"
    assert lines[1] == "mode: fixed-lag 1"
    assert lines[2] == "revised prior turns: none"
    assert lines[3] == "committed through turn: 2"
    assert lines[5].split() == list(TRACE_COLUMNS)
    assert set(lines[6]) == {"-", " "}
    assert lines[-1].split()[1] == "far"
    assert len(lines) == 7 + 4
    detail = run_session(fixed_lag=1).trace.render(detail=True).splitlines()
    assert detail[:5] == lines[:5]
    assert detail[5].split() == list(TRACE_COLUMNS + DETAIL_COLUMNS)
    assert detail[-1].split()[-2:] == ["b", "jump"]
    assert len(detail) == 6 + 4
    full = run_session().trace.render().splitlines()
    assert full[1] == "mode: full"
    assert full[3] == "committed through turn: none"


def test_classify_move():
    assert classify_move(0, "a", None, 0.0, 10.0) == "start"
    assert classify_move(1, "a", "a", 0.0, 10.0) == "stay"
    assert classify_move(1, "b", "a", 10.0, 10.0) == "jump"
    assert classify_move(1, "b", "a", 9.5, 10.0) == "drill"
