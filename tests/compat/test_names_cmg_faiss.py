"""Drop-in for mapmatched 0.1.0: upstream's public names, CMGDecoder, FAISSProvider's
upstream behaviour, and ``import mapmatched`` through the module alias.

Each test states the upstream behaviour it pins (what code written against the
pure-Python ``mapmatched`` relies on).
"""

from __future__ import annotations

import collections.abc
import importlib
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, List

import pytest

import mapmatched_torch
from mapmatched_torch import (
    CMGBackendUnavailableError,
    CMGDecoder,
    FAISSDependencyUnavailableError,
    GraphDependencyUnavailableError,
    InMemoryCorpusGraph,
    MissingDependencyError,
    ScoredCandidate,
    StandaloneDecoder,
    normalize_candidates,
)

from ..standalone.test_cmg import BACKEND, make_fake_cmg

ROOT = Path(__file__).resolve().parents[2]

#: upstream mapmatched's ``__all__`` (src/mapmatched/__init__.py after the 0.1.0 tag).
UPSTREAM_ALL = (
    "CMGBackendUnavailableError", "CMGDecoder", "CandidateProvider", "CorpusGraph", "DecodedPath", "DecodedStep",
    "Decoder", "FAISSDependencyUnavailableError", "FAISSIndex", "FAISSProvider", "FAISSScoreMode",
    "GraphDependencyUnavailableError", "GraphEdge", "InMemoryCorpusGraph", "KNNGraph", "MapMatchedRetriever",
    "MapMatchedSession", "QueryEmbedder", "RetrievalResult", "RetrievalTrace", "ScoreNormalization",
    "ScoredCandidate", "StandaloneDecoder", "TraceStep", "normalize_candidates", "render_trace", "softmax_entropy",
)  # fmt: skip


# --------------------------------------------------------------------------- names


def test_every_upstream_name_is_exported() -> None:
    missing = [name for name in UPSTREAM_ALL if name not in mapmatched_torch.__all__]
    assert missing == []
    for name in UPSTREAM_ALL:
        assert getattr(mapmatched_torch, name) is not None, name


@pytest.mark.parametrize(
    ("error", "extra"),
    [(FAISSDependencyUnavailableError, "faiss"), (GraphDependencyUnavailableError, "graph")],
)
def test_dependency_errors_are_import_errors_naming_their_extra(error: type, extra: str) -> None:
    assert issubclass(error, ImportError) and issubclass(error, MissingDependencyError)
    assert f"`pip install 'mapmatched-torch[{extra}]'`" in str(error())  # upstream's tests match r"\[extra\]"


def test_the_graph_extra_that_the_message_names_exists() -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "graph" in extras


def test_faiss_dependency_error_is_our_faiss_error() -> None:
    assert FAISSDependencyUnavailableError is mapmatched_torch.FAISSNotInstalledError


def test_cmg_error_is_an_import_error_with_upstreams_text() -> None:
    assert issubclass(CMGBackendUnavailableError, ImportError)
    message = str(CMGBackendUnavailableError())
    assert "compatible composable-model-graph installation" in message and "pip install" in message


def test_typing_aliases_are_upstreams() -> None:
    assert typing.get_args(mapmatched_torch.ScoreNormalization) == ("zscore", "center", "none")
    assert typing.get_args(mapmatched_torch.FAISSScoreMode) == ("similarity", "distance")
    embedder = mapmatched_torch.QueryEmbedder
    assert typing.get_origin(embedder) is collections.abc.Callable
    assert typing.get_args(embedder) == ([str], typing.Sequence[float])


def test_faiss_index_is_a_protocol_with_d_ntotal_and_search() -> None:
    index = mapmatched_torch.FAISSIndex
    assert typing.Protocol in index.__mro__ and index._is_protocol
    assert set(typing.get_type_hints(index)) == {"d", "ntotal"}
    assert callable(index.search)


# --------------------------------------------------------------------------- CMGDecoder


def _line_graph() -> InMemoryCorpusGraph:
    return InMemoryCorpusGraph.from_edges([("0", "1"), ("1", "2")], maximum_distance=3.0)


def _hand_computed_trellis() -> tuple:
    turns = [[("0", 5.0), ("1", 0.0), ("2", 0.0)], [("0", 3.0), ("1", 0.0), ("2", 6.0)], [("0", 8.0), ("1", 0.0), ("2", 0.0)]]
    return tuple(normalize_candidates([ScoredCandidate(*pair) for pair in turn], "none") for turn in turns)


def test_cmg_decoder_without_the_backend_raises_upstreams_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, BACKEND, None)
    monkeypatch.setitem(sys.modules, f"{BACKEND}.estimation", None)
    with pytest.raises(CMGBackendUnavailableError, match="compatible composable-model-graph installation"):
        CMGDecoder().decode(_hand_computed_trellis(), graph=_line_graph(), emission_weight=1.0, transition_weight=1.0)


