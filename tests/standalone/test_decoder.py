"""StandaloneDecoder: docs/spec.md section 5, by hand-computed fixtures and brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from mapmatched_torch.core.models import DecoderCandidate
from mapmatched_torch.standalone.decoder import StandaloneDecoder
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph


class TableGraph:
    """A fixture graph answering from a dict of pair distances (maximum elsewhere)."""

    def __init__(self, table, maximum_distance=10.0):
        self.table = table
        self.maximum_distance = maximum_distance
        self.calls = 0

    def distance(self, a, b):
        self.calls += 1
        if a == b:
            return 0.0
        return self.table.get((a, b), self.maximum_distance)

    def neighborhood(self, chunk_id, radius):
        return ()


def turn(*pairs):
    return [DecoderCandidate(chunk, score, score) for chunk, score in pairs]


def random_problem(rng, turns, candidates, integer):
    pool = [f"n{i}" for i in range(max(3, candidates + 1))]
    trellis = []
    for _ in range(turns):
        count = rng.randint(1, candidates)
        chunks = rng.sample(pool, count)
        if integer:
            scores = [float(rng.randint(-2, 2)) for _ in chunks]
        else:
            scores = [rng.choice([rng.uniform(-2, 2), 0.5, -0.25]) for _ in chunks]
        trellis.append([DecoderCandidate(c, s, s) for c, s in zip(chunks, scores)])
    table = {}
    for a in pool:
        for b in pool:
            if a != b:
                table[(a, b)] = float(rng.randint(0, 3)) if integer else rng.choice([rng.uniform(0, 3), 1.0, 2.0])
    return trellis, TableGraph(table, maximum_distance=3.0)


def brute_force(trellis, graph, lam, beta, locks=None):
    """Every path's left-fold score; the best by the decoder's tie rule."""
    choices = [range(len(t)) if locks is None or locks[i] is None else [locks[i]] for i, t in enumerate(trellis)]
    results = []
    for path in itertools.product(*choices):
        score = lam * trellis[0][path[0]].normalized_score
        for t in range(1, len(trellis)):
            d = graph.distance(trellis[t - 1][path[t - 1]].chunk_id, trellis[t][path[t]].chunk_id)
            score = (score - beta * d) + lam * trellis[t][path[t]].normalized_score
        results.append((score, path))
    best = max(score for score, _ in results)
    # Viterbi's rule: among optimal paths, smallest last index, then second-to-last, ...
    tie_winner = min((p for s, p in results if s == best), key=lambda p: tuple(reversed(p)))
    return best, tie_winner


DECODER = StandaloneDecoder()


def test_line_graph_three_turns_by_hand():
    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")], maximum_distance=10.0)
    trellis = [
        turn(("a", 1.0), ("c", 0.0)),
        turn(("c", 1.0), ("b", 0.5)),
        turn(("c", 1.0), ("a", 0.0)),
    ]
    path = DECODER.decode(trellis, graph, emission_weight=2.0, transition_weight=1.0)
    # Paths: a->b->c: 2 + (1 - 1) + (2 - 1) = 2 - 1 + 1 - 1 + 2 = 3.0
    #        a->c->c: 2 - 2 + 2 - 0 + 2 = 4.0 ; c->c->c: 0 + 2 + 2 = 4.0 ; first predecessor wins at turn 1
    # alpha0 = [2, 0]; alpha1(c) = 2 + max(2 - 2, 0 - 0) = 2 + 0 -> first j (a) wins the tie;
    # alpha1(b) = 1 + max(2 - 1, 0 - 1) = 2; alpha2(c) = 2 + max(2 - 0, 2 - 1) = 4
    assert path.chunk_ids == ("a", "c", "c")
    assert [s.cumulative_score for s in path.steps] == [2.0, 2.0, 4.0]
    assert [s.graph_distance for s in path.steps] == [0.0, 2.0, 0.0]
    assert [s.weighted_transition_cost for s in path.steps] == [0.0, 2.0, 0.0]
    assert [s.weighted_emission_score for s in path.steps] == [2.0, 2.0, 2.0]
    assert path.total_score == 4.0
    assert path.fixed_lag is None and path.committed_through_index is None


def test_first_final_candidate_wins_ties():
    graph = TableGraph({})
    path = DECODER.decode([turn(("x", 1.0), ("y", 1.0))], graph)
    assert path.chunk_ids == ("x",)
    path = DECODER.decode([turn(("y", 1.0), ("x", 1.0))], graph)
    assert path.chunk_ids == ("y",)


def test_beta_zero_is_per_turn_argmax_without_distances():
    rng = random.Random(3)
    for _ in range(50):
        trellis, graph = random_problem(rng, rng.randint(1, 5), 4, integer=False)
        graph.calls = 0
        path = DECODER.decode(trellis, graph, emission_weight=1.5, transition_weight=0.0)
        expected = []
        for candidates in trellis:
            scores = [1.5 * c.normalized_score for c in candidates]
            expected.append(candidates[scores.index(max(scores))].chunk_id)
        assert path.chunk_ids == tuple(expected)
        assert all(step.graph_distance == 0.0 for step in path.steps)
        assert graph.calls == 0


def test_beta_zero_ignores_rounding_ties_of_the_accumulation():
    # 1.0 + 1e-17 == 1.0 in float64, but the emissions themselves differ.
    trellis = [turn(("a", 1.0)), [DecoderCandidate("p", 0.0, 0.0), DecoderCandidate("q", 0.0, 1e-17)]]
    path = DECODER.decode(trellis, TableGraph({}), transition_weight=0.0)
    assert path.chunk_ids == ("a", "q")


@pytest.mark.parametrize("integer", [True, False])
def test_brute_force_full_decoding(integer):
    rng = random.Random(11 if integer else 12)
    for _ in range(300):
        trellis, graph = random_problem(rng, rng.randint(1, 5), 4, integer)
        lam = rng.choice([0.0, 0.5, 1.0, 2.0])
        beta = rng.choice([0.25, 1.0, 3.0])
        path = DECODER.decode(trellis, graph, emission_weight=lam, transition_weight=beta)
        best, winner = brute_force(trellis, graph, lam, beta)
        assert path.total_score == best
        if integer:
            assert path.chunk_ids == tuple(trellis[t][i].chunk_id for t, i in enumerate(winner))


def literal_fixed_lag(trellis, graph, lam, beta, lag):
    """SPEC's lock procedure, with brute force as the prefix decoder."""
    locks = [None] * len(trellis)
    history = []
    for t in range(len(trellis)):
        _, prefix_path = brute_force(trellis[: t + 1], graph, lam, beta, locks[: t + 1])
        history.append(prefix_path)
        if t >= lag:
            locks[t - lag] = prefix_path[t - lag]
    best, final = brute_force(trellis, graph, lam, beta, locks)
    return best, final, locks, history


