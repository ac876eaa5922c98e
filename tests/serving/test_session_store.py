"""serving/session_store.py, codes.py, contexts.py: the tensor step equals independent
sessions field by field; failed rows change nothing; the store's bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch

from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.serving import MapMatchedServer, StepCode
from mapmatched_torch.serving.codes import ChunkCodes
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph
from mapmatched_torch.testing import turn_tensors

NODES = [f"n{i}" for i in range(12)]


def make_graph(seed=0):
    rng = random.Random(seed)
    edges = [(a, b, rng.choice([0.5, 1.0, 1.5, rng.uniform(0.2, 2.0)])) for a, b in zip(NODES, NODES[1:])]
    edges += [(rng.choice(NODES), rng.choice(NODES), 1.0) for _ in range(6)]
    return InMemoryCorpusGraph([e for e in edges if e[0] != e[1]], maximum_distance=4.0)


def random_turn(rng, width=5, extra=("ghost",)):
    chunks = rng.sample(NODES + list(extra), rng.randint(1, width))
    return [ScoredCandidate(c, rng.choice([rng.gauss(0, 1), 1.0, 0.0])) for c in chunks]


OPTIONS = [
    {},
    {"fixed_lag": 0},
    {"fixed_lag": 2, "transition_weight": 2.0},
    {"transition_weight": 0.0},
    {"emission_weight": 0.5, "score_normalization": "center", "context_limit": 4},
]


@pytest.mark.parametrize("tensor_graph", [False, True])
@pytest.mark.parametrize("options", OPTIONS)
def test_the_tensor_step_equals_independent_sessions_field_by_field(options, tensor_graph):
    rng = random.Random(len(str(options)) + tensor_graph)
    plain = make_graph()
    graph = TensorCorpusGraph.from_graph(plain) if tensor_graph else plain
    server = MapMatchedServer(graph, candidate_limit=5, capacity=2, **options)
    sessions = {}
    for step in range(10):
        if rng.random() < 0.4 or not sessions:
            key = f"s{len(sessions)}"
            server.open(key)
            sessions[key] = MapMatchedRetriever(graph, candidate_limit=5, **options).session()
        keys = [key for key in sessions if rng.random() < 0.8] or list(sessions)
        turns = [random_turn(rng) for _ in keys]
        codes, raw = turn_tensors(server, turns)
        out = server.step_slots(server.slots(keys), codes, raw)
        assert out.status.tolist() == [0] * len(keys)
        names = server.store.codes.names
        for row, (key, turn) in enumerate(zip(keys, turns)):
            expected = sessions[key].retrieve_candidates(turn)
            length = int(out.lengths[row])
            assert length == len(expected.path.steps)
            assert names([int(out.chunks[row])]) == [expected.chunk_id]
            assert names(out.path[row, :length].tolist()) == list(expected.path.chunk_ids)
            steps = expected.path.steps
            assert out.emissions[row, :length].tolist() == [s.weighted_emission_score for s in steps]
            assert out.transitions[row, :length].tolist() == [s.weighted_transition_cost for s in steps]
            assert out.distances[row, :length].tolist() == [s.graph_distance for s in steps]
            revised = out.revised[row].nonzero().view(-1).tolist()
            assert tuple(revised) == expected.trace.revised_prior_indices
            committed = expected.trace.committed_through_index
            assert int(out.committed_through[row]) == (-1 if committed is None else committed)
            context = [name for name in names(out.contexts[row].tolist()) if name is not None]
            assert tuple(context) == expected.context_chunk_ids
            finals = dict(zip([c.chunk_id for c in turn], out.final_scores[row, : len(turn)].tolist()))
            assert {c.chunk_id: c.trajectory_score for c in expected.candidate_ranking} == {
                chunk: score for chunk, score in finals.items() if score != float("-inf")
            }
            assert server.path(key) == expected.path and server.trace(key) == expected.trace


def test_failed_rows_report_their_code_and_change_nothing():
    graph = TensorCorpusGraph.from_graph(make_graph())
    server = MapMatchedServer(graph, candidate_limit=3)
    reference = MapMatchedServer(graph, candidate_limit=3)
    for target in (server, reference):
        for key in "abcdefghij":
            target.open(key)
    first = {key: [ScoredCandidate("n1", 1.0), ScoredCandidate("n2", 0.5)] for key in "abcdefghij"}
    server.step(first), reference.step(first)
    server.close("j")
    nan = float("nan")
    rows = {  # key (or slot) -> (codes, raw), expected code
        "a": ([1, 2, -1, -1], [1.0, 2.0, 0.0, 0.0], StepCode.OK),
        "b": ([1, 99, -1, -1], [1.0, 2.0, 0.0, 0.0], StepCode.OUT_OF_RANGE),
        "c": ([1, -1, 2, -1], [1.0, 0.0, 2.0, 0.0], StepCode.GAPPED),
        "d": ([1, 2, 3, 4], [1.0, 2.0, 3.0, nan], StepCode.NONFINITE_SCORE),  # past the cut, still checked
        "e": ([1, 2, 1, -1], [1.0, 2.0, 3.0, 0.0], StepCode.DUPLICATE),
        "f": ([-1, -1, -1, -1], [0.0, 0.0, 0.0, 0.0], StepCode.EMPTY),
        "g": ([1, 2, -1, -1], [1e308, 1e308, 0.0, 0.0], StepCode.NORMALIZATION_OVERFLOW),
        "h": ([3, -1, -1, -1], [1.0, 0.0, 0.0, 0.0], StepCode.REPEATED_SLOT),
        "i": ([3, -1, -1, -1], [1.0, 0.0, 0.0, 0.0], StepCode.OK),
    }
    keys = list(rows)
    slots = server.slots(keys)
    slots[keys.index("h")] = server.slot("i")  # h's row names i's slot: both rows are refused
    slots = torch.cat([slots, torch.tensor([77, -1])])  # never opened, and closed "j"'s slot -1
    codes = torch.tensor([rows[key][0] for key in keys] + [[1, -1, -1, -1]] * 2)
    raw = torch.tensor([rows[key][1] for key in keys] + [[1.0, 0.0, 0.0, 0.0]] * 2, dtype=torch.float64)
    out = server.step_slots(slots, codes, raw)
    expected = [rows[key][2] for key in keys]
    expected[keys.index("i")] = StepCode.REPEATED_SLOT
    assert [StepCode(code) for code in out.status.tolist()] == expected + [StepCode.UNKNOWN_SLOT] * 2
    assert (out.chunks[1:] == -1).all() and (out.path[1:] == -1).all()
    # every refused session is exactly as it was: its next turn equals the reference's
    after = {key: [ScoredCandidate("n3", 1.0), ScoredCandidate("n1", 0.0)] for key in "bcdefghi"}
    got, errors = server.step(after)
    want, _ = reference.step(after)
    assert not errors and {key: got[key] for key in after} == {key: want[key] for key in after}
    assert server.turn_count("a") == 2 and server.turn_count("b") == 2


def test_results_of_a_closed_session_stay_readable_after_its_slot_is_reused():
    graph = make_graph()
    server = MapMatchedServer(graph, candidate_limit=4, capacity=1)
    session = MapMatchedRetriever(graph, candidate_limit=4).session()
    server.open("old")
    turn = [ScoredCandidate("n1", 1.0), ScoredCandidate("n5", 0.2)]
    results, _ = server.step({"old": turn})
    expected = session.retrieve_candidates(turn)
    server.close("old")
    server.open("new")  # takes the same slot
    server.step({"new": [ScoredCandidate("n9", 1.0)]})
    assert results["old"] == expected and results.contexts()["old"] == expected.context_chunk_ids


def test_session_ids_must_be_restorable():
    server = MapMatchedServer(make_graph())
    for good in ("a", 3, 2.5, None, ("user", 7, ("x",))):
        server.open(good)
    for bad in (object(), frozenset({1}), ("a", object())):
        with pytest.raises(TypeError, match="session ID must be a str, an int .*torch.load.*; got "):
            server.open(bad)
    with pytest.raises(TypeError):
        server.open(["a"])
    state = server.state_dict()
    restored = MapMatchedServer(make_graph())
    restored.load_state_dict(state)
    assert set(restored.session_ids) == set(server.session_ids)


def test_chunk_codes_number_graph_nodes_first_and_others_after():
    graph = TensorCorpusGraph.from_graph(make_graph())
    codes = ChunkCodes(graph)
    assert codes.codes(["n3", "zz", "n0", "zz", "yy"]) == [graph.nodes.index("n3"), 12, graph.nodes.index("n0"), 12, 13]
    assert codes.names([12, -1, 13]) == ["zz", None, "yy"] and len(codes) == 14
    assert codes.graph_codes(torch.tensor([0, 11, 12, 13, -1])).tolist() == [0, 11, -2, -3, -1]
    again = ChunkCodes(graph)
    again.load_state_dict(codes.state_dict())
    assert again.codes(["yy"]) == [13]
    with pytest.raises(ValueError, match="node of this graph"):
        again.load_state_dict(["n1"])
    with pytest.raises(ValueError, match="twice"):
        again.load_state_dict(["a", "a"])
    plain = ChunkCodes(make_graph())  # a non-tensor graph: every ID is numbered in order of arrival
    assert plain.codes(["b", "a", "b"]) == [0, 1, 0]


def test_step_slots_checks_its_arguments():
    server = MapMatchedServer(make_graph())
    server.open("a")
    slots = server.slots(["a"])
    with pytest.raises(TypeError):
        server.step_slots(slots, [[1]], torch.ones(1, 1))
    with pytest.raises(ValueError, match="int64"):
        server.step_slots(slots, torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="one row per session"):
        server.step_slots(slots, torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1))
    assert server.turn_count("a") == 0


@pytest.mark.parametrize("columns", [3, 5, 8])
def test_the_one_pass_row_checks_equal_the_torch_checks(columns):
    """Unknown, closed, negative and repeated slots, codes out of range, gaps, non-finite
    scores inside and past the kept columns, duplicates inside and past them, empty rows."""
    from mapmatched_torch.kernels import fused_step
    from mapmatched_torch.kernels.numba_runtime import available
    from mapmatched_torch.serving.session_store import _CHECK_ORDER

    if not available():
        pytest.skip("numba is not installed")
    server = MapMatchedServer(make_graph(), candidate_limit=5, capacity=4)
    for name in "abcdefg":
        server.open(name)
    server.close("c")
    store = server.store
    store.codes.codes(NODES + ["ghost", "other ghost"])  # numbered as a step's candidates would be
    code_count = len(store.codes)
    assert code_count == len(NODES) + 2
    generator = torch.Generator().manual_seed(columns)
    for trial in range(200):
        rows = int(torch.randint(1, 9, (1,), generator=generator))
        slots = torch.randint(-2, store.decoder.capacity + 2, (rows,), generator=generator)
        codes = torch.randint(-1, code_count, (rows, columns), generator=generator)
        lengths = torch.randint(0, columns + 1, (rows,), generator=generator)
        codes[torch.arange(columns).unsqueeze(0) >= lengths.unsqueeze(1)] = -1
        raw = torch.randn(rows, columns, generator=generator, dtype=torch.float64)
        faults = torch.rand(rows, 5, generator=generator) < 0.15
        for row in range(rows):
            column = int(torch.randint(0, columns, (1,), generator=generator))
            if faults[row, 0]:
                codes[row, column] = code_count if trial % 2 else -3
            if faults[row, 1]:
                codes[row, column] = -1  # a gap where candidates follow
            if faults[row, 2]:
                raw[row, column] = float("nan") if trial % 2 else float("-inf")
            if faults[row, 3] and columns > 1:
                codes[row, 1] = codes[row, 0]
            if faults[row, 4]:
                codes[row] = -1
        got = fused_step.checked_rows(slots, store._live, codes, raw, code_count, store.width, _CHECK_ORDER)
        want = store._checked_rows(slots, codes, raw)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{m}: {slots}, {codes}, {raw}")


@pytest.mark.parametrize("tensor_graph", [False, True])
def test_name_rows_equal_the_names_of_each_row(tensor_graph):
    """Packed rows (codes, then -1s), -1s in between, empty rows, names added between
    calls (the object array grows) and restored codes."""
    graph = TensorCorpusGraph.from_graph(make_graph()) if tensor_graph else make_graph()
    codes = ChunkCodes(graph)
    assert codes.name_rows(torch.full((2, 3), -1)) == [(), ()]
    generator = torch.Generator().manual_seed(1)
    for round_ in range(4):
        codes.codes(NODES[round_ * 3:] + [f"ghost {round_} {i}" for i in range(round_ * 5)])
        table = torch.randint(-1, len(codes), (7, 6), generator=generator)
        table[0] = -1
        table[1, 3:] = -1
        table[2] = torch.sort(table[2], descending=True).values  # packed
        expected = [tuple(name for name in codes.names(row) if name is not None) for row in table.tolist()]
        assert codes.name_rows(table) == expected
        assert codes.name_rows(table[:, :0]) == [()] * 7
    restored = ChunkCodes(graph)
    if len(restored):  # names filled before the restore must not hide the restored ones
        restored.name_rows(torch.zeros(1, 1, dtype=torch.long))
    restored.load_state_dict(codes.state_dict())
    table = torch.arange(len(codes)).view(1, -1)
    assert restored.name_rows(table) == codes.name_rows(table) == [tuple(codes.names(range(len(codes))))]
    with pytest.raises(ValueError, match=r"\(S, C\)"):
        codes.name_rows(torch.zeros(3, dtype=torch.long))


def test_name_rows_beside_a_step_that_numbers_new_ids():
    """A reader's name_rows while a concurrent step appends a chunk ID between the
    reader's length read and its slice (simulated; found by fuzzing): no error, and
    the names it returns are right."""
    codes = ChunkCodes(make_graph())
    codes.codes(["x0", "x1"])

    class Interleaved(list):
        fired = False

        def __getitem__(self, index):
            if isinstance(index, slice) and not Interleaved.fired:
                Interleaved.fired = True
                codes.codes(["x-new"])  # what a step on another thread does
            return super().__getitem__(index)

    codes._extra_names = Interleaved(codes._extra_names)
    assert codes.name_rows(torch.tensor([[0, 1]])) == [("x0", "x1")]
    assert Interleaved.fired
    assert codes.name_rows(torch.tensor([[2, 0]])) == [("x-new", "x0")]


def _contexts_of_steps(server, plan):
    """Each planned step's context codes (one step of sessions s0, s1, s2 per plan entry)."""
    keys = ["s0", "s1", "s2"]
    for key in keys:
        server.open(key)
    found = []
    for turns in plan:
        codes, raw = turn_tensors(server, turns)
        found.append(server.step_slots(server.slots(keys), codes, raw).contexts.tolist())
    return found


