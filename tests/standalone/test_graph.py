"""Tests of the pure-Python reference corpus graph (docs/spec.md section 4)."""

from __future__ import annotations

import math
import random
from typing import Dict, List, Tuple

import pytest

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.core.protocols import CorpusGraph
from mapmatched_torch.standalone.graph import CacheInfo, GraphEdge, InMemoryCorpusGraph


def chain(maximum_distance: float = 1.0, **kwargs) -> InMemoryCorpusGraph:
    """a -0.5- b -0.25- c -0.25- d -0.5- e (dyadic, so every sum is exact)."""
    edges = [("a", "b", 0.5), ("b", "c", 0.25), ("c", "d", 0.25), ("d", "e", 0.5)]
    return InMemoryCorpusGraph(edges, maximum_distance=maximum_distance, **kwargs)


# ---------------------------------------------------------------------- GraphEdge


def test_graph_edge_defaults_and_float_conversion() -> None:
    edge = GraphEdge("a", "b")
    assert edge.distance == 1.0
    converted = GraphEdge("a", "b", 2)
    assert converted.distance == 2.0 and isinstance(converted.distance, float)
    with pytest.raises(AttributeError):
        edge.distance = 3.0  # type: ignore[misc]


@pytest.mark.parametrize("distance", [0.0, -1.0, math.inf, -math.inf, math.nan, True, "1.0", None])
def test_graph_edge_rejects_bad_distance(distance) -> None:
    with pytest.raises(ValueError, match=r"^graph edge distance must be finite and greater than zero, got .* \(edge 'a' -> 'b'\)$") as info:
        GraphEdge("a", "b", distance)
    assert isinstance(info.value, MapMatchedValueError)


@pytest.mark.parametrize(
    ("source", "target", "words"),
    [("", "b", r"^graph edge chunk IDs must not be empty \(source_chunk_id is ''\)"),
     ("a", "", r"^graph edge chunk IDs must not be empty \(target_chunk_id is ''\)"),
     (1, "b", "graph edge source_chunk_id must be a string")],
)
def test_graph_edge_rejects_bad_ids(source, target, words) -> None:
    with pytest.raises(ValueError, match=words):
        GraphEdge(source, target)


# ---------------------------------------------------------------------- construction


def test_edge_forms_are_equivalent() -> None:
    forms = [
        [GraphEdge("a", "b", 1.0), GraphEdge("b", "c", 2.0)],
        [("a", "b"), ("b", "c", 2.0)],
        [["a", "b", 1.0], ["b", "c", 2]],
    ]
    graphs = [InMemoryCorpusGraph(edges) for edges in forms]
    assert all(graph.edges() == graphs[0].edges() for graph in graphs)
    assert InMemoryCorpusGraph.from_edges([("a", "b"), ("b", "c")]).distance("a", "c") == 2.0


def test_structure_accessors_and_node_order() -> None:
    graph = InMemoryCorpusGraph(
        [("c", "a", 2.0), ("a", "b", 1.0)], nodes=["z", "a"], maximum_distance=5.0, distance_cache_size=3
    )
    assert graph.nodes == ("z", "a", "c", "b")
    assert len(graph) == 4
    assert "z" in graph and "b" in graph and "q" not in graph
    assert graph.maximum_distance == 5.0 and graph.distance_cache_size == 3 and graph.directed is False
    # out-arcs follow node order, edges() is (source, target) in node order, both directions
    assert graph.neighbors("a") == (("c", 2.0), ("b", 1.0))
    assert graph.neighbors("z") == () and graph.neighbors("unknown") == ()
    assert [(e.source_chunk_id, e.target_chunk_id, e.distance) for e in graph.edges()] == [
        ("a", "c", 2.0), ("a", "b", 1.0), ("c", "a", 2.0), ("b", "a", 1.0)
    ]
    assert graph.edge_count == 4 == len(graph.edges())
    assert "nodes=4" in repr(graph) and "arcs=4" in repr(graph)
    assert isinstance(graph, CorpusGraph)


