"""Tests of the pure-Python reference kNN graph (docs/spec.md section 4, "kNN graph")."""

from __future__ import annotations

import math
import random
from typing import Dict, FrozenSet, List, Tuple

import numpy as np
import pytest

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph
from mapmatched_torch.standalone.knn import KNNGraph, knn_neighbors

H = 1.0 / math.sqrt(2.0)  # the normalized entries of (1, 1)

# a = (1, 0), b = (0, 1), c = (1, 1) / sqrt 2, d = (-1, 0). Cosine distances:
#   a-b 1, a-c 1 - H, a-d 2, b-c 1 - H, b-d 1, c-d 1 + H
IDS = ["a", "b", "c", "d"]
VECTORS = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0]]


def edge_map(graph: InMemoryCorpusGraph) -> Dict[FrozenSet[str], float]:
    """{frozenset({u, v}): distance}, checking that both directions agree."""
    result: Dict[FrozenSet[str], float] = {}
    for edge in graph.edges():
        key = frozenset((edge.source_chunk_id, edge.target_chunk_id))
        assert result.setdefault(key, edge.distance) == edge.distance
    return result


def test_hand_checked_picks_with_k_1() -> None:
    assert knn_neighbors(IDS, VECTORS, 1) == [
        [("c", 1.0 - H)],
        [("c", 1.0 - H)],
        [("a", 1.0 - H)],  # tie with b at 1 - H: the smaller ID wins
        [("b", 1.0)],  # b at 1 beats c at 1 + H and a at 2
    ]
    graph = KNNGraph.from_embeddings(IDS, VECTORS, neighbor_count=1)
    assert edge_map(graph) == {
        frozenset("ac"): 1.0 - H,
        frozenset("bc"): 1.0 - H,
        frozenset("bd"): 1.0,
    }
    assert graph.nodes == tuple(IDS)
    assert graph.directed is False
    assert graph.distance("a", "b") == (1.0 - H) + (1.0 - H)
    assert graph.distance("a", "d") == ((1.0 - H) + (1.0 - H)) + 1.0


def test_hand_checked_picks_with_k_2_break_ties_by_id() -> None:
    assert knn_neighbors(IDS, VECTORS, 2) == [
        [("c", 1.0 - H), ("b", 1.0)],
        [("c", 1.0 - H), ("a", 1.0)],  # a and d are both at 1.0: a first, d dropped
        [("a", 1.0 - H), ("b", 1.0 - H)],
        [("b", 1.0), ("c", 1.0 + H)],
    ]
    graph = KNNGraph.from_embeddings(IDS, VECTORS, neighbor_count=2)
    assert edge_map(graph) == {
        frozenset("ac"): 1.0 - H,
        frozenset("ab"): 1.0,
        frozenset("bc"): 1.0 - H,
        frozenset("bd"): 1.0,
        frozenset("cd"): 1.0 + H,
    }


def test_ties_go_to_the_smaller_id_whatever_the_input_order() -> None:
    ids = ["q", "m", "z", "centre", "b"]
    vectors = [[0.0, 1.0], [0.0, -1.0], [1.0, 0.0], [1.0, 0.0], [-1.0, 0.0]]
    # from "centre": z at 0, then m and q both at 1 (m wins the tie), b opposite at 2
    picks = knn_neighbors(ids, vectors, 2)[3]
    assert picks == [("z", 0.0), ("m", 1.0)]


def test_k_at_least_n_connects_everyone() -> None:
    graph = KNNGraph.from_embeddings(IDS, VECTORS, neighbor_count=10)
    assert graph.neighbor_count == 10
    assert len(edge_map(graph)) == 6
    assert graph.edge_count == 12
    assert all(len(picks) == 3 for picks in knn_neighbors(IDS, VECTORS, 10))
    assert edge_map(graph)[frozenset("ad")] == 2.0


