"""Cost and memory bounded by the work in hand (issue 36 item 4): the chunk codes of IDs
outside the graph, the context table and the slot table shrink back when the sessions
that held them close, and what results hold keeps naming the right chunks."""

from __future__ import annotations

import random

import pytest
import torch

from mapmatched_torch import InMemoryCorpusGraph
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.serving import MapMatchedServer

NAMES = [f"c{i}" for i in range(12)]
EDGES = [(a, b, 1.0 + i % 3) for i, (a, b) in enumerate(zip(NAMES, NAMES[1:]))] + [("c0", "c5", 2.0)]
GRAPHS = {
    "tensor": lambda: TensorCorpusGraph.from_edges(EDGES, maximum_distance=4.0),
    "mapping": lambda: InMemoryCorpusGraph(EDGES, maximum_distance=4.0),
}


class Fresh:
    """Candidate turns: graph chunks and fresh chunk IDs outside the graph, ties included."""

    def __init__(self, seed):
        self.rng, self.count = random.Random(seed), 0

    def turn(self, unknown=2):
        rng = self.rng
        chunks = rng.sample(NAMES, rng.randint(1, 4))
        for _ in range(unknown):
            chunks.insert(rng.randrange(len(chunks) + 1), f"new{self.count}")
            self.count += 1
        return [ScoredCandidate(chunk, rng.choice([1.0, 0.5, rng.gauss(0, 1)])) for chunk in chunks]


def _churn(server, seed, rounds, keep=None, reference=None):
    """Open, step and close sessions with fresh unknown IDs in every turn; with
    ``reference`` (a server of a bound never reached) the same requests, the results
    compared: read at once (``keep`` None) or held unread and read at the end."""
    fresh = Fresh(seed)
    held = []
    open_ids = []
    for round_ in range(rounds):
        name = f"s{round_}"
        for target in (server, reference):
            if target is not None:
                target.open(name)
        open_ids.append(name)
        for _ in range(3):
            turns = {key: fresh.turn() for key in open_ids}
            results, errors = server.step(turns)
            assert not errors
            if reference is not None:
                expected, _ = reference.step(turns)
                expected = {key: expected[key] for key in expected}
                if keep is None:
                    assert {key: results[key] for key in results} == expected
                else:
                    held.append((results, expected, results.contexts()))
        if len(open_ids) > 2:
            closing = open_ids.pop(0)
            for target in (server, reference):
                if target is not None:
                    target.close(closing)
    return held


@pytest.mark.parametrize("kind", sorted(GRAPHS))
def test_the_codes_of_unknown_ids_are_dropped_when_their_sessions_close(kind):
    server = MapMatchedServer(GRAPHS[kind](), candidate_limit=8, fixed_lag=1, extra_codes=16)
    _churn(server, 0, 40)
    for key in server.session_ids:
        server.close(key)
    server.step({})  # (the step that would number new IDs compacts first)
    codes = server.store.codes
    # 40 sessions x 3 turns x 2 fresh IDs were numbered (252 extra codes with a mapping
    # graph's own 12); at most 3 sessions of 3 turns of 6 candidates were ever open
    assert codes.extra <= codes.bound <= max(16, 2 * 3 * 3 * 6), (codes.extra, codes.bound)
    assert server.store.contexts.row_count <= 2 * len(codes)
    assert server.store.compact_codes(force=True) and server.store.codes.extra == 0  # nothing open holds one
    assert server.store.contexts.row_count <= 2 * len(server.store.codes)


@pytest.mark.parametrize("kind", sorted(GRAPHS))
def test_sessions_decode_the_same_across_compactions(kind):
    """Every result equals a server's that never compacts, read at once."""
    server = MapMatchedServer(GRAPHS[kind](), candidate_limit=8, fixed_lag=1, extra_codes=4)
    reference = MapMatchedServer(GRAPHS[kind](), candidate_limit=8, fixed_lag=1)
    _churn(server, 1, 12, reference=reference)
    assert server.store.codes.extra < reference.store.codes.extra


@pytest.mark.parametrize("kind", sorted(GRAPHS))
def test_results_held_unread_name_the_right_chunks_after_compactions(kind):
    """Results are built when read: read long after compactions renumbered the codes,
    they still equal the never-compacting server's (contexts too)."""
    server = MapMatchedServer(GRAPHS[kind](), candidate_limit=8, fixed_lag=1, extra_codes=4)
    reference = MapMatchedServer(GRAPHS[kind](), candidate_limit=8, fixed_lag=1)
    held = _churn(server, 2, 10, keep=True, reference=reference)
    for results, expected, contexts in held:
        assert {key: results[key] for key in results} == expected
        assert results.contexts() == contexts == {key: value.context_chunk_ids for key, value in expected.items()}


def test_a_state_saved_after_compactions_restores_and_decodes_the_same(tmp_path):
    server = MapMatchedServer(GRAPHS["mapping"](), candidate_limit=8, fixed_lag=1, extra_codes=4)
    _churn(server, 3, 8)
    server.save(tmp_path / "state.pt")
    restored = MapMatchedServer(GRAPHS["mapping"](), candidate_limit=8, fixed_lag=1, extra_codes=4)
    restored.load(tmp_path / "state.pt")
    fresh = Fresh(9)
    for _ in range(4):
        turns = {key: fresh.turn() for key in server.session_ids}
        expected, _ = server.step(turns)
        got, _ = restored.step(turns)
        assert {key: got[key] for key in got} == {key: expected[key] for key in expected}


def test_the_slot_table_and_turn_capacity_shrink_back_after_churn():
    server = MapMatchedServer(GRAPHS["tensor"](), candidate_limit=4, capacity=4, turn_capacity=2)
    decoder = server.store.decoder
    keys = [f"s{i}" for i in range(100)]
    for key in keys:
        server.open(key)
    for turn in range(9):
        server.step({key: [ScoredCandidate(NAMES[(i + turn) % 12], 1.0)] for i, key in enumerate(keys)})
    assert (decoder.capacity, decoder.turn_capacity) == (128, 16)
    for key in keys[1:]:  # a long-lived session at the lowest slot stays
        server.close(key)
    assert decoder.capacity == 4  # back to the initial capacity
    server.open("late")
    assert server.slot("late") == 1  # the lowest free slot is reused first
    server.close(keys[0])
    assert decoder.turn_capacity == 2
    results, errors = server.step({"late": [ScoredCandidate("c1", 1.0)]})
    assert not errors and results["late"].chunk_id == "c1"
