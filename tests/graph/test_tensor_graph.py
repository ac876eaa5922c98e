"""TensorCorpusGraph: constructors, interop, the CorpusGraph protocol and trellis distances."""

from __future__ import annotations

import math
import random

import networkx as nx
import pytest
import torch
from torch_geometric.data import Data

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.protocols import CorpusGraph
from mapmatched_torch.graph import CacheInfo, TensorCorpusGraph
from mapmatched_torch.standalone.graph import GraphEdge, InMemoryCorpusGraph

from .conftest import WEIGHTS, random_reference


def arcs(graph) -> list:
    edge_index, edge_weight = graph.to_edge_index()
    ids = graph.nodes
    return [(ids[a], ids[b], w) for a, b, w in zip(*edge_index.tolist(), edge_weight.tolist())]


# ---------------------------------------------------------------------- construction


def test_from_edges_numbers_and_stores_like_the_standalone(device) -> None:
    edges = [("c", "a", 2.0), GraphEdge("a", "b"), ["b", "a", 0.5], ("a", "a", 3.0), ("a", "c", 4.0)]
    reference = InMemoryCorpusGraph(edges, nodes=["z", "a"])
    graph = TensorCorpusGraph.from_edges(edges, nodes=["z", "a"], device=device)
    assert graph.nodes == reference.nodes == ("z", "a", "c", "b")
    assert arcs(graph) == [(e.source_chunk_id, e.target_chunk_id, e.distance) for e in reference.edges()]
    assert graph.edge_count == reference.edge_count == 4  # self-loop dropped, parallel edges min-merged
    assert graph.indptr.tolist() == [0, 0, 2, 3, 4] and graph.weights.dtype == torch.float64
    assert graph.device.type == device.type and len(graph) == graph.num_nodes == 4
    assert "a" in graph and "q" not in graph and graph.directed is False
    assert isinstance(graph, CorpusGraph)
    assert "nodes=4" in repr(graph) and "arcs=4" in repr(graph)


def test_directed_graphs_keep_one_direction() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 1.0), ("b", "a", 3.0)], directed=True)
    assert arcs(graph) == [("a", "b", 1.0), ("b", "a", 3.0)] and graph.directed
    assert graph.distance("a", "b") == 1.0 and graph.distance("b", "a") == 3.0


@pytest.mark.parametrize("directed", [False, True])
def test_from_graph_copies_everything(directed) -> None:
    reference = random_reference(11, "float", directed)
    graph = TensorCorpusGraph.from_graph(reference, distance_cache_size=7)
    assert graph.nodes == reference.nodes and graph.directed == directed
    assert graph.maximum_distance == reference.maximum_distance and graph.cache_info().capacity == 7
    assert arcs(graph) == [(e.source_chunk_id, e.target_chunk_id, e.distance) for e in reference.edges()]


def test_edge_index_round_trip(device) -> None:
    edge_index = torch.tensor([[0, 1, 2, 2, 3], [1, 2, 0, 0, 3]], device=device)
    weight = torch.tensor([0.5, 0.25, 2.0, 1.0, 9.0], device=device)  # float32 accepted
    graph = TensorCorpusGraph.from_edge_index(edge_index, weight, num_nodes=5, directed=True, maximum_distance=3.0)
    assert graph.nodes == ("0", "1", "2", "3", "4") and graph.device.type == device.type
    out_index, out_weight = graph.to_edge_index()
    assert out_index.tolist() == [[0, 1, 2], [1, 2, 0]] and out_weight.tolist() == [0.5, 0.25, 1.0]
    assert out_weight.dtype == torch.float64 and out_index.dtype == torch.long
    again = TensorCorpusGraph.from_edge_index(out_index, out_weight, chunk_ids=graph.nodes, directed=True)
    assert arcs(again) == arcs(graph)
    unit = TensorCorpusGraph.from_edge_index(edge_index[:, :2])
    assert unit.num_nodes == 3 and unit.weights.tolist() == [1.0, 1.0, 1.0, 1.0]  # undirected, default 1.0


def test_to_data() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.5)], nodes=["z"])
    data = graph.to_data()
    assert isinstance(data, Data) and data.num_nodes == 3 and data.chunk_ids == ["z", "a", "b"]
    assert data.edge_index.tolist() == [[1, 2], [2, 1]] and data.edge_weight.tolist() == [0.5, 0.5]
    again = TensorCorpusGraph.from_edge_index(data.edge_index, data.edge_weight, chunk_ids=data.chunk_ids)
    assert arcs(again) == arcs(graph) and again.nodes == graph.nodes