def test_directed_graph_stores_one_direction() -> None:
    graph = InMemoryCorpusGraph([("a", "b", 1.0), ("b", "c", 1.0)], directed=True, maximum_distance=5.0)
    assert graph.directed is True
    assert graph.edge_count == 2
    assert graph.distance("a", "c") == 2.0
    assert graph.distance("c", "a") == 5.0
    assert graph.distance("b", "a") == 5.0
    assert graph.neighbors("b") == (("c", 1.0),)


def test_undirected_graph_is_symmetric() -> None:
    graph = chain(maximum_distance=10.0)
    for a in graph.nodes:
        for b in graph.nodes:
            assert graph.distance(a, b) == graph.distance(b, a)


@pytest.mark.parametrize("directed", [False, True])
def test_parallel_edges_keep_the_smallest_distance(directed: bool) -> None:
    edges = [("a", "b", 3.0), ("a", "b", 0.5), GraphEdge("a", "b", 2.0)]
    if not directed:
        edges.append(("b", "a", 0.25))  # the reverse spelling is the same undirected edge
    graph = InMemoryCorpusGraph(edges, directed=directed)
    expected = 0.5 if directed else 0.25
    assert graph.neighbors("a") == (("b", expected),)
    assert graph.distance("a", "b") == expected
    assert graph.edge_count == (1 if directed else 2)


def test_self_loops_are_accepted_and_ignored() -> None:
    graph = InMemoryCorpusGraph([("a", "a", 0.5), ("a", "b", 1.0), ("c", "c")])
    assert graph.nodes == ("a", "b", "c")
    assert graph.neighbors("a") == (("b", 1.0),)
    assert graph.neighbors("c") == ()
    assert graph.edge_count == 2
    assert graph.distance("a", "a") == 0.0
    with pytest.raises(ValueError, match="must be finite and greater than zero"):
        InMemoryCorpusGraph([("a", "a", -1.0)])


def test_declared_isolated_nodes() -> None:
    graph = InMemoryCorpusGraph([("a", "b")], nodes=["lonely"], maximum_distance=4.0)
    assert "lonely" in graph
    assert graph.distance("lonely", "a") == 4.0
    assert graph.distance("a", "lonely") == 4.0
    assert graph.distance("lonely", "lonely") == 0.0
    assert graph.distances_from("lonely") == {"lonely": 0.0}
    assert graph.neighborhood("lonely", 100.0) == ()


def test_empty_graph() -> None:
    graph = InMemoryCorpusGraph()
    assert len(graph) == 0 and graph.edge_count == 0 and graph.edges() == () and graph.nodes == ()
    assert graph.distance("a", "b") == 10.0
    assert graph.distance("a", "a") == 0.0


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan, True, "10", None])
def test_rejects_bad_maximum_distance(value) -> None:
    with pytest.raises(ValueError, match="^maximum_distance must be finite and greater than zero"):
        InMemoryCorpusGraph(maximum_distance=value)


@pytest.mark.parametrize(
    ("value", "words"),
    [(0, "distance_cache_size must be greater than zero"), (-3, "distance_cache_size must be greater than zero"),
     (True, "distance_cache_size must be an integer"), (2.0, "distance_cache_size must be an integer")],
)
def test_rejects_bad_cache_size(value, words) -> None:
    with pytest.raises(ValueError, match=words):
        InMemoryCorpusGraph(distance_cache_size=value)


@pytest.mark.parametrize(
    ("edges", "words"),
    [
        ([("a", "b", 0.0)], "must be finite and greater than zero, got 0.0"),
        ([("a", "b", -0.5)], "must be finite and greater than zero, got -0.5"),
        ([("a", "b", math.inf)], "must be finite and greater than zero, got inf"),
        ([("a", "b", math.nan)], "must be finite and greater than zero, got nan"),
        ([("", "b")], "graph edge chunk IDs must not be empty"),
        ([("a", "")], "graph edge chunk IDs must not be empty"),
        ([("a",)], r"edge 0 must be a GraphEdge or an \(a, b\)"),
        ([("a", "b"), ("a", "b", 1.0, 2.0)], r"edge 1 must be a GraphEdge"),
        (["ab"], r"edge 0 must be a GraphEdge"),
        ("ab", "edges must be an iterable, not a string"),
    ],
)
def test_rejects_bad_edges(edges, words) -> None:
    with pytest.raises(ValueError, match=words):
        InMemoryCorpusGraph(edges)


