"""Evaluation methods on tiny hand-made inputs; online rankings vs the streaming session, exactly."""

from __future__ import annotations

import math
import random
from typing import List, Tuple

import pytest
import torch

from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever, ScoredCandidate, StandaloneDecoder
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.candidates import Candidates, normalize_candidate_scores
from mapmatched_torch.eval.distances import CorpusDistances
from mapmatched_torch.eval.methods import (
    METHODS,
    MethodSpec,
    Setting,
    geodesic_online_order,
    history_concatenation_scores,
    map_matched_orders,
    maximal_marginal_relevance_order,
    online_forward_scores,
    rank_slots,
    register_method,
    settings_grid,
    similarity_from_distances,
)
from mapmatched_torch.kernels.decode import geodesic_viterbi
from mapmatched_torch.retrieval.torch_decoder import TorchDecoder

INF = math.inf


def _random_world(seed: int, conversations: int = 4, turns: int = 5, width: int = 4, nodes: int = 12):
    """A random weighted graph and ragged candidate tensors (unique passages per turn, continuous scores)."""
    rng = random.Random(seed)
    ids = [f"p{i:02d}" for i in range(nodes)]
    edges = {(a, b): rng.uniform(0.2, 1.7) for a in range(nodes) for b in range(a + 1, nodes) if rng.random() < 0.25}
    graph = InMemoryCorpusGraph([(ids[a], ids[b], d) for (a, b), d in edges.items()], nodes=ids, maximum_distance=3.0)
    index = torch.full((conversations, turns, width), -1, dtype=torch.long)
    scores = torch.zeros((conversations, turns, width), dtype=torch.float64)
    for b in range(conversations):
        length = rng.randint(1, turns)
        for t in range(length):
            count = rng.randint(1, width)
            picked = rng.sample(range(nodes), count)
            values = sorted((rng.gauss(0.0, 1.0) for _ in picked), reverse=True)
            index[b, t, :count] = torch.tensor(picked)
            scores[b, t, :count] = torch.tensor(values, dtype=torch.float64)
    return graph, ids, Candidates(index, scores, index >= 0)


def _session_rankings(graph, ids, cands: Candidates, setting: Setting, decoder) -> List[List[Tuple[str, List]]]:
    """For each conversation and turn: (decoded chunk, [(chunk, score), ...]) of a real session."""
    width = cands.shape[2]
    retriever = MapMatchedRetriever(
        graph, decoder=decoder, candidate_limit=width, emission_weight=setting.emission_weight,
        transition_weight=setting.transition_weight, fixed_lag=setting.fixed_lag,
    )
    out = []
    for b in range(cands.shape[0]):
        session = retriever.session()
        turns = []
        for t in range(int(cands.lengths[b])):
            real = cands.mask[b, t]
            candidates = [ScoredCandidate(ids[i], s) for i, s in
                          zip(cands.index[b, t][real].tolist(), cands.scores[b, t][real].tolist())]
            result = session.retrieve_candidates(candidates)
            turns.append((result.chunk_id, [(c.chunk_id, c.trajectory_score) for c in result.candidate_ranking]))
        out.append(turns)
    return out


SETTINGS = [
    Setting(1.0, 0.7, None),
    Setting(1.3, 0.45, 0),
    Setting(1.0, 0.7, 1),
    Setting(0.8, 1.5, 2),
    Setting(1.0, 2.0, 9),
]


