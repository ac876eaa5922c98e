"""Tests of mapmatched_torch.graph.balls: the ball table equals the bounded-Dijkstra oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from mapmatched_torch.graph import (
    BallTable,
    TensorCorpusGraph,
    ball_distances,
    ball_size_summary,
    build_ball_table,
    calibrate_bound,
)
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

from .conftest import WEIGHTS, random_reference


def _all_ids(graph):
    return list(graph.nodes) + ["unknown-a", "unknown-b"]


def _expected(reference, a, b):
    return reference.distance(a, b)  # the oracle: 0 for a == b (unknown too), M for unknown IDs


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("directed", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_ball_distances_equal_the_oracle(seed, weights, directed):
    reference = random_reference(seed, weights, directed)
    graph = TensorCorpusGraph.from_graph(reference).precompute_balls(bound=reference.maximum_distance * (1 + seed % 2))
    ids = _all_ids(graph)
    for a, b in itertools.product(ids, ids):
        assert graph.distance(a, b) == _expected(reference, a, b), (a, b)
    codes = graph.index(ids, distinct_unknown=True)
    sources, targets = codes[:, None].expand(len(ids), len(ids)), codes[None, :].expand(len(ids), len(ids))
    searched = TensorCorpusGraph.from_graph(reference).pair_distances(sources, targets, use_cache=False)
    assert torch.equal(graph.pair_distances(sources, targets), searched)
    assert torch.equal(graph.pair_distances(sources, targets, engine="balls"), searched)
    padded = torch.cat([codes, torch.tensor([-1])])
    trellis = padded.view(1, 1, -1).expand(2, 3, -1).contiguous()
    expected = TensorCorpusGraph.from_graph(reference).trellis_distances(trellis, use_cache=False)
    assert torch.equal(graph.trellis_distances(trellis), expected)
    for centre in list(graph.nodes)[:4]:
        for radius in (0.0, reference.maximum_distance / 2, reference.maximum_distance):
            assert graph.neighborhood_distances(centre, radius) == reference.neighborhood_distances(centre, radius)


def test_bound_ties_and_disconnected_parts():
    # a path exactly at the bound counts; ties between equal paths; an isolated node and another component
    reference = InMemoryCorpusGraph(
        [("a", "b", 0.5), ("b", "c", 0.5), ("a", "d", 1.0), ("d", "c", 0.25), ("x", "y", 0.25)],
        nodes=["lonely"], maximum_distance=1.0,
    )
    graph = TensorCorpusGraph.from_graph(reference).precompute_balls()
    assert graph.distance("a", "c") == 1.0 == reference.distance("a", "c")
    assert graph.distance("a", "d") == 1.0
    assert graph.distance("a", "x") == 1.0  # another component: the bound
    assert graph.distance("lonely", "lonely") == 0.0 and graph.distance("lonely", "a") == 1.0
    assert graph.distance("nope", "nope") == 0.0 and graph.distance("nope", "a") == 1.0
    assert graph.neighborhood("a", 1.0) == reference.neighborhood("a", 1.0)
    assert graph.ball_table.ball_sizes().tolist()[graph.vocabulary.index_of("lonely")] == 0


def test_a_larger_bound_is_clamped_and_a_smaller_one_refused():
    reference = random_reference(3, "float", False, nodes=20, maximum_distance=1.0)
    graph = TensorCorpusGraph.from_graph(reference)
    wide = build_ball_table(graph.adjacency, 3.0)
    graph.attach_balls(wide)
    for a, b in itertools.product(graph.nodes, graph.nodes):
        assert graph.distance(a, b) == reference.distance(a, b)
    with pytest.raises(ValueError, match="below maximum_distance"):
        graph.attach_balls(build_ball_table(graph.adjacency, 0.5))
    with pytest.raises(ValueError, match="below maximum_distance"):
        ball_distances(wide, torch.tensor([0]), torch.tensor([1]), 4.0)
    with pytest.raises(ValueError, match="nodes"):
        TensorCorpusGraph.from_edges([("a", "b")]).attach_balls(wide)
    graph.drop_balls()
    with pytest.raises(ValueError, match="needs a ball table"):
        graph.pair_distances(torch.tensor([0]), torch.tensor([1]), engine="balls")


def test_resumable_build_in_a_directory(tmp_path):
    reference = random_reference(5, "dyadic", False, nodes=24)
    graph = TensorCorpusGraph.from_graph(reference)
    memory = build_ball_table(graph.adjacency, reference.maximum_distance)
    folder = tmp_path / "balls"
    # an interrupted build: one finished batch is on disk, with a matching record
    first = build_ball_table(graph.adjacency, reference.maximum_distance, directory=folder, batch_size=5)
    assert torch.equal(first.indptr, memory.indptr) and torch.equal(first.distances, memory.distances)
    assert torch.equal(first.neighbors.long(), memory.neighbors.long())
    assert not (folder / "ball_parts").exists()
    loaded = BallTable.load(folder, reference.maximum_distance)
    assert torch.equal(loaded.distances, memory.distances) and loaded.directory == folder.resolve()


def test_resume_skips_finished_batches(tmp_path, monkeypatch):
    from mapmatched_torch.graph import balls

    reference = random_reference(7, "unit", False, nodes=20)
    graph = TensorCorpusGraph.from_graph(reference)
    calls = []
    original = balls._batch_rows

    def failing(adjacency, centres, bound, budget):
        calls.append(int(centres[0]))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(adjacency, centres, bound, budget)

    monkeypatch.setattr(balls, "_batch_rows", failing)
    with pytest.raises(KeyboardInterrupt):
        build_ball_table(graph.adjacency, 2.0, directory=tmp_path, batch_size=4)
    monkeypatch.setattr(balls, "_batch_rows", lambda *args: (calls.append(int(args[1][0])), original(*args))[1])
    table = build_ball_table(graph.adjacency, 2.0, directory=tmp_path, batch_size=4)
    assert calls == [0, 4, 8, 8, 12, 16]  # the two finished batches were not searched again
    assert torch.equal(table.distances, build_ball_table(graph.adjacency, 2.0).distances)


def test_calibrated_bound_and_summary():
    # a path 0-1-2-...-9 with unit edges: the 3rd nearest other node is 2 hops away
    graph = TensorCorpusGraph.from_edges([(str(i), str(i + 1)) for i in range(9)])
    bound = calibrate_bound(graph.adjacency, ball_size=3, sample=10)
    assert bound == 2.0
    assert calibrate_bound(graph.adjacency, ball_size=3, sample=10) == bound  # deterministic
    with pytest.raises(ValueError, match="quantile"):
        calibrate_bound(graph.adjacency, quantile=0.0)
    summary = ball_size_summary(np.array([0, 2, 4]))
    assert summary["max"] == 4.0 and summary["empty_share"] == pytest.approx(1 / 3)


def test_the_torch_lookup_equals_the_compiled_one(monkeypatch):
    from mapmatched_torch.graph import balls

    reference = random_reference(2, "float", False, nodes=24)
    graph = TensorCorpusGraph.from_graph(reference).precompute_balls()
    ids = _all_ids(graph)
    codes = graph.index(ids, distinct_unknown=True)
    codes = torch.cat([codes, torch.tensor([-1])])
    sources, targets = codes[:, None], codes[None, :]
    compiled = ball_distances(graph.ball_table, sources, targets, reference.maximum_distance)
    monkeypatch.setattr(balls, "_compiled_lookup", lambda: None)
    plain = ball_distances(graph.ball_table, sources, targets, reference.maximum_distance)
    assert torch.equal(plain, compiled)
    assert plain[-1, -1] == reference.maximum_distance  # padding is never 0 from itself


def test_knn_graph_auto_bound_is_the_calibrated_one():
    from mapmatched_torch.graph import knn_graph

    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 6))
    ids = [f"c{i:03d}" for i in range(80)]
    auto = knn_graph(x, ids, 3, maximum_distance="auto")
    wide = knn_graph(x, ids, 3, maximum_distance=2.0)
    assert auto.maximum_distance == calibrate_bound(wide.adjacency) < 2.0
    assert torch.equal(auto.weights, wide.weights)


@pytest.mark.parametrize("groups", [3, 40])  # serial below numba_runtime.SERIAL_BELOW groups, threads above
@pytest.mark.parametrize("members", ["int32", "int64"])
@pytest.mark.parametrize("weights", WEIGHTS)  # unit and dyadic weights: exact ties between paths
@pytest.mark.parametrize("seed", range(4))
def test_the_grid_lookup_equals_the_pairwise_one_and_the_oracle(seed, weights, members, groups, monkeypatch):
    """(G, A, 1) against (G, 1, C): the row-at-a-time kernel equals the per-pair search,
    the torch search and the oracle, with repeated codes, equal and distinct unknown IDs,
    padding, isolated nodes and a bound below the table's."""
    from mapmatched_torch.graph import balls

    pytest.importorskip("numba")
    reference = random_reference(seed, weights, bool(seed % 2), nodes=30)
    graph = TensorCorpusGraph.from_graph(reference).precompute_balls(bound=reference.maximum_distance * 1.5)
    table = graph.ball_table
    if members == "int64":
        table = BallTable(table.indptr, table.neighbors.long(), table.distances, table.bound)
    ids = _all_ids(graph)
    codes = torch.cat([graph.index(ids, distinct_unknown=True), torch.tensor([-1, -2])])
    rng = np.random.default_rng(seed)
    pick = torch.from_numpy(rng.integers(0, codes.numel(), size=(groups, 2, 7)))
    trellis = codes[pick]  # (G, 2, 7): repeats within and across turns
    sources, targets = trellis[:, 0, :, None], trellis[:, 1, None, :]
    grid = ball_distances(table, sources, targets, reference.maximum_distance)
    pairwise = ball_distances(table, sources.expand(-1, -1, 7).reshape(-1), targets.expand(-1, 7, -1).reshape(-1),
                              reference.maximum_distance).view(groups, 7, 7)
    assert torch.equal(grid, pairwise)
    monkeypatch.setattr(balls, "_compiled_lookup", lambda: None)
    assert torch.equal(ball_distances(table, sources, targets, reference.maximum_distance), grid)
    names = {int(code): name for code, name in zip(codes.tolist(), ids + [None, "unknown-c"])}
    for g, a, c in itertools.product(range(groups), range(7), range(7)):
        source, target = int(trellis[g, 0, a]), int(trellis[g, 1, c])
        if source == -1 or target == -1:
            expected = reference.maximum_distance  # padding: never 0, even from itself
        else:
            expected = _expected(reference, names[source], names[target])
        assert float(grid[g, a, c]) == expected, (g, a, c)