@pytest.mark.parametrize("context_limit", [None, 3])
def test_precomputed_contexts_equal_contexts_searched_on_first_visit(context_limit, monkeypatch):
    rng = random.Random(7)
    graph = TensorCorpusGraph.from_graph(make_graph(3))
    plan = [[random_turn(rng) for _ in range(3)] for _ in range(6)]
    options = {"candidate_limit": 5, "context_radius": 1.5, "context_limit": context_limit}
    expected = _contexts_of_steps(MapMatchedServer(graph, **options), plan)
    server = MapMatchedServer(graph, **options)
    width = server.precompute_contexts()
    assert width == server.store.contexts.rows(torch.arange(len(NODES))).shape[1] > 0

    def searched(*args, **kwargs):
        raise AssertionError("a step searched a neighbourhood after precompute_contexts")

    monkeypatch.setattr(TensorCorpusGraph, "_ordered_balls", searched)  # what every neighbourhood search runs
    assert _contexts_of_steps(server, plan) == expected


def test_precomputed_contexts_survive_a_restored_state(monkeypatch):
    rng = random.Random(8)
    graph = TensorCorpusGraph.from_graph(make_graph(4))
    plan = [[random_turn(rng) for _ in range(3)] for _ in range(4)]
    server = MapMatchedServer(graph, candidate_limit=5)
    server.precompute_contexts()
    _contexts_of_steps(server, plan[:2])  # numbers the ghost chunk too
    state = server.state_dict()
    reference = MapMatchedServer(graph, candidate_limit=5)
    reference.load_state_dict(state)
    turns = plan[2]
    codes, raw = turn_tensors(reference, turns)
    expected = reference.step_slots(reference.slots(["s0", "s1", "s2"]), codes, raw).contexts.tolist()

    def searched(*args, **kwargs):
        raise AssertionError("a restored server searched a neighbourhood it had precomputed")

    server.load_state_dict(state)
    monkeypatch.setattr(TensorCorpusGraph, "_ordered_balls", searched)  # what every neighbourhood search runs
    codes, raw = turn_tensors(server, turns)
    assert server.step_slots(server.slots(["s0", "s1", "s2"]), codes, raw).contexts.tolist() == expected


