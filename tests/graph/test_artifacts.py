"""Tests of mapmatched_torch.graph.artifacts: round trips, damaged and mismatched artifacts."""

from __future__ import annotations

import json

import pytest
import torch

from mapmatched_torch.graph import TensorCorpusGraph, load_graph, read_manifest, save_graph

from .conftest import random_reference


def _graph(balls: bool = True) -> TensorCorpusGraph:
    graph = TensorCorpusGraph.from_graph(random_reference(11, "float", False, nodes=20, maximum_distance=2.0))
    return graph.precompute_balls() if balls else graph


def _all_pairs(graph):
    codes = graph.index(list(graph.nodes) + ["zz"], distinct_unknown=True)
    n = codes.numel()
    return codes[:, None].expand(n, n), codes[None, :].expand(n, n)


@pytest.mark.parametrize("balls", [True, False])
def test_round_trip(tmp_path, balls):
    graph = _graph(balls)
    save_graph(graph, tmp_path / "g", metadata={"k": 3})
    loaded = load_graph(tmp_path / "g", chunk_ids=graph.nodes)
    assert loaded.nodes == graph.nodes and loaded.maximum_distance == graph.maximum_distance
    assert torch.equal(loaded.indptr, graph.indptr) and torch.equal(loaded.weights, graph.weights)
    assert (loaded.ball_table is not None) == balls
    sources, targets = _all_pairs(graph)
    assert torch.equal(loaded.pair_distances(sources, targets), graph.pair_distances(sources, targets))
    assert read_manifest(tmp_path / "g")["metadata"] == {"k": 3}
    smaller = load_graph(tmp_path / "g", maximum_distance=1.0)  # a ball table answers smaller bounds too
    reference = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=1.0)
    assert torch.equal(smaller.pair_distances(sources, targets), reference.pair_distances(sources, targets))


def test_balls_built_in_place_are_kept(tmp_path):
    graph = _graph(False).precompute_balls(directory=tmp_path / "g")
    save_graph(graph, tmp_path / "g")
    assert load_graph(tmp_path / "g", verify="full").ball_table.neighbors.numel() == graph.ball_table.neighbors.numel()


@pytest.mark.parametrize("name", ["csr_weights.npy", "ball_distances.npy", "vocabulary.json", "csr_indices.npy"])
def test_damaged_files_are_refused(tmp_path, name):
    save_graph(_graph(), tmp_path)
    path = tmp_path / name
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{name} fails its checksum"):
        load_graph(tmp_path)
    load_graph(tmp_path, verify="size")  # sizes only: not noticed (documented)


def test_truncated_missing_and_incomplete_are_refused(tmp_path):
    save_graph(_graph(), tmp_path)
    (tmp_path / "csr_indptr.npy").write_bytes((tmp_path / "csr_indptr.npy").read_bytes()[:-8])
    with pytest.raises(ValueError, match="csr_indptr.npy has .* bytes"):
        load_graph(tmp_path)
    (tmp_path / "csr_indptr.npy").unlink()
    with pytest.raises(ValueError, match="csr_indptr.npy is missing"):
        load_graph(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(ValueError, match="not a graph artifact"):
        load_graph(tmp_path)


def test_mismatched_artifacts_are_refused(tmp_path):
    graph = _graph()
    save_graph(graph, tmp_path)
    with pytest.raises(ValueError, match="built for another corpus: node 0"):
        load_graph(tmp_path, chunk_ids=["other"] + list(graph.nodes[1:]))
    with pytest.raises(ValueError, match=r"has \d+ chunk IDs but the corpus has 2"):
        load_graph(tmp_path, chunk_ids=["a", "b"])
    with pytest.raises(ValueError, match="below maximum_distance"):
        load_graph(tmp_path, maximum_distance=5.0)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["balls"]["graph_fingerprint"] = "0" * 64
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="ball table was built for another graph"):
        load_graph(tmp_path)
    manifest["version"] = 99
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format version 99"):
        load_graph(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="damaged"):
        load_graph(tmp_path)