def test_identical_vectors_get_minimum_edge_distance() -> None:
    ids = ["x", "y", "z", "w"]
    vectors = [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [3.0, 6.0, 9.0], [0.1, 0.2, 0.3]]
    for picks in knn_neighbors(ids, vectors, 3):
        assert all(distance <= 1e-15 for _, distance in picks)
    graph = KNNGraph.from_embeddings(ids, vectors, neighbor_count=3, minimum_edge_distance=0.125)
    assert set(edge_map(graph).values()) == {0.125}
    assert graph.minimum_edge_distance == 0.125
    default = KNNGraph.from_embeddings(ids, vectors, neighbor_count=3)
    assert set(edge_map(default).values()) == {1e-6}
    assert default.distance("x", "y") == 1e-6 and default.distance("x", "y") > 0.0


def test_edge_distance_is_capped_at_maximum_distance() -> None:
    graph = KNNGraph.from_embeddings(IDS, VECTORS, neighbor_count=3, maximum_distance=1.5)
    assert edge_map(graph)[frozenset("ad")] == 1.5
    assert edge_map(graph)[frozenset("cd")] == 1.5
    assert edge_map(graph)[frozenset("ab")] == 1.0
    assert graph.maximum_distance == 1.5


def test_mutual_picks_make_one_edge_with_the_smaller_distance() -> None:
    # a and c pick each other (k = 1); b also picks c; the a-c edge exists once per direction.
    graph = KNNGraph.from_embeddings(IDS, VECTORS, neighbor_count=1)
    assert graph.neighbors("a") == (("c", 1.0 - H),)
    assert graph.neighbors("c") == (("a", 1.0 - H), ("b", 1.0 - H))
    assert graph.edge_count == 6
    # the rule itself is the graph's parallel-edge rule: min of the two spellings
    rebuilt = KNNGraph([("a", "c", 0.5), ("c", "a", 0.25)], neighbor_count=1)
    assert rebuilt.neighbors("a") == (("c", 0.25),)
    assert rebuilt.neighbors("c") == (("a", 0.25),)


def test_single_chunk_is_one_node_without_edges() -> None:
    assert knn_neighbors(["only"], [[3.0, 4.0]], 5) == [[]]
    graph = KNNGraph.from_embeddings(["only"], [[3.0, 4.0]])
    assert graph.nodes == ("only",) and graph.edge_count == 0
    assert graph.distance("only", "other") == 10.0


def random_embeddings(rng: random.Random, size: int, dimension: int) -> List[List[float]]:
    """Small integer coordinates (many exact ties and duplicates) plus some awkward floats."""
    rows = []
    while len(rows) < size:
        if rng.random() < 0.7:
            row = [float(rng.randint(-2, 2)) for _ in range(dimension)]
        else:
            row = [rng.uniform(-1.0, 1.0) for _ in range(dimension)]
        if any(row):
            rows.append(row)
    rows[-1] = list(rows[0])  # at least one duplicate
    return rows


def picks_by_id(ids: List[str], rows: List[List[float]], k: int) -> Dict[str, List[Tuple[str, float]]]:
    return dict(zip(ids, knn_neighbors(ids, rows, k)))


@pytest.mark.parametrize("seed", range(6))
def test_result_does_not_depend_on_row_order(seed: int) -> None:
    rng = random.Random(seed)
    size, dimension, k = rng.randint(2, 14), rng.randint(1, 5), rng.randint(1, 5)
    ids = [f"c{i:02d}" for i in range(size)]
    rng.shuffle(ids)
    rows = random_embeddings(rng, size, dimension)
    order = list(range(size))
    rng.shuffle(order)
    shuffled_ids = [ids[i] for i in order]
    shuffled_rows = [rows[i] for i in order]
    assert picks_by_id(ids, rows, k) == picks_by_id(shuffled_ids, shuffled_rows, k)
    first = KNNGraph.from_embeddings(ids, rows, neighbor_count=k, maximum_distance=1.5)
    second = KNNGraph.from_embeddings(shuffled_ids, shuffled_rows, neighbor_count=k, maximum_distance=1.5)
    assert edge_map(first) == edge_map(second)
    assert all(first.distance(a, b) == second.distance(a, b) for a in ids for b in ids)


