"""The tensor graph Protocols: what implements them, and the fast check the hot paths use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mapmatched_torch.core.protocols import CorpusGraph, implements, missing_members
from mapmatched_torch.graph import NeighborhoodGraph, TensorCorpusGraph, TensorGraph, TrellisGraph
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph


class _Corpus:
    """The CorpusGraph members only."""

    maximum_distance = 1.0

    def distance(self, a, b):
        return 0.0

    def neighborhood(self, chunk_id, radius):
        return ()


class _Trellis(_Corpus):
    """CorpusGraph + the trellis calls, no vocabulary (what consecutive_distances accepts)."""

    def index_trellis(self, conversations):
        raise NotImplementedError

    def trellis_distances(self, chunk_index):
        raise NotImplementedError


class _Neighborhoods(_Corpus):
    """CorpusGraph + batched neighbourhoods only (a server's neighbourhood cache batches it)."""

    def neighborhoods(self, chunk_ids, radius):
        return tuple(() for _ in chunk_ids)


class _Proxy:
    """Forwards every attribute (as a counting wrapper in the tests does)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _objects():
    tensor = TensorCorpusGraph.from_edges([("a", "b")])
    return {
        "tensor": tensor,
        "standalone": InMemoryCorpusGraph.from_edges([("a", "b")]),
        "trellis": _Trellis(),
        "neighborhoods": _Neighborhoods(),
        "proxy": _Proxy(tensor),
        "plain": object(),
    }


PROTOCOLS = (CorpusGraph, TrellisGraph, NeighborhoodGraph, TensorGraph)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_implements_agrees_with_isinstance(protocol) -> None:
    for name, value in _objects().items():
        assert implements(value, protocol) == isinstance(value, protocol), (name, protocol)


def test_which_graphs_implement_which_protocol() -> None:
    found = {name: [implements(value, p) for p in PROTOCOLS] for name, value in _objects().items()}
    assert found == {
        "tensor": [True, True, True, True],
        "standalone": [True, False, False, False],
        "trellis": [True, True, False, False],
        "neighborhoods": [True, False, True, False],
        "proxy": [True, True, True, True],
        "plain": [False, False, False, False],
    }
    assert missing_members(_Trellis(), TensorGraph) == (
        "device", "index", "neighborhood_indices", "neighborhoods", "nodes", "num_nodes", "pair_distances",
        "vocabulary",
    )
    assert missing_members(object(), CorpusGraph) == ("distance", "maximum_distance", "neighborhood")


def test_importing_the_protocols_does_not_import_torch_geometric() -> None:
    # the decoders, the server and the evaluation import them at module level:
    # torch_geometric (seconds to import) waits for the first graph built
    code = (
        "import sys\n"
        "import mapmatched_torch.graph.protocols, mapmatched_torch.serving.server\n"
        "assert 'torch_geometric' not in sys.modules, 'torch_geometric imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
