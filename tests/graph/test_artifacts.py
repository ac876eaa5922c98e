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
