"""MapMatchedServer == independent sessions; isolation of bad requests; persistence."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from mapmatched_torch.decoder import TorchDecoder
from mapmatched_torch.models import ScoredCandidate
from mapmatched_torch.providers.dense import DenseProvider
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

NODES = [f"n{i}" for i in range(12)]


def make_graph(seed=0):
    rng = random.Random(seed)
    edges = [(a, b, rng.choice([0.5, 1.0, 1.5, rng.uniform(0.2, 2.0)])) for a, b in zip(NODES, NODES[1:])]
    edges += [(rng.choice(NODES), rng.choice(NODES), 1.0) for _ in range(6)]
    edges = [e for e in edges if e[0] != e[1]]
    return InMemoryCorpusGraph(edges, maximum_distance=4.0)


def random_turn(rng, width=5):
    chunks = rng.sample(NODES + ["ghost"], rng.randint(1, width))
    return [ScoredCandidate(c, rng.choice([rng.gauss(0, 1), 1.0, 0.0])) for c in chunks]


OPTIONS = [
    {},
    {"fixed_lag": 0},
    {"fixed_lag": 1},
    {"fixed_lag": 3, "transition_weight": 2.0},
    {"transition_weight": 0.0},
    {"transition_weight": 0.0, "fixed_lag": 0},
    {"emission_weight": 0.5, "score_normalization": "none", "context_limit": 3},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_server_equals_independent_sessions(options):
    rng = random.Random(len(str(options)))
    graph = make_graph()
    server = MapMatchedServer(graph, candidate_limit=5, capacity=2, **options)
    reference = {}
    for _ in range(12):
        if rng.random() < 0.3 or not reference:
            session_id = f"s{len(reference)}"
            server.open(session_id)
            reference[session_id] = MapMatchedRetriever(graph, candidate_limit=5, **options).session()
        stepping = {key: random_turn(rng) for key in reference if rng.random() < 0.8}
        results, errors = server.step(stepping)
        assert errors == {}
        for key, candidates in stepping.items():
            expected = reference[key].retrieve_candidates(candidates)
            assert results[key] == expected
            assert server.path(key) == expected.path


def test_torch_decoder_sessions_stream_and_roll_back():
    rng = random.Random(5)
    graph = make_graph(1)
    options = {"fixed_lag": 1, "candidate_limit": 5, "score_normalization": "none", "emission_weight": 4.0}
    streamed = MapMatchedRetriever(graph, decoder=TorchDecoder(), **options).session()
    plain = MapMatchedRetriever(graph, **options).session()
    assert streamed._stream is not None
    for turn in range(8):
        candidates = random_turn(rng)
        if turn == 4:
            with pytest.raises(ValueError, match="nonfinite"):
                streamed.retrieve_candidates([("n1", 1e308), ("n2", 1.0)])
        assert streamed.retrieve_candidates(candidates) == plain.retrieve_candidates(candidates)


def test_bad_requests_fail_alone_and_leave_state_unchanged():
    graph = make_graph()
    options = {"candidate_limit": 5, "score_normalization": "none", "emission_weight": 4.0}
    server = MapMatchedServer(graph, **options)
    reference = {key: MapMatchedRetriever(graph, **options).session() for key in "abcdef"}
    for key in reference:
        server.open(key)
    first = {key: [ScoredCandidate("n1", 1.0), ScoredCandidate("n3", 0.5)] for key in reference}
    server.step(first)
    for key, candidates in first.items():
        reference[key].retrieve_candidates(candidates)
    bad = {
        "a": [],
        "b": [("n1", math.nan)],
        "c": [("n1", 1.0), ("n1", 2.0)],
        "d": [("n1", 1e308), ("n2", 1.0)],  # 4 * 1e308 overflows
        "e": "a query without a provider",
        "zzz": [("n1", 1.0)],
        "f": [("n2", 1.0), ("n4", 0.0)],
    }
    results, errors = server.step(bad)
    assert set(results) == {"f"}
    assert set(errors) == {"a", "b", "c", "d", "e", "zzz"}
    assert all(isinstance(error, ValueError) for error in errors.values())
    assert "must contain candidates" in str(errors["a"])
    assert "finite" in str(errors["b"])
    assert "duplicate chunk IDs" in str(errors["c"])
    assert "nonfinite score" in str(errors["d"])
    assert "CandidateProvider" in str(errors["e"])
    assert "unknown session" in str(errors["zzz"])
    assert results["f"] == reference["f"].retrieve_candidates(bad["f"])
    follow_up = {key: [("n3", 1.0), ("n5", 0.2)] for key in "abcd"}
    results, errors = server.step(follow_up)
    assert not errors
    for key, candidates in follow_up.items():
        assert server.turn_count(key) == 2
        assert results[key] == reference[key].retrieve_candidates(candidates)


def test_open_close_and_slot_reuse():
    server = MapMatchedServer(make_graph(), candidate_limit=5, capacity=1)
    server.open("x")
    with pytest.raises(ValueError, match="already open"):
        server.open("x")
    server.step({"x": [("n1", 1.0)]})
    server.close("x")
    with pytest.raises(ValueError, match="unknown session"):
        server.close("x")
    server.open("y")
    results, _ = server.step({"y": [("n2", 1.0)]})
    assert results["y"].path.chunk_ids == ("n2",)
    assert len(server) == 1 and "y" in server and server.session_ids == ("y",)


def test_queries_through_a_batched_provider():
    generator = torch.Generator().manual_seed(0)
    embeddings = torch.randn(len(NODES), 8, generator=generator)
    queries = {f"q{i}": torch.randn(8, generator=generator) for i in range(6)}
    provider = DenseProvider(embeddings, NODES, queries.__getitem__, metric="cosine")
    graph = make_graph()
    server = MapMatchedServer(graph, provider=provider, candidate_limit=4)
    sessions = {key: MapMatchedRetriever(graph, provider=provider, candidate_limit=4).session() for key in "ab"}
    for key in sessions:
        server.open(key)
    for turn in range(3):
        asked = {"a": f"q{turn}", "b": f"q{turn + 3}"}
        results, errors = server.step(asked)
        assert not errors
        for key, query in asked.items():
            assert results[key] == sessions[key].retrieve(query)


def test_state_dict_round_trip_in_a_new_process(tmp_path):
    rng = random.Random(9)
    graph_seed = 3
    turns = [{key: random_turn(rng) for key in ("a", "b", "c") if rng.random() < 0.9} for _ in range(6)]
    build = lambda: MapMatchedServer(make_graph(graph_seed), candidate_limit=5, fixed_lag=1)  # noqa: E731
    uninterrupted, interrupted = build(), build()
    for server in (uninterrupted, interrupted):
        for key in ("a", "b", "c"):
            server.open(key)
    expected = [uninterrupted.step(turn)[0] for turn in turns]
    for turn in turns[:3]:
        interrupted.step(turn)
    path = tmp_path / "server.pt"
    torch.save(interrupted.state_dict(), path)
    payload = tmp_path / "turns.pt"
    torch.save([{k: [(c.chunk_id, c.score) for c in v] for k, v in turn.items()} for turn in turns[3:]], payload)
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_serving import make_graph
        from mapmatched_torch.serving import MapMatchedServer
        server = MapMatchedServer(make_graph({graph_seed}), candidate_limit=5, fixed_lag=1)
        server.load_state_dict(torch.load({str(path)!r}, weights_only=True))
        out = []
        for turn in torch.load({str(payload)!r}, weights_only=True):
            results, errors = server.step(turn)
            assert not errors, errors
            out.append({{k: r.trace.to_json() for k, r in results.items()}})
        print(repr(out))
        """
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    restored = eval(completed.stdout.strip())
    assert restored == [{k: r.trace.to_json() for k, r in step.items()} for step in expected[3:]]


