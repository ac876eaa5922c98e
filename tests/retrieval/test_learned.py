"""Learned transitions in sessions: the standalone reference given the model's costs ==
sessions (standalone and streaming TorchDecoder) == decode_weighted with model.bind(features)."""

from __future__ import annotations

import random

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import DecoderCandidate, ScoredCandidate
from mapmatched_torch.kernels.gate_features import gate_features
from mapmatched_torch.kernels.transitions import GatedTransitions, decode_weighted
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.retrieval.torch_decoder import TorchDecoder
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

from .test_torch_decoder import random_graph


def random_model(rng: random.Random, *, features: int = 1, calibrate: bool = False, beta: float = None):
    model = GatedTransitions(rng.choice([0.25, 1.0, 2.5]) if beta is None else beta, num_features=features,
                             calibrate=calibrate, cap=rng.choice([1.5, 4.0]))
    with torch.no_grad():
        if features:
            model.gate_bias.fill_(rng.uniform(-1.0, 1.0))
            model.gate_weights.fill_(rng.uniform(-2.0, 2.0))
            model.feature_mean.fill_(rng.uniform(-0.5, 0.5))
            model.feature_std.fill_(rng.uniform(0.5, 2.0))
    return model.requires_grad_(False)


def random_turns(rng: random.Random, pool, turns: int, width: int, integer: bool):
    conversation = []
    for _ in range(turns):
        chunks = rng.sample(pool, rng.randint(1, min(width, len(pool))))
        if integer:
            scores = [float(rng.randint(-2, 2)) for _ in chunks]
        else:
            scores = [rng.choice([rng.gauss(0.0, 1.0), 0.5, 0.5, -1.0]) for _ in chunks]
        conversation.append([ScoredCandidate(c, s) for c, s in zip(chunks, scores)])
    return conversation


def reference_path(retriever: MapMatchedRetriever, model, normalized_turns, queries=None, passages=None, ids=None):
    """decode_weighted with model.bind(features) over the whole conversation: (path indices, final scores)."""
    turns, width = len(normalized_turns), retriever.candidate_limit
    numbers = {}
    index = torch.full((1, turns, width), -1, dtype=torch.long)
    scores = torch.zeros((1, turns, width), dtype=torch.float64)
    mask = torch.zeros((1, turns, width), dtype=torch.bool)
    for t, turn in enumerate(normalized_turns):
        for m, candidate in enumerate(turn):
            key = ids.index(candidate.chunk_id) if passages is not None else numbers.setdefault(candidate.chunk_id, len(numbers))
            index[0, t, m] = key
            scores[0, t, m] = candidate.normalized_score
            mask[0, t, m] = True
    features = gate_features(index, scores, mask, queries, passages)
    distances = torch.zeros((1, max(turns - 1, 0), width, width), dtype=torch.float64)
    for t in range(1, turns):
        for j, a in enumerate(normalized_turns[t - 1]):
            for i, b in enumerate(normalized_turns[t]):
                distances[0, t - 1, j, i] = retriever.graph.distance(a.chunk_id, b.chunk_id)
    emissions = torch.where(mask, retriever.emission_weight * scores, 0.0)
    decoded = decode_weighted(emissions, distances, mask, model.bind(features), retriever.fixed_lag)
    return decoded.paths[0, :turns].tolist()


def run_sessions(retrievers, conversation, embeddings=None):
    sessions = [r.session() for r in retrievers]
    results = []
    for t, turn in enumerate(conversation):
        extra = {} if embeddings is None else {"query_embedding": embeddings[t]}
        results.append([s.retrieve_candidates(turn, **extra) for s in sessions])
    return sessions, results


def assert_same_results(results):
    for per_turn in results:
        first = per_turn[0]
        for other in per_turn[1:]:
            assert other.path == first.path  # every reported number, bit for bit (dataclass equality)
            assert other.candidate_ranking == first.candidate_ranking
            assert other.trace.to_dict() == first.trace.to_dict()


@pytest.mark.parametrize("calibrate", [False, True])
def test_sessions_with_a_learned_model_equal_the_reference_and_decode_weighted(calibrate):
    rng = random.Random(7 + calibrate)
    for case in range(60):
        integer = rng.random() < 0.5
        nodes = [f"n{i}" for i in range(rng.randint(2, 8))]
        graph = random_graph(rng, nodes, integer)
        pool = nodes + ["ghost-1", "ghost-2"]  # unknown IDs
        width = rng.randint(1, 5)
        conversation = random_turns(rng, pool, rng.randint(1, 5), width, integer)
        model = random_model(rng, features=rng.choice([0, 1, 1]), calibrate=calibrate,
                             beta=0.0 if case % 10 == 0 else None)
        options = dict(candidate_limit=width, emission_weight=rng.choice([0.5, 1.0]),
                       fixed_lag=rng.choice([None, None, 0, 1, 3]), transitions=model,
                       score_normalization=rng.choice(["zscore", "none"]))
        retrievers = [MapMatchedRetriever(graph, **options), MapMatchedRetriever(graph, decoder=TorchDecoder(), **options)]
        sessions, results = run_sessions(retrievers, conversation)
        assert_same_results(results)
        if options["fixed_lag"] is None and not model.is_zero:
            chosen = reference_path(retrievers[0], model, sessions[0].trellis)
            names = [turn[i].chunk_id for turn, i in zip(sessions[0].trellis, chosen)]
            assert list(results[-1][0].path.chunk_ids) == names