@pytest.mark.parametrize("seed", range(4))
def test_picks_match_a_full_sort(seed: int) -> None:
    rng = random.Random(100 + seed)
    size, dimension, k = rng.randint(1, 10), rng.randint(1, 4), rng.randint(1, 12)
    ids = [f"n{i}" for i in range(size)]
    rows = random_embeddings(rng, size, dimension)
    picks = knn_neighbors(ids, rows, k)
    everyone = knn_neighbors(ids, rows, size)  # k >= n: every other chunk, in pick order
    for i, chunk in enumerate(ids):
        assert sorted(other for other, _ in everyone[i]) == sorted(ids[:i] + ids[i + 1:])
        assert everyone[i] == sorted(everyone[i], key=lambda pick: (pick[1], pick[0]))
        assert picks[i] == everyone[i][: min(k, size - 1)]
        for other, distance in everyone[i]:
            assert 0.0 <= distance <= 2.0
            assert dict(everyone[ids.index(other)])[chunk] == distance  # symmetric, bit for bit
    # the graph is the undirected union of the picks, with clamped distances
    graph = KNNGraph.from_embeddings(ids, rows, neighbor_count=k, maximum_distance=1.5)
    union = {frozenset((chunk, other)): min(max(d, 1e-6), 1.5) for chunk, row in zip(ids, picks) for other, d in row}
    assert edge_map(graph) == union


def test_numpy_torch_and_list_inputs_agree() -> None:
    rows = [[0.3, -1.25, 2.0], [1.0, 1.0, 0.1], [0.0, 2.5, -0.7], [0.3, -1.25, 2.0]]
    ids = ["w", "x", "y", "z"]
    expected = knn_neighbors(ids, rows, 2)
    assert knn_neighbors(ids, np.array(rows), 2) == expected
    assert knn_neighbors(ids, [np.array(row) for row in rows], 2) == expected
    assert knn_neighbors(tuple(ids), tuple(tuple(row) for row in rows), 2) == expected
    float32 = np.array(rows, dtype=np.float32)
    assert knn_neighbors(ids, float32, 2) == knn_neighbors(ids, float32.tolist(), 2)
    lists = KNNGraph.from_embeddings(ids, rows, neighbor_count=2)
    arrays = KNNGraph.from_embeddings(np.array(ids).tolist(), np.array(rows), neighbor_count=2)
    assert lists.edges() == arrays.edges()
    torch = pytest.importorskip("torch")
    tensor = KNNGraph.from_embeddings(ids, torch.tensor(rows, dtype=torch.float64), neighbor_count=2)
    assert tensor.edges() == lists.edges()


def spec_cosine_distance(left: List[float], right: List[float]) -> float:
    """The rule spelled out: column-order sums for the norm and the dot product, clip, 1 - s."""
    def column_sum(values):
        total = 0.0
        for value in values:
            total += value
        return total

    def normalize(row: List[float]) -> List[float]:
        norm = math.sqrt(column_sum(x * x for x in row))
        return [x / norm for x in row]

    products = [a * b for a, b in zip(normalize(left), normalize(right))]
    return 1.0 - min(1.0, max(-1.0, column_sum(products)))


