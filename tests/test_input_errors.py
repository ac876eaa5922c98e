"""Bad input of the wrong type at the public entry points (sessions, the server, the
batched decoder, providers' answers) raises a project error that names the turn and
position and says what was expected -- never a bare TypeError, AttributeError or
KeyError -- and leaves the session or server exactly as it was.

Errors for the wrong type are :class:`MapMatchedTypeError`: a ValueError (the spec's
class for bad input) and a TypeError (what Python raised there before)."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever, ScoredCandidate, TorchDecoder
from mapmatched_torch.core.errors import MapMatchedError, MapMatchedTypeError
from mapmatched_torch.graph import TensorCorpusGraph
from mapmatched_torch.serving.server import MapMatchedServer

EXPECTED = "must be a sequence of ScoredCandidate, (chunk_id, score) pairs or objects with chunk_id and score"
ENTRY = "must be a ScoredCandidate, a (chunk_id, score) pair or an object with chunk_id and score"

#: a bad value where one turn's candidates belong -> (error class, message fragment)
BAD_CANDIDATES = [
    (None, MapMatchedTypeError, f"candidates {EXPECTED}, got None"),
    (42, MapMatchedTypeError, f"candidates {EXPECTED}, got int 42"),
    (math.nan, MapMatchedTypeError, f"candidates {EXPECTED}, got float nan"),
    ("a", MapMatchedTypeError, f"candidates {EXPECTED}, got str 'a'"),
    (b"a", MapMatchedTypeError, f"candidates {EXPECTED}, got bytes b'a'"),
    (object(), MapMatchedTypeError, f"candidates {EXPECTED}, got object"),
    ([None], MapMatchedTypeError, f"candidates: candidate 0 {ENTRY}, got None"),
    ([42], MapMatchedTypeError, f"candidates: candidate 0 {ENTRY}, got int 42"),
    ({"a": 1}, MapMatchedTypeError, f"candidates: candidate 0 {ENTRY}, got str 'a'"),
    ([("a",)], MapMatchedTypeError, f"candidates: candidate 0 {ENTRY}, got tuple ('a',)"),
    ([["a", 1.0]], MapMatchedTypeError, f"candidates: candidate 0 {ENTRY}, got list ['a', 1.0]"),
    ([ScoredCandidate("a", 1.0), None], MapMatchedTypeError, f"candidates: candidate 1 {ENTRY}, got None"),
    ([("id", None)], MapMatchedTypeError, "candidates: candidate 0: candidate score must be finite, got None (candidate 'id')"),
    ([(None, 1.0)], ValueError, "candidates: candidate 0: candidate chunk_id must be a string, got NoneType"),
    ([("a", math.nan)], ValueError, "candidates: candidate 0: candidate score must be finite, got nan (candidate 'a')"),
    ([("a", "x")], MapMatchedTypeError, "candidates: candidate 0: candidate score must be finite, got 'x' (candidate 'a')"),
]


def graph():
    return InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")])


class Answers:
    """A provider that answers every query with ``answer`` (batched, or one at a time)."""

    def __init__(self, answer, batched=False):
        self.answer = answer
        if batched:
            self.retrieve_batch = lambda queries, limit: [answer for _ in queries]

    def retrieve(self, query, limit):
        return self.answer


def check_error(error, kind, fragment, turn):
    assert isinstance(error, MapMatchedError) and isinstance(error, kind), repr(error)
    assert f"trellis turn {turn} " in str(error) and fragment.split(", got")[0] in str(error), str(error)
    if kind is MapMatchedTypeError:
        assert isinstance(error, TypeError) and isinstance(error, ValueError)
        assert fragment in str(error)


@pytest.mark.parametrize("decoder", [None, TorchDecoder()], ids=["standalone", "torch"])
@pytest.mark.parametrize("value, kind, fragment", BAD_CANDIDATES, ids=repr)
def test_a_session_refuses_bad_candidates_and_is_unchanged(decoder, value, kind, fragment):
    session = MapMatchedRetriever(graph(), decoder=decoder).session()
    session.retrieve_candidates([("a", 1.0), ("b", 0.5)])
    before = (session.turn_count, session.trellis, session.path, session.trace)
    with pytest.raises(kind) as caught:
        session.retrieve_candidates(value)
    check_error(caught.value, kind, fragment, turn=1)
    assert (session.turn_count, session.trellis, session.path, session.trace) == before
    session.retrieve_candidates([("b", 1.0)])  # still usable
    assert session.turn_count == 2


@pytest.mark.parametrize("value, kind, fragment", BAD_CANDIDATES[:8], ids=repr)
def test_a_providers_bad_answer_is_named_in_a_session(value, kind, fragment):
    session = MapMatchedRetriever(graph(), provider=Answers(value)).session()
    with pytest.raises(kind) as caught:
        session.retrieve("a question")
    check_error(caught.value, kind, fragment.replace("candidates", "candidates from Answers.retrieve(query, limit)"), 0)
    assert session.turn_count == 0 and session.path is None


@pytest.mark.parametrize("tensor_graph", [False, True])
def test_the_server_refuses_bad_requests_for_that_session_alone(tensor_graph):
    served = TensorCorpusGraph.from_graph(graph()) if tensor_graph else graph()
    server = MapMatchedServer(served)
    for key in ("alice", "bob"):
        server.open(key)
    server.step({"alice": [("a", 1.0)], "bob": [("b", 1.0)]})
    for value, kind, fragment in BAD_CANDIDATES:
        if isinstance(value, str):
            continue  # a query string, for the server's provider
        before = (server.turn_count("alice"), server.path("alice"), server.trace("alice"))
        results, errors = server.step({"alice": value, "bob": [("c", 1.0)]})
        assert set(errors) == {"alice"} and set(results) == {"bob"}
        check_error(errors["alice"], kind, fragment, turn=1)
        # word for word what an independent session says
        session = MapMatchedRetriever(graph()).session()
        session.retrieve_candidates([("a", 1.0)])
        with pytest.raises(kind) as caught:
            session.retrieve_candidates(value)
        assert str(errors["alice"]) == str(caught.value)
        assert (server.turn_count("alice"), server.path("alice"), server.trace("alice")) == before


@pytest.mark.parametrize("batched", [False, True])
def test_the_server_names_a_providers_bad_answer(batched):
    server = MapMatchedServer(graph(), provider=Answers(None, batched=batched))
    server.open("alice")
    results, errors = server.step({"alice": "a question"})
    assert not results and isinstance(errors["alice"], MapMatchedTypeError)
    assert str(errors["alice"]) == f"trellis turn 0 candidates from Answers.retrieve(query, limit) {EXPECTED}, got None"
    assert server.turn_count("alice") == 0


@pytest.mark.parametrize(
    "turns, message",
    [
        ("a", "step(turns) must be a mapping of session ID -> candidates (or a query string), got str 'a'"),
        (None, "step(turns) must be a mapping of session ID -> candidates (or a query string), got None"),
        (42, "step(turns) must be a mapping of session ID -> candidates (or a query string), got int 42"),
        ([None], "entry 0 is not a (session ID, candidates) pair: None"),
        ([("alice",)], "entry 0 is not a (session ID, candidates) pair: tuple ('alice',)"),
        ([(["alice"], [])], "with hashable session IDs"),
    ],
)
def test_server_step_refuses_what_is_not_a_mapping(turns, message):
    server = MapMatchedServer(graph())
    server.open("alice")
    with pytest.raises(MapMatchedTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        server.step(turns)
    assert server.turn_count("alice") == 0
    results, errors = server.step([("alice", [("a", 1.0)])])  # pairs are still accepted
    assert not errors and results["alice"].chunk_id == "a"


def test_unhashable_session_ids_are_project_type_errors():
    server = MapMatchedServer(TensorCorpusGraph.from_graph(graph()))
    for call in (server.open, server.close, server.path, server.trace, server.turn_count):
        with pytest.raises(MapMatchedTypeError, match=r"a session ID must be a str, an int .*; got list \['a'\], "
                                                      r"which is unhashable"):
            call(["a"])
    server.open("a")
    rows, scores = torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, 1), dtype=torch.float64)
    with pytest.raises(MapMatchedTypeError, match="session ID must be a str.*which is unhashable"):
        server.step_indexed([["a"]], rows, scores)
    for session_ids in (None, 42, "a"):
        with pytest.raises(MapMatchedTypeError, match="step_indexed session_ids must be a sequence of session IDs"):
            server.step_indexed(session_ids, rows, scores)
    with pytest.raises(MapMatchedTypeError, match="got candidates None and scores"):
        server.step_indexed(["a"], None, scores)
    assert server.turn_count("a") == 0 and len(server) == 1


SCORED = ScoredCandidate("a", 1.0)


@pytest.mark.parametrize(
    "trellises, message",
    [
        ([[[SCORED]]], "conversation 0: trellis turn 0 candidate 0 is a ScoredCandidate (chunk_id, score), but a "
                       "trellis holds normalized DecoderCandidate (chunk_id, raw_score, normalized_score): convert "
                       "each turn with normalize_candidates(turn, score_normalization) first"),
        (None, "trellises must be a sequence of trellises (one per conversation), got None"),
        (42, "trellises must be a sequence of trellises (one per conversation), got int 42"),
        ([None], "conversation 0: trellis must be a sequence of turns"),
        ([[None]], "conversation 0: trellis turn 0 must be a sequence of DecoderCandidate, got None"),
        ([[[None]]], "conversation 0: trellis turn 0 candidate 0 must be a DecoderCandidate"),
        ([[[("a", 1.0)]]], "conversation 0: trellis turn 0 candidate 0 must be a DecoderCandidate"),
    ],
)
def test_decode_batch_says_what_it_got_and_what_it_takes(trellises, message):
    with pytest.raises(MapMatchedTypeError) as caught:
        TorchDecoder().decode_batch(trellises, graph())
    assert str(caught.value).startswith(message) and isinstance(caught.value, TypeError)
