"""MapMatchedRetriever and its session (docs/spec.md section 6)."""

from __future__ import annotations

import math

import pytest

from mapmatched_torch.core.models import DecodedPath, ScoredCandidate
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph


def line_graph(**kwargs):
    return InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c"), ("c", "d")], **kwargs)


class ListProvider:
    def __init__(self, answers):
        self.answers = answers
        self.requests = []

    def retrieve(self, query, limit):
        self.requests.append((query, limit))
        return self.answers[query]


def candidates(*pairs):
    return [ScoredCandidate(chunk, score) for chunk, score in pairs]


def test_three_turn_line_graph_session_by_hand():
    retriever = MapMatchedRetriever(line_graph(), score_normalization="none", transition_weight=1.0)
    session = retriever.session()
    first = session.retrieve_candidates(candidates(("a", 1.0), ("d", 0.5)))
    assert first.chunk_id == "a"
    assert first.path.total_score == 1.0
    second = session.retrieve_candidates(candidates(("d", 2.0), ("b", 1.5)))
    # a->d: 1 - 3 + 2 = 0; a->b: 1 - 1 + 1.5 = 1.5; d->d: 0.5 + 2 = 2.5 -> path d, d (revises turn 0)
    assert second.path.chunk_ids == ("d", "d")
    assert second.trace.revised_prior_indices == (0,)
    assert [s.cumulative_score for s in second.path.steps] == [0.5, 2.5]
    third = session.retrieve_candidates(candidates(("c", 1.0), ("a", 0.0)))
    # d,d,c: 2.5 - 1 + 1 = 2.5; best alternative a,b,c: 1 + 0.5 = 1.5 - 1 + 1 = 1.5
    assert third.path.chunk_ids == ("d", "d", "c")
    assert third.path.total_score == 2.5
    assert third.trace.revised_prior_indices == ()
    assert [s.move for s in third.trace.steps] == ["start", "stay", "drill"]
    assert session.turn_count == 3
    assert session.current_chunk_id == "c"
    assert session.path is third.path
    assert session.trace is third.trace


def test_context_is_decoded_then_neighborhood_then_candidates_deduplicated():
    graph = line_graph()
    session = MapMatchedRetriever(graph, context_radius=1.0).session()
    result = session.retrieve_candidates(candidates(("b", 3.0), ("d", 1.0), ("a", 0.5)))
    assert result.context_chunk_ids == ("b", "a", "c", "d")
    limited = MapMatchedRetriever(graph, context_radius=2.0, context_limit=2).session()
    assert limited.retrieve_candidates(candidates(("b", 3.0))).context_chunk_ids == ("b", "a")
    none = MapMatchedRetriever(graph, context_radius=0.0).session()
    assert none.retrieve_candidates(candidates(("b", 3.0), ("d", 1.0))).context_chunk_ids == ("b", "d")


def test_candidate_limit_keeps_provider_order_prefix():
    provider = ListProvider({"q": candidates(("a", 0.0), ("b", 5.0), ("c", 9.0))})
    session = MapMatchedRetriever(line_graph(), provider=provider, candidate_limit=2).session()
    result = session.retrieve("q")
    assert provider.requests == [("q", 2)]
    assert [c.chunk_id for c in result.candidates] == ["a", "b"]
    assert result.chunk_id == "b"


def test_retrieve_needs_a_query_and_a_provider():
    session = MapMatchedRetriever(line_graph()).session()
    with pytest.raises(ValueError, match="query must not be empty"):
        session.retrieve("")
    with pytest.raises(TypeError, match="query must be a string, got int 3"):
        session.retrieve(3)
    for query in ("hello", "  "):  # a whitespace query is not empty (as in mapmatched 0.1.0)
        with pytest.raises(RuntimeError, match="retrieve\\(query\\) requires a CandidateProvider"):
            session.retrieve(query)
    assert session.turn_count == 0


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "candidate set must not be empty \\(turn 1\\)"),
        ([ScoredCandidate("a", 1.0), ScoredCandidate("a", 2.0)], "candidate chunk_ids must be unique within a turn"),
        ([("a", math.nan)], "finite"),
        (["a"], "ScoredCandidate"),
        ([("", 1.0)], "candidate chunk_id must not be empty"),
    ],
)
def test_a_failed_turn_leaves_the_session_unchanged(bad, message):
    session = MapMatchedRetriever(line_graph()).session()
    first = session.retrieve_candidates(candidates(("a", 1.0), ("b", 0.0)))
    with pytest.raises(ValueError, match=message):
        session.retrieve_candidates(bad)
    assert session.turn_count == 1
    assert session.path is first.path
    assert session.trace is first.trace
    again = session.retrieve_candidates(candidates(("b", 1.0)))
    assert again.path.chunk_ids == ("a", "b")