def test_fixed_lag_matches_the_literal_procedure_on_integer_problems():
    rng = random.Random(5)
    for _ in range(200):
        trellis, graph = random_problem(rng, rng.randint(1, 5), 3, integer=True)
        lag = rng.randint(0, 5)
        path = DECODER.decode(trellis, graph, transition_weight=1.0, fixed_lag=lag)
        best, final, locks, history = literal_fixed_lag(trellis, graph, 1.0, 1.0, lag)
        assert path.chunk_ids == tuple(trellis[t][i].chunk_id for t, i in enumerate(final))
        assert path.total_score == best
        committed = len(trellis) - lag - 1
        assert path.committed_through_index == (committed if committed >= 0 else None)
        for t, lock in enumerate(locks):
            if lock is not None:
                assert path.chunk_ids[t] == trellis[t][lock].chunk_id


def test_fixed_lag_committed_turns_never_change_as_turns_arrive():
    rng = random.Random(8)
    for _ in range(100):
        trellis, graph = random_problem(rng, 6, 4, integer=rng.random() < 0.5)
        lag = rng.randint(0, 3)
        previous = None
        for t in range(1, len(trellis) + 1):
            path = DECODER.decode(trellis[:t], graph, fixed_lag=lag)
            if previous is not None and previous.committed_through_index is not None:
                keep = previous.committed_through_index + 1
                assert path.chunk_ids[:keep] == previous.chunk_ids[:keep]
            previous = path


def test_lag_zero_is_causal_filtering():
    # Turn 1's evidence would pull turn 0 to "b", but turn 0 is committed at once.
    graph = TableGraph({("a", "c"): 10.0, ("b", "c"): 0.5, ("c", "a"): 10.0, ("c", "b"): 0.5}, maximum_distance=10.0)
    trellis = [turn(("a", 1.0), ("b", 0.9)), turn(("c", 1.0))]
    assert DECODER.decode(trellis, graph).chunk_ids == ("b", "c")
    lagged = DECODER.decode(trellis, graph, fixed_lag=0)
    assert lagged.chunk_ids == ("a", "c")
    assert lagged.committed_through_index == 1
    assert DECODER.decode(trellis, graph, fixed_lag=1).chunk_ids == ("b", "c")
    assert DECODER.decode(trellis, graph, fixed_lag=1).committed_through_index == 0
    assert DECODER.decode(trellis, graph, fixed_lag=5).committed_through_index is None


