"""A saved server state is bound to its graph and options, sealed by one checksum, and
never loads silently wrong (issue 36 items 1 and 2; docs/serving-guarantees.md)."""

from __future__ import annotations

import io
import random

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

CHAPTERS = ["intro", "setup", "gpu"]
EDGES = [("intro", "setup", 1.0), ("setup", "gpu", 2.0)]


def _tensor_graph(names=CHAPTERS, edges=EDGES, **options):
    return TensorCorpusGraph.from_edges(edges, nodes=names, **options)


def _turns(names, rng):
    return [ScoredCandidate(name, rng.gauss(0, 1)) for name in rng.sample(names, len(names))]


def _served(graph, names=CHAPTERS, steps=3, seed=0, **options):
    rng = random.Random(seed)
    server = MapMatchedServer(graph, candidate_limit=3, capacity=4, turn_capacity=4, **options)
    for key in ("a", "b", "c"):
        server.open(key)
    for _ in range(steps):
        results, errors = server.step({key: _turns(names + ["unknown chunk"], rng)[:3] for key in ("a", "b", "c")})
        assert not errors
    server.close("b")
    return server


def _same(first, second):
    """Two servers hold the same content (their states' checksums agree)."""
    return first.state_dict()["checksum"] == second.state_dict()["checksum"]


def _refused(target, state, match, **options):
    before = target.state_dict()
    with pytest.raises(MapMatchedValueError, match=match):
        target.load_state_dict(state, **options)
    assert target.state_dict()["checksum"] == before["checksum"]  # nothing changed


# -------------------------------------------------- item 1: bound to its graph


@pytest.mark.parametrize("kind", ["tensor graph", "in-memory graph"])
def test_a_state_saved_over_one_graph_is_refused_over_another_naming_what_differs(kind):
    make = _tensor_graph if kind == "tensor graph" else (lambda names=CHAPTERS, edges=EDGES, **o: InMemoryCorpusGraph(
        edges, nodes=names, **o))
    state = _served(make()).state_dict()
    other = ["x", "y", "z"]
    target = _served(make(other, [("x", "y", 1.0), ("y", "z", 2.0)]), names=other)
    _refused(target, state, r"another graph.*node_set_sha256")
    _refused(_served(make(maximum_distance=3.0)), state, r"another graph.*maximum_distance \(saved 10.0, this 3.0\)")
    _refused(_served(make(directed=True)), state, r"another graph.*directed \(saved False, this True\)")
    _refused(_served(make(edges=[("intro", "setup", 1.0), ("setup", "gpu", 2.5)])), state, r"edges_sha256")
    same = _served(make(), seed=3)
    same.load_state_dict(state)
    assert same.state_dict()["checksum"] == state["checksum"]


def test_a_state_with_other_settings_is_refused_naming_them():
    state = _served(_tensor_graph()).state_dict()
    for options, named in [({"transition_weight": 2.0}, r"transition_weight \(saved 1.0, this 2.0\)"),
                           ({"emission_weight": 0.5}, "emission_weight"), ({"fixed_lag": 1}, "fixed_lag"),
                           ({"score_normalization": "none"}, "score_normalization")]:
        _refused(_served(_tensor_graph(), **options), state, named)


def test_the_same_chunk_ids_in_another_order_migrate_only_when_asked_and_then_decode_as_before():
    graph = _tensor_graph()
    server = _served(graph)
    path = io.BytesIO()
    torch.save(server.state_dict(), path)
    reordered = _tensor_graph(names=list(reversed(CHAPTERS)))
    assert reordered.nodes != graph.nodes
    target = _served(reordered, seed=4)
    _refused(target, torch.load(io.BytesIO(path.getvalue()), weights_only=True), r"another order.*migrate=True")
    target.load_state_dict(torch.load(io.BytesIO(path.getvalue()), weights_only=True), migrate=True)
    assert target.session_ids == server.session_ids
    rng = random.Random(9)
    for _ in range(3):
        turns = {key: _turns(CHAPTERS + ["unknown chunk"], rng)[:3] for key in ("a", "c")}
        expected, _ = server.step(turns)
        got, errors = target.step(turns)
        assert not errors
        for key in turns:
            assert got[key] == expected[key]
    # a reordered graph with other edges is not a migration
    _refused(_served(_tensor_graph(names=list(reversed(CHAPTERS)), edges=EDGES[:1])), server.state_dict(),
             "another graph", migrate=True)


# ------------------------------------------------ item 2: one checksum, all of it