@pytest.mark.parametrize("directed", [False, True])
def test_networkx_round_trip(directed) -> None:
    reference = random_reference(4, "dyadic", directed)
    graph = TensorCorpusGraph.from_graph(reference)
    network = graph.to_networkx()
    assert isinstance(network, nx.DiGraph if directed else nx.Graph) and list(network.nodes) == list(graph.nodes)
    again = TensorCorpusGraph.from_networkx(network, maximum_distance=reference.maximum_distance)
    assert again.nodes == graph.nodes and again.directed == directed and arcs(again) == arcs(graph)


def test_from_networkx_multigraph_keeps_the_smallest_distance() -> None:
    network = nx.MultiGraph()
    network.add_edge("a", "b", length=2.0)
    network.add_edge("a", "b", length=0.5)
    network.add_edge("b", "c")
    graph = TensorCorpusGraph.from_networkx(network, weight="length")
    assert arcs(graph) == [("a", "b", 0.5), ("b", "a", 0.5), ("b", "c", 1.0), ("c", "b", 1.0)]


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_edge_distances_name_the_edge(bad) -> None:
    with pytest.raises(MapMatchedValueError, match=r"^graph edge distance must be finite and greater than zero, got .* \(edge 'a' -> 'b'\)$"):
        TensorCorpusGraph.from_edges([("a", "b", bad)])
    edge_index = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(MapMatchedValueError, match=r"^graph edge distance must be finite and greater than zero, got .* \(edge 1: 'y' -> 'z'\)$"):
        TensorCorpusGraph.from_edge_index(edge_index, torch.tensor([1.0, bad]), chunk_ids=["x", "y", "z"])
    network = nx.Graph()
    network.add_edge("a", "b", weight=bad)
    with pytest.raises(MapMatchedValueError, match=r"greater than zero, got .* \(edge 0: 'a' -> 'b'\)"):
        TensorCorpusGraph.from_networkx(network)


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf, "1", True])
def test_bad_maximum_distance(bad) -> None:
    for build in (
        lambda: TensorCorpusGraph.from_edges([("a", "b")], maximum_distance=bad),
        lambda: TensorCorpusGraph.from_edge_index(torch.tensor([[0], [1]]), maximum_distance=bad),
    ):
        with pytest.raises(MapMatchedValueError, match="maximum_distance must be finite and greater than zero"):
            build()


@pytest.mark.parametrize(
    ("edge_index", "weight", "options", "words"),
    [
        (torch.tensor([0, 1]), None, {}, r"edge_index must be a \(2, E\) tensor, got \(2,\)"),
        (torch.tensor([[0.0], [1.0]]), None, {}, "edge_index must have an integer dtype"),
        (torch.tensor([[0], [1]]), torch.tensor([1.0, 2.0]), {}, r"edge_weight must be a \(1,\) tensor"),
        (torch.tensor([[0], [5]]), None, {"num_nodes": 3}, r"node 5, outside \[0, 3\)"),
        (torch.tensor([[0], [-1]]), None, {"num_nodes": 3}, r"node -1, outside \[0, 3\)"),
        (torch.tensor([[0], [1]]), None, {"chunk_ids": ["a", "b"], "num_nodes": 3}, "num_nodes=3 but 2 chunk_ids"),
        (torch.tensor([[0], [1]]), None, {"chunk_ids": ["a", "a"]}, "duplicate chunk ID 'a'"),
        ([[0], [1]], None, {}, "edge_index must be a"),
    ],
)
def test_bad_edge_index(edge_index, weight, options, words) -> None:
    with pytest.raises(MapMatchedValueError, match=words):
        TensorCorpusGraph.from_edge_index(edge_index, weight, **options)