def test_cmg_decoder_with_the_backend_equals_the_standalone_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[Any] = []
    monkeypatch.setitem(sys.modules, BACKEND, make_fake_cmg(calls))
    arguments = {"graph": _line_graph(), "emission_weight": 1.0, "transition_weight": 1.0}
    for lag, expected in ((None, ("0", "0", "0")), (0, ("0", "2", "0")), (1, ("0", "0", "0"))):
        path = CMGDecoder().decode(_hand_computed_trellis(), fixed_lag=lag, **arguments)
        assert path == StandaloneDecoder().decode(_hand_computed_trellis(), fixed_lag=lag, **arguments)
        assert path.chunk_ids == expected
    assert [call["function"] for call in calls] == ["decode_path", "decode_path_fixed_lag", "decode_path_fixed_lag"]


def test_cmg_decoder_rejects_a_bad_backend_answer_as_a_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, BACKEND, make_fake_cmg([], lambda result: type(result)(state_ids=("0",) * 3)))
    with pytest.raises(RuntimeError, match="^CMG decoder returned invalid state IDs"):
        CMGDecoder().decode(_hand_computed_trellis(), graph=_line_graph(), emission_weight=1.0, transition_weight=1.0)


# --------------------------------------------------------------------------- FAISSProvider


class FixtureMatrix:
    """A search result that only supports ``[row]`` and ``tolist()`` (as upstream's tests use)."""

    def __init__(self, values: list) -> None:
        self._values = values

    def __getitem__(self, index: int) -> "FixtureMatrix":
        value = self._values[index]
        if not isinstance(value, list):
            raise TypeError("matrix row must be a list")
        return FixtureMatrix(value)

    def tolist(self) -> list:
        return list(self._values)


class FixtureIndex:
    d = 2

    def __init__(self, scores: list, labels: list, ntotal: int) -> None:
        self.ntotal, self._scores, self._labels = ntotal, scores, labels
        self.searches = 0

    def search(self, query_vectors: object, limit: int) -> tuple:
        self.searches += 1
        return FixtureMatrix([self._scores]), FixtureMatrix([self._labels])


@pytest.fixture
def without_faiss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)  # upstream never imports faiss; neither do we


@pytest.mark.parametrize(
    ("scores", "labels", "chunk_ids", "message"),
    [
        ([float("nan")], [0], ["a"], "non-finite"),
        ([1.0], [2], ["a"], "invalid result index"),
        ([1.0, 0.5], [0, 0], ["a", "b"], "duplicate result index"),
        (["x"], [0], ["a"], "non-numeric score"),
        ([1.0], [0, 1], ["a", "b"], "different score and index counts"),
    ],
)
def test_bad_search_results_are_runtime_errors(without_faiss, scores, labels, chunk_ids, message) -> None:
    provider = mapmatched_torch.FAISSProvider(FixtureIndex(scores, labels, len(chunk_ids)), chunk_ids, lambda q: [1.0, 0.0])
    with pytest.raises(RuntimeError, match=f"^FAISS returned .*{message}"):
        provider.candidates("query", len(chunk_ids))


def test_a_label_that_is_not_an_integer_is_a_type_error(without_faiss) -> None:
    provider = mapmatched_torch.FAISSProvider(FixtureIndex([1.0], [0.0], 1), ["a"], lambda q: [1.0, 0.0])
    with pytest.raises(TypeError, match="^FAISS index result index must be an integer"):
        provider.candidates("query", 1)


def test_fixture_results_are_read_like_upstream(without_faiss) -> None:
    index = FixtureIndex([0.5, 2.0], [1, 0], 2)
    provider = mapmatched_torch.FAISSProvider(index, ["a", "b"], lambda q: [1.0, 0.0])
    assert provider.candidates("query", limit=5) == (ScoredCandidate("a", 2.0), ScoredCandidate("b", 0.5))
    assert provider.candidates("query", 2) == provider.retrieve("query", 2)