def test_the_lookup_benchmarks_run_on_a_small_artifact(tmp_path):
    """benchmarks/ball_lookup.py and distance_oracles.py on a saved 40-node graph: every
    kernel agrees, the labels answer the oracle's distances, figures reported."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from mapmatched_torch.graph import save_graph

    pytest.importorskip("numba")
    reference = random_reference(1, "float", False, nodes=40)
    graph = TensorCorpusGraph.from_graph(reference).precompute_balls()
    save_graph(graph, tmp_path / "graph")
    rng = np.random.default_rng(0)
    np.save(tmp_path / "turns.npy", rng.integers(0, graph.num_nodes, size=(4, 33, 5)))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ball_lookup.py"
    done = subprocess.run([sys.executable, str(script), "--dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["pairs_per_step"] == 33 * 5 * 5 and report["steps"] == 3
    assert report["grid_1_thread_p50_ms"] >= 0.0
    # the 2-hop labels' benchmark on the same artifact: its answers are the oracle's up to rounding
    script = script.with_name("distance_oracles.py")
    done = subprocess.run([sys.executable, str(script), "--dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    labels = json.loads(done.stdout)["labels"]
    assert labels["largest_difference"] < 1e-12 and labels["pairs_on_the_other_side_of_the_bound"] == 0
    assert labels["entries_per_node"] >= 1.0


def test_a_saved_table_of_another_dtype_or_shape_is_refused(tmp_path):
    reference = random_reference(0, "float", False, nodes=12)
    graph = TensorCorpusGraph.from_graph(reference)
    table = build_ball_table(graph.adjacency, 1.0, directory=tmp_path)
    assert torch.equal(BallTable.load(tmp_path, 1.0).distances, table.distances)
    np.save(tmp_path / "ball_distances.npy", table.distances.numpy().astype(np.float32))
    with pytest.raises(ValueError, match=r"ball table: ball_distances.npy holds float32 .* expected 1-D float64"):
        BallTable.load(tmp_path, 1.0)
    np.save(tmp_path / "ball_neighbors.npy", table.neighbors.numpy().reshape(1, -1))
    with pytest.raises(ValueError, match="ball table: ball_neighbors.npy holds"):
        BallTable.load(tmp_path, 1.0)
    (tmp_path / "ball_indptr.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match="ball table: ball_indptr.npy is not a readable array"):
        BallTable.load(tmp_path, 1.0)