def test_the_reported_costs_are_the_models_and_the_standalone_reference_takes_them():
    rng = random.Random(3)
    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c"), ("c", "d")], maximum_distance=3.0)
    model = random_model(rng, calibrate=True)
    retriever = MapMatchedRetriever(graph, candidate_limit=3, transitions=model)
    session = retriever.session()
    turns = [[("a", 1.0), ("d", 0.9)], [("b", 0.2), ("c", 0.5), ("x", 0.1)], [("d", 1.0), ("a", 1.0)]]
    for turn in turns:
        result = session.retrieve_candidates(turn)
    assert retriever.transition_weight == float(model.effective_transition_weight)
    # the costs, as tables, into the standalone decoder directly: the same path and numbers
    costs = []
    for t in range(1, len(turns)):
        table = [[graph.distance(a.chunk_id, b.chunk_id) for b in session.trellis[t]] for a in session.trellis[t - 1]]
        features = retriever.learned.turn_features(
            [c.chunk_id for c in session.trellis[t - 1]], [c.chunk_id for c in session.trellis[t]],
            [c.normalized_score for c in session.trellis[t]], 3)
        costs.append((-model(torch.tensor(table, dtype=torch.float64), features[: len(table)])).tolist())
    path, ranking = StandaloneDecoder().decode_ranked(session.trellis, graph, transition_costs=costs)
    assert path == result.path and ranking == result.candidate_ranking
    step = result.path.steps[1]
    assert step.weighted_transition_cost == costs[0][session.trellis[0].index(
        next(c for c in session.trellis[0] if c.chunk_id == result.path.chunk_ids[0]))][
        [c.chunk_id for c in session.trellis[1]].index(step.chunk_id)]


def test_the_cosine_feature_needs_embeddings_and_matches_decode_weighted():
    rng = random.Random(11)
    nodes = [f"n{i}" for i in range(6)]
    graph = random_graph(rng, nodes, False)
    passages = torch.randn(len(nodes), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    model = random_model(rng)
    conversation = random_turns(rng, nodes, 4, 3, False)
    queries = torch.randn(len(conversation), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    options = dict(candidate_limit=3, transitions=model, passage_embeddings=passages, passage_ids=nodes)
    retrievers = [MapMatchedRetriever(graph, **options), MapMatchedRetriever(graph, decoder=TorchDecoder(), **options)]
    sessions, results = run_sessions(retrievers, conversation, queries)
    assert_same_results(results)
    chosen = reference_path(retrievers[0], model, sessions[0].trellis, queries.unsqueeze(0), passages, nodes)
    assert list(results[-1][0].path.chunk_ids) == [turn[i].chunk_id for turn, i in zip(sessions[0].trellis, chosen)]
    # without the query embedding after the first turn: a clear error, the session unchanged
    session = retrievers[1].session()
    session.retrieve_candidates(conversation[0])
    with pytest.raises(MapMatchedValueError, match="query embedding"):
        session.retrieve_candidates(conversation[1])
    assert session.turn_count == 1
    bad = MapMatchedRetriever(graph, candidate_limit=3, transitions=model, passage_embeddings=passages[:2],
                              passage_ids=nodes[:2]).session()
    bad.retrieve_candidates([("n3", 1.0)])
    with pytest.raises(MapMatchedValueError, match="no passage embedding"):
        bad.retrieve_candidates([("n0", 1.0)], query_embedding=queries[1])


def test_transitions_are_checked_at_the_edge():
    graph = InMemoryCorpusGraph.from_edges([("a", "b")])
    with pytest.raises(MapMatchedValueError, match="GatedTransitions"):
        MapMatchedRetriever(graph, transitions=0.5)
    with pytest.raises(MapMatchedValueError, match="num_features=2"):
        MapMatchedRetriever(graph, transitions=GatedTransitions(1.0, num_features=2))
    negative = GatedTransitions(1.0, num_features=1)
    with torch.no_grad():
        negative.transition_weight.fill_(-0.5)
    with pytest.raises(MapMatchedValueError, match="finite and nonnegative"):
        MapMatchedRetriever(graph, transitions=negative)
    with pytest.raises(MapMatchedValueError, match="go with transitions"):
        MapMatchedRetriever(graph, passage_embeddings=torch.zeros(2, 3))
    with pytest.raises(MapMatchedValueError, match="passage_ids"):
        MapMatchedRetriever(graph, transitions=GatedTransitions(1.0, num_features=1), passage_embeddings=torch.zeros(2, 3))

    class UpstreamDecoder:
        def decode(self, trellis, graph, **options):
            raise AssertionError

    with pytest.raises(MapMatchedValueError, match="streams"):
        MapMatchedRetriever(graph, decoder=UpstreamDecoder(), transitions=GatedTransitions(1.0))


def test_the_standalone_reference_checks_its_cost_tables():
    graph = InMemoryCorpusGraph.from_edges([("a", "b")])
    trellis = [[DecoderCandidate("a", 1.0, 1.0)], [DecoderCandidate("b", 1.0, 1.0), DecoderCandidate("c", 0.0, 0.0)]]
    with pytest.raises(MapMatchedValueError, match="1 tables"):
        StandaloneDecoder().decode(trellis, graph, transition_costs=[])
    with pytest.raises(MapMatchedValueError, match="at least 1 x 2"):
        StandaloneDecoder().decode(trellis, graph, transition_costs=[[[0.0]]])
    with pytest.raises(MapMatchedValueError, match="finite"):
        StandaloneDecoder().decode(trellis, graph, transition_costs=[[[0.0, float("nan")]]])
    # a function of the turn and its distance table: here 5 * d, so "c" (d = 10) loses
    path = StandaloneDecoder().decode(trellis, graph, transition_costs=lambda t, d: [[5 * x for x in row] for row in d])
    assert path.chunk_ids == ("a", "b") and path.steps[1].weighted_transition_cost == 5.0
