"""The built-in synthetic benchmark: determinism, structure, and that map-matching helps follow-ups only."""

from __future__ import annotations

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.models import ScoredCandidate
from mapmatched_torch.core.scoring import normalize_candidates
from mapmatched_torch.eval.slices import emission_entropy, entropy_slices
from mapmatched_torch.eval.synthetic import DRILL, JUMP, START, make_synthetic
from mapmatched_torch.standalone import InMemoryCorpusGraph, StandaloneDecoder


@pytest.fixture(scope="module")
def bench():
    return make_synthetic(n_conversations=60, turns=6, candidates=12, seed=5)


def test_same_seed_same_benchmark(bench):
    again = make_synthetic(n_conversations=60, turns=6, candidates=12, seed=5)
    for name in ("candidate_index", "candidate_scores", "gold_index", "moves", "ambiguous"):
        assert torch.equal(getattr(again, name), getattr(bench, name)), name
    assert again.dataset == bench.dataset and again.edges == bench.edges and again.config == bench.config
    other = make_synthetic(n_conversations=60, turns=6, candidates=12, seed=6)
    assert not torch.equal(other.candidate_scores, bench.candidate_scores)


def test_shapes_and_candidate_lists(bench):
    B, T, M = 60, 6, 12
    assert bench.candidate_index.shape == (B, T, M) and bench.candidate_index.dtype == torch.long
    assert bench.candidate_scores.shape == (B, T, M) and bench.candidate_scores.dtype == torch.float64
    assert bench.gold_index.shape == (B, T) and bench.moves.shape == (B, T) and bench.ambiguous.dtype == torch.bool
    passages = len(bench.dataset.passages)
    assert passages == 64 * 24 and bool(((bench.candidate_index >= 0) & (bench.candidate_index < passages)).all())
    # provider order: decreasing scores; unique candidates; the gold exactly once
    assert bool((bench.candidate_scores[..., :-1] >= bench.candidate_scores[..., 1:]).all())
    ordered = bench.candidate_index.sort(dim=2).values
    assert bool((ordered[..., 1:] != ordered[..., :-1]).all())
    assert bool(((bench.candidate_index == bench.gold_index.unsqueeze(2)).sum(dim=2) == 1).all())
    first = bench.candidates[0][0]
    assert all(isinstance(candidate, ScoredCandidate) for candidate in first) and len(bench.candidates) == B
    assert [c.chunk_id for c in first] == [bench.dataset.passages[int(i)].id for i in bench.candidate_index[0, 0]]
    assert [c.score for c in first] == bench.candidate_scores[0, 0].tolist()
    edge_index, edge_weight = bench.edge_tensors()
    assert edge_index.shape == (2, 2 * len(bench.edges)) and edge_weight.shape == (2 * len(bench.edges),)
    assert torch.equal(edge_index[:, : len(bench.edges)].flip(0), edge_index[:, len(bench.edges):])


def test_conversations_drill_and_jump(bench):
    dataset = bench.dataset
    ids = dataset.passage_ids
    graph = InMemoryCorpusGraph(bench.edges)
    assert (bench.moves[:, 0] == START).all() and not bench.ambiguous[:, 0].any()
    assert {DRILL, JUMP} <= set(bench.moves[:, 1:].unique().tolist())
    assert not (bench.ambiguous & (bench.moves != DRILL)).any()
    for b, conversation in enumerate(dataset.conversations):
        for t, turn in enumerate(conversation.turns):
            gold = ids[int(bench.gold_index[b, t])]
            assert turn.qrels == {gold: 1.0} and turn.topic_switch == (int(bench.moves[b, t]) == JUMP)
            assert turn.rewrite is not None and (turn.query == turn.rewrite) != bool(bench.ambiguous[b, t])
            if t == 0:
                continue
            previous = ids[int(bench.gold_index[b, t - 1])]
            same_topic = dataset.passage(gold).doc_id == dataset.passage(previous).doc_id
            if int(bench.moves[b, t]) == DRILL:
                assert same_topic and graph.distance(previous, gold) == 1.0
            else:
                assert not same_topic


def test_followups_are_ambiguous_and_map_matching_helps_them_only(bench):
    # emission entropy (lambda = 1, z-scores) separates the two kinds of turn
    scores = bench.candidate_scores
    normalized = (scores - scores.mean(2, keepdim=True)) / scores.std(2, unbiased=False, keepdim=True)
    entropy = emission_entropy(normalized)
    assert float(entropy[bench.ambiguous].mean()) > float(entropy[~bench.ambiguous].mean()) + 0.3
    sliced = entropy_slices(entropy, torch.arange(6))
    agreement = (sliced.followup == bench.ambiguous)[:, 1:].double().mean()
    assert float(agreement) > 0.8

    graph = InMemoryCorpusGraph(bench.edges)
    decoder = StandaloneDecoder()
    gold = [[bench.dataset.passage_ids[int(i)] for i in row] for row in bench.gold_index]

    def accuracy(beta: float) -> torch.Tensor:
        hits = torch.zeros(bench.gold_index.shape, dtype=torch.bool)
        for b, turns in enumerate(bench.candidates):
            trellis = [normalize_candidates(turn) for turn in turns]
            path = decoder.decode(trellis, graph, emission_weight=1.0, transition_weight=beta)
            hits[b] = torch.tensor([chosen == truth for chosen, truth in zip(path.chunk_ids, gold[b])])
        return hits.double()

    pointwise, matched = accuracy(0.0), accuracy(0.5)
    followup_lift = float(matched[bench.ambiguous].mean() - pointwise[bench.ambiguous].mean())
    standalone_change = float(matched[~bench.ambiguous].mean() - pointwise[~bench.ambiguous].mean())
    assert float(pointwise[bench.ambiguous].mean()) < 0.5  # the pointwise top-1 is often wrong
    assert float(pointwise[~bench.ambiguous].mean()) > 0.9
    assert followup_lift > 0.25
    assert standalone_change > -0.03


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"candidates": 2}, "candidates must be an int >= 3"),
        ({"candidates": 20, "topics": 10}, r"candidates \(20\) must not exceed topics \(10\)"),
        ({"jump_probability": 1.5}, "jump_probability must be a number in"),
        ({"n_conversations": 0}, "n_conversations must be an int >= 1"),
        ({"turns": 2.0}, "turns must be an int"),
    ],
)
def test_synthetic_validation(kwargs, message):
    with pytest.raises(MapMatchedValueError, match=message):
        make_synthetic(**kwargs)