def test_a_stray_edge_index_is_named_not_allocated() -> None:
    # one stray index made from_edge_index number 2**40 + 1 nodes (MemoryError); an
    # inferred N far beyond the nodes the edges name is refused, naming the edge
    stray = torch.tensor([[0, 1, 2, 3], [1, 2, 2**22, 0]])
    with pytest.raises(MapMatchedValueError, match=r"edge 2 \(2 -> 4194304\) of edge_index has node 4194304, so N "
                                                   r"would be 4194305, but the edges name only 5 distinct nodes"):
        TensorCorpusGraph.from_edge_index(stray)
    stray[1, 2] = 2**40
    with pytest.raises(MapMatchedValueError, match=r"edge 2 .* pass num_nodes \(or chunk_ids\)"):
        TensorCorpusGraph.from_edge_index(stray)
    # a declared N: the edge and its node are named
    for options in ({"num_nodes": 4}, {"chunk_ids": ["a", "b", "c", "d"]}):
        with pytest.raises(MapMatchedValueError, match=r"edge 2 \(2 -> 1099511627776\) of edge_index has node "
                                                       r"1099511627776, outside \[0, 4\)"):
            TensorCorpusGraph.from_edge_index(stray, **options)
    # a sparse numbering within the floor is inferred as before (isolated nodes between)
    assert TensorCorpusGraph.from_edge_index(torch.tensor([[0], [5000]])).num_nodes == 5001


def test_bad_edges_and_nodes() -> None:
    with pytest.raises(ValueError, match="edge 0 must be a GraphEdge"):
        TensorCorpusGraph.from_edges([("a",)])
    with pytest.raises(ValueError, match="^graph edge chunk IDs must not be empty"):
        TensorCorpusGraph.from_edges([("", "b")])
    with pytest.raises(ValueError, match="^graph node IDs must not be empty$"):
        TensorCorpusGraph.from_edges([("a", "b")], nodes=[""])
    with pytest.raises(ValueError, match="must be an iterable, not a string"):
        TensorCorpusGraph.from_edges("ab")
    network = nx.Graph()
    network.add_edge(1, 2)
    with pytest.raises(ValueError, match="must be a string"):
        TensorCorpusGraph.from_networkx(network)


# ---------------------------------------------------------------------- the protocol


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("directed", [False, True])
def test_distance_and_neighborhood_match_the_standalone(device, weights, directed) -> None:
    for seed in range(4):
        reference = random_reference(100 + seed, weights, directed)
        graph = TensorCorpusGraph.from_graph(reference, device=device)
        ids = list(reference.nodes) + ["unknown", "other"]
        for a in ids:
            assert [graph.distance(a, b) for b in ids] == [reference.distance(a, b) for b in ids]
        small_rounds = TensorCorpusGraph.from_graph(reference, device=device, memory_budget=1)  # a centre per round
        for radius in (0.0, 0.5, 1.0, 1e300):
            expected = tuple(reference.neighborhood_distances(a, radius) for a in ids)
            for engine in ("auto", "scipy", "compiled"):
                assert graph.neighborhoods(ids, radius, engine=engine, distances=True) == expected, engine
            assert small_rounds.neighborhoods(ids, radius, engine="compiled", distances=True) == expected
            assert graph.neighborhoods(ids, radius) == tuple(reference.neighborhood(a, radius) for a in ids)
        assert graph.neighborhood(ids[0], 2.0) == reference.neighborhood(ids[0], 2.0)
        assert graph.neighborhood_distances(ids[0], 2.0) == reference.neighborhood_distances(ids[0], 2.0)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("directed", [False, True])
def test_neighborhood_indices_match_the_standalone(device, weights, directed, monkeypatch) -> None:
    for seed in range(4):
        reference = random_reference(200 + seed, weights, directed)
        graph = TensorCorpusGraph.from_graph(reference, device=device)
        small_rounds = TensorCorpusGraph.from_graph(reference, device=device, memory_budget=1)
        # every centre twice, in random order, with padding and unknown codes among them
        codes = list(range(graph.num_nodes)) * 2 + [-1, -2, -7]
        random.Random(seed).shuffle(codes)
        centres = torch.tensor(codes, dtype=torch.long, device=device)
        for radius in (0.0, 0.5, 1.0, 1e300):
            expected = [
                [graph.vocabulary.indices_of([chunk])[0] for chunk in reference.neighborhood(graph.nodes[code], radius)]
                if code >= 0 else []
                for code in codes
            ]
            width = max(map(len, expected))
            padded = torch.tensor([row + [-1] * (width - len(row)) for row in expected], dtype=torch.long).reshape(
                len(codes), width
            )
            for engine in ("auto", "scipy", "compiled"):
                found = graph.neighborhood_indices(centres, radius, engine=engine)
                assert found.device == centres.device and found.dtype == torch.long
                assert torch.equal(found.cpu(), padded), (engine, radius)
            assert torch.equal(small_rounds.neighborhood_indices(centres, radius, engine="compiled").cpu(), padded)
            # balls larger than the first round's room are searched again in full
            monkeypatch.setattr("mapmatched_torch.graph.engines.compiled.BALL_FIRST_WIDTH", 2)
            assert torch.equal(graph.neighborhood_indices(centres, radius, engine="compiled").cpu(), padded)
            monkeypatch.undo()