def _edits(state):
    """(name, edited state) for structured edits of every entry of a saved state."""
    def copy():
        return torch.load(_saved(state), weights_only=True)

    for key in sorted(state):
        edited = copy()
        del edited[key]
        yield f"remove {key}", edited
        edited = copy()
        edited[key + "_renamed"] = edited.pop(key)
        yield f"rename {key}", edited
    edited = copy()
    edited["sessions"][0][0], edited["sessions"][1][0] = edited["sessions"][1][0], edited["sessions"][0][0]
    yield "swap two session IDs", edited
    edited = copy()
    edited["store"]["codes"][0] = edited["store"]["codes"][0] + "!"
    yield "rename a chunk code", edited
    edited = copy()
    codes = edited["store"]["codes"]
    codes[0], codes[1] = codes[1], codes[0]
    yield "swap two chunk codes", edited
    edited = copy()
    tensors = edited["store"]["decoder"]["tensors"]
    tensors["payload.raw"], tensors["payload.normalized"] = tensors["payload.normalized"], tensors["payload.raw"]
    yield "swap two tensors", edited
    edited = copy()
    edited["store"]["decoder"]["tensors"]["payload.raw"][0, 0, 0] += 1.0
    yield "edit a score", edited
    edited = copy()
    edited["previous_queries"] = [[0, "a query"]]
    yield "add a previous query", edited
    edited = copy()
    edited["store"]["decoder"]["free"] = []
    yield "edit the free list", edited
    edited = copy()
    edited["options"]["candidate_limit"] = 4
    yield "edit an option", edited


def _saved(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def _chunk_server():
    """A server whose state has every kind of entry: unknown chunk codes, two sessions."""
    server = _served(InMemoryCorpusGraph(EDGES, nodes=CHAPTERS))
    assert len(server.state_dict()["store"]["codes"]) >= 2
    return server


def test_every_structured_edit_of_a_state_is_refused_and_changes_nothing():
    state = _chunk_server().state_dict()
    seen = 0
    for name, edited in _edits(state):
        target = _served(InMemoryCorpusGraph(EDGES, nodes=CHAPTERS), seed=5)
        before = target.state_dict()["checksum"]
        with pytest.raises(MapMatchedValueError):
            target.load_state_dict(edited)
        assert target.state_dict()["checksum"] == before, name
        seen += 1
    assert seen > 20


def test_a_state_without_its_checksum_loads_only_when_legacy_is_asked():
    state = _chunk_server().state_dict()
    stripped = {key: value for key, value in state.items() if key != "checksum"}
    target = _served(InMemoryCorpusGraph(EDGES, nodes=CHAPTERS), seed=5)
    _refused(target, stripped, "no whole-state checksum.*legacy=True")
    _refused(target, dict(stripped, version=2), "no whole-state checksum")
    target.load_state_dict(stripped, legacy=True)
    assert target.state_dict()["checksum"] == state["checksum"]
    _refused(target, dict(state, checksum="0" * 64), "does not match its checksum")
    _refused(target, dict(state, version=4), "unknown state version 4")


def _bit_flip_sweep(positions, seed):
    server = _chunk_server()
    data = _saved(server.state_dict()).getvalue()
    rng = random.Random(seed)
    picked = range(len(data) * 8) if positions is None else rng.sample(range(len(data) * 8), positions)
    target = _served(InMemoryCorpusGraph(EDGES, nodes=CHAPTERS), seed=5)
    before = target.state_dict()["checksum"]
    loaded = refused = 0
    for bit in picked:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            state = torch.load(io.BytesIO(bytes(flipped)), weights_only=True)
        except Exception:
            refused += 1  # (load() words it as a MapMatchedValueError naming the file)
            continue
        try:
            target.load_state_dict(state)
        except MapMatchedValueError:
            assert target.state_dict()["checksum"] == before, bit
            refused += 1
            continue
        # loaded: then it is the saved content exactly
        assert target.state_dict()["checksum"] == server.state_dict()["checksum"], bit
        loaded += 1
        target = _served(InMemoryCorpusGraph(EDGES, nodes=CHAPTERS), seed=5)
    return loaded, refused


def test_every_sampled_bit_flip_of_a_saved_file_is_refused_or_loads_identical_content():
    loaded, refused = _bit_flip_sweep(2000, seed=36)
    assert refused > 1000 and loaded + refused == 2000


@pytest.mark.slow
def test_every_bit_flip_of_a_saved_file_is_refused_or_loads_identical_content():
    _bit_flip_sweep(None, seed=0)


def test_load_refuses_a_flipped_file_naming_it(tmp_path):
    server = _chunk_server()
    path = tmp_path / "server.pt"
    server.save(path)
    data = bytearray(path.read_bytes())
    target = _served(InMemoryCorpusGraph(EDGES, nodes=CHAPTERS), seed=5)
    before = target.state_dict()["checksum"]
    # a flip inside a tensor's bytes: torch.load reads it, the checksum refuses it
    raw = server.state_dict()["store"]["decoder"]["tensors"]["payload.raw"]
    value = raw[raw != 0][0].item()
    import struct
    where = bytes(data).find(struct.pack("<d", value))
    assert where > 0
    data[where] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(MapMatchedValueError, match="server.pt.*checksum"):
        target.load(path)
    assert target.state_dict()["checksum"] == before
