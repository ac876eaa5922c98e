"""Seeded random stress test of MapMatchedServer's tensor session store (issue 14).

One server is driven with random operations (open, close, reopen into a reused slot,
``step`` / ``step_indexed`` / ``step_slots`` mixed on the same server, reads of old
results, ``path`` / ``trace`` / ``turn_count``, a ``state_dict`` round trip through
``torch.save`` / ``torch.load(weights_only=True)`` into a fresh server; random initial
turn capacities and precomputed contexts), and beside it
one independent :class:`MapMatchedSession` per open session: the oracle. Every
success must equal the session's result exactly, and every failure must fail in the
session too, with the same exception type and message, leaving both unchanged.
"""

from __future__ import annotations

import io
import itertools
import math
import random

import pytest
import torch

from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.serving.session_store import StepCode
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

NODES = [f"n{i}" for i in range(12)]
GHOSTS = ["ghost-a", "ghost-b", "ghost-c"]  # chunk IDs that are not in the graph
LIMIT = 4  # candidate_limit
SPECIAL = [math.nan, math.inf, -math.inf, 1e308, -1e308, 1e300, 1e200, 5e-324]


def make_graph(seed):
    rng = random.Random(seed)
    edges = [(a, b, rng.choice([0.5, 1.0, 1.5, rng.uniform(0.2, 2.0)])) for a, b in itertools.pairwise(NODES)]
    edges += [(rng.choice(NODES), rng.choice(NODES), 1.0) for _ in range(6)]
    return InMemoryCorpusGraph([edge for edge in edges if edge[0] != edge[1]], maximum_distance=4.0)


def random_turn(rng, pool, opposite=True):
    """A random turn as (chunk_id, score) pairs: sometimes empty, longer than LIMIT, with
    repeats (inside or past the cut), ghosts, ties, one special score, or (``opposite``)
    two huge scores of opposite signs, whose trace margin overflows."""
    if rng.random() < 0.05:
        return []
    count = rng.randint(1, LIMIT + 3)
    if rng.random() < 0.1:
        chunks = [rng.choice(pool) for _ in range(count)]
    else:
        chunks = rng.sample(pool, min(count, len(pool)))
    scores = [rng.choice([rng.gauss(0.0, 1.0), 1.0, 0.0, -2.5, rng.uniform(-50, 50)]) for _ in chunks]
    if rng.random() < 0.12:
        scores[rng.randrange(len(scores))] = rng.choice(SPECIAL)
    elif opposite and len(scores) > 1 and rng.random() < 0.05:
        first, second = rng.sample(range(len(scores)), 2)
        scores[first], scores[second] = rng.choice([1e308, 1.7e308]), rng.choice([-1e308, -1.7e308])
    return list(zip(chunks, scores))


def as_request(rng, pairs):
    """The pairs as step() takes them: ScoredCandidate objects (finite scores) or pairs."""
    if all(math.isfinite(score) for _, score in pairs) and rng.random() < 0.5:
        return [ScoredCandidate(chunk_id, score) for chunk_id, score in pairs]
    return list(pairs)


def oracle(session, pairs):
    """The session's result for this turn, or the exception it raised."""
    try:
        return session.retrieve_candidates(pairs), None
    except Exception as error:  # noqa: BLE001 - what the server must report too
        return None, error


CONFIGS = [
    ("memory", {}),
    ("tensor", {"fixed_lag": 0}),
    ("memory", {"fixed_lag": 1, "score_normalization": "center"}),
    ("tensor", {"fixed_lag": 2, "context_limit": 3}),
    ("tensor", {"transition_weight": 0.0, "score_normalization": "none", "emission_weight": 4.0}),
    ("memory", {"score_normalization": "none", "fixed_lag": 2, "context_limit": 2}),
    ("tensor", {"score_normalization": "center", "emission_weight": 0.5}),
]


class _RowOf:
    """Row ``position`` of a step, read as if it were row r of another (``field[r]``)."""

    def __init__(self, step, position):
        self._step, self._position = step, position

    def __getattr__(self, name):
        values = getattr(self._step, name)
        return _Fixed(values[self._position])


class _Fixed:
    def __init__(self, value):
        self._value = value

    def __getitem__(self, _row):
        return self._value