def test_state_dict_refuses_other_options():
    state = MapMatchedServer(make_graph(), candidate_limit=5).state_dict()
    with pytest.raises(ValueError, match="does not match"):
        MapMatchedServer(make_graph(), candidate_limit=6).load_state_dict(state)


@pytest.mark.parametrize("fixed_lag, context_radius", [(None, 1.0), (2, 1.0), (None, 2.5), (2, 0.0)])
def test_server_on_a_tensor_graph_equals_sessions_on_the_standalone_graph(fixed_lag, context_radius):
    # the server asks the tensor graph for all sessions' context neighbourhoods at once
    from mapmatched_torch.graph import TensorCorpusGraph

    rng = random.Random(11)
    graph = make_graph(4)
    tensor_graph = TensorCorpusGraph.from_graph(graph)
    options = dict(candidate_limit=5, fixed_lag=fixed_lag, context_radius=context_radius)
    server = MapMatchedServer(tensor_graph, **options)
    sessions = {key: MapMatchedRetriever(graph, **options).session() for key in "abc"}
    for key in sessions:
        server.open(key)
    for _ in range(6):
        turns = {key: random_turn(rng) for key in sessions}
        results, errors = server.step(turns)
        assert not errors
        for key, candidates in turns.items():
            assert results[key] == sessions[key].retrieve_candidates(candidates)