def test_saving_without_balls_removes_an_old_table(tmp_path):
    save_graph(_graph(), tmp_path)
    save_graph(_graph(False), tmp_path)
    assert not (tmp_path / "ball_distances.npy").exists()
    assert load_graph(tmp_path).ball_table is None


# ---------------------------------------------------------------------- context neighbourhoods


def _centres(graph):
    # every node, padding and unknown codes, repeats
    return torch.cat([torch.arange(graph.num_nodes), torch.tensor([-1, -3, 0, graph.num_nodes - 1])])


@pytest.mark.parametrize("balls", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_precomputed_neighborhoods_equal_the_searched_ones(balls, seed):
    reference = random_reference(40 + seed, ["unit", "dyadic", "float"][seed], seed == 2, nodes=30)
    graph = TensorCorpusGraph.from_graph(reference)
    graph = graph.precompute_balls() if balls else graph
    searched = TensorCorpusGraph.from_graph(reference)
    for radius in (0.0, 0.5, 1.0, reference.maximum_distance, 50.0):
        graph.precompute_neighborhoods(radius, batch_size=7)
        table = graph.neighborhood_table
        assert table.radius == radius and table.limit == min(radius, reference.maximum_distance)
        centres = _centres(graph)
        expected = searched.neighborhood_indices(centres, radius, engine="compiled")
        assert torch.equal(graph.neighborhood_indices(centres, radius), expected), radius
        assert torch.equal(table.rows(centres), expected), radius
        for centre in range(graph.num_nodes):  # the reference's order: by (distance, chunk ID)
            names = [graph.nodes[i] for i in expected[centre].tolist() if i >= 0]
            assert tuple(names) == reference.neighborhood(graph.nodes[centre], radius)
    empty = graph.neighborhood_table.rows(torch.tensor([-1, -2]))
    assert empty.shape == (2, 0)


def test_a_context_table_round_trips_and_serves_without_searching(tmp_path, monkeypatch):
    from mapmatched_torch.serving import MapMatchedServer

    graph = _graph().precompute_neighborhoods(1.5)
    save_graph(graph, tmp_path / "g")
    manifest = read_manifest(tmp_path / "g")
    assert manifest["contexts"]["radius"] == 1.5 and manifest["contexts"]["limit"] == 1.5
    loaded = load_graph(tmp_path / "g", context_radius=1.5)
    assert torch.equal(loaded.neighborhood_table.indptr, graph.neighborhood_table.indptr)
    assert torch.equal(loaded.neighborhood_table.nodes, graph.neighborhood_table.nodes)
    centres = _centres(graph)
    expected = _graph(False).neighborhood_indices(centres, 1.5)
    assert torch.equal(loaded.neighborhood_indices(centres, 1.5), expected)

    # a server's context rows come from the table: no neighbourhood is searched
    def searched(*args, **kwargs):
        raise AssertionError("searched a neighbourhood")

    monkeypatch.setattr(loaded, "_ordered_balls", searched)
    server = MapMatchedServer(loaded, candidate_limit=4, context_radius=1.5)
    server.precompute_contexts()
    other = MapMatchedServer(_graph(False), candidate_limit=4, context_radius=1.5)
    other.precompute_contexts()
    found = []
    for server_ in (server, other):
        server_.open("s")
        first, _ = server_.step({"s": [(graph.nodes[0], 1.0), (graph.nodes[3], 0.5)]})
        second, _ = server_.step({"s": [(graph.nodes[1], 1.0), ("unknown", 0.7)]})
        found.append((first["s"].context_chunk_ids, second["s"].context_chunk_ids))
    assert found[0] == found[1] and len(found[0][0]) > 1
    # another radius: searched as before (the table answers only its own limit)
    monkeypatch.undo()
    assert torch.equal(loaded.neighborhood_indices(centres, 0.5), _graph(False).neighborhood_indices(centres, 0.5))
    # saving without a table removes the old one
    save_graph(_graph(), tmp_path / "g")
    assert read_manifest(tmp_path / "g")["contexts"] is None and not (tmp_path / "g" / "context_nodes.npy").exists()


def test_mismatched_or_damaged_context_tables_are_refused(tmp_path):
    graph = _graph().precompute_neighborhoods(1.5)
    save_graph(graph, tmp_path / "g")
    with pytest.raises(ValueError, match=r"context table has radius 1.5, not 2.0"):
        load_graph(tmp_path / "g", context_radius=2.0)
    with pytest.raises(ValueError, match=r"holds neighbourhoods within 1.5, but maximum_distance 1.0"):
        load_graph(tmp_path / "g", maximum_distance=1.0)
    save_graph(_graph(), tmp_path / "plain")
    with pytest.raises(ValueError, match=r"holds no context table \(radius 1.5 asked\)"):
        load_graph(tmp_path / "plain", context_radius=1.5)
    manifest_path = tmp_path / "g" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["contexts"]["graph_fingerprint"] = "0" * 64
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="context table was built for another graph"):
        load_graph(tmp_path / "g")
    save_graph(graph, tmp_path / "g")
    path = tmp_path / "g" / "context_nodes.npy"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="context_nodes.npy fails its checksum"):
        load_graph(tmp_path / "g")