def test_neighborhood_indices_shapes_and_bad_input() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 1.0), ("b", "c", 1.0)], nodes=["z"])
    assert graph.neighborhood_indices(torch.zeros(0, dtype=torch.long), 1.0).shape == (0, 0)
    assert graph.neighborhood_indices(torch.tensor([-1, -3]), 1.0).tolist() == [[], []]
    assert graph.neighborhood_indices(graph.index(["b", "z"]), 1.0).tolist() == [graph.index(["a", "c"]).tolist(), [-1, -1]]
    with pytest.raises(ValueError, match="int64 tensor of index codes"):
        graph.neighborhood_indices(torch.tensor([0.0]), 1.0)
    with pytest.raises(ValueError, match="out of range"):
        graph.neighborhood_indices(torch.tensor([4]), 1.0)
    with pytest.raises(ValueError, match=r"centres must be a \(C,\) tensor"):
        graph.neighborhood_indices(torch.tensor([[0]]), 1.0)
    with pytest.raises(ValueError, match="^neighborhood radius must be finite and nonnegative"):
        graph.neighborhood_indices(torch.tensor([0]), -1.0)


def test_distance_uses_and_counts_the_row_cache() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.5), ("b", "c", 0.5)], nodes=["z"], maximum_distance=1.0)
    assert graph.distance("a", "c") == 1.0 and graph.distance("a", "z") == 1.0 and graph.distance("a", "b") == 0.5
    assert graph.cache_info() == CacheInfo(hits=2, misses=1, size=1, capacity=65536)
    assert graph.distance("q", "q") == 0.0 and graph.distance("q", "a") == 1.0
    assert graph.cache_info().hits == 2
    graph.clear_cache()
    assert graph.cache_info() == CacheInfo(0, 0, 0, 65536)


def test_neighborhood_rejects_bad_radii() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")])
    for bad in (-1.0, math.nan, math.inf, "1"):
        for method in (graph.neighborhood, graph.neighborhood_distances):
            with pytest.raises(ValueError, match="^neighborhood radius must be finite and nonnegative"):
                method("a", bad)
    for method in (graph.neighborhood, graph.neighborhood_distances, lambda c, r: graph.neighborhoods(["a", c], r)):
        with pytest.raises(ValueError, match="^neighborhood chunk_id must not be empty"):
            method("", 1.0)
    with pytest.raises(ValueError, match="^distance chunk IDs must not be empty"):
        graph.distance("", "")


def test_to_moves_everything_and_starts_a_new_cache(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.5)], maximum_distance=2.0)
    graph.distance("a", "b")
    moved = graph.to(device)
    if device.type == "cpu":
        assert moved is graph
    else:
        assert moved.device.type == device.type and moved.cache_info().misses == 0
        assert moved.distance("a", "b") == 0.5 and moved.vocabulary is graph.vocabulary


# ---------------------------------------------------------------------- trellis distances


