"""DecodeSettings: validated once, frozen, hashable, and held whole by every owner."""

from __future__ import annotations

import dataclasses

import pytest

from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever, MapMatchedServer, StandaloneDecoder
from mapmatched_torch.core.models import DecoderCandidate, ScoredCandidate
from mapmatched_torch.core.settings import DecodeSettings, DecodingMode
from mapmatched_torch.kernels.transitions import DecodingMode as KernelDecodingMode
from mapmatched_torch.kernels.transitions import decoding_mode


def test_defaults_and_normalized_values():
    settings = DecodeSettings()
    assert settings == DecodeSettings(1.0, 1.0, None, "zscore")
    given = DecodeSettings(2, 0, 3, "center")
    assert type(given.emission_weight) is float and type(given.transition_weight) is float
    assert given.fixed_lag == 3 and given.score_normalization == "center"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"emission_weight": -1.0}, "^emission_weight must be finite and nonnegative, got -1.0$"),
        ({"emission_weight": float("nan")}, "^emission_weight must be finite and nonnegative"),
        ({"transition_weight": float("inf")}, "^transition_weight must be finite and nonnegative, got inf$"),
        ({"transition_weight": True}, "^transition_weight must be finite and nonnegative, got True$"),
        ({"fixed_lag": -1}, "^fixed_lag must be nonnegative, got -1$"),
        ({"fixed_lag": 1.5}, "^fixed_lag must be an integer, got 1.5$"),
        ({"score_normalization": "minmax"}, "^unsupported score normalization: minmax "),
        # the first bad option in field order is the one named
        ({"transition_weight": -1.0, "fixed_lag": -1, "score_normalization": "x"}, "^transition_weight"),
        ({"fixed_lag": -1, "score_normalization": "x"}, "^fixed_lag"),
    ],
)
def test_validation_messages_are_the_specs(options, message):
    with pytest.raises(ValueError, match=message):
        DecodeSettings(**options)


