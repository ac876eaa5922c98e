"""Drop-in for mapmatched 0.1.0: providers, decoders, sessions and their results.

Code written against upstream's API (a provider with only ``candidates(query, limit)``,
a decoder with only ``decode(trellis, *, graph, ...)``, ``RetrievalResult.candidates``
as raw ``ScoredCandidate``s, ``CandidateScore(chunk_id, trajectory_score)``, its error
classes and messages) gives the same answers here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from mapmatched_torch import CandidateScore, MapMatchedRetriever, ScoredCandidate
from mapmatched_torch.core.protocols import CandidateProvider, provider_answer
from mapmatched_torch.providers.dense import DenseProvider
from mapmatched_torch.providers.fusion import FusionProvider
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph


def line_graph():
    return InMemoryCorpusGraph.from_edges([("0", "1"), ("1", "2"), ("2", "3")], maximum_distance=3.0)


class UpstreamProvider:
    """Upstream's provider protocol only: ``candidates(query, limit)``."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def candidates(self, query, limit):
        self.calls.append((query, limit))
        return self.answers[query]


class Hit:
    """A candidate as upstream reads it: any object with ``chunk_id`` and ``score``."""

    def __init__(self, chunk_id, score):
        self.chunk_id, self.score = chunk_id, score


class UpstreamDecoder:
    """Upstream's Decoder protocol only: ``decode`` with keyword-only ``graph`` and no
    ``decode_ranked`` (as upstream's CMGDecoder); it returns the standalone path with no
    lag fields, as an upstream-built ``DecodedPath`` has none."""

    def __init__(self):
        self.calls = []

    def decode(self, trellis, *, graph, emission_weight, transition_weight, fixed_lag=None):
        self.calls.append(fixed_lag)
        path = StandaloneDecoder().decode(
            trellis, graph=graph, emission_weight=emission_weight, transition_weight=transition_weight,
            fixed_lag=fixed_lag,
        )
        return dataclasses.replace(path, fixed_lag=None, committed_through_index=None)


TURN = [ScoredCandidate("1", 3.0), ScoredCandidate("0", 1.0), ScoredCandidate("3", 0.5)]


# ----------------------------------------------------------------- point 1: providers


def test_a_provider_with_only_candidates_answers_a_session():
    provider = UpstreamProvider({"question": TURN})
    session = MapMatchedRetriever(line_graph(), provider=provider, candidate_limit=2).session()
    result = session.retrieve("question")
    assert provider.calls == [("question", 2)]  # positional, as upstream calls it
    assert result.candidates == tuple(TURN[:2])  # raw, after the candidate_limit cut
    assert result.chunk_id == "1"
    assert session.trellis[-1][0].normalized_score == 1.0  # the normalized turn lives in the session


def test_the_provider_rule_prefers_retrieve_and_names_the_method():
    class Both(UpstreamProvider):
        def retrieve(self, query, limit):
            return self.answers[query][:1]

    assert provider_answer(Both({}))[0] == "retrieve"
    assert provider_answer(UpstreamProvider({}))[0] == "candidates"
    with pytest.raises(TypeError, match="CandidateProvider protocol.*object has neither"):
        provider_answer(object())
    bad = MapMatchedRetriever(line_graph(), provider=UpstreamProvider({"q": [3]})).session()
    with pytest.raises(TypeError, match=r"candidates from UpstreamProvider\.candidates\(query, limit\): candidate 0"):
        bad.retrieve("q")


def test_duck_typed_and_pair_candidates_are_accepted_as_upstream():
    session = MapMatchedRetriever(line_graph(), provider=UpstreamProvider({"q": [Hit("2", 4), ("3", 1.0)]})).session()
    result = session.retrieve("q")
    assert result.candidates == (ScoredCandidate("2", 4.0), ScoredCandidate("3", 1.0))
    direct = MapMatchedRetriever(line_graph()).session().retrieve_candidates((Hit("2", 4), Hit("3", 1.0)))
    assert direct.candidates == result.candidates and direct.path == result.path


def test_our_providers_answer_to_candidates_with_the_same_implementation():
    embeddings = torch.eye(3, dtype=torch.float64)
    dense = DenseProvider(embeddings, ["a", "b", "c"], embed_query=lambda q: embeddings[int(q)])
    assert dense.candidates("1", 2) == dense.candidates("1", limit=2) == dense.retrieve("1", 2)
    assert isinstance(dense, CandidateProvider)
    fusion = FusionProvider([UpstreamProvider({"1": [Hit("x", 1.0), Hit("y", 0.5)]}), dense])
    assert fusion.candidates("1", limit=2) == fusion.retrieve("1", 2)
    with pytest.raises(ValueError, match="limit must be greater than zero, got 0"):
        dense.candidates("1", 0)  # the errors are retrieve's
    for cls in (DenseProvider, FusionProvider):
        assert "candidates" not in vars(cls)  # one implementation: the base class forwards to retrieve


