"""benchmarks/scale.py's eval phase end to end on a tiny saved corpus: the report's keys,
and the map-matched answers equal to the standalone decoder's on the same candidates."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("faiss", reason="faiss is not installed (the [faiss] extra)")

from mapmatched_torch import DecoderCandidate, InMemoryCorpusGraph, StandaloneDecoder  # noqa: E402
from mapmatched_torch.core.scoring import normalize_scores  # noqa: E402
from mapmatched_torch.graph import knn_graph, load_graph, save_graph  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str):
    """A benchmark script as a module, without putting benchmarks/ on sys.path (its names are generic)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scale = _script("scale")
scale_eval = _script("scale_eval")
evaluate_directory, walk_conversations = scale_eval.evaluate_directory, scale_eval.walk_conversations

ROWS, DIMENSION = 300, 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """DIR as the scale run leaves it: clustered float16 embeddings and the saved artifact (ball table)."""
    folder = tmp_path_factory.mktemp("scale")
    scale.write_embeddings(folder / "embeddings.npy", ROWS, DIMENSION, clusters=6, seed=0)
    embeddings = np.load(folder / "embeddings.npy", mmap_mode="r")
    graph = knn_graph(np.asarray(embeddings, dtype=np.float32), [f"chunk-{i:08d}" for i in range(ROWS)], 5,
                      maximum_distance="auto")
    graph.precompute_balls(directory=folder / "graph")
    save_graph(graph, folder / "graph")
    return folder


def _run(folder: Path, **options) -> dict:
    settings = dict(conversations=40, turns=4, width=8, betas=(4.0, 1.0), noise=0.6, batch_size=16, resamples=200,
                    examples=40)
    settings.update(options)
    return evaluate_directory(str(folder), **settings)


def test_eval_report_keys_and_figures(corpus):
    report = _run(corpus)
    assert set(report["seconds"]) >= {"queries", "search", "distances", "decode", "metrics", "index", "bootstrap"}
    assert report["conversations"] == 40 and report["turns"] == 4 and report["index"] == "flat"
    methods = ["pointwise", "map-matched beta=4", "map-matched beta=1"]
    assert list(report["quality"]) == methods and list(report["hit1_lift"]) == methods[1:]
    for method in methods:
        for part in ("all", "followup", "switch"):
            assert set(report["quality"][method][part]) == {"hit@1", "ndcg@3", "mrr"}
    assert 0.0 < report["quality"]["pointwise"]["all"]["hit@1"] < 1.0  # the noise makes pointwise top-1 wrong
    lift = report["hit1_lift"]["map-matched beta=4"]["followup"]
    assert lift["turns"] == 40 * 3 and lift["low"] <= lift["mean"] <= lift["high"]
    assert report["conversations_per_second"] > 0 and 0.0 < report["gold_in_candidates"] <= 1.0
    # the batch size changes nothing (the noise is drawn in conversation order)
    again = _run(corpus, batch_size=40)
    assert again["quality"] == report["quality"] and again["examples"] == report["examples"]
    table = scale.table_rows({"rows": ROWS, "dim": DIMENSION, "eval": report})
    assert "follow-ups (turn > 0)" in table and "conversations/s" in table
    json.dumps(report)


def test_map_matched_answers_equal_the_standalone_decoder(corpus):
    report = _run(corpus)
    graph = load_graph(corpus / "graph")
    ids = graph.vocabulary.chunk_ids
    adjacency = graph.adjacency
    indptr, targets, weights = (t.tolist() for t in (adjacency.indptr, adjacency.indices, adjacency.weights))
    # the reference graph from the artifact's arcs alone (its searches, not the ball table)
    edges = [(ids[u], ids[targets[e]], weights[e]) for u in range(ROWS) for e in range(indptr[u], indptr[u + 1])]
    reference = InMemoryCorpusGraph(edges, nodes=ids, directed=True, maximum_distance=graph.maximum_distance)
    decoder = StandaloneDecoder()
    differs = 0
    for example in report["examples"]:
        trellis = [[DecoderCandidate(ids[row], score, normalized)
                    for row, score, normalized in zip(rows, scores, normalize_scores(scores))]
                   for rows, scores in zip(example["candidates"], example["scores"])]
        for turn in range(len(trellis)):
            assert example["pointwise"][turn] == example["candidates"][turn][0]  # provider order: best first
            for beta in (4.0, 1.0):
                answer = decoder.decode(trellis[: turn + 1], reference, transition_weight=beta).chunk_ids[-1]
                assert ids[example[f"map-matched beta={beta:g}"][turn]] == answer
            differs += example["map-matched beta=4"][turn] != example["pointwise"][turn]
    assert differs > 0  # the check is not vacuous: map-matching changed some answers