def test_frozen_slotted_equal_and_hashable():
    settings = DecodeSettings(transition_weight=0.5, fixed_lag=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.transition_weight = 1.0  # type: ignore[misc]
    assert not hasattr(settings, "__dict__")
    assert settings == DecodeSettings(1, 0.5, 2) and hash(settings) == hash(DecodeSettings(1, 0.5, 2))
    assert settings != DecodeSettings(1.0, 0.5, 2, "none")
    assert len({settings, DecodeSettings(1.0, 0.5, 2), DecodeSettings()}) == 2
    # replace validates again
    with pytest.raises(ValueError, match="^fixed_lag must be nonnegative"):
        dataclasses.replace(settings, fixed_lag=-2)


@pytest.mark.parametrize(
    "beta, lag, mode",
    [
        (0.0, None, DecodingMode.POINTWISE),
        (0.0, 2, DecodingMode.POINTWISE),
        (0.5, None, DecodingMode.VITERBI),
        (0.5, 0, DecodingMode.FIXED_LAG),
    ],
)
def test_mode_is_the_one_choice_of_decoder(beta, lag, mode):
    settings = DecodeSettings(transition_weight=beta, fixed_lag=lag)
    assert settings.mode is mode is decoding_mode(beta, lag)
    assert settings.mode.uses_distances is (beta != 0.0)


def test_decoding_mode_has_one_home():
    assert KernelDecodingMode is DecodingMode


def test_transition_cost_and_decoder_options():
    settings = DecodeSettings(0.5, 0.25, 1)
    assert settings.transition_cost(3.0) == 0.25 * 3.0
    assert settings.decoder_options == {"emission_weight": 0.5, "transition_weight": 0.25, "fixed_lag": 1}


def test_resolve_takes_settings_or_loose_options_not_both():
    settings = DecodeSettings(transition_weight=0.5)
    assert DecodeSettings.resolve(settings, emission_weight=1.0, transition_weight=1.0) is settings
    assert DecodeSettings.resolve(None, transition_weight=0.5) == settings
    with pytest.raises(ValueError, match="pass either settings= or transition_weight=, not both"):
        DecodeSettings.resolve(settings, transition_weight=0.7)
    with pytest.raises(ValueError, match="settings must be a DecodeSettings, got dict"):
        DecodeSettings.resolve({"transition_weight": 0.5})  # type: ignore[arg-type]


def _graph():
    return InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")])


def test_the_retriever_and_the_server_hold_one_settings():
    graph = _graph()
    settings = DecodeSettings(0.5, 0.25, 1, "center")
    loose = dict(emission_weight=0.5, transition_weight=0.25, fixed_lag=1, score_normalization="center")
    retriever = MapMatchedRetriever(graph, **loose)
    assert retriever.settings == settings
    assert (retriever.emission_weight, retriever.transition_weight, retriever.fixed_lag) == (0.5, 0.25, 1)
    assert retriever.score_normalization == "center"
    assert MapMatchedRetriever(graph, settings=settings).settings is settings
    server = MapMatchedServer(graph, **loose)
    assert server.settings == settings
    assert server.store.settings is server.settings is server.store.decoder.settings
    assert MapMatchedServer(graph, settings=settings).settings is settings
    assert server.retriever.settings is server.settings  # made on demand, with the same options
    with pytest.raises(ValueError, match="pass either settings= or fixed_lag=, not both"):
        MapMatchedServer(graph, settings=settings, fixed_lag=2)
    with pytest.raises(ValueError, match="pass either settings= or score_normalization=, not both"):
        MapMatchedRetriever(graph, settings=settings, score_normalization="none")


def test_the_server_validates_without_building_a_retriever(monkeypatch):
    import mapmatched_torch.serving.server as server_module

    def refuse(*args, **kwargs):
        raise AssertionError("the server built a MapMatchedRetriever")

    monkeypatch.setattr(server_module, "MapMatchedRetriever", refuse)
    server = MapMatchedServer(_graph(), transition_weight=0.5)
    server.open("a")
    results, errors = server.step({"a": [ScoredCandidate("a", 1.0)]})
    assert not errors and results["a"].chunk_id == "a"
    with pytest.raises(ValueError, match="^transition_weight must be finite and nonnegative"):
        MapMatchedServer(_graph(), transition_weight=-1.0)


def test_settings_decode_as_the_loose_options():
    graph = _graph()
    trellis = [[DecoderCandidate("a", 1.0, 1.0)], [DecoderCandidate("c", 2.0, 1.0), DecoderCandidate("b", 1.0, 0.5)]]
    decoder = StandaloneDecoder()
    for beta, lag in ((0.0, None), (0.5, None), (2.0, 0)):
        loose = decoder.decode_ranked(trellis, graph, transition_weight=beta, fixed_lag=lag)
        assert decoder.decode_ranked(trellis, graph, settings=DecodeSettings(transition_weight=beta, fixed_lag=lag)) == loose


def test_evaluation_settings_are_decode_settings():
    from mapmatched_torch.eval.methods import Setting, settings_grid

    grid = settings_grid((1.0,), (0.0, 0.5), (None, 1))
    assert all(isinstance(setting, DecodeSettings) and type(setting) is Setting for setting in grid)
    assert [setting.mode for setting in grid] == [
        DecodingMode.POINTWISE, DecodingMode.POINTWISE, DecodingMode.VITERBI, DecodingMode.FIXED_LAG
    ]
    with pytest.raises(ValueError, match="^transition_weight must be finite and nonnegative, got -0.5$"):
        settings_grid((1.0,), (-0.5,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        grid[0].fixed_lag = 3  # type: ignore[misc]


def test_a_fit_hands_back_one_settings():
    from mapmatched_torch.fit import fit_weights

    def turn(relevant, **scores):
        return tuple(ScoredCandidate(chunk_id, score) for chunk_id, score in scores.items()), set(relevant)

    conversations = [[turn({"a"}, a=1.0, b=0.5), turn({"b"}, b=0.2, c=0.9)], [turn({"c"}, a=0.3, c=0.2)]]
    result = fit_weights(conversations, _graph(), score_normalization="center", validation_fraction=0.0,
                         max_iterations=2, progress=False)
    assert result.settings == DecodeSettings(result.emission_weight, result.transition_weight, None, "center")
    assert MapMatchedRetriever(_graph(), settings=result.settings).settings == result.settings
