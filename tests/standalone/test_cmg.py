"""Tests of mapmatched_torch.standalone.cmg: CMGDecoder against a fake composable-model-graph.

composable-model-graph is not installed here (it is not on PyPI), so :func:`fake_cmg`
puts a module in ``sys.modules`` that has its API (``CandidateState``, ``decode_path``,
``decode_path_fixed_lag``, results with ``state_ids`` as a list of str) and decodes with
StandaloneDecoder on the states and the cost it is handed; it records every call.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import types
from typing import Any, Callable, Dict, List, Optional

import pytest

from mapmatched_torch import (
    CMGBackendUnavailableError,
    CMGDecoder,
    DecoderCandidate,
    InMemoryCorpusGraph,
    MapMatchedBackendError,
    MissingDependencyError,
    StandaloneDecoder,
)
from mapmatched_torch.standalone import cmg as cmg_module

BACKEND = "composable_model_graph"


@dataclasses.dataclass
class CandidateState:
    """composable-model-graph's state: a plain, mutable dataclass."""

    id: str
    score: float
    value: Any = None


class _CostGraph:
    """A graph whose distance is the backend's transition cost (step index 0: unused)."""

    def __init__(self, cost: Optional[Callable[..., float]]) -> None:
        self._cost = cost
        self.maximum_distance = float("inf")

    def distance(self, source: str, target: str) -> float:
        if self._cost is None:
            return 0.0
        return self._cost(CandidateState(source, 0.0), CandidateState(target, 0.0), 0)

    def neighborhood(self, chunk_id: str, radius: float) -> tuple:
        return ()


def _decode(steps: List[List[CandidateState]], lag: Optional[int], cost: Any, weight: float) -> Any:
    trellis = [[DecoderCandidate(state.id, state.score, state.score) for state in turn] for turn in steps]
    path = StandaloneDecoder().decode(
        trellis, _CostGraph(cost), emission_weight=1.0, transition_weight=weight, fixed_lag=lag
    )
    return types.SimpleNamespace(state_ids=list(path.chunk_ids), total_score=path.total_score)


def make_fake_cmg(calls: List[Dict[str, Any]], answer: Optional[Callable[[Any], Any]] = None) -> types.ModuleType:
    """A stand-in ``composable_model_graph`` module; ``answer`` may rewrite its result."""
    module = types.ModuleType(BACKEND)
    module.CandidateState = CandidateState

    def decode_path(steps, transition_cost=None, transition_weight=1.0):
        calls.append({"function": "decode_path", "steps": steps, "cost": transition_cost, "weight": transition_weight})
        result = _decode(steps, None, transition_cost, transition_weight)
        return answer(result) if answer else result

    def decode_path_fixed_lag(steps, lag, transition_cost=None, transition_weight=1.0):
        calls.append(
            {"function": "decode_path_fixed_lag", "steps": steps, "lag": lag, "cost": transition_cost, "weight": transition_weight}
        )
        result = _decode(steps, lag, transition_cost, transition_weight)
        return answer(result) if answer else result

    module.decode_path = decode_path
    module.decode_path_fixed_lag = decode_path_fixed_lag
    return module


@pytest.fixture
def cmg_calls(monkeypatch: pytest.MonkeyPatch) -> List[Dict[str, Any]]:
    """Install the fake backend; the list collects its calls."""
    calls: List[Dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, BACKEND, make_fake_cmg(calls))
    return calls


