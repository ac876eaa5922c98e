"""kNN construction on tensors: bit-for-bit parity with the reference rules (docs/spec.md section 4)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

import mapmatched_torch.graph.knn as knn_module
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.graph import TensorCorpusGraph, knn_edges, knn_graph, knn_neighbors_tensor
from mapmatched_torch.standalone.knn import KNNGraph, knn_neighbors

Picks = List[List[Tuple[str, float]]]


# ---------------------------------------------------------------------- helpers


def tensor_picks(ids: List[str], embeddings, k: int, **options) -> Picks:
    """knn_neighbors_tensor's answer in the reference's format: [(chunk_id, distance)] per row."""
    neighbors, distances = knn_neighbors_tensor(embeddings, ids, k, **options)
    assert neighbors.dtype == torch.long and distances.dtype == torch.float64
    return [[(ids[j], d) for j, d in zip(row, dist)] for row, dist in zip(neighbors.tolist(), distances.tolist())]


def random_rows(rng: np.random.Generator, size: int, dimension: int, duplicates: int = 1) -> np.ndarray:
    """Small integers (exact ties) mixed with floats of magnitudes 1e-3..1e3; no zero rows."""
    integers = rng.integers(-2, 3, size=(size, dimension)).astype(np.float64)
    floats = rng.uniform(-1.0, 1.0, size=(size, dimension)) * 10.0 ** rng.integers(-3, 4, size=(size, 1))
    rows = np.where(rng.random((size, 1)) < 0.5, integers, floats)
    rows[np.abs(rows).sum(axis=1) == 0.0, 0] = 1.0
    for _ in range(duplicates):
        rows[rng.integers(size)] = rows[rng.integers(size)] * rng.choice([1.0, 3.0, 0.25])
    return rows


def shuffled_ids(rng: np.random.Generator, size: int) -> List[str]:
    """Unique IDs whose sorted order is unrelated to row order."""
    return [f"c{value}" for value in rng.permutation(10 * size)[:size]]


def undirected_map(edge_index: torch.Tensor, edge_weight: torch.Tensor, ids: List[str]) -> Dict[frozenset, float]:
    """{frozenset({a, b}): weight}, checking both directions exist with equal weights."""
    arcs = {(ids[a], ids[b]): w for (a, b), w in zip(edge_index.T.tolist(), edge_weight.tolist())}
    assert all(arcs[(b, a)] == w for (a, b), w in arcs.items())
    return {frozenset(pair): w for pair, w in arcs.items()}


def reference_union(ids: List[str], picks: Picks, minimum: float, maximum: float) -> Dict[frozenset, float]:
    graph = KNNGraph(
        [(a, b, min(max(d, minimum), maximum)) for a, row in zip(ids, picks) for b, d in row],
        nodes=ids,
        maximum_distance=maximum,
        minimum_edge_distance=minimum,
    )
    return {frozenset((e.source_chunk_id, e.target_chunk_id)): e.distance for e in graph.edges()}


# ---------------------------------------------------------------------- parity


@pytest.mark.parametrize(
    ("size", "dimension", "k"),
    [(1, 3, 1), (2, 1, 1), (7, 2, 10), (10, 3, 1), (12, 5, 3), (40, 4, 5), (60, 16, 1), (80, 8, 12), (150, 6, 4)],
)
def test_random_parity_with_the_reference(size: int, dimension: int, k: int, device: torch.device) -> None:
    rng = np.random.default_rng(1000 * size + 10 * dimension + k)
    rows, ids = random_rows(rng, size, dimension, duplicates=2), shuffled_ids(rng, size)
    expected = knn_neighbors(ids, rows.tolist(), k)
    assert tensor_picks(ids, torch.tensor(rows, device=device), k) == expected
    assert tensor_picks(ids, rows, k, candidate_dtype=torch.float64) == expected


def test_inputs_of_every_kind_and_precision_agree() -> None:
    rng = np.random.default_rng(3)
    rows, ids = random_rows(rng, 30, 6), shuffled_ids(rng, 30)
    single = rows.astype(np.float32)
    expected = knn_neighbors(ids, single.tolist(), 4)
    for embeddings in (single, single.tolist(), torch.from_numpy(single), torch.from_numpy(single).double()):
        assert tensor_picks(ids, embeddings, 4) == expected
    integers = rng.integers(-3, 4, size=(20, 3))
    integers[:, 0] = 5
    assert tensor_picks(ids[:20], integers, 3) == knn_neighbors(ids[:20], integers.tolist(), 3)
    assert tensor_picks(ids[:20], torch.from_numpy(integers), 3) == knn_neighbors(ids[:20], integers.tolist(), 3)


def test_outputs_stay_on_the_input_device(device: torch.device) -> None:
    embeddings = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]], device=device)
    neighbors, distances = knn_neighbors_tensor(embeddings, ["a", "b", "c"], 1)
    edge_index, edge_weight = knn_edges(embeddings, ["a", "b", "c"], 1)
    assert {t.device.type for t in (neighbors, distances, edge_index, edge_weight)} == {device.type}
    assert neighbors.shape == distances.shape == (3, 1)


def test_large_tie_regions_widen_the_search_until_exact(monkeypatch) -> None:
    """Groups of identical directions are bigger than the first candidate set: rows must widen."""
    rng = np.random.default_rng(5)
    directions = rng.integers(-1, 2, size=(6, 4)).astype(np.float64)
    directions[np.abs(directions).sum(axis=1) == 0.0, 0] = 1.0
    rows = directions[rng.integers(0, 6, size=180)] * rng.choice([0.5, 1.0, 2.0, 7.0], size=(180, 1))
    ids = shuffled_ids(rng, 180)
    counts: List[int] = []
    coarse = knn_module._coarse_candidates

    def spy(search, rows, count):
        counts.append(count)
        return coarse(search, rows, count)

    monkeypatch.setattr(knn_module, "_coarse_candidates", spy)
    for k in (1, 3, 8):
        counts.clear()
        assert tensor_picks(ids, rows, k, block_size=64) == knn_neighbors(ids, rows.tolist(), k)
        assert counts  # some rows needed a second, wider search


def test_near_duplicates_below_float32_resolution() -> None:
    rng = np.random.default_rng(11)
    rows = np.repeat(rng.normal(size=(12, 24)), 8, axis=0) + 1e-10 * rng.normal(size=(96, 24))
    ids = shuffled_ids(rng, 96)
    expected = knn_neighbors(ids, rows.tolist(), 5)
    assert tensor_picks(ids, rows, 5, candidate_dtype=torch.float32) == expected
    assert tensor_picks(ids, rows, 5, candidate_dtype=torch.float64) == expected


def test_reduced_precision_float32_matmul_settings_change_nothing() -> None:
    """With TF32/bf16 float32 matmuls allowed, the default falls back to float64 and an
    explicit float32 search uses the looser bound: the answer stays exact."""
    rng = np.random.default_rng(12)
    rows, ids = random_rows(rng, 60, 12, duplicates=4), shuffled_ids(rng, 60)
    expected = knn_neighbors(ids, rows.tolist(), 6)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert knn_module._default_candidate_dtype(torch.device("cpu")) == torch.float64
        assert tensor_picks(ids, rows, 6) == expected
        assert tensor_picks(ids, rows, 6, candidate_dtype=torch.float32) == expected
    finally:
        torch.set_float32_matmul_precision(previous)
    assert knn_module._default_candidate_dtype(torch.device("cpu")) == torch.float32


def test_inputs_are_never_modified() -> None:
    columns = torch.tensor([[3.0, 0.0, 1.0], [4.0, 2.0, 1.0]], dtype=torch.float64)  # (D, N), contiguous
    embeddings = columns.T  # (N, D) view whose transpose is already contiguous float64
    array = np.array([[3.0, 4.0], [0.0, 2.0], [1.0, 1.0]])
    before = (columns.clone(), array.copy())
    knn_neighbors_tensor(embeddings, ["a", "b", "c"], 2)
    knn_neighbors_tensor(array, ["a", "b", "c"], 2)
    readonly = array.copy()
    readonly.flags.writeable = False
    knn_neighbors_tensor(readonly, ["a", "b", "c"], 2)
    assert torch.equal(columns, before[0]) and np.array_equal(array, before[1])


def test_clustered_high_dimensional_embeddings() -> None:
    rng = np.random.default_rng(2)
    centers = rng.normal(size=(8, 96))
    rows = (centers[rng.integers(0, 8, size=240)] + 0.3 * rng.normal(size=(240, 96))).astype(np.float32)
    ids = shuffled_ids(rng, 240)
    assert tensor_picks(ids, rows, 10) == knn_neighbors(ids, rows.tolist(), 10)


def test_ties_go_to_the_smaller_id_and_identical_vectors_get_minimum_edge_distance() -> None:
    ids = ["q", "m", "z", "centre", "b", "twin"]
    rows = [[0.0, 1.0], [0.0, -1.0], [1.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [2.0, 0.0]]
    picks = tensor_picks(ids, rows, 3)
    assert picks[3] == [("twin", 0.0), ("z", 0.0), ("m", 1.0)]  # m and q tie at 1: m wins
    assert picks == knn_neighbors(ids, rows, 3)
    edges = undirected_map(*knn_edges(rows, ids, 3, minimum_edge_distance=0.125), ids)
    assert edges[frozenset(("centre", "twin"))] == 0.125
    assert edges[frozenset(("centre", "z"))] == 0.125


def test_result_does_not_depend_on_row_order() -> None:
    rng = np.random.default_rng(9)
    rows, ids = random_rows(rng, 50, 3, duplicates=4), shuffled_ids(rng, 50)
    order = rng.permutation(50)
    first = dict(zip(ids, tensor_picks(ids, rows, 4)))
    second = dict(zip([ids[i] for i in order], tensor_picks([ids[i] for i in order], rows[order], 4)))
    assert first == second


@pytest.mark.parametrize(
    "options",
    [
        {"block_size": 3},
        {"block_size": 1},
        {"block_size": 4, "candidate_dtype": torch.float64},
        {"block_size": 7},
        {"candidate_dtype": torch.float32},
    ],
)
def test_block_sizes_never_change_the_result(options, device: torch.device) -> None:
    rng = np.random.default_rng(4)
    rows = torch.tensor(random_rows(rng, 10, 3, duplicates=2), device=device)
    ids = shuffled_ids(rng, 10)
    for k in (1, 4, 20):
        default = knn_neighbors_tensor(rows, ids, k)
        blocked = knn_neighbors_tensor(rows, ids, k, **options)
        assert torch.equal(default[0], blocked[0]) and torch.equal(default[1], blocked[1])
        assert torch.equal(knn_edges(rows, ids, k)[1], knn_edges(rows, ids, k, **options)[1])


# ---------------------------------------------------------------------- edges and graphs


@pytest.mark.parametrize(("k", "maximum", "minimum"), [(1, 10.0, 1e-6), (3, 1.5, 1e-6), (5, 0.5, 0.5), (30, 1.0, 0.25)])
def test_edges_are_the_min_union_of_the_reference_picks(k: int, maximum: float, minimum: float, device) -> None:
    rng = np.random.default_rng(k)
    rows, ids = random_rows(rng, 25, 3, duplicates=3), shuffled_ids(rng, 25)
    edge_index, edge_weight = knn_edges(
        torch.tensor(rows, device=device), ids, k, maximum_distance=maximum, minimum_edge_distance=minimum
    )
    assert edge_index.dtype == torch.long and edge_weight.dtype == torch.float64
    pairs = edge_index[0] * 25 + edge_index[1]
    assert torch.equal(pairs, pairs.sort().values) and pairs.unique().numel() == pairs.numel()  # coalesced
    assert bool((edge_index[0] != edge_index[1]).all())
    expected = reference_union(ids, knn_neighbors(ids, rows.tolist(), k), minimum, maximum)
    assert undirected_map(edge_index.cpu(), edge_weight.cpu(), ids) == expected


def test_single_chunk_has_no_edges() -> None:
    neighbors, distances = knn_neighbors_tensor([[3.0, 4.0]], ["only"], 5)
    assert neighbors.shape == distances.shape == (1, 0)
    edge_index, edge_weight = knn_edges([[3.0, 4.0]], ["only"], 5)
    assert edge_index.shape == (2, 0) and edge_weight.shape == (0,)


def test_knn_graph_matches_the_standalone_graph(device: torch.device) -> None:
    rng = np.random.default_rng(21)
    rows, ids = random_rows(rng, 30, 4, duplicates=3), shuffled_ids(rng, 30)
    graph = knn_graph(rows, ids, 3, maximum_distance=2.5, device=device)
    reference = KNNGraph.from_embeddings(ids, rows.tolist(), neighbor_count=3, maximum_distance=2.5)
    assert isinstance(graph, TensorCorpusGraph)
    assert graph.nodes == tuple(ids) and graph.maximum_distance == 2.5
    edge_index, edge_weight = graph.to_edge_index()
    assert edge_index.device.type == device.type
    assert undirected_map(edge_index.cpu(), edge_weight.cpu(), ids) == {
        frozenset((e.source_chunk_id, e.target_chunk_id)): e.distance for e in reference.edges()
    }
    assert all(graph.distance(a, b) == reference.distance(a, b) for a in ids[:8] for b in ids)


# ---------------------------------------------------------------------- KNNGraph.from_embeddings


@pytest.mark.parametrize("seed", range(4))
def test_tensor_picks_equal_the_reference_picks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = int(rng.integers(2, 40))
    rows, ids = random_rows(rng, size, int(rng.integers(1, 6)), duplicates=3), shuffled_ids(rng, size)
    count = int(rng.integers(1, 8))
    neighbors, distances = knn_neighbors_tensor(rows, ids, count)
    tensor_picks = [
        [(ids[j], distance) for j, distance in zip(row, row_distances)]
        for row, row_distances in zip(neighbors.tolist(), distances.tolist())
    ]
    assert tensor_picks == knn_neighbors(ids, rows.tolist(), count)  # IDs and distances exactly


def test_the_reference_does_not_use_the_tensor_engine(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(knn_module, "knn_neighbors_tensor", lambda *args, **kwargs: calls.append(args))
    graph = KNNGraph.from_embeddings(["a", "b", "c"], torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]), neighbor_count=1)
    assert graph.neighbors("a") == (("b", 1e-06), ("c", 1.0))
    assert calls == []  # the reference stays independent of what it checks


def test_standalone_package_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from mapmatched_torch.standalone.knn import KNNGraph\n"
        "g = KNNGraph.from_embeddings(['a', 'b', 'c'], [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], neighbor_count=1)\n"
        "assert g.neighbors('c') == (('a', 1.0),) and 'mapmatched_torch.graph' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# ---------------------------------------------------------------------- validation

BAD_EMBEDDINGS = [
    (["a", "b"], np.array([1.0, 2.0])),
    (["a", "b", "c"], np.array([1.0, 2.0])),
    (["a"], np.ones((1, 1, 1))),
    (["a", "b"], np.array([[True, False], [True, True]])),
    (["a", "b"], np.array([[1 + 1j, 0], [1, 0]])),
    (["a", "b", "c"], np.ones((2, 1))),
    (["a", "b"], np.zeros((2, 0))),
    (["a", "b"], np.array([[1.0], [math.nan]])),
    (["a", "b"], np.array([[1.0, math.inf], [1.0, 0.0]])),
    (["a", "b"], np.array([[1.0, 0.0], [-math.inf, 0.0]])),
    (["a", "b"], np.array([[1.0, 0.0], [0.0, 0.0]])),
    (["a", "b"], np.array([[1.0, 0.0], [1e-200, 0.0]])),
    (["a", "b"], np.array([[1.0, 0.0], [1e200, 1e200]])),
    (["a", "b", "c"], np.array([[1.0, 0.0], [0.0, 0.0], [math.nan, 1.0]])),  # the first bad row wins
    (["a", "b", "c"], np.array([[1.0, 0.0], [math.nan, 0.0], [0.0, 0.0]])),
    (["a", "b"], np.array([[1.0, 0.0], [1e200, math.nan]])),  # non-finite before the norm
    (["a", "b"], [[1.0, 0.0], [True, 1.0]]),
    (["a", "b"], [[1.0, 2.0], [1.0]]),
    (["a"], "ab"),
    ([], []),
    (["a", ""], [[1.0], [2.0]]),
    (["a", 7], [[1.0], [2.0]]),
    (["a", "b", "a"], [[1.0], [2.0], [3.0]]),
    ("ab", [[1.0], [2.0]]),
]


def reference_error(ids, embeddings) -> str:
    with pytest.raises(MapMatchedValueError) as info:
        knn_neighbors(ids, embeddings, 2)
    return str(info.value)


@pytest.mark.parametrize(("ids", "embeddings"), BAD_EMBEDDINGS)
def test_bad_embeddings_raise_the_reference_error(ids, embeddings) -> None:
    message = reference_error(ids, embeddings)
    inputs = [embeddings]
    if isinstance(embeddings, np.ndarray) and embeddings.dtype.kind in "fi":
        inputs.append(torch.from_numpy(embeddings))
    for value in inputs:
        for build in (knn_neighbors_tensor, knn_edges, knn_graph):
            with pytest.raises(MapMatchedValueError) as info:
                build(value, ids, 2)
            assert str(info.value) == message


def test_subnormal_squares_are_not_flushed() -> None:
    rows = [[1e-160, 0.0], [0.0, 1e-160], [1e-160, 1e-160]]
    assert tensor_picks(["a", "b", "c"], np.array(rows), 2) == knn_neighbors(["a", "b", "c"], rows, 2)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"k": 0}, "k must be greater than zero"),
        ({"k": -1}, "k must be greater than zero"),
        ({"k": 2.0}, "k must be an integer"),
        ({"k": True}, "k must be an integer"),
        ({"maximum_distance": 0.0}, "^maximum_distance must be finite and greater than zero"),
        ({"maximum_distance": math.inf}, "^maximum_distance must be finite and greater than zero"),
        ({"maximum_distance": math.nan}, "^maximum_distance must be finite and greater than zero"),
        ({"minimum_edge_distance": 0.0}, "^minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance"),
        ({"minimum_edge_distance": -1e-6}, "^minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance"),
        ({"minimum_edge_distance": 10.5}, r"no greater than maximum_distance, got 10.5 \(maximum_distance=10.0\)"),
        ({"minimum_edge_distance": 2.0, "maximum_distance": 1.0}, r"got 2.0 \(maximum_distance=1.0\)"),
        ({"block_size": 0}, "block_size must be greater than zero"),
        ({"block_size": 2.5}, "block_size must be an integer"),
        ({"candidate_dtype": torch.float16}, "candidate_dtype must be torch.float32 or torch.float64"),
    ],
)
def test_bad_options(options, words) -> None:
    with pytest.raises(MapMatchedValueError, match=words):
        knn_edges([[1.0, 0.0], [0.0, 1.0]], ["a", "b"], **options)
    with pytest.raises(MapMatchedValueError, match=words):
        knn_graph([[1.0, 0.0], [0.0, 1.0]], ["a", "b"], **options)


# ---------------------------------------------------------------------- progress


def test_progress_flag(capsys, monkeypatch) -> None:
    import mapmatched_torch.core.progress as progress

    monkeypatch.setattr(progress, "_terminal", lambda: True)  # a bar (off a terminal: a line every 10 s)
    rows, ids = np.eye(4) + 0.1, ["a", "b", "c", "d"]
    knn_edges(rows, ids, 2, progress=True)
    assert "kNN" in capsys.readouterr().err
    knn_edges(rows, ids, 2, progress=False)
    knn_edges(rows, ids, 2)  # auto: small N, no bar
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(knn_module, "PROGRESS_THRESHOLD", 4)
    knn_edges(rows, ids, 2)
    assert "kNN" in capsys.readouterr().err
