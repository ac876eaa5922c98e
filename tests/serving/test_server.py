"""MapMatchedServer == independent sessions; isolation of bad requests; persistence."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedTypeError
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.providers.dense import DenseProvider
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.retrieval.torch_decoder import TorchDecoder
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph
from mapmatched_torch.testing import turn_tensors

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
        contexts = results.contexts()
        for key, candidates in stepping.items():
            expected = reference[key].retrieve_candidates(candidates)
            assert contexts[key] == expected.context_chunk_ids and results.chunk_id(key) == expected.chunk_id
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
    assert all(isinstance(error, ValueError) for key, error in errors.items() if key != "e")
    assert isinstance(errors["e"], RuntimeError)  # SPEC section 6: no provider is a RuntimeError
    assert str(errors["a"]) == "candidate set must not be empty (turn 1)"  # mapmatched 0.1.0's text first
    assert "finite" in str(errors["b"])
    assert str(errors["c"]).startswith("candidate chunk_ids must be unique within a turn")
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
        from test_server import make_graph
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
    with pytest.raises(ValueError, match="other options: candidate_limit"):
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


# ------------------------------------------------------------------ step_indexed


def indexed_turns(rng, graph, sessions, width=5):
    """Random rows of node indices (-1 padding after a random count) and scores, and the
    same turns as (chunk_id, score) pairs."""
    rows, scores, pairs = [], [], {}
    for key in sessions:
        nodes = rng.sample(range(len(graph)), rng.randint(1, width))
        values = [rng.choice([rng.gauss(0, 1), 1.0, 0.0, -2.5]) for _ in nodes]
        rows.append(nodes + [-1] * (width - len(nodes)))
        scores.append(values + [rng.choice([0.0, math.nan])] * (width - len(nodes)))  # padding scores are ignored
        pairs[key] = [(graph.nodes[node], value) for node, value in zip(nodes, values)]
    shape = (len(rows), width)
    return torch.tensor(rows, dtype=torch.long).view(shape), torch.tensor(scores, dtype=torch.float64).view(shape), pairs


@pytest.mark.parametrize("options", OPTIONS + [{"score_normalization": "center", "fixed_lag": 2}])
@pytest.mark.parametrize("dense", [False, True])
def test_step_indexed_equals_step_and_independent_sessions(options, dense):
    from mapmatched_torch.graph import TensorCorpusGraph

    rng = random.Random(7 + len(str(options)))
    standalone = make_graph(2)
    graph = TensorCorpusGraph.from_graph(standalone)
    if dense:
        graph.precompute_dense()
    indexed = MapMatchedServer(graph, candidate_limit=5, capacity=2, **options)
    plain = MapMatchedServer(graph, candidate_limit=5, **options)
    reference = {}
    for _ in range(10):
        if rng.random() < 0.3 or not reference:
            key = f"s{len(reference)}"
            indexed.open(key)
            plain.open(key)
            reference[key] = MapMatchedRetriever(standalone, candidate_limit=5, **options).session()
        stepping = [key for key in reference if rng.random() < 0.8]
        candidates, scores, pairs = indexed_turns(rng, graph, stepping)
        results, errors = indexed.step_indexed(stepping, candidates, scores)
        expected_plain, plain_errors = plain.step(pairs)
        assert errors == {} == plain_errors and list(results) == stepping
        for key in stepping:
            assert results.chunk_id(key) == expected_plain.chunk_id(key)
            expected = reference[key].retrieve_candidates(pairs[key])
            assert results[key] == expected == expected_plain[key]
            assert indexed.path(key) == expected.path and indexed.trace(key) == expected.trace


def test_step_indexed_isolates_bad_rows_and_leaves_them_unchanged():
    from mapmatched_torch.graph import TensorCorpusGraph

    graph = TensorCorpusGraph.from_graph(make_graph())
    options = {"candidate_limit": 3, "score_normalization": "none", "emission_weight": 4.0}
    server = MapMatchedServer(graph, **options)
    keys = list("abcdefghij")
    reference = {key: MapMatchedRetriever(graph, **options).session() for key in keys}
    for key in keys:
        server.open(key)
    first = torch.tensor([[0, 1, -1]] * len(keys))
    server.step_indexed(keys, first, torch.ones(len(keys), 3))
    for session in reference.values():
        session.retrieve_candidates([(graph.nodes[0], 1.0), (graph.nodes[1], 1.0)])
    n = len(graph)
    rows = {
        "a": ([-1, -1, -1], [0.0, 0.0, 0.0], "^candidate set must not be empty \\(turn 1\\)$"),
        "b": ([2, n, -1], [1.0, 1.0, 0.0], "must be -1 \\(padding\\) or in"),
        "c": ([2, -2, -1], [1.0, 1.0, 0.0], "must be -1 \\(padding\\) or in"),
        "d": ([-1, 2, 3], [0.0, 1.0, 1.0], "padding \\(-1\\) must come after"),
        "e": ([4, 4, -1], [1.0, 2.0, 0.0], "^candidate chunk_ids must be unique within a turn: turn 1 contains"),
        "f": ([4, 5, -1], [math.nan, 2.0, 0.0], "raw_score must be finite"),
        "g": ([4, 5, -1], [1.0, math.inf, 0.0], "raw_score must be finite"),
        "h": ([4, 5, -1], [1e308, 1.0, 0.0], "nonfinite score"),  # 4 * 1e308 overflows in the decoder
        "i": ([6, 7, 8], [1.0, 0.5, 0.25], None),
        "j": ([3, 6, -1], [0.1, 0.2, 0.0], None),
    }
    ids = list(rows) + ["zzz", "j"]
    candidates = torch.tensor([rows[key][0] for key in rows] + [[1, -1, -1], [1, -1, -1]])
    scores = torch.tensor([rows[key][1] for key in rows] + [[1.0, 0, 0], [1.0, 0, 0]], dtype=torch.float64)
    results, errors = server.step_indexed(ids, candidates, scores)
    assert list(results) == ["i"]
    assert set(errors) == set("abcdefghj") | {"zzz"}
    assert "unknown session" in str(errors["zzz"]) and "more than once" in str(errors["j"])
    for key, (_, _, message) in rows.items():
        if message is not None:
            with pytest.raises(ValueError, match=message):
                raise errors[key]
        expected_turns = 2 if key == "i" else 1
        assert server.turn_count(key) == expected_turns, key
    assert results["i"] == reference["i"].retrieve_candidates([(graph.nodes[v], s) for v, s in zip([6, 7, 8], [1.0, 0.5, 0.25])])
    # the failed rows' sessions continue exactly as their sessions do
    follow = torch.tensor([[3, 5, -1]] * 9)
    results, errors = server.step_indexed(list("abcdefghj"), follow, torch.tensor([[0.5, 0.25, 0.0]] * 9))
    assert not errors
    for key in "abcdefghj":
        assert results[key] == reference[key].retrieve_candidates([(graph.nodes[3], 0.5), (graph.nodes[5], 0.25)])


def test_step_indexed_refuses_malformed_calls_without_changing_anything():
    from mapmatched_torch.graph import TensorCorpusGraph

    graph = TensorCorpusGraph.from_graph(make_graph())
    server = MapMatchedServer(graph, candidate_limit=3)
    server.open("a")
    good = torch.tensor([[0, 1, -1]])
    scores = torch.ones(1, 3)
    for args, message in [
        (("a", good, scores), "sequence of session IDs"),
        ((["a"], good.tolist(), scores), "two \\(S, K\\) tensors"),
        ((["a"], good.int(), scores), "int64"),
        ((["a"], good, torch.ones(1, 2)), "of its shape"),
        ((["a"], good, torch.ones(1, 3, dtype=torch.long)), "must be floating"),
        ((["a", "a"], good, scores), "one row per session"),
    ]:
        with pytest.raises(ValueError, match=message):
            server.step_indexed(*args)
    assert server.turn_count("a") == 0
    with pytest.raises(ValueError, match="needs a tensor corpus graph"):
        MapMatchedServer(make_graph()).step_indexed(["a"], good, scores)
    # as in a session, candidates past candidate_limit are checked before the cut
    results, errors = server.step_indexed(["a"], torch.tensor([[2, 3, 4, 5]]), torch.tensor([[0.5, 0.25, 1.0, math.nan]]))
    assert "raw_score must be finite" in str(errors["a"]) and server.turn_count("a") == 0
    with pytest.raises(ValueError, match="raw score|finite"):
        MapMatchedRetriever(graph, candidate_limit=3).session().retrieve_candidates(
            [(graph.nodes[i], s) for i, s in zip((2, 3, 4, 5), (0.5, 0.25, 1.0, math.nan))])
    # a repeated index past the limit is cut first, as in a session
    results, errors = server.step_indexed(["a"], torch.tensor([[2, 3, 4, 2]]), torch.ones(1, 4))
    assert not errors and server.turn_count("a") == 1
    server.close("a"), server.open("a")
    # float32 scores are widened exactly; columns past candidate_limit are cut
    results, errors = server.step_indexed(["a"], torch.tensor([[2, 3, 4, 5]]), torch.tensor([[0.5, 0.25, 1.0, 9.0]]))
    assert not errors and [c.chunk_id for c in results["a"].candidates] == [graph.nodes[i] for i in (2, 3, 4)]


def test_mixed_object_and_indexed_turns_and_unknown_ids():
    # a session fed objects (with IDs the graph lacks) then tensors takes the chunk-ID path
    from mapmatched_torch.graph import TensorCorpusGraph

    standalone = make_graph(5)
    graph = TensorCorpusGraph.from_graph(standalone)
    server = MapMatchedServer(graph, candidate_limit=4, fixed_lag=1)
    session = MapMatchedRetriever(standalone, candidate_limit=4, fixed_lag=1).session()
    server.open("x")
    rng = random.Random(3)
    for turn in range(6):
        if turn % 2:
            candidates, scores, pairs = indexed_turns(rng, graph, ["x"], width=4)
            results, errors = server.step_indexed(["x"], candidates, scores)
            pairs = pairs["x"]
        else:
            pairs = [(c.chunk_id, c.score) for c in random_turn(rng, width=4)]  # may hold "ghost"
            results, errors = server.step({"x": pairs})
        assert not errors
        assert results["x"] == session.retrieve_candidates(pairs)


def test_contexts_and_built_results_search_each_chunk_once_on_a_tensor_graph(monkeypatch):
    # a tensor graph's neighbourhoods come as node-index rows into the context table, and
    # built results read their neighbourhoods from it: no chunk-ID search, no second one
    from mapmatched_torch.graph import TensorCorpusGraph

    standalone = make_graph(6)
    graph = TensorCorpusGraph.from_graph(standalone)
    calls = {"indices": 0, "ids": 0}
    indices, ids = graph.neighborhood_indices, graph.neighborhoods

    def counted_indices(*args, **kwargs):
        calls["indices"] += 1
        return indices(*args, **kwargs)

    def counted_ids(*args, **kwargs):
        calls["ids"] += 1
        return ids(*args, **kwargs)

    monkeypatch.setattr(graph, "neighborhood_indices", counted_indices)
    monkeypatch.setattr(graph, "neighborhoods", counted_ids)
    server = MapMatchedServer(graph, candidate_limit=5, context_radius=2.0)
    sessions = {key: MapMatchedRetriever(standalone, candidate_limit=5, context_radius=2.0).session() for key in "ab"}
    for key in sessions:
        server.open(key)
    rng = random.Random(5)
    candidates, scores, pairs = indexed_turns(rng, graph, list(sessions), width=5)
    results, errors = server.step_indexed(list(sessions), candidates, scores)
    assert not errors
    built = results.materialize()
    assert calls == {"indices": 1, "ids": 0}
    assert results.contexts() == {key: built[key].context_chunk_ids for key in sessions}
    assert calls == {"indices": 1, "ids": 0}  # the contexts read the rows the results filled
    for key in sessions:
        assert built[key] == sessions[key].retrieve_candidates(pairs[key])


def test_results_are_built_when_read():
    from mapmatched_torch.graph import TensorCorpusGraph

    graph = TensorCorpusGraph.from_graph(make_graph())
    server = MapMatchedServer(graph, candidate_limit=3)
    for key in "ab":
        server.open(key)
    results, _ = server.step_indexed(["a", "b"], torch.tensor([[0, 1, -1], [2, 3, 4]]), torch.rand(2, 3))
    assert repr(results) == "StepResults(2 sessions, 0 built)"
    chunk_ids = results.chunk_ids()
    contexts = results.contexts()
    assert results.context_chunk_ids("b") == contexts["b"] and list(contexts) == ["a", "b"]
    assert repr(results) == "StepResults(2 sessions, 0 built)" and len(results) == 2 and "a" in results
    assert {key: results[key].context_chunk_ids for key in "ab"} == contexts
    results = server.step_indexed(["a", "b"], torch.tensor([[0, 1, -1], [2, 3, 4]]), torch.rand(2, 3))[0]
    chunk_ids = results.chunk_ids()
    assert repr(results) == "StepResults(2 sessions, 0 built)"
    assert results["a"].chunk_id == chunk_ids["a"] and repr(results) == "StepResults(2 sessions, 1 built)"
    assert results["a"] is results["a"]
    built = results.materialize()
    assert built == dict(results.items()) and results == built and built["b"].chunk_id == chunk_ids["b"]
    # a later step does not change what an earlier step's results read
    server.step_indexed(["a"], torch.tensor([[5, 6, -1]]), torch.rand(1, 3))
    assert results["b"].path.chunk_ids[-1] == chunk_ids["b"] and len(results["b"].path.steps) == 2
    assert len(server.path("a").steps) == 3 and len(server.path("b").steps) == 2


def test_state_dict_round_trip_after_indexed_turns():
    from mapmatched_torch.graph import TensorCorpusGraph

    graph = TensorCorpusGraph.from_graph(make_graph(6))
    rng = random.Random(4)
    turns = [indexed_turns(rng, graph, ["a", "b"], width=4) for _ in range(6)]
    build = lambda: MapMatchedServer(graph, candidate_limit=4, fixed_lag=2)  # noqa: E731
    uninterrupted, interrupted = build(), build()
    for server in (uninterrupted, interrupted):
        server.open("a"), server.open("b")
    expected = [uninterrupted.step_indexed(["a", "b"], c, s)[0].materialize() for c, s, _ in turns]
    for c, s, _ in turns[:3]:
        interrupted.step_indexed(["a", "b"], c, s)
    restored = build()
    restored.load_state_dict(interrupted.state_dict())
    assert restored.path("a") == interrupted.path("a") and restored.trace("b") == interrupted.trace("b")
    for (c, s, _), want in zip(turns[3:], expected[3:]):
        results, errors = restored.step_indexed(["a", "b"], c, s)
        assert not errors and results.materialize() == want


def test_step_indexed_reports_an_overflowing_normalization_alone():
    from mapmatched_torch.graph import TensorCorpusGraph

    graph = TensorCorpusGraph.from_graph(make_graph())
    server = MapMatchedServer(graph, candidate_limit=2)  # z-scores: the exact sum of 1e308 + 1e308 overflows
    server.open("a"), server.open("b")
    results, errors = server.step_indexed(
        ["a", "b"], torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1e308, 1e308], [1.0, 2.0]], dtype=torch.float64)
    )
    # the error an independent session raises for these scores
    assert list(results) == ["b"] and "scores too large to normalize" in str(errors["a"])
    assert server.turn_count("a") == 0 and server.turn_count("b") == 1


@pytest.mark.parametrize("normalization", ["none", "center"])
def test_a_turn_whose_trace_overflows_fails_alone_as_in_a_session(normalization):
    # 1e308 and -1e308 decode, but their trace margin (or entropy) overflows: a session
    # refuses the turn, so the server must too, and leave the session as it was
    graph = make_graph()
    options = dict(candidate_limit=5, score_normalization=normalization, fixed_lag=1)
    server = MapMatchedServer(graph, **options)
    sessions = {key: MapMatchedRetriever(graph, **options).session() for key in "ab"}
    for key in sessions:
        server.open(key)
    turns = [
        {"a": [("n1", 1.0), ("n2", 0.5)], "b": [("n3", 1.0)]},
        {"a": [("n1", 1e308), ("n2", -1e308)], "b": [("n4", 2.0), ("n5", 1.0)]},
        {"a": [("n2", 1.0), ("n3", 0.25)], "b": [("n1", 1e300), ("n2", -1e300)]},
        {"a": [("n4", 1.0)], "b": [("n6", 0.5), ("n7", 1.5)]},
    ]
    for turn in turns:
        results, errors = server.step(turn)
        for key, candidates in turn.items():
            try:
                expected = sessions[key].retrieve_candidates(candidates)
            except ValueError as error:
                assert str(errors[key]) == str(error) and key not in results
            else:
                assert key not in errors and results[key] == expected
            assert server.turn_count(key) == sessions[key].turn_count
    assert server.path("a") == sessions["a"].path and server.trace("b") == sessions["b"].trace
    torch.save(server.state_dict(), __import__("io").BytesIO())  # the state stays savable


def test_state_dict_is_a_copy_and_loaded_servers_are_independent():
    graph = make_graph()
    turns = [[("n1", 1.0), ("n4", 0.0)], [("n4", 2.0), ("n2", 0.0)], [("n3", 1.0), ("n1", 0.5)]]
    server = MapMatchedServer(graph, candidate_limit=2)
    server.open("x")
    server.step({"x": turns[0]})
    snapshot = server.state_dict()
    server.step({"x": turns[1]})  # must not change the snapshot
    first, second = MapMatchedServer(graph, candidate_limit=2), MapMatchedServer(graph, candidate_limit=2)
    first.load_state_dict(snapshot)
    second.load_state_dict(snapshot)
    session = MapMatchedRetriever(graph, candidate_limit=2).session()
    session.retrieve_candidates(turns[0])
    expected = session.retrieve_candidates(turns[1])
    assert first.step({"x": turns[1]})[0]["x"] == expected
    assert second.step({"x": turns[1]})[0]["x"] == expected  # not disturbed by the first


def test_a_batched_provider_that_answers_too_few_queries_falls_back_to_single_queries():
    class Short:
        def retrieve(self, query, limit):
            return [("n1", 1.0), (query, 0.5)]

        def retrieve_batch(self, queries, limit):
            return [self.retrieve(query, limit) for query in queries[:-1]]  # one answer short

    server = MapMatchedServer(make_graph(), provider=Short(), candidate_limit=3)
    server.open("a"), server.open("b")
    results, errors = server.step({"a": "n2", "b": "n3"})
    assert not errors and [c.chunk_id for c in results["b"].candidates] == ["n1", "n3"]


def test_scores_whose_exact_sum_overflows_are_a_value_error_everywhere():
    # SPEC section 8: a ValueError (it used to escape as a bare OverflowError)
    graph = make_graph()
    session = MapMatchedRetriever(graph, candidate_limit=3).session()
    with pytest.raises(ValueError, match="exact sum overflows"):
        session.retrieve_candidates([("n1", 1e308), ("n2", 1e308)])
    assert session.turn_count == 0
    server = MapMatchedServer(graph, candidate_limit=3)
    server.open("a")
    _, errors = server.step({"a": [("n1", 1e308), ("n2", 1e308)]})
    assert isinstance(errors["a"], ValueError) and server.turn_count("a") == 0


def adversarial_request(rng, width=5):
    """A request a session may accept or refuse: clean turns, unknown IDs, duplicates,
    NaN or huge scores, empty lists, bad entries, repeated IDs past the cut."""
    kind = rng.random()
    turn = [(c.chunk_id, c.score) for c in random_turn(rng, width)]
    if kind < 0.5:
        return turn
    if kind < 0.58:
        return turn + [turn[0]]  # a repeat: past the cut when the turn is full
    if kind < 0.64:
        return [turn[0], turn[0]]
    if kind < 0.7:
        return turn[:-1] + [(turn[-1][0], math.nan)]
    if kind < 0.76:
        return [(turn[0][0], 1e308), ("n11", -1e308)] + turn[1:]  # exact sum fine, z-score overflows
    if kind < 0.78:
        return [(turn[0][0], 1e308), ("n11", 1e308)]  # exact sum overflows
    if kind < 0.8:
        return [("n9", 1.7e308), ("n10", -1.7e308), ("n11", -1.7e308)]  # r - mean overflows
    if kind < 0.84:
        return []
    if kind < 0.88:
        return turn + [("", 1.0)]  # an invalid chunk ID, checked before the cut
    if kind < 0.92:
        return [("n1", 1.0), 7]
    return [(c, rng.choice([1.0, 2.0, 0.0])) for c in rng.sample(NODES, min(width, 3))]


@pytest.mark.parametrize("tensor_graph", [False, True])
@pytest.mark.parametrize("options", [{}, {"fixed_lag": 1, "score_normalization": "center"},
                                     {"score_normalization": "none", "emission_weight": 3.0}])
def test_step_answers_and_refuses_exactly_as_independent_sessions(tensor_graph, options):
    # every request, good or bad, gets what an independent session gives: the same result,
    # or an error of the same type and message (the batched normalization re-runs a bad
    # turn through the session's functions); batches mix node-only rows (node-index path)
    # with rows holding unknown IDs (chunk-ID path)
    from mapmatched_torch.graph import TensorCorpusGraph

    rng = random.Random(11 + len(str(options)) + tensor_graph)
    standalone = make_graph(3)
    graph = TensorCorpusGraph.from_graph(standalone) if tensor_graph else standalone
    server = MapMatchedServer(graph, candidate_limit=4, capacity=2, **options)
    sessions = {}
    for _ in range(25):
        if rng.random() < 0.3 or len(sessions) < 3:
            key = f"s{len(sessions)}"
            server.open(key)
            sessions[key] = MapMatchedRetriever(standalone, candidate_limit=4, **options).session()
        requests = {key: adversarial_request(rng) for key in sessions if rng.random() < 0.85}
        if rng.random() < 0.5:  # node-only batches take the node-index path on a tensor graph
            requests = {key: [pair for pair in request if not isinstance(pair, tuple) or pair[0] != "ghost"]
                        for key, request in requests.items()}
        results, errors = server.step(requests)
        assert set(results) | set(errors) == set(requests) and not set(results) & set(errors)
        for key, request in requests.items():
            try:
                expected = sessions[key].retrieve_candidates(request)
            except Exception as error:  # noqa: BLE001 - the session's refusal is the expectation
                assert type(errors[key]) is type(error) and str(errors[key]) == str(error), key
            else:
                assert results[key] == expected, key
            assert server.turn_count(key) == sessions[key].turn_count


@pytest.mark.parametrize("options", [{"fixed_lag": 1}, {}, {"fixed_lag": 2, "emission_weight": 0.3}])
def test_results_read_in_any_pattern_equal_sessions(options):
    # a result reuses the previous step's path and trace only when that step's result was
    # built; reading every step, some steps, only paths, or late must all give what a
    # session gives (turns revised by later evidence included)
    rng = random.Random(21 + len(str(options)))
    graph = make_graph(4)
    server = MapMatchedServer(graph, candidate_limit=5, **options)
    sessions = {}
    for key in "abcd":
        server.open(key)
        sessions[key] = MapMatchedRetriever(graph, candidate_limit=5, **options).session()
    held = []
    for _ in range(14):
        turns = {key: random_turn(rng) for key in sessions if rng.random() < 0.8}
        results, errors = server.step(turns)
        assert not errors
        expected = {key: sessions[key].retrieve_candidates(turn) for key, turn in turns.items()}
        for key in turns:
            pattern = rng.random()
            if pattern < 0.4:
                assert results[key] == expected[key]
            elif pattern < 0.6:
                assert server.path(key) == expected[key].path and server.trace(key) == expected[key].trace
            elif pattern < 0.7:
                held.append((results, key, expected[key]))  # read after later steps
    for results, key, expected in held:
        assert results[key] == expected


def test_served_turns_are_sequences_of_candidates_built_when_read():
    from mapmatched_torch.core.models import DecoderCandidate
    from mapmatched_torch.serving.step_results import ServedTurn

    turn = ServedTurn((1.0, 2.0), (-1.0, 1.0), nodes=(2, 0), names=("x", "y", "z"))
    expected = (DecoderCandidate("z", 1.0, -1.0), DecoderCandidate("x", 2.0, 1.0))
    assert len(turn) == 2 and turn[1] == expected[1] and tuple(turn) == expected == turn.candidates
    assert turn.candidates is not turn.candidates  # built anew: a served session keeps no candidate objects
    assert turn.chunk_ids == ("z", "x") and ServedTurn.from_candidates(expected).candidates == expected
    assert turn[-1] == expected[-1] and turn[0:1] == expected[0:1] and turn[::-1] == expected[::-1]
    with pytest.raises(IndexError):
        turn[2]


def test_a_duck_typed_tensor_graph_without_a_vocabulary_serves_by_chunk_id():
    # a proxy exposing CorpusGraph + index_trellis/trellis_distances but no vocabulary
    # (what consecutive_distances accepts) takes the chunk-ID path, as before
    from mapmatched_torch.graph import TensorCorpusGraph

    standalone = make_graph(6)
    inner = TensorCorpusGraph.from_graph(standalone)

    class Proxy:
        maximum_distance = inner.maximum_distance

        def distance(self, a, b):
            return inner.distance(a, b)

        def neighborhood(self, chunk_id, radius):
            return inner.neighborhood(chunk_id, radius)

        def index_trellis(self, conversations):
            return inner.index_trellis(conversations)

        def trellis_distances(self, chunk_index, **options):
            return inner.trellis_distances(chunk_index, **options)

    server = MapMatchedServer(Proxy(), candidate_limit=4, fixed_lag=1)
    server.open("x")
    session = MapMatchedRetriever(standalone, candidate_limit=4, fixed_lag=1).session()
    rng = random.Random(8)
    for _ in range(5):
        turn = random_turn(rng, width=4)
        results, errors = server.step({"x": turn})
        assert not errors and results["x"] == session.retrieve_candidates(turn)
    restored = MapMatchedServer(Proxy(), candidate_limit=4, fixed_lag=1)
    restored.load_state_dict(server.state_dict())
    turn = random_turn(rng, width=4)
    assert restored.step({"x": turn})[0]["x"] == session.retrieve_candidates(turn)


@pytest.mark.parametrize("dense", [False, True])
def test_a_server_on_the_device_equals_sessions(device, dense):
    # the graph (cache or dense table) and the decoder state on the device (CUDA when
    # present), candidates as device tensors and as objects; the CPU run is the same test
    from mapmatched_torch.graph import TensorCorpusGraph

    rng = random.Random(31)
    standalone = make_graph(7)
    graph = TensorCorpusGraph.from_graph(standalone, device=device)
    if dense:
        graph.precompute_dense()
    options = {"candidate_limit": 5, "fixed_lag": 1}
    server = MapMatchedServer(graph, device=device, **options)
    keys = ["a", "b", "c"]
    sessions = {key: MapMatchedRetriever(standalone, **options).session() for key in keys}
    for key in keys:
        server.open(key)
    for tick in range(6):
        candidates, scores, pairs = indexed_turns(rng, graph, keys)
        if tick % 2:
            results, errors = server.step({key: pairs[key] for key in keys})
        else:
            results, errors = server.step_indexed(keys, candidates.to(device), scores.to(device))
        assert not errors
        for key in keys:
            assert results[key] == sessions[key].retrieve_candidates(pairs[key])
    restored = MapMatchedServer(graph, device=device, **options)
    restored.load_state_dict(server.state_dict())
    candidates, scores, pairs = indexed_turns(rng, graph, keys)
    results, errors = restored.step_indexed(keys, candidates.to(device), scores.to(device))
    assert not errors and all(results[key] == sessions[key].retrieve_candidates(pairs[key]) for key in keys)


# ------------------------------------------------- state files: crafted, torn, atomic (issue 14)


def _stepped_server():
    rng = random.Random(21)
    server = MapMatchedServer(make_graph(5), candidate_limit=5, fixed_lag=1)
    for key in ("a", "b", "c"):
        server.open(key)
    for _ in range(3):
        server.step({key: random_turn(rng) for key in ("a", "b", "c")})
    server.close("b")
    return server


def _resealed_decoder(state):
    from mapmatched_torch.kernels.slot_persistence import _checksum

    state["store"]["decoder"]["checksum"] = _checksum(state["store"]["decoder"])
    return state


@pytest.mark.parametrize(
    "edit",
    ["live slot in the free list", "allocated zero", "shared slot", "orphan slot", "malformed session", "bad slot type"],
)
def test_a_crafted_server_state_is_refused_and_the_server_is_untouched(edit):
    state = _stepped_server().state_dict()
    sessions = state["sessions"]
    if edit == "live slot in the free list":
        state["store"]["decoder"]["free"].append(sessions[0][1])
        _resealed_decoder(state)
    elif edit == "allocated zero":
        state["store"]["decoder"]["allocated"], state["store"]["decoder"]["free"] = 0, []
        _resealed_decoder(state)
    elif edit == "shared slot":
        sessions[1][1] = sessions[0][1]
    elif edit == "orphan slot":  # a live slot that no session holds
        sessions.pop(0)
    elif edit == "malformed session":
        sessions[0] = sessions[0][:1]
    else:
        sessions[0][1] = "0"
    target = _stepped_server()
    target.open("z")
    before = target.state_dict()
    with pytest.raises(ValueError, match="refusing the server state|slot"):
        target.load_state_dict(state)
    after = target.state_dict()
    assert after["store"]["decoder"]["checksum"] == before["store"]["decoder"]["checksum"]
    assert [entry[0] for entry in after["sessions"]] == [entry[0] for entry in before["sessions"]]


def test_save_is_atomic_and_a_torn_file_is_refused(tmp_path):
    server = _stepped_server()
    path = tmp_path / "server.pt"
    server.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["server.pt"]  # no temporary left behind
    data = path.read_bytes()
    restored = MapMatchedServer(make_graph(5), candidate_limit=5, fixed_lag=1)
    restored.load(path)
    assert restored.session_ids == server.session_ids
    for cut in (len(data) // 3, len(data) - 7):
        (tmp_path / "torn.pt").write_bytes(data[:cut])
        target = _stepped_server()
        with pytest.raises(ValueError, match="torn.pt"):
            target.load(tmp_path / "torn.pt")
        assert target.state_dict()["store"]["decoder"]["checksum"] == server.state_dict()["store"]["decoder"]["checksum"]


# ------------------------------------------------ interrupted steps and threads (issue 14)


class _Interrupt(BaseException):
    """Stands for KeyboardInterrupt / an out-of-memory error in the middle of a step."""


@pytest.mark.parametrize("fixed_lag", [None, 1])
@pytest.mark.parametrize("fail_at", [0, 2])
def test_an_interrupted_step_leaves_every_session_as_it_was(monkeypatch, fixed_lag, fail_at):
    import mapmatched_torch.serving.server as server_module

    rng = random.Random(31 + fail_at)
    turns = [{key: random_turn(rng) for key in ("a", "b", "c")} for _ in range(6)]
    build = lambda: MapMatchedServer(make_graph(2), candidate_limit=5, fixed_lag=fixed_lag)  # noqa: E731
    reference, interrupted = build(), build()
    for server in (reference, interrupted):
        for key in ("a", "b", "c"):
            server.open(key)
    expected = [reference.step(turn)[0] for turn in turns]
    for turn in turns[:3]:
        interrupted.step(turn)
    before = interrupted.state_dict()

    def failing(*args, **kwargs):  # after the tensor step: making the results, or building the large ones
        raise _Interrupt()

    if fail_at == 0:
        monkeypatch.setattr(server_module, "StepResults", failing)
    else:
        monkeypatch.setattr(server_module.MapMatchedServer, "_refuse_overflowing_traces", failing)
    with pytest.raises(_Interrupt):
        interrupted.step(turns[3])
    monkeypatch.undo()
    after = interrupted.state_dict()
    assert after["store"]["decoder"]["checksum"] == before["store"]["decoder"]["checksum"]
    assert after["sessions"] == before["sessions"]
    for turn, step in zip(turns[3:], expected[3:]):
        results, errors = interrupted.step(turn)
        assert not errors and {key: results[key] for key in turn} == {key: step[key] for key in turn}


#: Places inside the tensor step where an interrupt can land: (module, attribute, the
#: call that raises), from the decoder's writes to the contexts after them.
_INSIDE_THE_STEP = [
    ("mapmatched_torch.kernels.slot_decoder", "_exchange", 3),  # half-way through the writes
    ("mapmatched_torch.kernels.fused_step", "backtrack_slots", 1),  # after every write
    ("mapmatched_torch.kernels.slot_decoder.SlotDecoder", "put_rows", 2),  # the store's own writes
    ("mapmatched_torch.serving.session_store.SessionStore", "_fields", 1),
    ("mapmatched_torch.serving.session_store", "context_codes", 1),
]


@pytest.mark.parametrize("fixed_lag", [None, 1])
@pytest.mark.parametrize("target", _INSIDE_THE_STEP, ids=lambda target: target[1])
def test_an_interrupt_inside_the_tensor_step_leaves_every_session_as_it_was(monkeypatch, fixed_lag, target):
    import importlib

    path, name, failing_call = target
    module_path, _, owner = path.rpartition(".") if path.endswith(("SlotDecoder", "SessionStore")) else (path, "", "")
    holder = getattr(importlib.import_module(module_path), owner) if owner else importlib.import_module(path)
    rng = random.Random(41)
    turns = [[random_turn(rng) for _ in "abc"] for _ in range(6)]
    build = lambda: MapMatchedServer(make_graph(3), candidate_limit=5, fixed_lag=fixed_lag)  # noqa: E731
    reference, interrupted = build(), build()
    tensors = []
    for server in (reference, interrupted):
        for key in "abc":
            server.open(key)
        tensors.append([turn_tensors(server, turn) for turn in turns])
    slots = interrupted.slots(list("abc"))
    expected = [reference.step_slots(slots, codes, raw) for codes, raw in tensors[0]]
    for codes, raw in tensors[1][:3]:
        interrupted.step_slots(slots, codes, raw)
    before = interrupted.state_dict()
    original, calls = getattr(holder, name), []

    def failing(*args, **kwargs):
        calls.append(None)
        if len(calls) == failing_call:
            raise _Interrupt()
        return original(*args, **kwargs)

    monkeypatch.setattr(holder, name, failing)
    with pytest.raises(_Interrupt):
        interrupted.step_slots(slots, *tensors[1][3])
    monkeypatch.undo()
    assert calls, "the interrupt was never reached"
    after = interrupted.state_dict()
    assert after["store"]["decoder"]["checksum"] == before["store"]["decoder"]["checksum"]
    for (codes, raw), step in zip(tensors[1][3:], expected[3:]):
        again = interrupted.step_slots(slots, codes, raw)
        for got, want in zip(again, step):
            assert torch.equal(got, want)


def test_an_interrupted_streaming_turn_leaves_the_session_as_it_was(monkeypatch):
    import mapmatched_torch.retrieval.streaming as streaming_module

    rng = random.Random(8)
    graph = make_graph(1)
    options = {"fixed_lag": 1, "candidate_limit": 5}
    streamed = MapMatchedRetriever(graph, decoder=TorchDecoder(), **options).session()
    plain = MapMatchedRetriever(graph, **options).session()
    original = streaming_module.report_step
    for turn in range(6):
        candidates = random_turn(rng)
        if turn in (2, 4):
            def failing(*args, **kwargs):
                raise _Interrupt()

            monkeypatch.setattr(streaming_module, "report_step", failing)
            with pytest.raises(_Interrupt):
                streamed.retrieve_candidates(candidates)
            monkeypatch.setattr(streaming_module, "report_step", original)
            assert streamed.turn_count == turn
        assert streamed.retrieve_candidates(candidates) == plain.retrieve_candidates(candidates)


def test_threads_stepping_disjoint_and_shared_sessions_are_serialized():
    import threading

    from mapmatched_torch.graph import TensorCorpusGraph

    graph = make_graph(6)
    tensor_graph = TensorCorpusGraph.from_graph(graph)
    server = MapMatchedServer(tensor_graph, candidate_limit=5, fixed_lag=1)
    plans = {}
    for worker in range(4):
        rng = random.Random(100 + worker)
        plans[worker] = [random_turn(rng) for _ in range(8)]
        server.open(f"w{worker}")
    server.open("shared")
    failures = []

    def work(worker):
        try:
            rng = random.Random(worker)
            for candidates in plans[worker]:
                results, errors = server.step({f"w{worker}": candidates})
                assert not errors
                results, errors = server.step({"shared": random_turn(rng)})
                assert not errors
        except BaseException as error:  # reported below
            failures.append(error)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for worker in range(4):
        session = MapMatchedRetriever(graph, candidate_limit=5, fixed_lag=1).session()
        for candidates in plans[worker]:
            expected = session.retrieve_candidates(candidates)
        assert server.path(f"w{worker}") == expected.path
    assert server.turn_count("shared") == 32 and len(server.path("shared").chunk_ids) == 32


def test_a_server_whose_long_session_closed_loads_its_own_state():
    """Closing a long session shrinks the turn capacity; the freed slot kept its old
    length, so the server's own state was refused ("lengths outside [0, turn
    capacity]"). Found by fuzzing."""
    graph = InMemoryCorpusGraph([("a", "b"), ("b", "c")])
    server = MapMatchedServer(graph, candidate_limit=2)
    server.open("long"), server.open("short")
    for _ in range(9):  # the turn capacity grows from 8 to 16
        server.step({"long": [ScoredCandidate("a", 1.0), ScoredCandidate("b", 0.0)]})
    server.step({"short": [ScoredCandidate("c", 1.0)]})
    server.close("long")  # and shrinks back to 8
    assert server.store.decoder.turn_capacity == 8
    state = server.state_dict()
    restored = MapMatchedServer(graph, candidate_limit=2)
    restored.load_state_dict(state)
    server.load_state_dict(state)
    turn = {"short": [ScoredCandidate("b", 0.5), ScoredCandidate("c", 0.2)]}
    assert restored.step(turn)[0]["short"] == server.step(turn)[0]["short"]
    server.open("new")
    assert server.turn_count("new") == 0


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError("DefaultCPUAllocator: not enough memory: you tried "
                                                                  "to allocate 1099511627776 bytes.")])