def test_missing_numpy_raises_before_the_search(without_faiss, monkeypatch: pytest.MonkeyPatch) -> None:
    faiss_adapter = importlib.import_module("mapmatched_torch.providers.faiss")  # mapmatched.adapters.faiss's home
    index = FixtureIndex([1.0], [0], 1)
    provider = mapmatched_torch.FAISSProvider(index, ["a"], lambda q: [1.0, 0.0])
    original = importlib.import_module

    def import_without_numpy(name: str, package: Any = None) -> Any:
        if name == "numpy":
            raise ImportError("missing")
        return original(name, package)

    monkeypatch.setattr(faiss_adapter.importlib, "import_module", import_without_numpy)
    with pytest.raises(FAISSDependencyUnavailableError, match=r"\[faiss\]"):
        provider.candidates("query", 1)
    assert index.searches == 0


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda P: P(FixtureIndex([], [], 1), ["a", "b"], list), ValueError, r"^FAISS index contains 1 vectors but received 2 chunk IDs$"),
        (lambda P: P(FixtureIndex([], [], 1), ["a"], "not callable"), TypeError, "^embed_query must be callable"),
        (lambda P: P(FixtureIndex([], [], 1.5), ["a"], list), TypeError, "^FAISS index ntotal must be an integer"),
        (lambda P: P(FixtureIndex([], [], 1), ["a"], list, score_mode="cosine"), ValueError, "^unsupported FAISS score mode: cosine"),
        (lambda P: P(FixtureIndex([], [], 0), [], list), ValueError, "^chunk_ids must contain at least one ID"),
    ],
)
def test_construction_errors_match_upstreams(without_faiss, build, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        build(mapmatched_torch.FAISSProvider)


def test_query_vector_errors_match_upstreams(without_faiss) -> None:
    provider = mapmatched_torch.FAISSProvider(FixtureIndex([1.0], [0], 1), ["a"], lambda q: [1.0])
    with pytest.raises(ValueError, match=r"dimension 1.*expected 2"):
        provider.candidates("query", 1)
    index = FixtureIndex([1.0], [0], 1)
    grown = mapmatched_torch.FAISSProvider(index, ["a"], lambda q: [1.0, 0.0])
    index.ntotal = 2
    with pytest.raises(RuntimeError, match="^FAISS index size changed after provider construction"):
        grown.candidates("query", 1)


# --------------------------------------------------------------------------- import mapmatched


ALIAS_SCRIPT = """
import importlib, sys
import mapmatched_torch
assert "mapmatched" not in sys.modules  # importing mapmatched_torch does not install the alias
assert mapmatched_torch.install_mapmatched_alias() is mapmatched_torch.install_mapmatched_alias()
import mapmatched
from mapmatched import CMGDecoder, GraphDependencyUnavailableError, KNNGraph, knn as knn_module
from mapmatched.adapters import faiss as faiss_adapter
from mapmatched.cmg import CMGBackendUnavailableError
from mapmatched.decoder import Decoder, StandaloneDecoder, Trellis
from mapmatched.graph import CorpusGraph, GraphEdge, InMemoryCorpusGraph
from mapmatched.models import CandidateScore, DecoderCandidate
from mapmatched.retrieval import CandidateProvider, MapMatchedRetriever, MapMatchedSession
from mapmatched.scoring import ScoreNormalization, normalize_candidates
from mapmatched.trace import render_trace
import mapmatched.graph as graph_view

ours = mapmatched_torch
assert (CMGDecoder, KNNGraph, StandaloneDecoder, InMemoryCorpusGraph) == (
    ours.CMGDecoder, ours.KNNGraph, ours.StandaloneDecoder, ours.InMemoryCorpusGraph)
assert (CandidateProvider, MapMatchedSession, DecoderCandidate) == (
    ours.CandidateProvider, ours.MapMatchedSession, ours.DecoderCandidate)
assert faiss_adapter.FAISSProvider is ours.FAISSProvider
assert faiss_adapter.importlib is importlib and knn_module.importlib is importlib
assert knn_module._load_scipy_sparse() is None
assert faiss_adapter.FAISSDependencyUnavailableError is ours.FAISSDependencyUnavailableError
# our own modules stay what they are
import mapmatched_torch.graph, mapmatched_torch.retrieval
assert hasattr(ours.graph, "TensorCorpusGraph") and hasattr(ours.retrieval, "decode_turns")
assert hasattr(graph_view, "InMemoryCorpusGraph") and not hasattr(graph_view, "TensorCorpusGraph")
assert mapmatched.graph is graph_view and mapmatched.cmg is sys.modules["mapmatched_torch.standalone.cmg"]
# no module file is loaded twice: every mapmatched.X is a module of ours or a view
for name, module in list(sys.modules.items()):
    if name.startswith("mapmatched."):
        spec_name = module.__spec__.name
        assert spec_name.startswith("mapmatched_torch.") or getattr(module, "__mapmatched_view__", False), name
        assert not getattr(module, "__file__", None) or spec_name.startswith("mapmatched_torch."), name
print("ok", sorted(name for name in sys.modules if name.startswith("mapmatched.")))
"""


def test_import_mapmatched_gives_upstreams_modules() -> None:
    script = textwrap.dedent(ALIAS_SCRIPT)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok") and "mapmatched.graph" in result.stdout


def test_the_alias_refuses_to_hide_another_mapmatched() -> None:
    script = textwrap.dedent(
        """
        import sys, types
        sys.modules["mapmatched"] = types.ModuleType("mapmatched")
        import mapmatched_torch
        try:
            mapmatched_torch.install_mapmatched_alias()
        except ImportError as error:
            print(error)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "another 'mapmatched' module" in result.stdout and "install_mapmatched_alias() would hide it" in result.stdout


def test_without_the_alias_mapmatched_paths_are_not_ours() -> None:
    if "mapmatched" in sys.modules:
        pytest.skip("mapmatched is imported in this process")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mapmatched.graph")