@pytest.mark.parametrize("prefault", [True, False, "auto"])
def test_prefaulting_reads_every_page_and_changes_no_answer(tmp_path, prefault, monkeypatch):
    from mapmatched_torch.graph import _memory

    graph = _graph(True)
    graph.precompute_neighborhoods(1.0)
    save_graph(graph, tmp_path / "g")
    covered = []
    original = _memory.prefault
    monkeypatch.setattr(_memory, "prefault", lambda arrays: covered.append(original(arrays)) or covered[-1])
    loaded = load_graph(tmp_path / "g", prefault=prefault)
    table, contexts = loaded.ball_table, loaded.neighborhood_table
    arrays = [loaded.indptr, loaded.indices, loaded.weights, table.indptr, table.neighbors, table.distances,
              contexts.indptr, contexts.nodes]
    expected = sum(array.numel() * array.element_size() for array in arrays)
    # "auto" reads a 20-node artifact (far below half the available memory) wherever the OS says how much there is
    wanted = prefault is True or (prefault == "auto" and _memory.available_bytes() is not None)
    assert covered == ([expected] if wanted else [])
    sources, targets = _all_pairs(graph)
    assert torch.equal(loaded.pair_distances(sources, targets), graph.pair_distances(sources, targets))
    assert load_graph(tmp_path / "g", prefault=True, mmap=False).ball_table is not None  # nothing mapped: nothing read
    with pytest.raises(ValueError, match="prefault must be True, False or 'auto'"):
        load_graph(tmp_path / "g", prefault="yes")


def test_auto_prefault_leaves_an_artifact_larger_than_half_the_memory_paged_lazily(tmp_path, monkeypatch):
    from mapmatched_torch.graph import _memory

    save_graph(_graph(True), tmp_path / "g")
    monkeypatch.setattr(_memory, "available_bytes", lambda: 1000)  # the arrays take more than 500 bytes
    monkeypatch.setattr(_memory, "prefault", lambda arrays: pytest.fail("prefaulted"))
    load_graph(tmp_path / "g")
    monkeypatch.setattr(_memory, "available_bytes", lambda: None)  # unknown: not read either
    load_graph(tmp_path / "g")


def test_the_context_table_build_reports_progress_per_batch(capsys, monkeypatch):
    from mapmatched_torch.core import progress

    monkeypatch.setattr(progress, "INTERVAL", 0.0)  # a line per batch
    graph = _graph(False)
    quiet = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=graph.maximum_distance)
    graph.precompute_neighborhoods(1.0, batch_size=8, progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("context table:")]
    nodes = graph.num_nodes
    assert lines[0].startswith(f"context table: 8/{nodes} node") and "done in" in lines[-1]
    assert f"{nodes}/{nodes}" in lines[-1]
    quiet.precompute_neighborhoods(1.0, batch_size=8)  # a small graph: no progress by default
    assert "context table" not in capsys.readouterr().err
    assert torch.equal(quiet.neighborhood_table.nodes, graph.neighborhood_table.nodes)