def test_walks_follow_arcs_except_at_switches():
    indptr = np.array([0, 2, 3, 3, 4])  # node 2 has no arcs: the walk must jump
    indices = np.array([1, 3, 0, 0])
    golds, switched = walk_conversations(indptr, indices, 200, 6, 0.25, seed=3)
    assert not switched[:, 0].any() and 0.1 < switched[:, 1:].mean() < 0.45
    for previous, gold, jump in zip(golds[:, :-1].ravel(), golds[:, 1:].ravel(), switched[:, 1:].ravel()):
        if not jump:
            assert gold in indices[indptr[previous]:indptr[previous + 1]]
        else:
            assert 0 <= gold < 4
    assert switched[:, 1:][golds[:, :-1] == 2].all()
    again = walk_conversations(indptr, indices, 200, 6, 0.25, seed=3)
    assert np.array_equal(again[0], golds) and np.array_equal(again[1], switched)


def test_eval_only_runs_over_a_kept_directory_and_writes_only_its_report(corpus, tmp_path):
    before = sorted(path.name for path in corpus.rglob("*"))
    out = tmp_path / "eval.json"
    command = [sys.executable, str(BENCHMARKS / "scale.py"), "--eval-only", "--dir", str(corpus), "--conversations",
               "20", "--eval-turns", "3", "--width", "6", "--betas", "2", "--report", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)})
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert saved["eval"]["quality"] == printed["quality"] and saved["rows"] == ROWS
    assert "eval batch 1/1: 20/20 conversations" in result.stderr
    assert sorted(path.name for path in corpus.rglob("*")) == before


def test_eval_refuses_bad_options(corpus):
    from mapmatched_torch.core.errors import MapMatchedValueError

    for options in ({"conversations": 0}, {"width": -1}, {"noise": float("nan")}, {"switch": 1.5}):
        with pytest.raises(MapMatchedValueError):
            _run(corpus, **options)
    with pytest.raises(MapMatchedValueError, match="larger than the corpus"):
        _run(corpus, width=ROWS + 1)


def test_serving_phase_reports_the_first_cold_and_warm_steps(corpus, tmp_path):
    """The serving phase in a fresh process over the saved corpus: the first step (no
    transitions), the cold step (the first with them) and the warm ones, in a table."""
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(corpus, folder)
    ring = (np.arange(ROWS)[:, None] + np.arange(1, 6)[None, :]) % ROWS  # (N, 5) stand-in kNN picks
    candidates = scale.turn_candidates(ring, 6, 5, 8, 0)  # (T = 5, S = 6, M = 8)
    np.save(folder / "turns.npy", candidates)
    done = subprocess.run([sys.executable, str(BENCHMARKS / "scale.py"), "--serving-only", "--dir", str(folder)],
                          capture_output=True, text=True, timeout=240, check=False, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    serve = json.loads(done.stdout.strip().splitlines()[-1])
    assert serve["sessions"] == 6 and serve["candidates"] == 8 and serve["warm_steps"] == 3
    assert 0 < serve["cold_step_s"] and 0 < serve["first_step_s"] and serve["warm_step_p50_s"] <= serve["warm_step_p90_s"]
    report = {"rows": ROWS, "dim": DIMENSION, "serving": serve}
    table = scale.table_rows(report)
    assert "| cold step (the first with transitions, nothing cached) |" in table
    np.save(folder / "turns.npy", candidates[:2])
    done = subprocess.run([sys.executable, str(BENCHMARKS / "scale.py"), "--serving-only", "--dir", str(folder)],
                          capture_output=True, text=True, timeout=240, check=False, env=dict(os.environ))
    assert done.returncode != 0 and "at least 3 turns" in done.stderr