def test_cosine_distance_is_the_column_order_rule() -> None:
    rng = random.Random(5)
    rows = [[rng.uniform(-1.0, 1.0) * 10.0 ** rng.randint(-3, 3) for _ in range(8)] for _ in range(12)]
    ids = [f"r{i}" for i in range(12)]
    naive_differs = False
    for i, picks in enumerate(knn_neighbors(ids, rows, 11)):
        for other, distance in picks:
            j = ids.index(other)
            assert distance == spec_cosine_distance(rows[i], rows[j])
            exact = 1.0 - math.fsum(a * b for a, b in zip(*(
                [x / math.sqrt(math.fsum(y * y for y in row)) for x in row] for row in (rows[i], rows[j])
            )))
            naive_differs = naive_differs or exact != distance
    assert naive_differs  # the data can tell the column-order sum from an exactly rounded fsum


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("ids", "embeddings", "words"),
    [
        (["a", "b"], [1.0, 2.0], r"two-dimensional matrix: embeddings row 0 \(chunk 'a'\) is a float"),
        (["a", "b"], np.array([1.0, 2.0]), "two-dimensional matrix"),
        (["a"], [[[1.0]]], r"two-dimensional matrix of numbers: embeddings row 0 \(chunk 'a'\), column 0"),
        (["a"], "ab", "two-dimensional matrix"),
        (["a"], 3.0, "two-dimensional matrix"),
        (["a", "b"], [[1.0, 2.0], [1.0]], r"ragged matrix\): embeddings row 1 \(chunk 'b'\) has 1"),
        (["a", "b", "c"], [[1.0], [2.0]], "^received 2 embeddings for 3 chunk IDs$"),
        (["a", "b"], [[], []], "^embedding dimension must be greater than zero"),
        (["a", "b"], np.zeros((2, 0)), "^embedding dimension must be greater than zero"),
        (["a", "b"], [[1.0], [math.nan]], r"row 1 \(chunk 'b'\) has .* at column 0"),
        (["a", "b"], [[1.0, math.inf], [1.0, 0.0]], r"row 0 \(chunk 'a'\) has .* at column 1"),
        (["a", "b"], [[1.0, 0.0], [0.0, 0.0]], r"row 1 \(chunk 'b'\) is a zero vector"),
        (["a", "b"], [[1.0, 0.0], [1e-200, 0.0]], r"row 1 \(chunk 'b'\) is a zero vector"),
        (["a", "b"], [[1.0, 0.0], [1e200, 1e200]], r"row 1 \(chunk 'b'\) has a norm too large"),
        (["a", "b"], [[1.0, 0.0], [True, 1.0]], r"two-dimensional matrix of numbers: embeddings row 1 \(chunk 'b'\), column 0"),
        (["a", "b"], [[1.0, 0.0], ["1", 1.0]], "two-dimensional matrix of numbers"),
        ([], [], "^chunk_ids must contain at least one ID$"),
        (["a", ""], [[1.0], [2.0]], "^chunk IDs must not be empty \\(position 1\\)"),
        (["a", 7], [[1.0], [2.0]], "chunk ID at position 1 must be a string"),
        (["a", "b", "a"], [[1.0], [2.0], [3.0]], "^chunk IDs must be unique: 'a' at positions 0 and 2"),
        ("ab", [[1.0], [2.0]], "not a string"),
    ],
)
def test_rejects_bad_embeddings_and_ids(ids, embeddings, words) -> None:
    for build in (lambda: knn_neighbors(ids, embeddings, 2), lambda: KNNGraph.from_embeddings(ids, embeddings)):
        with pytest.raises(ValueError, match=words) as info:
            build()
        assert isinstance(info.value, MapMatchedValueError)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"neighbor_count": 0}, "neighbor_count must be greater than zero"),
        ({"neighbor_count": -2}, "neighbor_count must be greater than zero"),
        ({"neighbor_count": 2.0}, "neighbor_count must be an integer"),
        ({"neighbor_count": True}, "neighbor_count must be an integer"),
        ({"maximum_distance": 0.0}, "^maximum_distance must be finite and greater than zero"),
        ({"maximum_distance": math.inf}, "^maximum_distance must be finite and greater than zero"),
        ({"maximum_distance": math.nan}, "^maximum_distance must be finite and greater than zero"),
        ({"minimum_edge_distance": 0.0}, "^minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance"),
        ({"minimum_edge_distance": -1e-6}, "^minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance"),
        ({"minimum_edge_distance": math.nan}, "^minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance"),
        ({"minimum_edge_distance": 10.5}, r"no greater than maximum_distance, got 10.5 \(maximum_distance=10.0\)"),
        ({"minimum_edge_distance": 2.0, "maximum_distance": 1.0}, r"got 2.0 \(maximum_distance=1.0\)"),
        ({"distance_cache_size": 0}, "distance_cache_size must be greater than zero"),
    ],
)
def test_rejects_bad_options(options, words) -> None:
    with pytest.raises(ValueError, match=words):
        KNNGraph.from_embeddings(IDS, VECTORS, **options)
    with pytest.raises(ValueError, match=words):
        KNNGraph(**options)


def test_knn_neighbors_rejects_bad_neighbor_count() -> None:
    with pytest.raises(ValueError, match="neighbor_count must be greater than zero"):
        knn_neighbors(IDS, VECTORS, 0)


def test_minimum_edge_distance_may_equal_maximum_distance() -> None:
    graph = KNNGraph.from_embeddings(IDS, VECTORS, neighbor_count=3, maximum_distance=0.5, minimum_edge_distance=0.5)
    assert set(edge_map(graph).values()) == {0.5}
