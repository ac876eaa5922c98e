"""``fit --method`` model directories, and the acceptance parity: the evaluation's per-turn online
rankings of a model equal what sessions and the server loaded from its directory return, turn by turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mapmatched_torch import MapMatchedRetriever, MapMatchedServer
from mapmatched_torch.cli import main
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.settings import DecodeSettings
from mapmatched_torch.eval.candidates import normalize_candidate_scores, query_texts
from mapmatched_torch.eval.data import load_directory
from mapmatched_torch.eval.distances import CorpusDistances
from mapmatched_torch.eval.embedders import make_embedder
from mapmatched_torch.eval.inputs import inputs_from_dataset
from mapmatched_torch.eval.methods import map_matched_orders, pointwise_order
from mapmatched_torch.eval.methods.registry import Setting
from mapmatched_torch.eval.model_fit import choose_method, online_rankings, online_scores
from mapmatched_torch.fit.artifacts import save_model
from mapmatched_torch.fit.model import MapMatchedModel
from mapmatched_torch.kernels.online import rank_slots
from mapmatched_torch.providers.dense import DenseProvider
from mapmatched_torch.providers.query_mixing import QueryMixing
from mapmatched_torch.retrieval.pretrained import load_model

TINY = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny"
DATA = ["--data", str(TINY), "--embedder", "hash", "--k", "3", "--candidates", "5", "--quiet"]


@pytest.fixture(scope="module")
def tiny():
    """The tiny dataset's evaluation inputs, its embedder and a provider a session can query."""
    dataset = load_directory(TINY)
    embedder = make_embedder("hash")
    inputs = inputs_from_dataset(dataset, embedder, k=3, candidates=5, progress=False)
    provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, lambda q: embedder.encode([q])[0])
    return dataset, embedder, inputs, provider


def _eval_rankings(inputs, model):
    """Per (conversation, turn): (chunk the eval decodes, its (chunk ID, score) ranking in the session's
    tie order), checked against the order the method itself computes with the eval's code."""
    cands, scores = online_scores(inputs, model)
    normalized = normalize_candidate_scores(cands.scores, cands.mask, model.settings.score_normalization)
    settings = model.settings
    if model.method == "mixed":  # the mixed method ranks each turn pointwise
        order = pointwise_order(normalized, cands.mask)
    else:  # the fitted (map-matched) method's ranking
        distances = CorpusDistances(inputs.graph, inputs.passage_ids).consecutive(cands.index)
        setting = Setting(settings.emission_weight, settings.transition_weight, settings.fixed_lag)
        order = map_matched_orders(normalized, distances, cands.mask, (setting,))[0]
    assert torch.equal(order, rank_slots(scores, cands.mask))  # the eval ranks by these scores
    rankings = online_rankings(inputs, model)
    ids = inputs.passage_ids
    for (b, t), (chunk, _) in rankings.items():
        assert chunk == ids[int(cands.index[b, t, order[b, t, 0]])]
    assert len(rankings) == int(cands.valid.sum())
    return rankings


def _assert_parity(folder, dataset, embedder, inputs, provider):
    model = load_model(folder)
    expected = _eval_rankings(inputs, model)
    texts = query_texts(dataset)
    retriever = MapMatchedRetriever.from_pretrained(folder, graph=inputs.graph, provider=provider, embedder=embedder)
    server = MapMatchedServer.from_pretrained(folder, graph=inputs.graph, provider=provider, embedder=embedder)
    sessions = {b: retriever.session() for b in range(len(texts))}
    for b in sessions:
        server.open(b)
    for t in range(max(map(len, texts))):
        turn = {b: queries[t] for b, queries in enumerate(texts) if t < len(queries)}
        results, errors = server.step(turn)
        assert not errors
        for b, query in turn.items():
            chunk, ranking = expected[b, t]
            session = sessions[b].retrieve(query)
            for result in (session, results[b]):
                assert result.chunk_id == chunk, (b, t)
                assert [(c.chunk_id, c.trajectory_score) for c in result.candidate_ranking] == ranking, (b, t)  # bit for bit
    return model