def test_precompute_contexts_refuses_what_it_cannot_keep():
    plain = make_graph()
    for chunk_ids in (["n0"], None):  # the real reason first, not "pass chunk_ids"
        server = MapMatchedServer(plain)
        with pytest.raises(ValueError, match="never kept|asked every step"):
            server.precompute_contexts(chunk_ids)
        assert len(server.store.codes) == 0  # nothing numbered
    server = MapMatchedServer(TensorCorpusGraph.from_graph(plain))
    with pytest.raises(ValueError, match="sequence of chunk IDs"):
        server.precompute_contexts("n0")
    with pytest.raises(ValueError, match="non-empty"):
        server.precompute_contexts(["n0", ""])
    with pytest.raises(ValueError, match="chunk codes in"):
        server.store.contexts.precompute(torch.tensor([len(server.store.codes)]))
    # chunk IDs the graph does not know get a code and an empty neighbourhood
    assert server.precompute_contexts(["n1", "ghost"]) >= 1
    assert server.store.contexts.rows(torch.tensor(server.store.codes.codes(["ghost"]))).eq(-1).all()


def test_a_turn_capacity_set_ahead_is_never_grown_nor_shrunk_below():
    graph = InMemoryCorpusGraph([("a", "b"), ("b", "c")])
    server = MapMatchedServer(graph, candidate_limit=2, turn_capacity=16)
    decoder = server.store.decoder
    server.open("long"), server.open("short")
    turn = [ScoredCandidate("a", 1.0), ScoredCandidate("b", 0.0)]
    for _ in range(16):
        server.step({"long": turn})
    assert decoder.turn_capacity == 16  # 16 turns fit: no growth
    for _ in range(60):
        server.step({"long": turn})
    assert decoder.turn_capacity == 128
    server.step({"short": turn})
    server.close("long")
    assert decoder.turn_capacity == 16  # back to the initial capacity, not below
    with pytest.raises(ValueError, match="turn_capacity"):
        MapMatchedServer(graph, turn_capacity=0)


