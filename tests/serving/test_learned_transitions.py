"""Learned transitions in the server: its steps == sessions == the standalone reference,
on every kernel backend, saved with a fingerprint; and the evaluation's gated online
ranking == what a session and the server rank, turn by turn."""

from __future__ import annotations

import random

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.candidates import Candidates, normalize_candidate_scores
from mapmatched_torch.eval.methods.gated import _gated_order, gate_features
from mapmatched_torch.fit.model import MapMatchedModel
from mapmatched_torch.graph.tensor_graph import TensorCorpusGraph
from mapmatched_torch.kernels.fused import use_fused_kernels
from mapmatched_torch.kernels.online import online_forward_scores
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.retrieval.torch_decoder import TorchDecoder
from mapmatched_torch.serving.server import MapMatchedServer
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

from ..retrieval.test_learned import assert_same_results, random_model, random_turns
from ..retrieval.test_torch_decoder import random_graph


def _run(server_options, retriever_options, graph, conversations, embeddings=None):
    """Every conversation stepped together in the server, and each in its own sessions."""
    server = MapMatchedServer(graph, **server_options)
    retrievers = [MapMatchedRetriever(graph, **retriever_options),
                  MapMatchedRetriever(graph, decoder=TorchDecoder(), **retriever_options)]
    sessions = {key: [r.session() for r in retrievers] for key in conversations}
    for key in conversations:
        server.open(key)
    turns = max(len(c) for c in conversations.values())
    for t in range(turns):
        batch = {key: c[t] for key, c in conversations.items() if t < len(c)}
        extra = {} if embeddings is None else {"query_embeddings": {key: embeddings[key][t] for key in batch}}
        results, errors = server.step(batch, **extra)
        assert not errors
        for key, turn in batch.items():
            kwargs = {} if embeddings is None else {"query_embedding": embeddings[key][t]}
            expected = [s.retrieve_candidates(turn, **kwargs) for s in sessions[key]]
            assert_same_results([[results[key], *expected]])
    return server


@pytest.mark.parametrize("calibrate", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_server_steps_equal_sessions_and_the_reference(calibrate, fused):
    rng = random.Random(20 + 2 * calibrate + fused)
    use_fused_kernels(fused)
    try:
        for case in range(12):
            integer = rng.random() < 0.5
            nodes = [f"n{i}" for i in range(rng.randint(2, 7))]
            graph = random_graph(rng, nodes, integer)
            pool = nodes + ["ghost-1", "ghost-2"]  # unknown IDs
            width = rng.randint(1, 4)
            conversations = {k: random_turns(rng, pool, rng.randint(1, 5), width, integer) for k in range(4)}
            model = random_model(rng, features=rng.choice([0, 1, 1]), calibrate=calibrate,
                                 beta=0.0 if case == 0 else None)
            options = dict(candidate_limit=width, emission_weight=rng.choice([0.5, 1.0]),
                           fixed_lag=rng.choice([None, None, 0, 1, 2]), transitions=model)
            _run(options, options, graph, conversations)
    finally:
        use_fused_kernels(True)


def _tensor_graph(rng, nodes):
    edges = [(a, b) for a in range(len(nodes)) for b in range(a + 1, len(nodes)) if rng.random() < 0.4]
    edge_index = torch.tensor(edges, dtype=torch.long).t().reshape(2, -1)
    weights = torch.tensor([rng.choice([0.5, 1.0, 2.0]) for _ in edges], dtype=torch.float64)
    return TensorCorpusGraph.from_edge_index(edge_index, weights, chunk_ids=nodes, num_nodes=len(nodes),
                                             maximum_distance=3.0)


def test_the_cosine_feature_in_the_server_and_its_tensor_steps():
    rng = random.Random(5)
    nodes = [f"n{i}" for i in range(7)]
    graph = _tensor_graph(rng, nodes)
    passages = torch.randn(len(nodes), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    model = random_model(rng, calibrate=True)
    conversations = {k: random_turns(rng, nodes, 4, 3, False) for k in range(3)}
    embeddings = {k: torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + k))
                  for k in conversations}
    # the passage IDs default to the tensor graph's nodes (the server); the session names them
    server = _run(dict(candidate_limit=3, transitions=model, passage_embeddings=passages),
                  dict(candidate_limit=3, transitions=model, passage_embeddings=passages, passage_ids=nodes),
                  graph, conversations, embeddings)
    # step_indexed and the tensor step (synchronizing or not) give the same results
    twin = MapMatchedServer(graph, candidate_limit=3, transitions=model, passage_embeddings=passages)
    graph.precompute_dense()
    device_twin = MapMatchedServer(graph, candidate_limit=3, transitions=model, passage_embeddings=passages)
    for key in conversations:
        twin.open(key)
        device_twin.open(key)
    keys = list(conversations)
    for t in range(4):
        codes = torch.tensor([[nodes.index(c.chunk_id) for c in conversations[k][t]] + [-1] * (3 - len(conversations[k][t]))
                              for k in keys])
        scores = torch.tensor([[c.score for c in conversations[k][t]] + [0.0] * (3 - len(conversations[k][t]))
                               for k in keys], dtype=torch.float64)
        queries = torch.stack([embeddings[k][t] for k in keys])
        results, errors = twin.step_indexed(keys, codes, scores, query_embeddings=queries)
        assert not errors
        step = device_twin.step_slots(device_twin.slots(keys), codes, scores, synchronize=False, contexts=False,
                                      query_embeddings=queries)
        assert bool((step.status == 0).all())
        for row, key in enumerate(keys):
            path = results[key].path
            length = len(path.steps)
            assert step.path_index[row, :length].tolist() == [
                [c.chunk_id for c in conversations[key][s]].index(path.chunk_ids[s]) for s in range(length)]
            assert step.transitions[row, :length].tolist() == [s.weighted_transition_cost for s in path.steps]
    for key in keys:
        assert twin.path(key) == server.path(key)
    # a session past its first turn without a query embedding fails alone
    lonely = MapMatchedServer(graph, candidate_limit=3, transitions=model, passage_embeddings=passages)
    lonely.open("a"), lonely.open("b")
    lonely.step({"a": [("n0", 1.0)], "b": [("n1", 1.0)]})
    results, errors = lonely.step({"a": [("n2", 1.0)], "b": [("n3", 1.0)]}, query_embeddings={"b": embeddings[0][1]})
    assert set(errors) == {"a"} and "query embedding" in str(errors["a"]) and "b" in results
    assert lonely.turn_count("a") == 1 and lonely.turn_count("b") == 2