def test_fit_map_matched_writes_a_model_that_sessions_and_the_server_rank_as_the_eval(tiny, tmp_path):
    dataset, embedder, inputs, provider = tiny
    folder = tmp_path / "model"
    assert main(["fit", *DATA, "--method", "map-matched", "--out", str(folder), "--json", str(tmp_path / "w.json")]) == 0
    written = json.loads((tmp_path / "w.json").read_text())
    model = _assert_parity(folder, dataset, embedder, inputs, provider)
    assert model.method == written["method"] == "map-matched" and model.settings.transition_weight == written["beta"] > 0
    assert model.config["candidate_limit"] == 5 and model.fingerprint["embedder"]["dimension"] == 256
    assert set(model.metrics["cross_fitted"]["methods"]) == {"pointwise", "map-matched"}
    assert model.metrics["validation"]["best_iteration"] == written["best_iteration"]


@pytest.mark.parametrize("mixing", [QueryMixing(0.6, 0.5, 2.0, 0.1, 0.2), QueryMixing(0.4, 0.0, 0.0, 0.0, 1.0, 0.3)])
def test_a_mixed_model_mixes_and_ranks_in_sessions_and_the_server_as_in_the_eval(tiny, tmp_path, mixing):
    dataset, embedder, inputs, provider = tiny
    folder = save_model(tmp_path / "mixed", MapMatchedModel(1.0, 0.0), DecodeSettings(1.0, 0.0), graph=inputs.graph,
                        embedder=embedder, method="mixed", mixing=mixing.to_dict(), candidate_limit=5)
    _assert_parity(folder, dataset, embedder, inputs, provider)
    mixed, _ = online_scores(inputs, load_model(folder))
    assert not torch.equal(mixed.index, inputs.candidates.index)  # the mix changed what later turns retrieve


def test_fit_mixed_and_auto_write_models_that_load(tiny, tmp_path, capsys):
    dataset, embedder, inputs, provider = tiny
    assert main(["fit", *DATA, "--method", "mixed", "--out", str(tmp_path / "mixed")]) == 0
    model = load_model(tmp_path / "mixed", graph=inputs.graph, embedder=embedder)
    assert model.method == "mixed" and model.settings.transition_weight == 0.0
    assert QueryMixing(**model.mixing).mix_weight >= 0.0
    retriever = MapMatchedRetriever.from_pretrained(tmp_path / "mixed", graph=inputs.graph, provider=provider)
    assert type(retriever.provider).__name__ == "QueryMixingProvider" and retriever.candidate_limit == 5
    assert main(["fit", *DATA, "--method", "auto", "--out", str(tmp_path / "auto")]) == 0
    auto = load_model(tmp_path / "auto")
    selection = auto.config["selection"]
    assert set(selection["candidates"]) == {"pointwise", "map-matched", "gated", "mixed", "mixed+gated"}
    best = max(v for v in selection["candidates"].values() if v is not None)
    assert selection["candidates"][selection["chosen"]] == best
    assert auto.method == ("map-matched" if selection["chosen"] == "pointwise" else selection["chosen"])


def test_fit_out_replaces_a_model_directory_and_refuses_any_other(tmp_path, capsys):
    synthetic = ["--conversations", "12", "--turns", "3", "--candidates", "6", "--quiet"]
    folder = tmp_path / "model"
    assert main(["fit", *synthetic, "--out", str(folder)]) == 0
    first = (folder / "manifest.json").read_text()
    assert main(["fit", *synthetic, "--seed", "1", "--out", str(folder)]) == 0  # a model directory: replaced
    assert (folder / "manifest.json").read_text() != first and not (tmp_path / "model.old").exists()
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["fit", *synthetic, "--out", str(other)]) == 2
    assert "is a directory that is not a model directory; refusing to replace it" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "mine"
    # the synthetic benchmark has no text: the learned methods that need embeddings say so
    assert main(["fit", *synthetic, "--method", "mixed", "--out", str(tmp_path / "m")]) == 2
    assert "query mixing needs query and passage embeddings" in capsys.readouterr().err


def test_auto_prefers_the_baseline_on_ties_and_refuses_no_metrics():
    metrics = {"methods": {"pointwise": {"all": 0.5}, "map-matched": {"all": 0.5}, "gated": {"all": None}},
               "skipped": {"mixed": "no embeddings"}}
    chosen, why = choose_method(metrics)
    assert chosen == "pointwise" and why["skipped"] == {"mixed": "no embeddings"}
    with pytest.raises(MapMatchedValueError, match="no method could be evaluated"):
        choose_method({"methods": {"pointwise": {"all": None}}})