def test_fusion_asks_upstream_sub_providers():
    upstream = UpstreamProvider({"q": [Hit("x", 1.0), Hit("y", 0.5)]})
    fusion = FusionProvider([upstream], rank_constant=0)
    assert [(c.chunk_id, c.score) for c in fusion.candidates("q", 2)] == [("x", 1.0), ("y", 0.5)]
    assert upstream.calls == [("q", 2)]


def test_the_server_asks_an_upstream_provider_and_equals_sessions():
    answers = {"a": TURN, "b": [ScoredCandidate("2", 1.0), ScoredCandidate("3", 2.0)], "  ": TURN[1:]}
    graph = line_graph()
    server = MapMatchedServer(graph, provider=UpstreamProvider(answers), candidate_limit=2)
    server.open("s")
    server.open("t")
    sessions = {key: MapMatchedRetriever(graph, provider=UpstreamProvider(answers), candidate_limit=2).session()
                for key in ("s", "t")}
    for queries in ({"s": "a", "t": "b"}, {"s": "b", "t": "  "}):
        results, errors = server.step(queries)
        assert errors == {}
        for key, query in queries.items():
            expected = sessions[key].retrieve(query)
            assert results[key] == expected
            assert results[key].candidates == tuple(answers[query][:2])
    results, errors = server.step({"s": ""})
    assert results == {} and str(errors["s"]) == "query must not be empty"


def test_the_adapters_ask_an_upstream_provider():
    pytest.importorskip("langchain_core")
    from mapmatched_torch.integrations.langchain import as_langchain_retriever

    retriever = MapMatchedRetriever(line_graph(), provider=UpstreamProvider({"q": TURN}), candidate_limit=2)
    documents = {chunk: f"text {chunk}" for chunk in "0123"}
    adapter = as_langchain_retriever(retriever, documents=documents)
    found = adapter.invoke("q")
    report = found[0].metadata["map_matched"]
    assert report["chunk_id"] == "1" and report["raw_score"] == 3.0 and report["normalized_score"] == 1.0
    assert report["trajectory_score"] == adapter.last_result.candidate_ranking[0].trajectory_score
    again = asyncio.run(adapter.ainvoke("q"))  # no aretrieve: candidates runs in the executor
    assert [d.page_content for d in again] == [d.page_content for d in found]
    assert adapter.last_result.path.chunk_ids == ("1", "1")
    server = MapMatchedServer(line_graph(), provider=UpstreamProvider({"q": TURN}), candidate_limit=2)
    served = as_langchain_retriever(server, session_id="s", documents=documents)
    assert [d.page_content for d in served.invoke("q")] == [d.page_content for d in found]
    assert served.last_result == retriever.session().retrieve("q")


# ----------------------------------------------------------------- point 2: decoders


def test_a_decoder_with_only_decode_works_and_ranks_nothing():
    decoder = UpstreamDecoder()
    session = MapMatchedRetriever(line_graph(), decoder=decoder, fixed_lag=0).session()
    reference = MapMatchedRetriever(line_graph(), fixed_lag=0).session()
    for turn in (TURN, [ScoredCandidate("2", 1.0), ScoredCandidate("0", 0.0)], TURN):
        result, expected = session.retrieve_candidates(turn), reference.retrieve_candidates(turn)
        assert result.candidate_ranking == ()
        assert result.path.chunk_ids == expected.path.chunk_ids
        # the committed boundary is the session's (T - L - 1), not the decoder's path's
        assert result.trace.committed_through_index == expected.trace.committed_through_index
        assert result.trace.fixed_lag == 0
    assert decoder.calls == [0, 0, 0]
    assert [r.chunk_id for r in expected.candidate_ranking][:1] == [expected.chunk_id]


def test_a_decoder_revising_a_committed_turn_is_caught_by_the_session():
    class Revising(UpstreamDecoder):
        def decode(self, trellis, *, graph, **options):
            path = super().decode(trellis, graph=graph, **options)
            if len(trellis) < 3:
                return path
            first = trellis[0][1]  # not the decoded chunk: a revision of committed turn 0
            step = dataclasses.replace(path.steps[0], chunk_id=first.chunk_id)
            steps = (step,) + path.steps[1:]
            return dataclasses.replace(path, steps=steps, chunk_ids=tuple(s.chunk_id for s in steps))

    session = MapMatchedRetriever(line_graph(), decoder=Revising(), fixed_lag=1).session()
    session.retrieve_candidates(TURN)
    session.retrieve_candidates(TURN)
    with pytest.raises(RuntimeError, match=r"^fixed-lag decoder revised a committed turn"):
        session.retrieve_candidates(TURN)
    assert session.turn_count == 2


# ----------------------------------------------------------------- points 3 and 4: results