def test_a_saved_state_carries_the_models_fingerprint_and_refuses_another():
    rng = random.Random(9)
    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")], maximum_distance=3.0)
    model = random_model(rng, calibrate=True)
    server = MapMatchedServer(graph, candidate_limit=2, transitions=model)
    server.open("s")
    server.step({"s": [("a", 1.0), ("c", 0.5)]})
    server.step({"s": [("b", 0.2), ("c", 0.1)]})
    state = server.state_dict()
    assert state["options"]["transitions"]["feature"] == "score-level query-source match"
    again = MapMatchedServer(graph, candidate_limit=2, transitions=model)
    again.load_state_dict(state)
    assert again.path("s") == server.path("s")
    other = random_model(random.Random(10), calibrate=True)
    for refusing in (MapMatchedServer(graph, candidate_limit=2, transitions=other),
                     MapMatchedServer(graph, candidate_limit=2, transition_weight=float(model.transition_weight))):
        with pytest.raises(MapMatchedValueError, match="transitions"):
            refusing.load_state_dict(state)
        assert len(refusing) == 0
    # the fixed model's saved options are unchanged (no transitions entry)
    assert "transitions" not in MapMatchedServer(graph).state_dict()["options"]


@pytest.mark.parametrize("embedded", [False, True])
def test_the_evaluations_gated_online_ranking_is_what_sessions_and_the_server_rank(embedded):
    """The eval's ``gated`` order (online forward scores of model.bind(features)) at every
    turn == the session's ``candidate_ranking`` (its final turn's forward scores), scores
    bit for bit. (The orders differ only in exact ties: eval breaks them by slot, a
    session by chunk ID; random scores have none.)"""
    rng = random.Random(30 + embedded)
    nodes = [f"p{i}" for i in range(9)]
    graph = random_graph(rng, nodes, False)
    batch, turns, width = 3, 4, 4
    generator = torch.Generator().manual_seed(7)
    index = torch.stack([torch.stack([torch.randperm(9, generator=generator)[:width] for _ in range(turns)])
                         for _ in range(batch)])
    counts = torch.randint(1, width + 1, (batch, turns), generator=generator)
    mask = torch.arange(width).view(1, 1, -1) < counts.unsqueeze(-1)
    index = torch.where(mask, index, -1)
    scores = torch.where(mask, torch.randn(batch, turns, width, dtype=torch.float64, generator=generator), 0.0)
    cands = Candidates(index, scores, mask)
    normalized = normalize_candidate_scores(scores, mask)
    queries = passages = None
    if embedded:
        passages = torch.randn(9, 5, generator=generator)
        queries = torch.randn(batch, turns, 5, generator=generator)
    features = gate_features(cands, normalized, queries, passages)
    distances = torch.zeros(batch, turns - 1, width, width, dtype=torch.float64)
    for b in range(batch):
        for t in range(turns - 1):
            for j in range(int(counts[b, t])):
                for i in range(int(counts[b, t + 1])):
                    distances[b, t, j, i] = graph.distance(nodes[index[b, t, j]], nodes[index[b, t + 1, i]])
    gate = random_model(rng, calibrate=embedded)
    model = MapMatchedModel(0.7, transition_model=gate).requires_grad_(False)
    order = _gated_order(model, normalized, distances, mask, features)
    forward = online_forward_scores(model.emissions(normalized, mask), model.transitions(distances, mask, features), mask)
    extra = {} if not embedded else {"passage_embeddings": passages, "passage_ids": nodes}
    session = MapMatchedRetriever(graph, candidate_limit=width, emission_weight=0.7, transitions=gate, **extra)
    server = MapMatchedServer(graph, candidate_limit=width, emission_weight=0.7, transitions=gate, **extra)
    for b in range(batch):
        conversation = session.session()
        server.open(b)
        for t in range(turns):
            turn = [(nodes[index[b, t, m]], float(scores[b, t, m])) for m in range(int(counts[b, t]))]
            kwargs = {} if not embedded else {"query_embedding": queries[b, t]}
            ranking = conversation.retrieve_candidates(turn, **kwargs).candidate_ranking
            results, errors = server.step({b: turn}, **({} if not embedded else {"query_embeddings": {b: queries[b, t]}}))
            assert not errors and results[b].candidate_ranking == ranking
            count = int(counts[b, t])
            expected = [nodes[index[b, t, m]] for m in order[b, t, :count].tolist()]
            assert [item.chunk_id for item in ranking] == expected
            assert [item.trajectory_score for item in ranking] == forward[b, t, order[b, t, :count]].tolist()