def test_index_trellis_pads_and_codes_unknown_ids(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")], device=device)
    index = graph.index_trellis([[["b", "x"], ["a"]], [["y", "a", "x"]]])
    assert index.device.type == device.type and index.shape == (2, 2, 3)
    assert index.tolist() == [[[1, -2, -1], [0, -1, -1]], [[-3, 0, -2], [-1, -1, -1]]]
    assert graph.index_trellis([]).shape == (0, 0, 0)
    with pytest.raises(ValueError, match="conversation 0 turn 1 candidate 0 chunk ID must be non-empty"):
        graph.index_trellis([[["a"], [""]]])


@pytest.mark.parametrize("tier", ["dense rows", "sparse rows"])
@pytest.mark.parametrize("engine", ["auto", "torch", "scipy", "hybrid"])
def test_trellis_distances_match_the_standalone_per_pair(device, engine, tier) -> None:
    # the cache's two tiers: a small graph keeps complete dense rows (the default here);
    # a row capacity below N keeps sparse target-aware rows (with evictions)
    rng = random.Random(3)
    for seed in range(3):
        reference = random_reference(200 + seed, "float", seed == 1)
        options = {"distance_cache_size": max(len(reference.nodes) - 1, 1)} if tier == "sparse rows" else {}
        graph = TensorCorpusGraph.from_graph(reference, device=device, **options)
        assert graph._cache.dense_rows == (tier == "dense rows" and device.type == "cpu")
        pool = list(reference.nodes) + ["ghost", "phantom"]
        conversations = [
            [rng.sample(pool, rng.randint(1, 5)) for _ in range(rng.randint(1, 5))] for _ in range(4)
        ]
        index = graph.index_trellis(conversations)
        batch, turns, width = index.shape
        for use_cache in (False, True, True):  # cold, then warm from the cache
            found = graph.trellis_distances(index, engine=engine, use_cache=use_cache)
            assert found.shape == (batch, max(turns - 1, 0), width, width) and found.dtype == torch.float64
            assert found.device.type == device.type
            for b, conversation in enumerate(conversations):
                for t in range(turns - 1):
                    for j in range(width):
                        for i in range(width):
                            real = (
                                t + 1 < len(conversation) and j < len(conversation[t])
                                and i < len(conversation[t + 1])
                            )
                            expected = (
                                reference.distance(conversation[t][j], conversation[t + 1][i])
                                if real else reference.maximum_distance
                            )
                            assert found[b, t, j, i].item() == expected, (seed, b, t, j, i)
        assert graph.cache_info().hits > 0


def test_trellis_distances_of_one_turn_is_empty(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")], device=device)
    assert graph.trellis_distances(graph.index_trellis([[["a", "b"]]])).shape == (1, 0, 2, 2)


def test_trellis_distances_validates_its_input(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")], device=device)
    with pytest.raises(MapMatchedValueError, match=r"chunk_index must be a \(B, T, M\) int64 tensor, got a 2-D"):
        graph.trellis_distances(torch.zeros(2, 2, dtype=torch.long, device=device))
    with pytest.raises(MapMatchedValueError, match="got a 3-D torch.int32"):
        graph.trellis_distances(torch.zeros(1, 2, 2, dtype=torch.int32, device=device))
    with pytest.raises(MapMatchedValueError, match="node index 7 is out of range"):
        graph.trellis_distances(torch.full((1, 2, 1), 7, dtype=torch.long, device=device))
    with pytest.raises(MapMatchedValueError, match="unsupported distance engine"):
        graph.trellis_distances(torch.zeros(1, 2, 1, dtype=torch.long, device=device), engine="magic")


def test_pair_distances_of_ids(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.5), ("b", "c", 0.5)], maximum_distance=0.75, device=device)
    # one index call for both sides, so equal unknown IDs share a code and different ones do not
    codes = graph.index(["a", "a", "q", "q", "q", "b", "c", "q", "a", "r"], distinct_unknown=True)
    sources, targets = codes[:5], codes[5:]
    assert graph.pair_distances(sources, targets).tolist() == [0.5, 0.75, 0.0, 0.75, 0.75]


def test_the_scipy_matrix_has_no_duplicates_and_no_zeros() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 2.0), ("a", "b", 0.5), ("b", "a", 1.0), ("c", "c", 1.0)])
    matrix = graph.adjacency.scipy_matrix()
    assert matrix.has_canonical_format and matrix.nnz == graph.edge_count == 2
    assert matrix.toarray().tolist() == [[0.0, 0.5, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_missing_networkx_names_the_extra(monkeypatch) -> None:
    from mapmatched_torch.core import optional as _optional
    from mapmatched_torch.core.errors import NetworkXNotInstalledError

    monkeypatch.setitem(_optional._PROBED, "networkx", ImportError("no networkx"))
    graph = TensorCorpusGraph.from_edges([("a", "b")])
    with pytest.raises(NetworkXNotInstalledError, match=r"mapmatched-torch\[networkx\]"):
        graph.to_networkx()
    with pytest.raises(ImportError, match="from_networkx"):
        TensorCorpusGraph.from_networkx(object())