def test_a_precompute_racing_result_reads_in_another_thread_keeps_every_row():
    """A fill that grew or widened the table replaced it while another thread wrote a
    row into the old one: that row was lost but marked filled, so every later step's
    contexts for its chunk were wrong. Found by a reviewer; 5 of 10 trials failed."""
    import threading

    rng = random.Random(0)
    nodes = [f"c{i}" for i in range(1500)]
    edges = [(nodes[i], nodes[i + 1], 1.0) for i in range(len(nodes) - 1)]
    edges += [(rng.choice(nodes), rng.choice(nodes), rng.uniform(0.2, 2.0)) for _ in range(4 * len(nodes))]
    graph = TensorCorpusGraph.from_graph(InMemoryCorpusGraph([e for e in edges if e[0] != e[1]], maximum_distance=3.0))
    reference = MapMatchedServer(graph, context_radius=1.5)
    reference.precompute_contexts()
    expected = reference.store.contexts.rows(torch.arange(len(nodes)))
    for trial in range(6):
        server = MapMatchedServer(graph, context_radius=1.5)
        table = server.store.contexts
        order = list(range(len(nodes)))
        rng.shuffle(order)
        failures = []

        def reader():
            try:
                for start in range(0, len(order), 7):
                    table.rows(torch.tensor(order[start: start + 7]))
            except Exception as error:  # pragma: no cover - reported below
                failures.append(error)

        thread = threading.Thread(target=reader)
        thread.start()
        server.precompute_contexts(batch_size=64)
        thread.join()
        assert not failures
        got = table.rows(torch.arange(len(nodes)))
        assert got.shape == expected.shape and torch.equal(got, expected), f"trial {trial}"


