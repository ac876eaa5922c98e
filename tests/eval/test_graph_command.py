"""``mapmatched-torch graph build`` and ``--graph-dir`` (mapmatched_torch.eval.graph_command)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

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


@pytest.fixture
def served(monkeypatch):
    """The serve command up to Ray: Ray itself is replaced (no cluster starts), the shard
    factory the command hands to Ray Serve is called and its parts kept in this list."""
    import signal

    from mapmatched_torch.core.optional import has_module

    if not has_module("ray.serve"):
        pytest.skip("needs ray[serve] (the [ray] extra)")
    import ray
    from ray import serve

    from mapmatched_torch.integrations import ray_serve

    handlers, parts = {}, []

    def fake_run(factory, **options):
        parts.append(factory())
        handlers[signal.SIGTERM]()  # as if stopped at once
        return None, "http://127.0.0.1:1"

    monkeypatch.setattr(signal, "signal", lambda signum, handler: handlers.__setitem__(signum, handler))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # nothing to start or shut down
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr(ray_serve, "run", fake_run)
    return parts


def test_serve_with_graph_dir_serves_the_artifact_and_refuses_another(fixtures, tmp_path, capsys, served):
    out = tmp_path / "graph"
    data = fixtures / "normalized"
    assert main(["graph", "build", "--passages", str(data / "tiny.passages.jsonl"), "--k", "2", "--ball-size", "2",
                 "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
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


# ---------------------------------------------------------------------- context tables

#: the tiny corpus's kNN graph (k=2, bound auto = 1.0) has arcs of 0.68 to 1.0: radius
#: 0.9 reaches some neighbours, 0.7 fewer (another limit), 2 and 3 the whole bound
RADIUS = 0.9


def _build(fixtures, out, *options):
    passages = fixtures / "normalized" / "tiny.passages.jsonl"
    return main(["graph", "build", "--passages", str(passages), "--k", "2", "--ball-size", "2", "--out", str(out),
                 *options])


def _no_search(*args, **kwargs):
    raise AssertionError("searched a neighbourhood")


def _steps(server, nodes):
    """Answers of a few steps of two sessions: decoded chunk, contexts, path (scores) and ranking."""
    server.open("a"), server.open("b")
    turns = [{"a": [(nodes[0], 1.0), (nodes[2], 0.4)], "b": [(nodes[4], 0.9), ("unknown", 0.8)]},
             {"a": [(nodes[1], 0.5), (nodes[3], 0.5)], "b": [(nodes[2], 1.0), (nodes[0], 0.2)]},
             {"a": [("unknown", 1.0), (nodes[4], 0.9)], "b": [(nodes[3], 0.3), (nodes[1], 0.3)]}]
    found = []
    for turn in turns:
        results, errors = server.step(turn)
        assert errors == {}
        found.append({key: (result.chunk_id, result.context_chunk_ids, result.path, result.candidate_ranking)
                      for key, result in results.items()})
    return found


def test_build_with_a_context_radius_writes_the_table_load_graph_reads(fixtures, tmp_path, capsys):
    out = tmp_path / "g"
    assert _build(fixtures, out, "--context-radius", str(RADIUS)) == 0
    captured = capsys.readouterr()
    facts = json.loads(captured.out)
    contexts = facts["contexts"]
    assert "graph build: context table within radius 0.9" in captured.err  # the progress line
    assert f"context table: radius 0.9, {contexts['entries']} entries, {contexts['bytes']} bytes" in captured.err
    manifest = read_manifest(out)
    assert manifest["contexts"]["radius"] == RADIUS and manifest["metadata"]["contexts"] == contexts
    loaded = load_graph(out, context_radius=RADIUS)
    table = loaded.neighborhood_table
    assert contexts["entries"] == table.nodes.numel() > 0 and contexts["limit"] == RADIUS
    assert contexts["bytes"] == 8 * (loaded.num_nodes + 1) + 4 * contexts["entries"]
    assert contexts["widest"] == int((table.indptr[1:] - table.indptr[:-1]).max())
    # the rows are the searched neighbourhoods
    searched = TensorCorpusGraph(loaded.adjacency, loaded.vocabulary, maximum_distance=loaded.maximum_distance)
    centres = torch.arange(-1, loaded.num_nodes)
    assert torch.equal(loaded.neighborhood_indices(centres, RADIUS), searched.neighborhood_indices(centres, RADIUS))
    with pytest.raises(ValueError, match="context table has radius 0.9, not 0.7"):
        load_graph(out, context_radius=0.7)
    # without the option: no table
    assert _build(fixtures, tmp_path / "plain", "--quiet") == 0
    assert "contexts" not in json.loads(capsys.readouterr().out) and read_manifest(tmp_path / "plain")["contexts"] is None
    assert _build(fixtures, tmp_path / "bad", "--context-radius", "-1", "--quiet") == 2
    assert "expected a finite number >= 0" in capsys.readouterr().err


def test_serve_reads_the_artifacts_context_table_and_answers_as_without_it(fixtures, tmp_path, capsys, served,
                                                                           monkeypatch):
    from mapmatched_torch.serving import MapMatchedServer

    out = tmp_path / "g"
    assert _build(fixtures, out, "--context-radius", str(RADIUS), "--quiet") == 0
    capsys.readouterr()
    data = str(fixtures / "normalized")
    # no --context-radius: the table's radius
    assert main(["serve", "--data", data, "--graph-dir", str(out), "--candidates", "3"]) == 0
    assert f"context rows (radius 0.9) read from {out.resolve()}'s table" in capsys.readouterr().err
    # the same radius named
    assert main(["serve", "--data", data, "--graph-dir", str(out), "--context-radius", "0.9", "--candidates", "3",
                 "--quiet"]) == 0
    for parts in served:
        server, graph = parts.server, parts.server.graph
        assert server.context_radius == RADIUS and graph.neighborhood_table.radius == RADIUS
        with monkeypatch.context() as patch:
            patch.setattr(graph, "_ordered_balls", _no_search)  # every neighbourhood search passes here
            answers = _steps(server, graph.nodes)
        plain = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=graph.maximum_distance)
        assert answers == _steps(MapMatchedServer(plain, candidate_limit=3, context_radius=RADIUS), graph.nodes)
        assert any(len(contexts) > 1 for turn in answers for _, contexts, _, _ in turn.values())
    assert served[0].fingerprint == served[1].fingerprint


def test_serve_refuses_a_context_radius_its_table_does_not_answer(fixtures, tmp_path, capsys, served):
    out = tmp_path / "g"
    assert _build(fixtures, out, "--context-radius", str(RADIUS), "--quiet") == 0
    capsys.readouterr()
    data = str(fixtures / "normalized")
    assert main(["serve", "--data", data, "--graph-dir", str(out), "--context-radius", "0.7", "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "context table was built for radius 0.9" in error and "context radius is 0.7" in error
    assert "graph build --context-radius 0.7" in error and "--search-contexts" in error and served == []
    # searching allowed: served at 0.7, the server warns once
    from mapmatched_torch.serving.contexts import ContextTableWarning

    with pytest.warns(ContextTableWarning, match="built for radius 0.9") as warned:
        assert main(["serve", "--data", data, "--graph-dir", str(out), "--context-radius", "0.7",
                     "--search-contexts", "--quiet"]) == 0
    assert served[0].server.context_radius == 0.7 and len(warned) == 2  # the command's check, then the replica's
    # radii above the bound share its limit: the table is read, nothing refused
    assert _build(fixtures, tmp_path / "wide", "--context-radius", "2", "--quiet") == 0
    capsys.readouterr()
    assert main(["serve", "--data", data, "--graph-dir", str(tmp_path / "wide"), "--context-radius", "3",
                 "--quiet"]) == 0
    assert served[-1].server.context_radius == 3.0 and served[-1].server.graph.neighborhood_table.radius == 2.0


def test_serve_without_a_context_table_searches_and_says_so(fixtures, tmp_path, capsys, served, monkeypatch):
    out = tmp_path / "g"
    assert _build(fixtures, out, "--quiet") == 0
    capsys.readouterr()
    data = str(fixtures / "normalized")
    assert main(["serve", "--data", data, "--graph-dir", str(out)]) == 0
    error = capsys.readouterr().err
    assert "holds no context table" in error and "graph build --context-radius 1 would make them reads" in error
    assert served[0].server.context_radius == 1.0 and served[0].server.graph.neighborhood_table is None
    graph = served[0].server.graph
    with monkeypatch.context() as patch, pytest.raises(AssertionError, match="searched"):
        patch.setattr(graph, "_ordered_balls", _no_search)
        _steps(served[0].server, graph.nodes)
    assert main(["serve", "--data", data, "--graph-dir", str(out), "--context-radius", "0.5", "--quiet"]) == 0
    assert served[1].server.context_radius == 0.5 and served[0].fingerprint != served[1].fingerprint