def test_running_out_of_memory_while_loading_is_a_resource_failure_not_a_damaged_file(tmp_path, monkeypatch, failure):
    from mapmatched_torch import MapMatchedResourceError

    server = _stepped_server()
    path = tmp_path / "server.pt"
    server.save(path)
    target = _stepped_server()
    before = target.state_dict()["store"]["decoder"]["checksum"]

    def load(*args, **kwargs):
        raise failure

    monkeypatch.setattr(torch, "load", load)
    with pytest.raises(MapMatchedResourceError, match="out of memory .*server.pt.*a resource failure, not a damaged") \
            as caught:
        target.load(path)
    assert isinstance(caught.value, MemoryError) and caught.value.__cause__ is failure
    assert "torn" not in str(caught.value)
    assert target.state_dict()["store"]["decoder"]["checksum"] == before


def test_running_out_of_memory_while_restoring_sessions_is_a_resource_failure():
    from mapmatched_torch import MapMatchedResourceError

    class Starved(dict):
        def __getitem__(self, key):
            if key == "sessions":
                raise MemoryError
            return super().__getitem__(key)

    state = Starved(_stepped_server().state_dict())
    with pytest.raises(MapMatchedResourceError, match="not a malformed state"):
        _stepped_server().load_state_dict(state)


def test_session_id_errors_say_what_is_accepted_and_numpy_integers_are_ints():
    import uuid

    import numpy as np

    server = MapMatchedServer(make_graph(5), candidate_limit=5)
    given = uuid.UUID(int=7)
    with pytest.raises(MapMatchedTypeError) as caught:
        server.open(given)
    message = str(caught.value)
    assert "hashable" not in message  # a UUID is hashable: that was never the problem
    assert message.startswith("a session ID must be a str, an int (numpy integers are taken as ints), a float, None, "
                              "or a tuple of them") and "; got UUID UUID('00000000-0000-0000-0000-000000000007')" in message
    with pytest.raises(MapMatchedTypeError, match=r"; got UUID .* inside tuple \('user', UUID"):
        server.open(("user", given))
    assert server.open(np.int64(3)) == 0
    assert server.session_ids == (3,) and type(server.session_ids[0]) is int
    with pytest.raises(ValueError, match="session 3 is already open"):
        server.open(3)
    assert server.open(("user", np.int32(4))) == 1 and ("user", 4) in server
    results, errors = server.step({np.int64(3): [ScoredCandidate("n1", 1.0)]})
    assert not errors and server.turn_count(3) == 1 and results[3].chunk_id == "n1"
    restored = MapMatchedServer(make_graph(5), candidate_limit=5)
    restored.load_state_dict(server.state_dict())  # the IDs were kept as ints, so the state is restorable
    assert restored.session_ids == (3, ("user", 4))
