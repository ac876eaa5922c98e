"""Model artifacts: a saved fit loads back exactly, and a damaged or mismatched one is refused."""

from __future__ import annotations

import json

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.settings import DecodeSettings
from mapmatched_torch.eval.embedders import make_embedder
from mapmatched_torch.fit.artifacts import load_model, save_model
from mapmatched_torch.fit.model import MapMatchedModel
from mapmatched_torch.kernels.transitions import GatedTransitions
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

GRAPH = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "c", 2.0)], maximum_distance=4.0)


def _gated() -> MapMatchedModel:
    gate = GatedTransitions(0.7, num_features=1, cap=4.0)
    with torch.no_grad():
        gate.gate_bias.fill_(-0.25)
    return MapMatchedModel(1.3, transition_model=gate)


def test_a_saved_model_loads_back_bit_for_bit(tmp_path):
    model = _gated()
    embedder = make_embedder("hash", dim=16)
    settings = DecodeSettings(1.3, 0.7, fixed_lag=2)
    folder = save_model(tmp_path / "model", model, settings, graph=GRAPH, embedder=embedder, method="gated",
                        metrics={"validation_ndcg@3": 0.5})
    loaded = load_model(folder, graph=GRAPH, embedder=make_embedder("hash", dim=16))
    assert (loaded.method, loaded.settings, loaded.metrics) == ("gated", settings, {"validation_ndcg@3": 0.5})
    assert loaded.state_dict.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded.state_dict[k], v) for k, v in model.state_dict().items())
    again = _gated()
    again.load_state_dict(loaded.state_dict)
    assert torch.equal(again.transition_model.gate_bias, model.transition_model.gate_bias)
    assert torch.load(folder / "weights.pt", weights_only=True).keys() == model.state_dict().keys()
    with pytest.raises(MapMatchedValueError, match="exists"):
        save_model(folder, model, settings, graph=GRAPH)


def test_a_model_fitted_over_another_graph_or_embedder_is_refused_naming_what_differs(tmp_path):
    folder = save_model(tmp_path / "m", MapMatchedModel(1.0, 0.5), DecodeSettings(1.0, 0.5), graph=GRAPH,
                        embedder=make_embedder("hash", dim=16))
    other = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "d", 2.0)], maximum_distance=4.0)
    with pytest.raises(MapMatchedValueError, match="another graph: node_ids_sha256"):
        load_model(folder, graph=other)
    wider = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "c", 2.0)], maximum_distance=5.0)
    with pytest.raises(MapMatchedValueError, match="maximum_distance 4.0 .artifact. vs 5.0 .given."):
        load_model(folder, graph=wider)
    with pytest.raises(MapMatchedValueError, match="another embedder: dimension 16 .artifact. vs 32"):
        load_model(folder, embedder=make_embedder("hash", dim=32))


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "weights.pt").write_bytes(b"x"), "weights.pt does not match its checksum"),
    (lambda f: (f / "metrics.json").unlink(), "metrics.json is missing"),
    (lambda f: (f / "manifest.json").write_text("{"), "cannot read manifest.json"),
    (lambda f: (f / "manifest.json").write_text(json.dumps({"format": 99})), "format 99"),
])
def test_a_damaged_artifact_is_refused(tmp_path, damage, message):
    folder = save_model(tmp_path / "m", MapMatchedModel(1.0, 0.5), DecodeSettings(1.0, 0.5), graph=GRAPH)
    damage(folder)
    with pytest.raises(MapMatchedValueError, match=message):
        load_model(folder)
