"""serving/step_results.py: served turns, the neighbourhood LRU, and StepResults read
lazily (chunk_ids / contexts / materialize) equal to independent sessions."""

from __future__ import annotations

from typing import List

import pytest

from mapmatched_torch.core.models import DecoderCandidate, ScoredCandidate
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.serving.step_results import NeighborhoodCache, ServedTurn, StepResults
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

EDGES = [("a", "b"), ("b", "c"), ("c", "d"), ("x", "y")]


class BatchedGraph:
    """A corpus graph that answers many neighbourhoods at once, and counts the calls."""

    def __init__(self) -> None:
        self.graph = InMemoryCorpusGraph.from_edges(EDGES)
        self.maximum_distance = self.graph.maximum_distance
        self.calls: List[List[str]] = []

    def distance(self, a: str, b: str) -> float:
        return self.graph.distance(a, b)

    def neighborhood(self, chunk_id: str, radius: float):
        return self.graph.neighborhood(chunk_id, radius)  # (what the reference sessions ask)

    def neighborhoods(self, chunk_ids, radius):
        self.calls.append(list(chunk_ids))
        return [tuple(self.graph.neighborhood(chunk_id, radius)) for chunk_id in chunk_ids]


def test_served_turns_build_the_candidates_they_were_made_from():
    candidates = [DecoderCandidate("a", 2.0, 1.0), DecoderCandidate("c", 0.0, -1.0)]
    turn = ServedTurn.from_candidates(candidates)
    assert len(turn) == 2 and list(turn) == candidates and turn[1] == candidates[1]
    assert turn[:1] == (candidates[0],) and turn.chunk_ids == ("a", "c") and turn.chunk_id(1) == "c"


def test_served_turns_of_node_indices_read_their_ids_from_the_graphs_names():
    turn = ServedTurn((2.0, 0.0), (1.0, -1.0), nodes=(3, 0), names=("a", "b", "c", "d"))
    assert turn.chunk_id(0) == "d" and turn.chunk_ids == ("d", "a")
    assert turn.candidates == (DecoderCandidate("d", 2.0, 1.0), DecoderCandidate("a", 0.0, -1.0))


def test_the_neighbourhood_cache_asks_a_batched_graph_once_per_chunk_and_evicts_the_oldest():
    graph = BatchedGraph()
    cache = NeighborhoodCache(graph, radius=1.0, capacity=2)
    assert cache.get(["b", "a", "b"]) == [("a", "c"), ("b",), ("a", "c")]  # chunk IDs, by distance
    assert graph.calls == [["b", "a"]]  # distinct chunks, one call
    cache.get(["a"])
    cache.get(["c"])  # evicts "b", the least recently used
    cache.get(["a", "b"])
    assert graph.calls == [["b", "a"], ["c"], ["b"]]


def test_the_neighbourhood_cache_asks_any_other_graph_every_time():
    graph = InMemoryCorpusGraph.from_edges(EDGES)
    cache = NeighborhoodCache(graph, radius=2.0)
    assert cache.get(["a", "x"]) == [("b", "c"), ("y",)]


def serve(graph, **options):
    """Two turns of three sessions on a server and on independent sessions."""
    server = MapMatchedServer(graph, candidate_limit=3, **options)
    sessions = {key: MapMatchedRetriever(graph, candidate_limit=3, **options).session() for key in "pqr"}
    turns = [
        {"p": [("a", 1.0), ("x", 0.5)], "q": [("x", 1.0)], "r": [("d", 0.2), ("c", 0.1)]},
        {"p": [("y", 0.9), ("b", 0.8)], "q": [("y", 0.3), ("a", 0.2)], "r": [("b", 1.0), ("c", 0.9)]},
    ]
    for key in sessions:
        server.open(key)
    for turn in turns:
        results, errors = server.step(turn)
        expected = {key: sessions[key].retrieve_candidates([ScoredCandidate(*c) for c in turn[key]]) for key in turn}
    assert errors == {}
    return results, expected


def test_contexts_of_some_sessions_in_the_order_asked_in_one_batched_call():
    graph = BatchedGraph()
    results, expected = serve(graph, context_limit=3)
    assert isinstance(results, StepResults)
    graph.calls.clear()
    contexts = results.contexts(["r", "p"])
    assert list(contexts) == ["r", "p"] and len(graph.calls) == 1
    assert contexts == {key: expected[key].context_chunk_ids for key in ("r", "p")}
    assert all(len(context) <= 3 for context in contexts.values())
    assert repr(results) == "StepResults(3 sessions, 0 built)"


def test_chunk_ids_and_materialize_equal_the_independent_sessions():
    graph = InMemoryCorpusGraph.from_edges(EDGES)
    results, expected = serve(graph, fixed_lag=1)
    assert results.chunk_ids() == {key: result.chunk_id for key, result in expected.items()}
    assert results.chunk_id("q") == expected["q"].chunk_id
    assert results.materialize() == expected
    assert repr(results) == "StepResults(3 sessions, 3 built)"
    with pytest.raises(KeyError):
        results["nobody"]
    assert "nobody" not in results and sorted(results) == ["p", "q", "r"]


def test_a_result_read_while_another_thread_closes_the_session_and_reuses_its_slot_is_right(monkeypatch):
    """Issue 36 item 3: the reader is paused right where it reads the session's turns
    from the store while a writer closes the session, opens another into the same slot
    and steps it. Holding the server's lock, the reader reads this step's turns; before,
    it read the new session's."""
    import threading

    from mapmatched_torch.serving import step_results

    graph = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "c", 1.0), ("x", "y", 1.0)])
    first = [ScoredCandidate("a", 1.0), ScoredCandidate("b", 0.5)]
    other = [ScoredCandidate("x", 2.0), ScoredCandidate("y", 0.1), ScoredCandidate("c", 0.3)]
    expected = MapMatchedRetriever(graph, candidate_limit=3).session().retrieve_candidates(first)
    original = step_results.StoredTurns.__getitem__
    for _ in range(3):  # bounded: each round waits at most 0.3 s for the writer
        server = MapMatchedServer(graph, candidate_limit=3)
        server.open("alice")
        results, _ = server.step({"alice": first})
        reading, written = threading.Event(), threading.Event()

        def paused(self, index, reading=reading, written=written):
            if not reading.is_set():
                reading.set()
                written.wait(0.3)  # (a writer blocked on the lock never sets it)
            return original(self, index)

        monkeypatch.setattr(step_results.StoredTurns, "__getitem__", paused)

        def writer(server=server, reading=reading, written=written):
            reading.wait(5)
            server.close("alice")
            assert server.open("bob") == 0  # alice's slot
            server.step({"bob": other})
            written.set()

        thread = threading.Thread(target=writer)
        thread.start()
        got = results["alice"]
        thread.join(10)
        assert not thread.is_alive()
        assert got == expected
        assert server.path("bob").chunk_ids == ("x",)
