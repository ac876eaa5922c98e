"""``mapmatched-torch graph build`` and ``--graph-dir`` (mapmatched_torch.eval.graph_command)."""

from __future__ import annotations

import json

import numpy as np

from mapmatched_torch.cli import main
from mapmatched_torch.eval.synthetic import make_synthetic
from mapmatched_torch.graph import TensorCorpusGraph, load_graph, read_manifest


def test_build_from_passages_then_eval_and_fit_with_graph_dir(fixtures, tmp_path, capsys):
    out = tmp_path / "graph"
    passages = fixtures / "normalized" / "tiny.passages.jsonl"
    assert main(["graph", "build", "--passages", str(passages), "--k", "2", "--ball-size", "2", "--out", str(out),
                 "--quiet"]) == 0
    facts = json.loads(capsys.readouterr().out)
    manifest = read_manifest(out)
    assert manifest["balls"] is not None and facts["bound"] == "auto" and facts["backend"] == "exact"
    assert manifest["maximum_distance"] == facts["maximum_distance"]
    graph = load_graph(out)
    searched = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=graph.maximum_distance)
    for a in graph.nodes:
        for b in graph.nodes:
            assert graph.distance(a, b) == searched.distance(a, b)
    rc = main(["eval", "--data", str(fixtures / "normalized"), "--graph-dir", str(out), "--candidates", "3",
               "--bootstrap", "0", "--quiet", "--methods", "pointwise,map-matched", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    assert json.loads((tmp_path / "r.json").read_text())["info"]["graph"] == "TensorCorpusGraph"
    rc = main(["fit", "--data", str(fixtures / "normalized"), "--graph-dir", str(out), "--candidates", "3",
               "--max-iterations", "2", "--quiet", "--json", str(tmp_path / "w.json")])
    assert rc == 0


def test_build_from_embeddings_with_faiss_and_a_fixed_bound(tmp_path, capsys):
    bench = make_synthetic(4, 2, 4, 0)
    ids = bench.dataset.passage_ids
    matrix = np.random.default_rng(0).normal(size=(len(ids), 8)).astype(np.float16)
    np.save(tmp_path / "e.npy", matrix)
    (tmp_path / "ids.txt").write_text("\n".join(ids) + "\n")
    out = tmp_path / "g"
    assert main(["graph", "build", "--embeddings", str(tmp_path / "e.npy"), "--ids", str(tmp_path / "ids.txt"),
                 "--backend", "faiss", "--faiss-index", "flat", "--maximum-distance", "0.5", "--recall-sample", "50",
                 "--k", "3", "--out", str(out), "--quiet"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["recall_at_k"] == 1.0 and facts["maximum_distance"] == 0.5 and facts["faiss"]["index"] == "flat"
    assert load_graph(out, chunk_ids=ids).ball_table.bound == 0.5
    # the synthetic benchmark with the artifact in place of its topic graph
    assert main(["eval", "--graph-dir", str(out), "--conversations", "4", "--turns", "2", "--candidates", "4",
                 "--bootstrap", "0", "--quiet", "--methods", "pointwise,map-matched"]) == 0


def test_mismatched_or_missing_artifacts_and_bad_options(fixtures, tmp_path, capsys):
    out = tmp_path / "g"
    np.save(tmp_path / "e.npy", np.eye(3, dtype=np.float32))
    assert main(["graph", "build", "--embeddings", str(tmp_path / "e.npy"), "--k", "1", "--out", str(out),
                 "--no-balls", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["eval", "--data", str(fixtures / "normalized"), "--graph-dir", str(out), "--quiet"]) == 2
    assert "built for another corpus" in capsys.readouterr().err
    assert main(["eval", "--graph-dir", str(tmp_path / "nothing"), "--quiet"]) == 2
    assert "not a graph artifact" in capsys.readouterr().err
    assert main(["eval", "--graph-dir", str(out), "--graph", "knn", "--quiet"]) == 2
    assert main(["eval", "--maximum-distance", "-1", "--quiet"]) == 2
    assert "expected auto or a finite number > 0" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.zeros(3))
    assert main(["graph", "build", "--embeddings", str(tmp_path / "bad.npy"), "--out", str(out), "--quiet"]) == 2
    assert "expected (N, D)" in capsys.readouterr().err


def test_auto_bound_for_built_graphs(fixtures, tmp_path):
    rc = main(["eval", "--data", str(fixtures / "normalized"), "--graph", "knn", "--maximum-distance", "auto",
               "--k", "2", "--candidates", "3", "--bootstrap", "0", "--quiet", "--methods", "pointwise,map-matched",
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    rc = main(["eval", "--maximum-distance", "auto", "--conversations", "4", "--turns", "2", "--candidates", "4",
               "--bootstrap", "0", "--quiet", "--methods", "pointwise,map-matched"])
    assert rc == 0


def test_serve_with_graph_dir_serves_the_artifact_and_refuses_another(fixtures, tmp_path, capsys, monkeypatch):
    # the serve command up to Ray: Ray itself is replaced (no cluster starts), the shard
    # factory the command hands to Ray Serve is called and its server inspected
    import signal

    import pytest

    from mapmatched_torch.core.optional import has_module

    if not has_module("ray.serve"):
        pytest.skip("needs ray[serve] (the [ray] extra)")
    import ray
    from ray import serve

    from mapmatched_torch.integrations import ray_serve

    out = tmp_path / "graph"
    data = fixtures / "normalized"
    assert main(["graph", "build", "--passages", str(data / "tiny.passages.jsonl"), "--k", "2", "--ball-size", "2",
                 "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    handlers, served = {}, []

    def fake_run(factory, **options):
        served.append(factory())
        handlers[signal.SIGTERM]()  # as if stopped at once
        return None, "http://127.0.0.1:1"

    monkeypatch.setattr(signal, "signal", lambda signum, handler: handlers.__setitem__(signum, handler))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # nothing to start or shut down
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr(ray_serve, "run", fake_run)
    assert main(["serve", "--data", str(data), "--graph-dir", str(out), "--candidates", "3", "--quiet"]) == 0
    graph = served[0].server.graph
    manifest = read_manifest(out)
    assert graph.ball_table is not None and graph.ball_table.directory == out.resolve()  # memory-mapped, not rebuilt
    assert graph.maximum_distance == manifest["maximum_distance"] and graph.num_nodes == manifest["num_nodes"]
    searched = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=graph.maximum_distance)
    assert all(graph.distance(a, b) == searched.distance(a, b) for a in graph.nodes for b in graph.nodes)
    assert main(["serve", "--data", str(data), "--graph-dir", str(out), "--maximum-distance", "100", "--quiet"]) == 2
    assert "ball table's bound" in capsys.readouterr().err  # a bound the saved ball table does not cover
    other = tmp_path / "other"
    np.save(tmp_path / "e.npy", np.eye(3, dtype=np.float32))
    assert main(["graph", "build", "--embeddings", str(tmp_path / "e.npy"), "--k", "1", "--out", str(other),
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["serve", "--data", str(data), "--graph-dir", str(other), "--quiet"]) == 2
    assert "built for another corpus" in capsys.readouterr().err and len(served) == 1