def test_candidate_score_has_upstreams_fields_and_messages():
    ranked = CandidateScore(chunk_id="a", trajectory_score=2.5)
    assert ranked.trajectory_score == 2.5 and [f.name for f in dataclasses.fields(ranked)] == ["chunk_id", "trajectory_score"]
    with pytest.raises(ValueError, match="^candidate score chunk_id must not be empty$"):
        CandidateScore("", 1.0)
    with pytest.raises(ValueError, match="^trajectory score must be finite"):
        CandidateScore("a", math.nan)


def test_a_ranking_holds_trajectory_scores():
    session = MapMatchedRetriever(line_graph(), score_normalization="none").session()
    session.retrieve_candidates([ScoredCandidate("0", 5.0)])
    result = session.retrieve_candidates([ScoredCandidate("3", 1.0), ScoredCandidate("1", 0.0)])
    assert [(r.chunk_id, r.trajectory_score) for r in result.candidate_ranking] == [("1", 4.0), ("3", 3.0)]


# ----------------------------------------------------------------- point 5: errors


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"candidate_limit": 0}, ValueError, "candidate_limit must be greater than zero"),
        ({"context_limit": 0}, ValueError, "context_limit must be greater than zero"),
        ({"emission_weight": -1.0}, ValueError, "emission_weight must be finite and nonnegative"),
        ({"transition_weight": math.inf}, ValueError, "transition_weight must be finite and nonnegative"),
        ({"fixed_lag": -1}, ValueError, "fixed_lag must be nonnegative"),
        ({"context_radius": -1.0}, ValueError, "context_radius must be finite and nonnegative"),
        ({"context_radius": math.inf}, ValueError, "context_radius must be finite and nonnegative"),
    ],
)
def test_retriever_errors_start_with_upstreams_text(options, error, message):
    with pytest.raises(error) as caught:
        MapMatchedRetriever(line_graph(), **options)
    assert str(caught.value).startswith(message)


def test_session_errors_start_with_upstreams_text_and_leave_the_session_clean():
    session = MapMatchedRetriever(line_graph()).session()
    with pytest.raises(ValueError, match="^query must not be empty$"):
        session.retrieve("")
    with pytest.raises(RuntimeError, match="^retrieve\\(query\\) requires a CandidateProvider; use retrieve_candidates instead"):
        session.retrieve("   ")  # whitespace is not empty upstream: the provider check comes next
    first = session.retrieve_candidates(TURN)
    for bad, message in (
        ([], "candidate set must not be empty"),
        ([ScoredCandidate("0", 1.0), ScoredCandidate("0", 2.0)], "candidate chunk_ids must be unique within a turn"),
    ):
        with pytest.raises(ValueError) as caught:
            session.retrieve_candidates(bad)
        assert str(caught.value).startswith(message) and "turn 1" in str(caught.value)
        assert session.turn_count == 1 and session.path is first.path and session.trace is first.trace


def test_the_eval_harness_asks_an_upstream_provider_as_it_searches_a_dense_one():
    from mapmatched_torch.eval.candidates import retrieve_candidates
    from mapmatched_torch.eval.embedders import HashEmbedder

    passages = ["p0", "p1", "p2", "p3"]
    embedder = HashEmbedder(dim=16)
    dense = DenseProvider(embedder.encode(["alpha beta", "beta gamma", "gamma delta", "delta alpha"]), passages,
                          embed_query=lambda text: embedder.encode([text])[0])
    texts = [["alpha", "gamma"], ["delta beta"]]
    searched = retrieve_candidates(texts, embedder, dense, 3)
    only = UpstreamProvider({})
    only.candidates = dense.candidates  # upstream's method only: no search_tensors, no retrieve
    asked = retrieve_candidates(texts, None, only, 3, passage_ids=passages)
    assert torch.equal(asked.index, searched.index.cpu()) and torch.equal(asked.mask, searched.mask.cpu())
    assert torch.equal(asked.scores, searched.scores.cpu())
    with pytest.raises(ValueError, match="no search_tensors: pass passage_ids="):
        retrieve_candidates(texts, None, only, 3)
    stranger = UpstreamProvider({"alpha": [Hit("elsewhere", 1.0)]})
    with pytest.raises(ValueError, match="gave chunk 'elsewhere', not a passage for conversation 0 turn 0"):
        retrieve_candidates([["alpha"]], None, stranger, 3, passage_ids=passages)


def test_the_retriever_names_the_first_bad_option_in_upstreams_order():
    with pytest.raises(ValueError, match="^context_limit must be greater than zero"):
        MapMatchedRetriever(line_graph(), context_limit=0, score_normalization="minmax")
    with pytest.raises(ValueError, match="^candidate_limit must be greater than zero"):
        MapMatchedRetriever(line_graph(), candidate_limit=0, emission_weight=-1.0)