class Fuzz:
    """One server, its oracle sessions, and the old results still to be re-read."""

    def __init__(self, seed, kind, options, synchronize=True):
        self.synchronize = synchronize  # False: step_slots runs the device step (no host reads)
        self.rng = random.Random(seed)
        self.standalone = make_graph(seed)
        self.graph = TensorCorpusGraph.from_graph(self.standalone) if kind == "tensor" else self.standalone
        self.options = dict(candidate_limit=LIMIT, **options)
        self.pool = NODES + GHOSTS
        self.server = self.new_server()
        self.sessions = {}  # open session ID -> oracle session
        self.old = []  # (StepResults, key, expected result) to read again later
        self.ids = 0

    def new_server(self):
        """A server with a random initial turn capacity (small ones grow and shrink often;
        a restored server's may differ from the saved one's), its contexts precomputed
        half the time where the graph keeps them."""
        server = MapMatchedServer(self.graph, capacity=2, turn_capacity=self.rng.choice([1, 2, 3, 8]), **self.options)
        if isinstance(self.graph, TensorCorpusGraph) and self.rng.random() < 0.5:
            server.precompute_contexts(self.pool if self.rng.random() < 0.5 else None)
        return server

    # ------------------------------------------------------------ operations

    def new_id(self):
        self.ids += 1
        return self.rng.choice([f"s{self.ids}", self.ids, ("user", self.ids), (self.ids, ("nested", str(self.ids)))])

    def open(self, session_id=None):
        session_id = self.new_id() if session_id is None else session_id
        self.server.open(session_id)
        self.sessions[session_id] = MapMatchedRetriever(self.standalone, **self.options).session()

    def close(self):
        key = self.rng.choice(list(self.sessions))
        slot = self.server.slot(key)
        self.server.close(key)
        del self.sessions[key]
        with pytest.raises(ValueError, match="unknown session"):
            self.server.path(key)
        # reopen at once: the slot is reused (by the same ID or a new one)
        reopened = key if self.rng.random() < 0.5 else self.new_id()
        self.open(reopened)
        assert self.server.slot(reopened) == slot

    def pick(self):
        return [key for key in self.sessions if self.rng.random() < 0.7]

    def step(self):
        keys = self.pick()
        turns = {key: random_turn(self.rng, self.pool) for key in keys}
        requests = {key: as_request(self.rng, pairs) for key, pairs in turns.items()}
        if self.rng.random() < 0.2:
            requests["never-opened"] = [("n1", 1.0)]
        results, errors = self.server.step(requests)
        self.check(results, errors, turns, "never-opened" in requests)

    def step_indexed(self):
        keys = self.pick()
        graph = self.graph
        turns, rows, scores = {}, [], []
        width = LIMIT + 3
        for key in keys:
            pairs = [(chunk, score) for chunk, score in random_turn(self.rng, NODES)]  # graph nodes only
            turns[key] = pairs
            rows.append([graph.index([chunk]).item() for chunk, _ in pairs] + [-1] * (width - len(pairs)))
            padding = [self.rng.choice([0.0, math.nan, 1e308]) for _ in range(width - len(pairs))]
            scores.append([score for _, score in pairs] + padding)  # padding scores are ignored
        shape = (len(keys), width)
        candidates = torch.tensor(rows, dtype=torch.long).view(shape)
        values = torch.tensor(scores, dtype=torch.float64).view(shape)
        ids, repeated = list(keys), set()
        if keys and self.rng.random() < 0.1:  # a session listed twice: both rows fail
            repeated.add(self.rng.choice(keys))
            ids.append(*repeated)
        if self.rng.random() < 0.1:
            ids.append("never-opened")
        extra = len(ids) - len(keys)
        candidates = torch.cat([candidates, torch.tensor([[1] + [-1] * (width - 1)] * extra, dtype=torch.long)])
        values = torch.cat([values, torch.ones(extra, width, dtype=torch.float64)])
        results, errors = self.server.step_indexed(ids, candidates, values)
        for key in repeated:
            assert "listed more than once" in str(errors.pop(key)) and key not in results
            del turns[key]
        self.check(results, errors, turns, "never-opened" in ids, indexed=True)

    def step_slots(self):
        keys = self.pick()
        entries = [(self.server.slot(key), key, random_turn(self.rng, self.pool)) for key in keys]
        repeated = set()
        if keys and self.rng.random() < 0.1:  # a slot listed twice: both rows fail
            repeated.add(self.rng.choice(keys))
            entries.append((self.server.slot(*repeated), None, [("n2", 1.0)]))
        if self.rng.random() < 0.1:  # a slot that is not open
            entries.append((self.rng.choice([-1, -7, 10**6]), None, [("n3", 1.0)]))
        self.rng.shuffle(entries)
        width = max([len(pairs) for _, _, pairs in entries] + [1]) + self.rng.randint(0, 1)
        coded = self.server.store.codes.codes
        codes = [coded([chunk for chunk, _ in pairs]) + [-1] * (width - len(pairs)) for _, _, pairs in entries]
        scores = [[score for _, score in pairs] + [0.0] * (width - len(pairs)) for _, _, pairs in entries]
        shape = (len(entries), width)
        arguments = (
            torch.tensor([slot for slot, _, _ in entries], dtype=torch.long),
            torch.tensor(codes, dtype=torch.long).view(shape), torch.tensor(scores, dtype=torch.float64).view(shape),
        )
        step = self.server.step_slots(*arguments, synchronize=self.synchronize)
        steps = [step] * len(entries)  # the step each row's result is read from
        if not self.synchronize:
            retry = (step.status == StepCode.EXACT_SUM_ON_HOST).nonzero().view(-1)
            if retry.numel():  # what the device could not certify, stepped again on the host
                again = self.server.step_slots(*(tensor[retry] for tensor in arguments))
                for position, row in enumerate(retry.tolist()):
                    steps[row] = _RowOf(again, position)
        names = self.server.store.codes.names
        status = [int(steps[row].status[row]) for row in range(len(entries))]
        for row, (slot, key, pairs) in enumerate(entries):
            step = steps[row]
            if key is None or key in repeated:
                open_slot = slot in [self.server.slot(key) for key in self.sessions]
                assert status[row] == (StepCode.REPEATED_SLOT if open_slot else StepCode.UNKNOWN_SLOT)
                continue
            expected, error = oracle(self.sessions[key], pairs)
            assert (status[row] == 0) == (error is None), (key, pairs, status[row], error)
            if error is None:
                length = int(step.lengths[row])
                assert length == self.sessions[key].turn_count
                assert names([int(step.chunks[row])]) == [expected.chunk_id]
                assert tuple(names(step.path[row, :length].tolist())) == expected.path.chunk_ids
                context = tuple(name for name in names(step.contexts[row].tolist()) if name is not None)
                assert context == expected.context_chunk_ids
                assert self.server.path(key) == expected.path
        for key in keys:
            self.check_state(key)

    def check(self, results, errors, turns, stranger, indexed=False):
        succeeded = []
        contexts = results.contexts()
        for key, pairs in turns.items():
            session = self.sessions[key]
            expected, error = oracle(session, pairs)
            if error is not None:
                assert key not in results, (key, pairs, error)
                assert type(errors[key]) is type(error), (pairs, errors[key], error)
                if indexed and "candidate score must be finite" in str(error):  # step_indexed: per column
                    assert f"trellis turn {session.turn_count} candidate" in str(errors[key])
                    assert "raw_score must be finite" in str(errors[key])
                else:
                    assert str(errors[key]) == str(error), (pairs, errors[key], error)
            else:
                assert key not in errors, (key, pairs, errors.get(key))
                succeeded.append(key)
                assert contexts[key] == expected.context_chunk_ids
                if self.rng.random() < 0.6:  # else read only later (lazily built after more steps)
                    assert results.chunk_id(key) == expected.chunk_id
                    assert results[key] == expected
                    assert self.server.path(key) == expected.path
                self.old.append((results, key, expected))
            self.check_state(key)
        if stranger:
            assert "unknown session" in str(errors.pop("never-opened"))
        assert list(results) == succeeded and set(errors) == set(turns) - set(succeeded)

    def check_state(self, key):
        session = self.sessions[key]
        assert self.server.turn_count(key) == session.turn_count
        if self.rng.random() < 0.5:
            assert self.server.path(key) == session.path
            assert self.server.trace(key) == session.trace

    def reread(self, everything=False):
        picked = self.old if everything else self.rng.sample(self.old, min(len(self.old), 3))
        for results, key, expected in picked:
            assert results[key] == expected
            assert results.contexts([key])[key] == expected.context_chunk_ids
            assert results.chunk_id(key) == expected.chunk_id

    def round_trip(self):
        state = self.server.state_dict()
        if self.rng.random() < 0.7:  # through a file, as a restarted server reads it
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            state = torch.load(buffer, weights_only=True)
        restored = self.new_server()
        restored.load_state_dict(state)
        assert set(restored.session_ids) == set(self.sessions)
        for key, session in self.sessions.items():
            assert restored.slot(key) == self.server.slot(key)
            assert restored.turn_count(key) == session.turn_count
            assert restored.path(key) == session.path and restored.trace(key) == session.trace
        self.server = restored  # results of the old server stay in self.old

    def run(self, operations):
        for _ in range(3):
            self.open()
        for index in range(operations):
            roll = self.rng.random()
            if roll < 0.08 and len(self.sessions) < 7:
                self.open()
            elif roll < 0.16 and self.sessions:
                self.close()
            elif roll < 0.22:
                self.reread()
            elif roll < 0.45 and isinstance(self.graph, TensorCorpusGraph):
                self.step_indexed()
            elif roll < 0.62:
                self.step_slots()
            else:
                self.step()
            if index == operations // 2:
                self.round_trip()
        self.reread(everything=True)