@pytest.fixture
def no_cmg(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import composable_model_graph`` (and its subpackage) raise ImportError."""
    monkeypatch.setitem(sys.modules, BACKEND, None)
    monkeypatch.setitem(sys.modules, f"{BACKEND}.estimation", None)


def _graph() -> InMemoryCorpusGraph:
    return InMemoryCorpusGraph.from_edges([("0", "1"), ("1", "2"), ("2", "3")], maximum_distance=3.0)


def _random_trellis(seed: int, turns: int = 5, width: int = 4) -> List[List[DecoderCandidate]]:
    rng = random.Random(seed)
    return [
        [DecoderCandidate(chunk, rng.uniform(-2, 2), rng.uniform(-2, 2)) for chunk in rng.sample("0123", width)]
        for _ in range(turns)
    ]


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lam,beta", [(1.0, 1.0), (0.5, 2.5), (1.0, 0.0), (2.0, 0.3)])
@pytest.mark.parametrize("lag", [None, 0, 1, 2])
def test_paths_equal_the_standalone_decoders(cmg_calls, seed: int, lam: float, beta: float, lag: Optional[int]) -> None:
    trellis, graph = _random_trellis(seed), _graph()
    options = {"emission_weight": lam, "transition_weight": beta, "fixed_lag": lag}
    assert CMGDecoder().decode(trellis, graph=graph, **options) == StandaloneDecoder().decode(trellis, graph, **options)
    assert cmg_calls[-1]["function"] == ("decode_path" if lag is None else "decode_path_fixed_lag")


def test_the_trellis_is_translated_as_upstream_translates_it(cmg_calls) -> None:
    trellis, graph = _random_trellis(7, turns=3), _graph()
    CMGDecoder().decode(trellis, graph=graph, emission_weight=0.5, transition_weight=2.0, fixed_lag=1)
    (call,) = cmg_calls
    assert call["function"] == "decode_path_fixed_lag" and call["lag"] == 1 and call["weight"] == 2.0
    assert [[(s.id, s.score, s.value) for s in turn] for turn in call["steps"]] == [
        [(c.chunk_id, 0.5 * c.normalized_score, None) for c in turn] for turn in trellis
    ]
    # the cost is the unweighted graph distance; the step index is ignored
    assert call["cost"](CandidateState("0", 9.0), CandidateState("3", 9.0), 5) == graph.distance("0", "3") == 3.0


def test_lag_is_passed_positionally(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: List[Any] = []
    module = make_fake_cmg([])

    def positional_only(steps, lag, /, transition_cost=None, transition_weight=1.0):
        seen.append(lag)
        return _decode(steps, lag, transition_cost, transition_weight)

    module.decode_path_fixed_lag = positional_only
    monkeypatch.setitem(sys.modules, BACKEND, module)
    CMGDecoder().decode(_random_trellis(1), graph=_graph(), fixed_lag=2)
    assert seen == [2]


def test_an_older_layout_with_the_decoder_in_estimation_works(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[Dict[str, Any]] = []
    root = types.ModuleType(BACKEND)  # older roots do not re-export the trellis decoder
    root.__path__ = []
    monkeypatch.setitem(sys.modules, BACKEND, root)
    monkeypatch.setitem(sys.modules, f"{BACKEND}.estimation", make_fake_cmg(calls))
    trellis = _random_trellis(2)
    assert CMGDecoder().decode(trellis, graph=_graph()) == StandaloneDecoder().decode(trellis, _graph())
    assert len(calls) == 1


# --------------------------------------------------------------------------- a missing backend


def test_missing_backend_says_how_to_install_it(no_cmg) -> None:
    with pytest.raises(CMGBackendUnavailableError) as caught:
        CMGDecoder().decode(_random_trellis(0), graph=_graph())
    error = caught.value
    assert isinstance(error, ImportError) and isinstance(error, MissingDependencyError)
    message = str(error)
    assert message.startswith("CMGDecoder requires a compatible composable-model-graph installation; ")
    assert "pip install 'composable-model-graph @ git+https://github.com/operatorstack/composable-model-graph" in message
    assert isinstance(error.__cause__, ImportError)


def test_an_installation_without_the_decoder_is_incompatible(monkeypatch: pytest.MonkeyPatch) -> None:
    module = make_fake_cmg([])
    del module.decode_path_fixed_lag
    monkeypatch.setitem(sys.modules, BACKEND, module)
    monkeypatch.setitem(sys.modules, f"{BACKEND}.estimation", None)
    with pytest.raises(CMGBackendUnavailableError, match="compatible composable-model-graph installation") as caught:
        CMGDecoder().decode(_random_trellis(0), graph=_graph())
    assert "decode_path_fixed_lag" in str(caught.value.__cause__)


@pytest.mark.parametrize(
    ("trellis", "options", "message"),
    [
        ([], {}, "trellis must contain at least one turn"),
        ([[]], {}, "trellis turn 0 must contain candidates"),
        ([[DecoderCandidate("a", 1.0, 1.0)]], {"emission_weight": -1.0}, "emission_weight must be finite and nonnegative"),
        ([[DecoderCandidate("a", 1.0, 1.0)]], {"transition_weight": float("inf")}, "transition_weight must be finite"),
        ([[DecoderCandidate("a", 1.0, 1.0)]], {"fixed_lag": -1}, "fixed_lag must be nonnegative"),
    ],
)
def test_arguments_are_checked_before_the_backend_is_imported(no_cmg, trellis, options, message) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        CMGDecoder().decode(trellis, graph=_graph(), **options)
    assert not isinstance(caught.value, ImportError)


# --------------------------------------------------------------------------- bad backend answers


@pytest.mark.parametrize(
    ("rewrite", "message"),
    [
        (lambda result: types.SimpleNamespace(state_ids=tuple(result.state_ids)), "CMG decoder returned invalid state IDs"),
        (lambda result: types.SimpleNamespace(state_ids=[1] * len(result.state_ids)), "CMG decoder returned invalid state IDs"),
        (lambda result: object(), "CMG decoder returned invalid state IDs"),
        (lambda result: types.SimpleNamespace(state_ids=result.state_ids[:-1]), "CMG decoder returned a path with the wrong length: 4 state IDs for 5 turns"),
        (lambda result: types.SimpleNamespace(state_ids=result.state_ids[:-1] + ["zz"]), "CMG decoder returned an unknown state ID: 'zz' is not a candidate of turn 4"),
    ],
)
def test_invalid_backend_results_are_rejected(monkeypatch: pytest.MonkeyPatch, rewrite, message: str) -> None:
    monkeypatch.setitem(sys.modules, BACKEND, make_fake_cmg([], rewrite))
    with pytest.raises(MapMatchedBackendError, match=f"^{message}") as caught:
        CMGDecoder().decode(_random_trellis(3), graph=_graph())
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, ValueError)


def test_it_is_stateless_and_has_no_ranking() -> None:
    assert not hasattr(CMGDecoder(), "decode_ranked")  # a session reports candidate_ranking == ()
    assert cmg_module.CMG_NAMES == ("CandidateState", "decode_path", "decode_path_fixed_lag")