def test_lag_at_least_t_minus_one_equals_full_decoding():
    rng = random.Random(21)
    for _ in range(100):
        trellis, graph = random_problem(rng, rng.randint(1, 5), 4, integer=False)
        full = DECODER.decode(trellis, graph)
        for lag in (len(trellis) - 1, len(trellis), len(trellis) + 3):
            lagged = DECODER.decode(trellis, graph, fixed_lag=lag)
            assert lagged.chunk_ids == full.chunk_ids
            assert lagged.total_score == full.total_score


def test_ranking_orders_by_score_then_id_and_uses_the_locks():
    graph = TableGraph({("a", "c"): 10.0, ("b", "c"): 0.5, ("a", "d"): 0.0, ("b", "d"): 1.0}, maximum_distance=10.0)
    trellis = [turn(("a", 1.0), ("b", 0.75)), turn(("d", 1.0), ("c", 1.5))]
    path, ranking = DECODER.decode_ranked(trellis, graph)
    # d: 1 + max(1 - 0, 0.75 - 1) = 2; c: 1.5 + max(1 - 10, 0.75 - 0.5) = 1.75
    assert [(r.chunk_id, r.trajectory_score) for r in ranking] == [("d", 2.0), ("c", 1.75)]
    assert path.chunk_ids[-1] == ranking[0].chunk_id
    # Lag 0 commits the final turn too: only the decoded chunk remains rankable.
    path, ranking = DECODER.decode_ranked(trellis, graph, fixed_lag=0)
    assert [r.chunk_id for r in ranking] == [path.chunk_ids[-1]]


def test_ranking_ties_go_to_the_smaller_chunk_id():
    _, ranking = DECODER.decode_ranked([turn(("z", 1.0), ("m", 1.0))], TableGraph({}))
    assert [r.chunk_id for r in ranking] == ["m", "z"]


@pytest.mark.parametrize(
    "trellis, message",
    [
        ([], "at least one turn"),
        ([[]], "turn 0 must contain candidates"),
        ([turn(("a", 1.0)), []], "turn 1 must contain candidates"),
        ([turn(("a", 1.0), ("a", 2.0))], "turn 0 contains duplicate chunk IDs"),
    ],
)
def test_invalid_trellis(trellis, message):
    with pytest.raises(ValueError, match=message):
        DECODER.decode(trellis, TableGraph({}))


def test_nonfinite_candidate_score_rejected():
    class Loose:
        chunk_id = "a"
        raw_score = 1.0
        normalized_score = math.nan

    with pytest.raises(ValueError, match="finite"):
        DECODER.decode([[Loose()]], TableGraph({}))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"emission_weight": -1.0}, "emission_weight must be finite and nonnegative"),
        ({"emission_weight": math.inf}, "emission_weight must be finite and nonnegative"),
        ({"transition_weight": math.nan}, "transition_weight must be finite and nonnegative"),
        ({"transition_weight": -0.5}, "transition_weight must be finite and nonnegative"),
        ({"fixed_lag": -1}, "fixed_lag must be nonnegative"),
        ({"fixed_lag": 1.5}, "fixed_lag must be an integer"),
        ({"fixed_lag": True}, "fixed_lag must be an integer"),
    ],
)
def test_invalid_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DECODER.decode([turn(("a", 1.0))], TableGraph({}), **kwargs)


def test_nonfinite_accumulation_is_an_error():
    trellis = [turn(("a", 1e308)), turn(("b", 1e308))]
    with pytest.raises(ValueError, match="decoder accumulation produced a nonfinite score"):
        DECODER.decode(trellis, TableGraph({("a", "b"): 0.0}), emission_weight=1.0, transition_weight=1.0)
    with pytest.raises(ValueError, match="nonfinite score"):
        DECODER.decode([turn(("a", 1e308))], TableGraph({}), emission_weight=10.0)


def test_one_turn_one_candidate():
    path, ranking = DECODER.decode_ranked([turn(("only", -3.0))], TableGraph({}), emission_weight=2.0)
    assert path.chunk_ids == ("only",)
    assert path.total_score == -6.0
    assert [(r.chunk_id, r.trajectory_score) for r in ranking] == [("only", -6.0)]


def test_unknown_ids_and_disconnected_graph_pay_the_maximum():
    graph = InMemoryCorpusGraph.from_edges([("a", "b"), ("x", "y")], maximum_distance=4.0)
    trellis = [turn(("a", 1.0), ("x", 0.0)), turn(("y", 2.0), ("ghost", 2.5), ("b", 0.0))]
    path = DECODER.decode(trellis, graph)
    # a->b: 1 - 1 + 0 = 0; x->y: 0 - 1 + 2 = 1; a->ghost: 1 - 4 + 2.5 = -0.5
    assert path.chunk_ids == ("x", "y")
    assert path.total_score == 1.0