@pytest.mark.parametrize(
    ("nodes", "words"),
    [([""], "^graph node IDs must not be empty$"), ([3], "graph node ID must be a string"),
     ("abc", "nodes must be an iterable, not a string")],
)
def test_rejects_bad_nodes(nodes, words) -> None:
    with pytest.raises(ValueError, match=words):
        InMemoryCorpusGraph(nodes=nodes)


@pytest.mark.parametrize(
    ("pairs", "words"),
    [([("a", "b", 2.0)], r"pair 0 must be an \(a, b\) pair"), ([("a", "b"), "ab"], "pair 1"),
     ([("", "b")], "must not be empty"), ("ab", "edges must be an iterable, not a string")],
)
def test_from_edges_rejects_bad_pairs(pairs, words) -> None:
    with pytest.raises(ValueError, match=words):
        InMemoryCorpusGraph.from_edges(pairs)


def test_from_edges_passes_keyword_arguments() -> None:
    graph = InMemoryCorpusGraph.from_edges(
        edges=[("a", "b")], nodes=["x"], directed=True, maximum_distance=3.0, distance_cache_size=4
    )
    assert graph.nodes == ("x", "a", "b") and graph.directed and graph.distance("b", "a") == 3.0
    assert graph.distance_cache_size == 4


# ---------------------------------------------------------------------- distance


def test_self_distance_is_zero_even_for_unknown_ids() -> None:
    graph = chain()
    assert graph.distance("a", "a") == 0.0
    assert graph.distance("nowhere", "nowhere") == 0.0
    assert graph.cache_info().misses == 0  # equal IDs never search


def test_unknown_ids_get_maximum_distance() -> None:
    graph = chain(maximum_distance=3.0)
    assert graph.distance("a", "nowhere") == 3.0
    assert graph.distance("nowhere", "a") == 3.0
    assert graph.distance("nowhere", "elsewhere") == 3.0


def test_bound_is_inclusive_and_clamps_beyond() -> None:
    graph = chain(maximum_distance=1.0)
    assert graph.distance("a", "b") == 0.5
    assert graph.distance("a", "c") == 0.75
    assert graph.distance("a", "d") == 1.0  # exactly at the bound: counts
    assert graph.distance("a", "e") == 1.0  # 1.5 is beyond: clamped
    assert graph.distance("b", "e") == 1.0  # exactly 1.0 by path
    assert graph.distances_from("a") == {"a": 0.0, "b": 0.5, "c": 0.75, "d": 1.0}
    assert graph.distances_from("b") == {"b": 0.0, "c": 0.25, "a": 0.5, "d": 0.5, "e": 1.0}


def test_bound_prunes_paths_not_nodes() -> None:
    # c is reachable within the bound only through the long-but-cheap detour.
    graph = InMemoryCorpusGraph(
        [("a", "c", 4.0), ("a", "x", 0.5), ("x", "y", 0.5), ("y", "c", 0.5)], maximum_distance=2.0
    )
    assert graph.distance("a", "c") == 1.5
    graph = InMemoryCorpusGraph([("a", "c", 4.0)], maximum_distance=2.0)
    assert graph.distance("a", "c") == 2.0


def test_disconnected_components() -> None:
    graph = InMemoryCorpusGraph([("a", "b"), ("c", "d")], maximum_distance=7.0)
    assert graph.distance("a", "b") == 1.0
    assert graph.distance("a", "c") == 7.0
    assert graph.distance("d", "a") == 7.0
    assert graph.neighborhood_distances("a", 7.0) == (("b", 1.0),)


def test_an_inexact_distance_is_answered_from_the_source_row() -> None:
    # 0.1 + 0.2 + 0.3 rounds differently from each end: the target's cached row is not
    # used, so the answer never depends on the cache
    edges = [("a", "b", 0.1), ("b", "c", 0.2), ("c", "d", 0.3)]
    fresh = InMemoryCorpusGraph(edges).distance("a", "d")
    graph = InMemoryCorpusGraph(edges)
    graph.distances_from("d")
    assert graph.distance("a", "d") == fresh == (0.1 + 0.2) + 0.3
    assert graph.distance("d", "a") == (0.3 + 0.2) + 0.1 != fresh
    assert graph.cache_info().misses == 2


