"""TorchDecoder == StandaloneDecoder (paths, committed turns, float64 scores, rankings)."""

from __future__ import annotations

import random

import pytest
import torch

from mapmatched_torch.core.models import DecoderCandidate, ScoredCandidate
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.retrieval.torch_decoder import TorchDecoder
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

STANDALONE = StandaloneDecoder()


def random_graph(rng, nodes, integer):
    edges = []
    for _ in range(rng.randint(0, 2 * len(nodes))):
        a, b = rng.sample(nodes, 2)
        weight = float(rng.randint(1, 3)) if integer else rng.choice([rng.uniform(0.1, 3.0), 0.5, 1.0])
        edges.append((a, b, weight))
    return InMemoryCorpusGraph(
        edges, nodes=nodes, directed=rng.random() < 0.3, maximum_distance=rng.choice([2.0, 3.0, 5.0])
    )


def random_trellis(rng, pool, turns, width, integer):
    trellis = []
    for _ in range(turns):
        chunks = rng.sample(pool, rng.randint(1, min(width, len(pool))))
        if integer:
            scores = [float(rng.randint(-2, 2)) for _ in chunks]
        else:
            scores = [rng.choice([rng.gauss(0.0, 1.0), 0.5, 0.5, -1.0]) for _ in chunks]
        trellis.append([DecoderCandidate(c, s * 3.0, s) for c, s in zip(chunks, scores)])
    return trellis


def random_case(rng):
    integer = rng.random() < 0.5
    nodes = [f"n{i}" for i in range(rng.randint(2, 8))]
    graph = random_graph(rng, nodes, integer)
    pool = nodes + ["ghost-1", "ghost-2"]  # unknown IDs: maximum distance to everything else
    trellis = random_trellis(rng, pool, rng.randint(1, 6), rng.randint(1, 5), integer)
    options = {
        "emission_weight": rng.choice([0.0, 0.5, 1.0, 2.0]),
        "transition_weight": rng.choice([0.0, 0.25, 1.0, 3.0]),
        "fixed_lag": rng.choice([None, None, 0, 1, 2, 3, 7]),
    }
    return trellis, graph, options


def test_single_conversation_parity_randomized():
    rng = random.Random(0)
    decoder = TorchDecoder()
    for _ in range(1500):
        trellis, graph, options = random_case(rng)
        expected = STANDALONE.decode_ranked(trellis, graph, **options)
        assert decoder.decode_ranked(trellis, graph, **options) == expected


def test_batch_parity_ragged():
    rng = random.Random(1)
    decoder = TorchDecoder()
    for _ in range(60):
        nodes = [f"n{i}" for i in range(8)]
        graph = random_graph(rng, nodes, integer=rng.random() < 0.5)
        options = {"emission_weight": 1.0, "transition_weight": rng.choice([0.0, 1.0, 2.0]), "fixed_lag": rng.choice([None, 0, 2])}
        batch = [random_trellis(rng, nodes + ["ghost"], rng.randint(1, 6), 5, integer=rng.random() < 0.5) for _ in range(rng.randint(1, 9))]
        got = decoder.decode_batch_ranked(batch, graph, **options)
        assert got == [STANDALONE.decode_ranked(t, graph, **options) for t in batch]
        assert decoder.decode_batch(batch, graph, **options) == [path for path, _ in got]


def test_exact_ties_follow_candidate_order():
    graph = InMemoryCorpusGraph.from_edges([("a", "x"), ("b", "x")])
    trellis = [
        [DecoderCandidate("b", 1.0, 1.0), DecoderCandidate("a", 1.0, 1.0)],
        [DecoderCandidate("y", 0.0, 0.0), DecoderCandidate("x", 0.0, 0.0)],
    ]
    for lag in (None, 0, 1):
        torch_path = TorchDecoder().decode(trellis, graph, fixed_lag=lag)
        assert torch_path == STANDALONE.decode(trellis, graph, fixed_lag=lag)
        assert torch_path.chunk_ids == ("b", "x")


def test_errors_match_the_standalone_messages():
    graph = InMemoryCorpusGraph.from_edges([("a", "b")])
    decoder = TorchDecoder()
    for bad, message in (([], "at least one turn"), ([[]], "turn 0 must contain candidates")):
        with pytest.raises(ValueError, match=message):
            decoder.decode(bad, graph)
    overflow = [[DecoderCandidate("a", 1e308, 1e308)], [DecoderCandidate("b", 1e308, 1e308)]]
    with pytest.raises(ValueError, match="decoder accumulation produced a nonfinite score"):
        decoder.decode(overflow, graph)
    with pytest.raises(ValueError, match="conversation 1: trellis turn 0 contains duplicate"):
        decoder.decode_batch(
            [[[DecoderCandidate("a", 1.0, 1.0)]], [[DecoderCandidate("a", 1.0, 1.0), DecoderCandidate("a", 0.0, 0.0)]]],
            graph,
        )
    with pytest.raises(ValueError, match="transition_weight must be finite and nonnegative"):
        decoder.decode([[DecoderCandidate("a", 1.0, 1.0)]], graph, transition_weight=-1.0)


def test_float32_paths_equal_float64_on_generic_inputs():
    rng = random.Random(2)
    fast, exact = TorchDecoder(dtype=torch.float32), TorchDecoder()
    nodes = [f"n{i}" for i in range(30)]
    graph = random_graph(rng, nodes, integer=False)
    batch = [random_trellis(rng, nodes, 8, 6, integer=False) for _ in range(50)]
    for a, b in zip(fast.decode_batch(batch, graph), exact.decode_batch(batch, graph)):
        assert a.chunk_ids == b.chunk_ids


@pytest.mark.parametrize("fixed_lag", [None, 0, 1, 3])
def test_sessions_with_either_decoder_are_identical(fixed_lag):
    rng = random.Random(3)
    nodes = [f"n{i}" for i in range(10)]
    graph = random_graph(rng, nodes, integer=False)
    sessions = [
        MapMatchedRetriever(graph, decoder=decoder, fixed_lag=fixed_lag, transition_weight=1.5).session()
        for decoder in (StandaloneDecoder(), TorchDecoder())
    ]
    for _ in range(8):
        candidates = [ScoredCandidate(c, rng.gauss(0.0, 1.0)) for c in rng.sample(nodes, 4)]
        first, second = (session.retrieve_candidates(candidates) for session in sessions)
        assert first == second


@pytest.mark.cuda
def test_cuda_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = random.Random(4)
    cpu, gpu = TorchDecoder(), TorchDecoder(device="cuda")
    for _ in range(200):
        trellis, graph, options = random_case(rng)
        assert gpu.decode_ranked(trellis, graph, **options) == cpu.decode_ranked(trellis, graph, **options)


def test_parity_with_distances_from_the_tensor_graph():
    from mapmatched_torch.graph import TensorCorpusGraph

    rng = random.Random(7)
    decoder = TorchDecoder()
    for _ in range(150):
        trellis, graph, options = random_case(rng)
        tensor_graph = TensorCorpusGraph.from_graph(graph)
        assert decoder.decode_ranked(trellis, tensor_graph, **options) == STANDALONE.decode_ranked(trellis, graph, **options)