def test_a_decoder_error_rolls_back_too():
    session = MapMatchedRetriever(line_graph(), score_normalization="none").session()
    session.retrieve_candidates(candidates(("a", 1e308)))
    with pytest.raises(ValueError, match="nonfinite score"):
        session.retrieve_candidates(candidates(("b", 1e308)))
    assert session.turn_count == 1 and len(session.trellis) == 1


class RevisingDecoder:
    """Decodes with a lag, then (wrongly) flips turn 0 on the third call."""

    def __init__(self):
        self.calls = 0
        self.inner = StandaloneDecoder()

    def decode(self, *args, **kwargs):
        return self.decode_ranked(*args, **kwargs)[0]

    def decode_ranked(self, trellis, graph, **kwargs):
        self.calls += 1
        path, ranking = self.inner.decode_ranked(trellis, graph, **kwargs)
        if self.calls == 3:
            first = path.steps[0]
            other = next(c for c in trellis[0] if c.chunk_id != first.chunk_id)
            steps = (type(first)(**{**{f: getattr(first, f) for f in first.__slots__}, "chunk_id": other.chunk_id}),)
            steps += path.steps[1:]
            ids = tuple(step.chunk_id for step in steps)
            path = DecodedPath(steps, ids, path.total_score, path.fixed_lag, path.committed_through_index)
        return path, ranking


def test_revising_a_committed_turn_is_a_runtime_error_and_rolls_back():
    session = MapMatchedRetriever(line_graph(), decoder=RevisingDecoder(), fixed_lag=0).session()
    session.retrieve_candidates(candidates(("a", 1.0), ("b", 0.0)))
    session.retrieve_candidates(candidates(("b", 1.0)))
    with pytest.raises(RuntimeError, match="fixed-lag decoder revised a committed turn"):
        session.retrieve_candidates(candidates(("c", 1.0)))
    assert session.turn_count == 2


def test_fixed_lag_session_reports_the_committed_boundary():
    session = MapMatchedRetriever(line_graph(), fixed_lag=1).session()
    r0 = session.retrieve_candidates(candidates(("a", 1.0), ("d", 0.0)))
    assert r0.trace.committed_through_index is None and r0.trace.fixed_lag == 1
    r1 = session.retrieve_candidates(candidates(("b", 1.0), ("d", 0.0)))
    assert r1.trace.committed_through_index == 0
    r2 = session.retrieve_candidates(candidates(("c", 1.0)))
    assert r2.trace.committed_through_index == 1
    assert r2.path.chunk_ids[:2] == r1.path.chunk_ids[:2]


def test_ranking_is_attached_to_the_result():
    session = MapMatchedRetriever(line_graph(), score_normalization="none").session()
    session.retrieve_candidates(candidates(("a", 1.0)))
    result = session.retrieve_candidates(candidates(("d", 1.0), ("b", 0.5)))
    assert [r.chunk_id for r in result.candidate_ranking] == ["b", "d"]
    assert result.candidate_ranking[0].trajectory_score == result.path.total_score


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"candidate_limit": 0}, "candidate_limit must be greater than zero"),
        ({"candidate_limit": 2.5}, "candidate_limit must be an integer"),
        ({"emission_weight": -1}, "emission_weight must be finite and nonnegative"),
        ({"transition_weight": math.inf}, "transition_weight must be finite and nonnegative"),
        ({"score_normalization": "rank"}, "unsupported score normalization: rank \\(expected one of 'zscore'"),
        ({"fixed_lag": -2}, "fixed_lag must be nonnegative"),
        ({"context_radius": math.inf}, "context_radius must be finite and nonnegative"),
        ({"context_radius": -1.0}, "context_radius must be finite and nonnegative"),
        ({"context_limit": 0}, "context_limit must be greater than zero"),
    ],
)
def test_retriever_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MapMatchedRetriever(line_graph(), **kwargs)


def test_graph_must_implement_the_protocol():
    with pytest.raises(ValueError, match="CorpusGraph"):
        MapMatchedRetriever(object())