@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0), (0.25, 1.5, 0.125), (3.0, 2.0, 7.0)])
def test_an_exact_undirected_distance_reuses_the_reverse_row(weights) -> None:
    edges = [("a", "b", weights[0]), ("b", "c", weights[1]), ("c", "d", weights[2])]
    graph = InMemoryCorpusGraph(edges)
    forward = graph.distance("a", "d")
    assert graph.distance("d", "a") == forward and graph.distance("c", "a") == weights[0] + weights[1]
    assert graph.cache_info().misses == 1  # d and c read a's row: no second search
    directed = InMemoryCorpusGraph(edges + [(b, a, w) for a, b, w in edges], directed=True)
    directed.distance("a", "d")
    assert directed.distance("d", "a") == forward and directed.cache_info().misses == 2


# ---------------------------------------------------------------------- neighborhood


def test_neighborhood_orders_by_distance_then_id() -> None:
    graph = InMemoryCorpusGraph(
        [("m", "z", 0.5), ("m", "b", 0.5), ("m", "a", 0.25), ("m", "q", 0.5), ("b", "far", 1.0)],
        maximum_distance=10.0,
    )
    assert graph.neighborhood_distances("m", 0.5) == (("a", 0.25), ("b", 0.5), ("q", 0.5), ("z", 0.5))
    assert graph.neighborhood("m", 0.5) == ("a", "b", "q", "z")
    assert graph.neighborhood_distances("m", 0.25) == (("a", 0.25),)
    assert graph.neighborhood("m", 0.0) == graph.neighborhood_distances("m", 0.0) == ()
    assert graph.neighborhood_distances("m", 2.0)[-1] == ("far", 1.5)
    assert graph.neighborhood("unknown", 5.0) == graph.neighborhood_distances("unknown", 5.0) == ()


def test_neighborhood_radius_is_clipped_at_maximum_distance() -> None:
    graph = chain(maximum_distance=1.0)
    expected = (("b", 0.5), ("c", 0.75), ("d", 1.0))
    assert graph.neighborhood_distances("a", 1e300) == expected
    assert graph.neighborhood_distances("a", 100) == expected
    assert graph.neighborhood_distances("a", 0.75) == expected[:2]
    assert graph.neighborhood("a", 100) == ("b", "c", "d")


@pytest.mark.parametrize("radius", [-0.5, math.nan, math.inf, "1", None, True])
@pytest.mark.parametrize("method", ["neighborhood", "neighborhood_distances"])
def test_neighborhood_rejects_bad_radius(radius, method) -> None:
    with pytest.raises(ValueError, match="^neighborhood radius must be finite and nonnegative"):
        getattr(chain(), method)("a", radius)


@pytest.mark.parametrize("method", ["neighborhood", "neighborhood_distances"])
def test_neighborhood_rejects_an_empty_centre(method) -> None:
    with pytest.raises(ValueError, match="^neighborhood chunk_id must not be empty"):
        getattr(chain(), method)("", 1.0)


# ---------------------------------------------------------------------- cache


def test_lru_cache_counts_and_eviction() -> None:
    graph = chain(maximum_distance=10.0, distance_cache_size=2)
    assert graph.cache_info() == CacheInfo(hits=0, misses=0, size=0, capacity=2)
    graph.distance("a", "e")  # miss a
    graph.distance("a", "b")  # hit a
    graph.distance("b", "e")  # miss b
    assert graph.cache_info() == CacheInfo(1, 2, 2, 2)
    graph.distance("a", "c")  # hit a: a is now most recent, b is least recent
    graph.distance("c", "a")  # c is not cached, a is (undirected): a's row answers, a hit
    assert graph.cache_info() == CacheInfo(3, 2, 2, 2)
    graph.distance("c", "e")  # miss c: evicts b
    assert graph.cache_info() == CacheInfo(3, 3, 2, 2)
    graph.distance("a", "d")  # hit: a survived
    assert graph.cache_info().hits == 4
    graph.distance("b", "e")  # miss: b was evicted (and e is not cached); evicts c
    assert graph.cache_info() == CacheInfo(4, 4, 2, 2)
    assert graph.distance("zz", "a") == 10.0  # unknown source: a's cached row answers
    graph.distance("zz", "yy")  # unknown IDs, nothing cached: no lookup counted
    graph.distance("a", "a")
    assert graph.cache_info() == CacheInfo(5, 4, 2, 2)
    graph.neighborhood("b", 1.0)  # hit
    graph.distances_from("a")  # hit (cache holds a and b)
    assert graph.cache_info() == CacheInfo(7, 4, 2, 2)
    graph.clear_cache()
    assert graph.cache_info() == CacheInfo(0, 0, 0, 2)
    assert graph.distance("a", "e") == 1.5