@pytest.mark.parametrize("kind, options", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_server_matches_independent_sessions_under_random_operations(seed, kind, options):
    Fuzz(seed * 100 + len(str(options)), kind, options).run(30)


# ------------------------------------------------------------- found by the fuzz


def test_step_slots_refuses_a_turn_whose_trace_overflows():
    graph = make_graph(0)
    server = MapMatchedServer(graph, candidate_limit=LIMIT, score_normalization="none")
    server.open("a")
    pairs = [("n1", 1e308), ("n2", -1e308)]
    with pytest.raises(ValueError, match="normalized_emission_margin must be finite"):
        MapMatchedRetriever(graph, candidate_limit=LIMIT, score_normalization="none").session().retrieve_candidates(
            pairs)
    assert "normalized_emission_margin" in str(server.step({"a": pairs})[1]["a"])  # step() refuses it
    step = server.step_slots(
        server.slots(["a"]), torch.tensor([server.store.codes.codes(["n1", "n2"])]),
        torch.tensor([[1e308, -1e308]], dtype=torch.float64),
    )
    assert int(step.status[0]) == StepCode.TRACE_OVERFLOW and server.turn_count("a") == 0 and server.path("a") is None
    assert int(step.chunks[0]) == -1 and bool((step.path[0] == -1).all())


def test_old_results_stay_readable_after_load_state_dict_into_the_same_server():
    graph = make_graph(0)
    server = MapMatchedServer(graph, candidate_limit=LIMIT)
    session = MapMatchedRetriever(graph, candidate_limit=LIMIT).session()
    server.open("a")
    server.step({"a": [("n1", 1.0)]}), session.retrieve_candidates([("n1", 1.0)])
    snapshot = server.state_dict()
    pairs = [("ghost-a", 2.0), ("n2", 1.0)]  # ghost-a gets a code the snapshot does not have
    results, _ = server.step({"a": pairs})
    expected = session.retrieve_candidates(pairs)
    server.load_state_dict(snapshot)
    server.step({"a": [("ghost-b", 2.0), ("n3", 1.0)]})  # ghost-b now takes ghost-a's old code
    assert results.chunk_id("a") == expected.chunk_id
    assert results.contexts()["a"] == expected.context_chunk_ids
    assert results["a"] == expected


@pytest.mark.parametrize("kind, options", [CONFIGS[0], CONFIGS[3], CONFIGS[-1]])
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
def test_server_on_the_triton_kernels_matches_independent_sessions(kind, options, monkeypatch):
    """The serving step's Triton kernels (the step and the backtrack; under the
    interpreter on CPU tensors) in the whole server, against the sessions' oracle."""
    pytest.importorskip("triton")
    from mapmatched_torch.kernels import _triton_step, use_backend

    launches = []
    for name in ("step", "backtrack"):
        original = getattr(_triton_step, name)
        monkeypatch.setattr(_triton_step, name, lambda *a, _original=original, _name=name: (
            launches.append(_name), _original(*a))[1])
    with use_backend("triton"):
        Fuzz(7 + len(str(options)), kind, options).run(12)
    assert "step" in launches and "backtrack" in launches


@pytest.mark.parametrize("kind, options", CONFIGS)
def test_the_device_step_matches_independent_sessions(kind, options):
    """step_slots(synchronize=False) (no host reads: every row in one batched step, fixed
    widths) mixed with every other operation, against the sessions' oracle; a row the
    device cannot certify (EXACT_SUM_ON_HOST) is stepped again on the host."""
    Fuzz(31 + len(str(options)), kind, options, synchronize=False).run(30)
