"""retrieval/streaming.py: turns into tensors, step distances, path reports, and
DecodingStream (push / rollback) against the standalone decoder."""

from __future__ import annotations

import random

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import DecoderCandidate
from mapmatched_torch.retrieval.streaming import DecodingStream, report_step, step_distances, turn_tensors
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

from .test_torch_decoder import random_case

STANDALONE = StandaloneDecoder()


def test_turn_tensors_pad_with_zeros_and_mask_the_padding():
    scores, mask = turn_tensors([[0.5, -1.0], [2.0], [1.0, 2.0, 3.0]], width=3)
    assert scores.dtype == torch.float64 and mask.dtype == torch.bool
    assert scores.tolist() == [[0.5, -1.0, 0.0], [2.0, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert mask.tolist() == [[True, True, False], [True, False, False], [True, True, True]]


def test_turn_tensors_refuse_a_turn_wider_than_the_decoder():
    with pytest.raises(MapMatchedValueError, match="a turn has 3 candidates but the decoder's width is 2"):
        turn_tensors([[1.0], [1.0, 2.0, 3.0]], width=2)
    assert issubclass(MapMatchedValueError, ValueError)


def test_step_distances_are_the_graphs_and_a_first_turn_gets_the_maximum():
    graph = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "c", 0.5)], maximum_distance=3.0)
    distances = step_distances(graph, [["a", "c"], None], [["b", "x", "c"], ["a"]], width=3)
    # shape: (S, M, M) [s, from, to]
    assert distances.shape == (2, 3, 3) and distances.dtype == torch.float64
    for j, before in enumerate(["a", "c"]):
        for i, after in enumerate(["b", "x", "c"]):
            assert distances[0, j, i].item() == graph.distance(before, after)
    assert distances[0, 2].tolist() == [3.0] * 3  # padding rows: the maximum (masked anyway)
    assert distances[1].tolist() == [[3.0] * 3] * 3  # no previous turn


def test_report_step_turns_a_decoded_row_into_the_standalone_report():
    graph = InMemoryCorpusGraph.from_edges([("a", "b")])
    trellis = [[DecoderCandidate("a", 2.0, 1.0), DecoderCandidate("c", 1.0, -1.0)],
               [DecoderCandidate("c", 2.0, 1.0), DecoderCandidate("b", 1.0, -1.0)]]
    expected_path, expected_ranking = STANDALONE.decode_ranked(trellis, graph)
    # What the DP gives, by hand: the path c -> c (candidate indices 1, 0), the distance
    # into each turn along it, and the last turn's forward scores: c max(1 - 10 + 1,
    # -1 + 0 + 1) = 0 (a -> c is a jump: c is not in the graph), b max(1 - 1 - 1, -1 - 10 - 1) = -1
    path, ranking = report_step(trellis, [1, 0], [0.0, 0.0], [0.0, -1.0],
                                emission_weight=1.0, transition_weight=1.0, fixed_lag=None)
    assert path == expected_path and ranking == expected_ranking and path.chunk_ids == ("c", "c")


def stream_for(graph, trellis, options):
    return DecodingStream(graph, max(len(turn) for turn in trellis), **options)


def test_every_push_returns_what_the_standalone_decoder_returns_for_the_prefix():
    rng = random.Random(7)
    for _ in range(150):
        trellis, graph, options = random_case(rng)
        stream = stream_for(graph, trellis, options)
        for t in range(len(trellis)):
            assert stream.push(trellis[t]) == STANDALONE.decode_ranked(trellis[: t + 1], graph, **options)


def test_rollback_undoes_the_last_push_exactly():
    rng = random.Random(8)
    for _ in range(60):
        trellis, graph, options = random_case(rng)
        other, _, _ = random_case(random.Random(rng.random()))
        stream = stream_for(graph, trellis + other, options)
        for t, turn in enumerate(trellis):
            wrong = other[t % len(other)]
            stream.push(wrong)  # a turn the session then rolls back
            stream.rollback()
            assert stream.push(turn) == STANDALONE.decode_ranked(trellis[: t + 1], graph, **options)


def test_rollback_goes_back_one_push_only():
    graph = InMemoryCorpusGraph.from_edges([("a", "b")])
    stream = DecodingStream(graph, 2)
    with pytest.raises(MapMatchedValueError, match="nothing to roll back"):
        stream.rollback()
    stream.push([DecoderCandidate("a", 1.0, 1.0)])
    stream.rollback()
    with pytest.raises(MapMatchedValueError, match="nothing to roll back"):
        stream.rollback()


def test_an_overflowing_push_raises_and_leaves_the_stream_as_it_was():
    graph = InMemoryCorpusGraph.from_edges([("a", "b")])
    stream = DecodingStream(graph, 2, fixed_lag=1)
    first = [DecoderCandidate("a", 1e308, 1e308), DecoderCandidate("b", 0.0, 0.0)]
    stream.push(first)
    with pytest.raises(ValueError, match="nonfinite score at turn 1"):
        stream.push([DecoderCandidate("b", 1e308, 1e308)])
    second = [DecoderCandidate("b", 1.0, 1.0), DecoderCandidate("a", 0.0, 0.0)]
    assert stream.push(second) == STANDALONE.decode_ranked([first, second], graph, fixed_lag=1)
