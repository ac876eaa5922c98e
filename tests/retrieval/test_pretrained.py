"""from_pretrained: a model directory round-trips into retrievers and servers, and a mismatched,
gated one without its feature's inputs or a damaged one is refused clearly."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever, MapMatchedServer, ScoredCandidate
from mapmatched_torch.core.errors import MapMatchedTypeError, MapMatchedValueError
from mapmatched_torch.core.model_artifacts import ModelMismatchWarning
from mapmatched_torch.core.settings import DecodeSettings
from mapmatched_torch.eval.embedders import make_embedder
from mapmatched_torch.fit.artifacts import save_model
from mapmatched_torch.fit.model import MapMatchedModel
from mapmatched_torch.kernels.transitions import GatedTransitions
from mapmatched_torch.providers.dense import DenseProvider
from mapmatched_torch.providers.query_mixing import QueryMixing, QueryMixingProvider
from mapmatched_torch.retrieval.pretrained import load_model, transition_model

IDS = ("a", "b", "c", "d")
GRAPH = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "c", 2.0), ("c", "d", 1.0)], maximum_distance=4.0)
EMBEDDER = make_embedder("hash", dim=16)


def _provider() -> DenseProvider:
    return DenseProvider(EMBEDDER.encode(list(IDS)), IDS, lambda q: EMBEDDER.encode([q])[0])


def _save(folder, method="map-matched", model=None, settings=DecodeSettings(1.5, 0.5), **kwargs):
    return save_model(folder, model or MapMatchedModel(settings.emission_weight, settings.transition_weight),
                      settings, graph=GRAPH, embedder=EMBEDDER, method=method, **kwargs)


@pytest.mark.parametrize("cls", [MapMatchedRetriever, MapMatchedServer])
def test_a_map_matched_model_sets_the_fitted_settings_and_candidate_limit(tmp_path, cls):
    folder = _save(tmp_path / "m", settings=DecodeSettings(1.5, 0.5, fixed_lag=1), candidate_limit=3)
    engine = cls.from_pretrained(folder, graph=GRAPH, provider=_provider(), embedder=make_embedder("hash", dim=16))
    assert engine.settings == DecodeSettings(1.5, 0.5, fixed_lag=1) and engine.candidate_limit == 3
    assert type(engine.provider) is DenseProvider
    assert cls.from_pretrained(folder, graph=GRAPH, candidate_limit=2, context_radius=0.0).candidate_limit == 2
    with pytest.raises(MapMatchedTypeError, match="takes transition_weight from the model"):
        cls.from_pretrained(folder, graph=GRAPH, transition_weight=2.0)


def test_a_map_matched_retriever_decodes_as_one_built_with_its_settings(tmp_path):
    folder = _save(tmp_path / "m", settings=DecodeSettings(0.5, 2.0))
    loaded = MapMatchedRetriever.from_pretrained(folder, graph=GRAPH).session()
    built = MapMatchedRetriever(GRAPH, emission_weight=0.5, transition_weight=2.0).session()
    for turn in ([("a", 1.0), ("d", 0.9)], [("d", 1.0), ("b", 0.95)], [("c", 1.0), ("a", 0.2)]):
        got, want = loaded.retrieve_candidates(turn), built.retrieve_candidates(turn)
        assert (got.path, got.candidate_ranking) == (want.path, want.candidate_ranking)


@pytest.mark.parametrize("cls", [MapMatchedRetriever, MapMatchedServer])
def test_a_mixed_model_wraps_the_provider_in_its_query_mixing(tmp_path, cls):
    mixing = QueryMixing(0.5, 0.1, -1.0, 0.2, 0.3, query_mix_weight=0.25)
    folder = _save(tmp_path / "m", method="mixed", settings=DecodeSettings(1.0, 0.0), mixing=mixing.to_dict())
    engine = cls.from_pretrained(folder, graph=GRAPH, provider=_provider())
    assert isinstance(engine.provider, QueryMixingProvider) and engine.provider.mixing == mixing
    with pytest.raises(MapMatchedValueError, match="from_pretrained needs provider="):
        cls.from_pretrained(folder, graph=GRAPH)
    with pytest.raises(MapMatchedTypeError, match="pass the plain vector-search provider"):
        cls.from_pretrained(folder, graph=GRAPH, provider=QueryMixingProvider(_provider(), mixing))


def _gated_model() -> MapMatchedModel:
    gate = GatedTransitions(0.7, num_features=1, calibrate=True, cap=3.0)
    with torch.no_grad():
        gate.gate_bias.fill_(-0.25)
        gate.gate_weights.fill_(0.5)
        gate.feature_mean.fill_(0.1)
    return MapMatchedModel(1.3, transition_model=gate)


@pytest.mark.parametrize("cls", [MapMatchedRetriever, MapMatchedServer])
def test_a_gated_model_is_served_with_its_fitted_transitions_and_feature(tmp_path, cls):
    model = _gated_model()
    folder = _save(tmp_path / "g", method="gated", model=model, settings=DecodeSettings(1.3, 0.7),
                   feature="query-source cosine")
    loaded = load_model(folder)
    assert loaded.config["transitions"] == {"kind": "gated", "num_features": 1, "calibrate": True,
                                            "cap": pytest.approx(3.0), "feature": "query-source cosine"}
    gate = transition_model(loaded)
    assert gate.state_dict().keys() == model.transition_model.state_dict().keys()
    assert all(torch.equal(gate.state_dict()[k], v) for k, v in model.transition_model.state_dict().items())
    # fitted on the cosine: the passages' embeddings are needed, as in the fit
    with pytest.raises(MapMatchedValueError, match="fitted on the query-source cosine .*: pass passage_embeddings="):
        cls.from_pretrained(folder, graph=GRAPH)
    passages = EMBEDDER.encode(list(IDS))
    engine = cls.from_pretrained(folder, graph=GRAPH, passage_embeddings=passages, passage_ids=IDS)
    weights = {k: v for k, v in engine.transitions.state_dict().items()}
    assert all(torch.equal(weights[k], v) for k, v in model.transition_model.state_dict().items())
    assert engine.settings.emission_weight == 1.3
    score_level = _save(tmp_path / "s", method="gated", model=model, settings=DecodeSettings(1.3, 0.7),
                        feature="score-level query-source match")
    with pytest.raises(MapMatchedValueError, match="leave passage_embeddings= out"):
        cls.from_pretrained(score_level, graph=GRAPH, passage_embeddings=passages, passage_ids=IDS)
    assert cls.from_pretrained(score_level, graph=GRAPH).learned.passage_embeddings is None


def test_a_gated_retriever_decodes_as_one_built_with_the_fitted_model(tmp_path):
    model = _gated_model()
    folder = _save(tmp_path / "g", method="gated", model=model, settings=DecodeSettings(1.3, 0.7),
                   feature="query-source cosine")
    passages = EMBEDDER.encode(list(IDS))
    loaded = MapMatchedRetriever.from_pretrained(folder, graph=GRAPH, provider=_provider(),
                                                 passage_embeddings=passages, passage_ids=IDS).session()
    built = MapMatchedRetriever(GRAPH, provider=_provider(), settings=DecodeSettings(1.3, 0.7), transitions=model.transition_model,
                                passage_embeddings=passages, passage_ids=IDS).session()
    for query in ("a b", "c", "d a", "b"):
        vector = torch.as_tensor(EMBEDDER.encode([query])[0])
        got, want = loaded.retrieve(query, query_embedding=vector), built.retrieve(query, query_embedding=vector)
        assert (got.path, got.candidate_ranking) == (want.path, want.candidate_ranking)


def test_another_graph_or_embedder_is_refused_or_warned_with_strict_false(tmp_path):
    folder = _save(tmp_path / "m")
    other = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "e", 2.0)], maximum_distance=4.0)
    with pytest.raises(MapMatchedValueError, match="another graph: node_ids_sha256 .*strict=False loads it anyway"):
        MapMatchedRetriever.from_pretrained(folder, graph=other)
    with pytest.raises(MapMatchedValueError, match="another embedder: dimension 16 .artifact. vs 8 .given."):
        MapMatchedServer.from_pretrained(folder, graph=GRAPH, embedder=make_embedder("hash", dim=8))
    with pytest.warns(ModelMismatchWarning, match="another graph"):
        retriever = MapMatchedRetriever.from_pretrained(folder, graph=other, strict=False)
    assert retriever.settings.transition_weight == 0.5
    reordered = InMemoryCorpusGraph([("d", "c", 1.0), ("c", "b", 2.0), ("b", "a", 1.0)], maximum_distance=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MapMatchedRetriever.from_pretrained(folder, graph=reordered)  # the same nodes in another order


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "config.json").write_text("{}"), "config.json does not match its checksum"),
    (lambda f: (f / "weights.pt").unlink(), "weights.pt is missing"),
    (lambda f: (f / "fingerprint.json").write_text("not json"), "fingerprint.json does not match"),
])
def test_a_damaged_model_directory_is_refused(tmp_path, damage, message):
    folder = _save(tmp_path / "m")
    damage(folder)
    with pytest.raises(MapMatchedValueError, match=message):
        MapMatchedRetriever.from_pretrained(folder, graph=GRAPH)


def test_an_unknown_method_or_a_bad_json_with_its_checksum_is_refused(tmp_path):
    from mapmatched_torch.core.model_artifacts import file_sha256

    folder = _save(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    for edit, message in (({"method": "magic"}, "damaged model artifact .*: unsupported model method: magic"), ({"settings": {}}, "damaged model artifact")):
        (folder / "config.json").write_text(json.dumps({**config, **edit}))
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"]["config.json"] = file_sha256(folder / "config.json")
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(MapMatchedValueError, match=message):
            load_model(folder)
    with pytest.raises(MapMatchedValueError, match="is not a model directory"):
        load_model(tmp_path / "nothing")
    with pytest.raises(MapMatchedValueError, match="unsupported model method: auto"):
        _save(tmp_path / "x", method="auto")


def test_save_model_overwrites_only_a_model_directory(tmp_path):
    folder = _save(tmp_path / "m")
    _save(folder, settings=DecodeSettings(1.0, 2.0), overwrite=True)
    assert load_model(folder).settings.transition_weight == 2.0
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(MapMatchedValueError, match="not a model directory, refusing to replace it"):
        _save(plain, overwrite=True)


def test_a_server_from_pretrained_steps_like_its_retriever(tmp_path):
    folder = _save(tmp_path / "m", settings=DecodeSettings(1.0, 1.0))
    server = MapMatchedServer.from_pretrained(folder, graph=GRAPH)
    session = MapMatchedRetriever.from_pretrained(folder, graph=GRAPH).session()
    server.open("s")
    for turn in ([ScoredCandidate("a", 1.0), ScoredCandidate("c", 0.5)], [ScoredCandidate("c", 1.0),
                                                                          ScoredCandidate("b", 0.9)]):
        results, errors = server.step({"s": turn})
        expected = session.retrieve_candidates(turn)
        assert not errors and results["s"].candidate_ranking == expected.candidate_ranking
        assert results["s"].chunk_id == expected.chunk_id