@pytest.mark.parametrize("decoder", [StandaloneDecoder(), TorchDecoder()], ids=["standalone", "torch"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_map_matched_turn_ranking_equals_streaming_session(decoder, seed):
    graph, ids, cands = _random_world(seed)
    normalized = normalize_candidate_scores(cands.scores, cands.mask)
    distances = CorpusDistances(graph, ids).consecutive(cands.index)
    orders = map_matched_orders(normalized, distances, cands.mask, SETTINGS)
    for setting, order in zip(SETTINGS, orders):
        emissions = setting.emission_weight * normalized
        scores = online_forward_scores(emissions, -(setting.transition_weight * distances), cands.mask, setting.fixed_lag)
        expected = _session_rankings(graph, ids, cands, setting, decoder)
        for b, turns in enumerate(expected):
            for t, (chunk, ranking) in enumerate(turns):
                ranked_ids = [ids[int(cands.index[b, t, slot])] for slot in order[b, t] if cands.mask[b, t, slot]]
                assert ranked_ids[0] == chunk, (setting, b, t)
                assert ranked_ids[: len(ranking)] == [c for c, _ in ranking], (setting, b, t)
                ours = [float(scores[b, t, slot]) for slot in order[b, t][: len(ranking)]]
                assert ours == [s for _, s in ranking], (setting, b, t)  # bit for bit
                # candidates a lock excludes come after the ranked ones, -inf
                assert all(float(scores[b, t, slot]) == -INF for slot in order[b, t][len(ranking):]
                           if cands.mask[b, t, slot])


def test_beta_zero_is_pointwise_and_matches_the_session_choice():
    graph, ids, cands = _random_world(3)
    normalized = normalize_candidate_scores(cands.scores, cands.mask)
    setting = Setting(1.0, 0.0, None)
    order = map_matched_orders(normalized, None, cands.mask, [setting])[0]
    assert torch.equal(order, rank_slots(normalized, cands.mask))
    for b, turns in enumerate(_session_rankings(graph, ids, cands, setting, StandaloneDecoder())):
        for t, (chunk, ranking) in enumerate(turns):
            assert ids[int(cands.index[b, t, order[b, t, 0]])] == chunk
            assert [ids[int(cands.index[b, t, s])] for s in order[b, t][: len(ranking)]] == [c for c, _ in ranking]


def test_grid_is_one_stacked_batch_per_lag_and_equals_single_settings():
    graph, ids, cands = _random_world(4, conversations=5)
    normalized = normalize_candidate_scores(cands.scores, cands.mask)
    distances = CorpusDistances(graph, ids).consecutive(cands.index)
    grid = settings_grid((0.5, 1.0), (0.0, 0.3, 1.1), (None, 1))
    assert len(grid) == 12
    together = map_matched_orders(normalized, distances, cands.mask, grid)
    for setting, order in zip(grid, together):
        assert torch.equal(order, map_matched_orders(normalized, distances, cands.mask, [setting])[0])


def test_settings_grid_validates_and_deduplicates():
    assert settings_grid((1, 1.0), (0.5,), (None, None)) == (Setting(1.0, 0.5, None),)
    with pytest.raises(MapMatchedValueError, match="transition_weight"):
        settings_grid((1.0,), (-1.0,))
    with pytest.raises(MapMatchedValueError, match="betas"):
        settings_grid((1.0,), ())
    assert Setting(1.0, 0.25, 2).label == "lambda=1 beta=0.25 lag=2"


def test_rank_slots_ties_by_slot_and_padding_last():
    values = torch.tensor([[1.0, 2.0, 1.0, -INF, 5.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    assert rank_slots(values, mask).tolist() == [[1, 0, 2, 3, 4]]


def test_history_concatenation_on_scores_by_hand():
    # turn 0: passages 5, 7 (normalized 1, -1); turn 1: passages 7, 9 (1, -1)
    index = torch.tensor([[[5, 7], [7, 9]]])
    normalized = torch.tensor([[[1.0, -1.0], [1.0, -1.0]]], dtype=torch.float64)
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    scores = history_concatenation_scores(normalized, index, mask)
    # turn 1: 7 -> mean(-1, 1) = 0; 9 was not retrieved at turn 0 -> turn 0's floor -1: mean(-1, -1)
    assert scores.tolist() == [[[1.0, -1.0], [0.0, -1.0]]]


def test_history_concatenation_ignores_padding_turns_and_slots():
    index = torch.tensor([[[3, -1], [3, 4], [-1, -1]]])
    normalized = torch.tensor([[[0.0, 0.0], [1.0, -1.0], [0.0, 0.0]]], dtype=torch.float64)
    mask = index >= 0
    scores = history_concatenation_scores(normalized, index, mask)
    assert scores.tolist() == [[[0.0, 0.0], [0.5, -0.5], [0.0, 0.0]]]


def test_maximal_marginal_relevance_by_hand():
    scores = torch.tensor([[[1.0, 0.9, 0.0, 0.0]]], dtype=torch.float64)
    mask = torch.tensor([[[True, True, True, False]]])
    similarity = torch.tensor([[[[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0],
                                 [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]]], dtype=torch.float64)
    # lambda 0.5: 0 first (relevance 1); then 2 (0.5*0 - 0.5*0 = 0) beats 1 (0.5*0.9 - 0.5*1 = -0.05)
    assert maximal_marginal_relevance_order(scores, similarity, mask, 0.5).tolist() == [[[0, 2, 1, 3]]]
    # lambda 1: pure relevance = the pointwise order
    assert maximal_marginal_relevance_order(scores, similarity, mask, 1.0).tolist() == [[[0, 1, 2, 3]]]
    with pytest.raises(MapMatchedValueError, match="Maximal Marginal Relevance"):
        maximal_marginal_relevance_order(scores, similarity, mask, 1.5)


def test_similarity_from_graph_distances():
    distances = torch.tensor([[[[0.0, 10.0], [2.5, 0.0]]]], dtype=torch.float64)
    assert similarity_from_distances(distances, 10.0).tolist() == [[[[1.0, 0.0], [0.75, 1.0]]]]


@pytest.mark.parametrize("seed", [0, 5])
def test_geodesic_online_order_matches_prefix_geodesic_viterbi(seed):
    graph, ids, cands = _random_world(seed, conversations=5, turns=5)
    # integer distances make distance ties frequent, so the emission tie-break is exercised
    distances = CorpusDistances(graph, ids).consecutive(cands.index).ceil()
    emissions = normalize_candidate_scores(cands.scores, cands.mask)
    order = geodesic_online_order(emissions, distances, cands.mask)
    for t in range(cands.shape[1]):
        prefix = slice(0, t + 1)
        alive = cands.valid[:, t]
        if not bool(alive.any()):
            continue
        decoded = geodesic_viterbi(emissions[alive][:, prefix], distances[alive][:, :t], cands.mask[alive][:, prefix])
        assert torch.equal(order[alive][:, t, 0], decoded.paths[:, t])


def test_register_method_refuses_duplicates():
    spec = METHODS["pointwise"]
    with pytest.raises(MapMatchedValueError, match="already registered"):
        register_method(spec)
    assert register_method(MethodSpec("pointwise", spec.title, spec.run), replace=True).name == "pointwise"
    METHODS["pointwise"] = spec