def test_small_and_single_turn_benchmarks():
    tiny = make_synthetic(n_conversations=1, turns=1, candidates=3, seed=0, topics=3, passages_per_topic=3, cross_links=0)
    assert tiny.candidate_index.shape == (1, 1, 3) and tiny.dataset.num_turns == 1
    assert len(tiny.edges) == 3 * 2


def test_tensor_helpers_match_the_dataset(bench):
    from mapmatched_torch.kernels.ranking_metrics import pack_qrels

    packed = pack_qrels(bench.dataset.turn_qrels(), bench.dataset.passage_index)
    qrels = bench.qrels()
    assert torch.equal(qrels.ids, packed.ids) and torch.equal(qrels.grades, packed.grades)
    table = bench.dataset.turn_table()
    assert torch.equal(bench.conversation_index(), table.conversation)
    assert torch.equal(bench.topic_switch.reshape(-1), table.topic_switch == 1)
    assert bench.shape == (60, 6, 12)


def test_without_conversations_the_tensors_are_the_same(bench):
    lean = make_synthetic(n_conversations=60, turns=6, candidates=12, seed=5, with_conversations=False)
    assert lean.dataset.conversations == () and lean.dataset.passages == bench.dataset.passages
    assert torch.equal(lean.candidate_index, bench.candidate_index)
    assert torch.equal(lean.candidate_scores, bench.candidate_scores)
    assert torch.equal(lean.qrels().ids, bench.qrels().ids)


# --------------------------------------------------------------------------- streaming


def test_a_stream_is_the_same_in_any_chunks_and_deterministic():
    from mapmatched_torch.eval.synthetic import synthetic_stream

    options = dict(block_size=8, topics=16, passages_per_topic=6)
    stream = synthetic_stream(30, 4, 6, seed=2, **options)
    whole = stream.materialize()
    for size in (1, 7, 8, 30):
        for name in ("candidate_index", "candidate_scores", "gold_index", "moves", "ambiguous"):
            parts = torch.cat([getattr(chunk, name) for chunk in stream.chunks(size)])
            assert torch.equal(parts, getattr(whole, name)), (size, name)
    # any range, even across blocks, from a fresh stream (no cache)
    again = synthetic_stream(30, 4, 6, seed=2, **options)
    assert torch.equal(again.select(5, 19).candidate_scores, whole.candidate_scores[5:19])
    assert again.edges == stream.edges and again.dataset == stream.dataset
    # the seed and the block size define the content; more conversations only append
    longer = synthetic_stream(50, 4, 6, seed=2, **options)
    assert torch.equal(longer.select(0, 30).candidate_index, whole.candidate_index)
    assert not torch.equal(synthetic_stream(30, 4, 6, seed=3, **options).materialize().candidate_scores,
                           whole.candidate_scores)
    assert not torch.equal(synthetic_stream(30, 4, 6, seed=2, **dict(options, block_size=4)).materialize()
                           .candidate_scores, whole.candidate_scores)


def test_a_stream_follows_the_generators_model():
    from mapmatched_torch.eval.synthetic import synthetic_stream

    bench = synthetic_stream(40, 5, 8, seed=1, block_size=16).materialize()
    assert bench.candidate_index.shape == (40, 5, 8) and bench.dataset.conversations == ()
    assert bool((bench.candidate_scores[..., :-1] >= bench.candidate_scores[..., 1:]).all())
    assert bool((bench.candidate_index == bench.gold_index.unsqueeze(2)).sum(dim=2).eq(1).all())  # gold once
    assert bool((bench.moves[:, 0] == START).all()) and bool(((bench.moves[:, 1:] == DRILL)
                                                              | (bench.moves[:, 1:] == JUMP)).all())
    assert bench.config["stream"] and bench.config["block_size"] == 16


def test_a_stream_rejects_bad_arguments_and_ranges():
    from mapmatched_torch.eval.synthetic import synthetic_stream

    with pytest.raises(MapMatchedValueError, match="unknown synthetic option"):
        synthetic_stream(10, topic=3)
    with pytest.raises(MapMatchedValueError, match="block_size"):
        synthetic_stream(10, block_size=0)
    with pytest.raises(MapMatchedValueError, match="candidates"):
        synthetic_stream(10, candidates=2)
    stream = synthetic_stream(10, 2, 4, topics=8, passages_per_topic=4)
    for start, stop in ((3, 3), (-1, 2), (5, 11)):
        with pytest.raises(MapMatchedValueError, match="select needs"):
            stream.select(start, stop)
