"""mapmatched_torch.serving.contexts: a graph's stored context table as the server reads it.

The table-backed server against the standalone sessions (the oracle) and a server that
searches, bit for bit; the table read without a search at its limit; a table of another
limit warned about once (ContextTableWarning). The context rows themselves are tested
with the store's tensor step (tests/serving/test_session_store.py, test_step_results.py,
test_bounded_state.py).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.graph import TensorCorpusGraph, load_graph, save_graph
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.serving.contexts import ContextTableWarning, context_table_mismatch
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph


def reference_graph(seed: int) -> InMemoryCorpusGraph:
    """A random graph of 14 nodes with tied, integer and float distances, two components
    (n12 and n13 apart) and a bound of 3."""
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(12)]
    edges = [(a, b, rng.choice([1.0, 0.5, 2.0, rng.uniform(0.2, 2.0)])) for a, b in zip(nodes, nodes[1:])]
    edges += [(rng.choice(nodes), rng.choice(nodes), rng.choice([1.0, 1.5])) for _ in range(8)]
    edges += [("n12", "n13", 1.0)]
    return InMemoryCorpusGraph([edge for edge in edges if edge[0] != edge[1]], maximum_distance=3.0)


def random_turns(rng: random.Random, nodes, sessions, turns: int):
    """Per turn, each session's candidates: 1 to 4 of the nodes and an unknown ID, with tied scores."""
    return [{key: [ScoredCandidate(chunk, rng.choice([1.0, 0.5, rng.gauss(0, 1)]))
                   for chunk in rng.sample(list(nodes) + ["ghost"], rng.randint(1, 4))] for key in sessions}
            for _ in range(turns)]


def answers(server, turns):
    for key in turns[0]:
        server.open(key)
    found = []
    for turn in turns:
        results, errors = server.step(turn)
        assert errors == {}
        found.append(dict(results.items()))
    return found


def no_search(*args, **kwargs):
    raise AssertionError("searched a neighbourhood")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("radius", [0.0, 1.0, 2.5, 7.0])
def test_a_stored_table_answers_as_the_search_and_the_oracle(tmp_path, monkeypatch, seed, radius):
    reference = reference_graph(seed)
    graph = TensorCorpusGraph.from_graph(reference).precompute_neighborhoods(radius)
    save_graph(graph, tmp_path / "g")
    loaded = load_graph(tmp_path / "g", context_radius=radius)
    searched = TensorCorpusGraph.from_graph(reference)
    rng = random.Random(seed)
    turns = random_turns(rng, reference.nodes, ["a", "b", "c"], 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextTableWarning)  # the table matches: no warning
        server = MapMatchedServer(loaded, candidate_limit=4, context_radius=radius)
    with monkeypatch.context() as patch:
        patch.setattr(loaded, "_ordered_balls", no_search)  # every neighbourhood search passes here
        stored = answers(server, turns)
        server.precompute_contexts()  # every node's row: read, not searched
    expected = answers(MapMatchedServer(searched, candidate_limit=4, context_radius=radius), turns)
    assert stored == expected  # RetrievalResult equality: chunk, contexts, path and its floats, ranking
    oracle = {key: MapMatchedRetriever(reference, candidate_limit=4, context_radius=radius).session()
              for key in turns[0]}
    for step, turn in zip(stored, turns):
        for key, candidates in turn.items():
            assert step[key] == oracle[key].retrieve_candidates(candidates)
    codes = torch.arange(-1, loaded.num_nodes)
    reference_server = MapMatchedServer(searched, context_radius=radius)
    reference_server.precompute_contexts()
    assert torch.equal(server.store.contexts.rows(codes[1:]), reference_server.store.contexts.rows(codes[1:]))


def test_a_table_of_another_limit_warns_once_and_is_searched(monkeypatch):
    graph = TensorCorpusGraph.from_graph(reference_graph(0)).precompute_neighborhoods(1.5)
    with pytest.warns(ContextTableWarning) as warned:
        server = MapMatchedServer(graph, candidate_limit=4, context_radius=1.0)
        answers(server, random_turns(random.Random(0), graph.nodes, ["a"], 3))
        server.load_state_dict(server.state_dict())
    assert len(warned) == 1 and warned[0].filename == __file__  # at the caller's line
    message = str(warned[0].message)
    assert "built for radius 1.5 (neighbourhoods within 1.5)" in message
    assert "the context radius is 1.0 (within 1.0)" in message and "--context-radius 1.0" in message
    monkeypatch.setattr(graph, "_ordered_balls", no_search)
    with pytest.raises(AssertionError, match="searched"):  # the rows are searched, not read
        server.precompute_contexts()
    # radii beyond the bound share its limit: the table is read, no warning
    wide = TensorCorpusGraph.from_graph(reference_graph(0)).precompute_neighborhoods(5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextTableWarning)
        MapMatchedServer(wide, context_radius=9.0).precompute_contexts()  # the monkeypatch is on `graph` only
        MapMatchedServer(TensorCorpusGraph.from_graph(reference_graph(0)), context_radius=1.0)  # no table
        MapMatchedServer(reference_graph(0), context_radius=1.0)  # not a tensor graph


def test_context_table_mismatch_compares_limits():
    assert context_table_mismatch(1.5, 1.5, 1.5, 3.0) is None
    assert context_table_mismatch(5.0, 3.0, 4.0, 3.0) is None  # both bounded at 3
    assert context_table_mismatch(5.0, 3.0, 4.0, 3.5) is not None  # a larger bound: 3.5 != 3
    message = context_table_mismatch(0.5, 0.5, 2.0, 1.0)
    assert "radius 0.5 (neighbourhoods within 0.5)" in message and "radius is 2.0 (within 1.0)" in message