def test_cache_state_never_changes_answers() -> None:
    cached = chain(maximum_distance=1.0, distance_cache_size=1)
    uncached = chain(maximum_distance=1.0, distance_cache_size=1000)
    pairs = [(a, b) for a in cached.nodes for b in cached.nodes] * 2
    random.Random(7).shuffle(pairs)
    assert [cached.distance(a, b) for a, b in pairs] == [uncached.distance(a, b) for a, b in pairs]


def test_distances_from_returns_a_copy() -> None:
    graph = chain(maximum_distance=1.0)
    row = graph.distances_from("a")
    row["b"] = 99.0
    row["e"] = 0.0
    del row["c"]
    assert graph.distance("a", "b") == 0.5
    assert graph.distance("a", "e") == 1.0
    assert graph.distance("a", "c") == 0.75
    assert graph.distances_from("a") == {"a": 0.0, "b": 0.5, "c": 0.75, "d": 1.0}
    unknown = graph.distances_from("unknown")
    assert unknown == {"unknown": 0.0}


# ---------------------------------------------------------------------- brute-force oracle


def bellman_ford(nodes: Tuple[str, ...], arcs: List[Tuple[str, str, float]], source: str) -> Dict[str, float]:
    """Unbounded min over paths of the left-fold path length, relaxing until nothing changes."""
    dist = {node: math.inf for node in nodes}
    dist[source] = 0.0
    changed = True
    while changed:
        changed = False
        for u, v, w in arcs:
            if u != v and dist[u] + w < dist[v]:
                dist[v] = dist[u] + w
                changed = True
    return dist


def random_graph(rng: random.Random, directed: bool) -> Tuple[InMemoryCorpusGraph, List[Tuple[str, str, float]]]:
    size = rng.randint(1, 9)
    names = [f"n{i}" for i in range(size)]
    edges = []
    for _ in range(rng.randint(0, 3 * size)):
        # awkward weights (0.1, 0.7, 1/3 ...) so rounding matters; repeats and self-loops happen
        weight = rng.choice([0.1, 0.2, 0.3, 0.7, 1.0 / 3.0, 1.0, 1e-9, rng.uniform(1e-3, 3.0)])
        edges.append((rng.choice(names), rng.choice(names), weight))
    bound = rng.choice([0.5, 0.6, 1.0, 1.3, 2.0, 100.0])
    graph = InMemoryCorpusGraph(
        edges, nodes=names, directed=directed, maximum_distance=bound, distance_cache_size=rng.randint(1, 4)
    )
    arcs = edges if directed else edges + [(b, a, w) for a, b, w in edges]
    return graph, arcs


@pytest.mark.parametrize("directed", [False, True])
def test_matches_bellman_ford_on_random_graphs(directed: bool) -> None:
    rng = random.Random(20240611 + directed)
    for _ in range(150):
        graph, arcs = random_graph(rng, directed)
        bound = graph.maximum_distance
        for source in graph.nodes:
            oracle = bellman_ford(graph.nodes, arcs, source)
            for target in graph.nodes:
                assert graph.distance(source, target) == min(oracle[target], bound), (source, target, arcs)
            within = sorted((d, node) for node, d in oracle.items() if node != source and d <= bound)
            assert graph.neighborhood_distances(source, bound) == tuple((node, d) for d, node in within)
            assert graph.distances_from(source) == {node: d for node, d in oracle.items() if d <= bound}