def test_a_restored_table_keeps_this_servers_turn_capacity():
    """load_state_dict took the saved table's turn capacity: a server built with
    turn_capacity=16 given a state saved with 8 doubled in a live step, and one saved
    with 3 loaded into 64 could never shrink back (96 turns). Found by a reviewer."""
    graph = InMemoryCorpusGraph([("a", "b"), ("b", "c")])
    turn = [ScoredCandidate("a", 1.0), ScoredCandidate("b", 0.0)]
    small = MapMatchedServer(graph, candidate_limit=2)
    small.open("x")
    small.step({"x": turn})
    server = MapMatchedServer(graph, candidate_limit=2, turn_capacity=16)
    server.load_state_dict(small.state_dict())
    decoder = server.store.decoder
    assert decoder.turn_capacity == 16
    for _ in range(15):
        server.step({"x": turn})
    assert decoder.turn_capacity == 16 and server.turn_count("x") == 16
    odd = MapMatchedServer(graph, candidate_limit=2, turn_capacity=3)
    odd.open("long"), odd.open("short")
    for _ in range(40):  # 3 -> 6 -> ... -> 48
        odd.step({"long": turn})
    odd.step({"short": turn})
    restored = MapMatchedServer(graph, candidate_limit=2, turn_capacity=64)
    restored.load_state_dict(odd.state_dict())
    assert restored.store.decoder.turn_capacity == 64
    assert restored.path("long") == odd.path("long")
    for _ in range(30):  # past 64 turns: 128
        restored.step({"long": turn})
        odd.step({"long": turn})
    assert restored.store.decoder.turn_capacity == 128 and restored.path("long") == odd.path("long")
    restored.close("long")
    assert restored.store.decoder.turn_capacity == 64  # back to its own initial capacity
    again = restored.step({"short": turn})[0]["short"]
    assert again == odd.step({"short": turn})[0]["short"]
