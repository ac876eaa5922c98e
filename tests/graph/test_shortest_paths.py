"""Exact bounded shortest paths: every engine == the standalone graph, bit for bit."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.sparse.csgraph import connected_components

import mapmatched_torch.graph.engines.frontier as frontier
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.graph import (
    ENGINES,
    TensorCorpusGraph,
    bounded_rows,
    pair_distances,
    resolve_engine,
    source_target_distances,
)
from mapmatched_torch.graph.engines import SEARCH_ENGINES, GroupedPairs, SearchOptions
from mapmatched_torch.graph.engines import compiled as _compiled
from mapmatched_torch.graph.engines.scipy_dijkstra import scipy_rows
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

from .conftest import WEIGHTS, random_reference

#: (engine, target_aware, search options) variants that must all agree.
VARIANTS = [
    ("torch", False, {}),
    ("torch", True, {}),
    ("torch", True, {"memory_budget": 1}),  # one source per chunk
    ("scipy", False, {}),
    ("scipy", True, {}),
    ("scipy", True, {"initial_radius": 0.1, "memory_budget": 1}),  # many widening rounds
    ("hybrid", True, {}),  # tiny graphs: scipy alone
    ("hybrid", True, {"work_limit": 1}),  # nearly every source handed to scipy
    ("hybrid", True, {"work_limit": 10**6}),  # torch settles every source
    ("hybrid", False, {}),
    ("compiled", True, {}),
]
#: compiled-engine variants that take pair groups: (search options); groups are random
GROUPED_VARIANTS = [
    {},
    {"settle_limit": 1},  # nearly every pair goes to the guided pass
    {"settle_limit": 1, "ball_limit": 1},  # balls of one node: the floor carries the guidance
    {"settle_limit": 2, "ball_limit": 3, "memory_budget": 1},  # one group per round
]


def all_pairs(reference: InMemoryCorpusGraph, device) -> tuple:
    nodes = len(reference)
    sources = torch.arange(nodes, device=device).repeat_interleave(nodes)
    targets = torch.arange(nodes, device=device).repeat(nodes)
    expected = [
        reference.distances_from(reference.nodes[s]).get(reference.nodes[t], math.inf)
        for s, t in zip(sources.tolist(), targets.tolist())
    ]
    return sources, targets, torch.tensor(expected, dtype=torch.float64)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("directed", [False, True])
def test_every_engine_matches_the_standalone_bit_for_bit(device, weights, directed) -> None:
    for seed in range(6):
        reference = random_reference(seed, weights, directed)
        graph = TensorCorpusGraph.from_graph(reference, device=device)
        sources, targets, expected = all_pairs(reference, device)
        for engine, target_aware, options in VARIANTS:
            found = source_target_distances(
                graph.adjacency, sources, targets, bound=reference.maximum_distance, engine=engine,
                target_aware=target_aware, **options,
            )
            assert found.device.type == device.type
            assert torch.equal(found.cpu(), expected), (seed, engine, target_aware, options)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("directed", [False, True])
def test_compiled_pair_groups_never_change_a_value(device, weights, directed) -> None:
    # groups only guide the far searches (A* on a strictly consistent heuristic)
    for seed in range(6):
        reference = random_reference(seed, weights, directed)
        graph = TensorCorpusGraph.from_graph(reference, device=device)
        sources, targets, expected = all_pairs(reference, device)
        generator = torch.Generator().manual_seed(seed)
        for groups in (
            torch.zeros_like(sources),  # one group
            torch.randint(0, 4, sources.shape, generator=generator).to(device),  # scattered targets
            sources.clone(),  # a group per source
        ):
            for options in GROUPED_VARIANTS:
                found = source_target_distances(
                    graph.adjacency, sources, targets, bound=reference.maximum_distance, engine="compiled",
                    groups=groups, **options,
                )
                assert torch.equal(found.cpu(), expected), (seed, options)


def knn_like_graph(nodes: int, seed: int, directed: bool = False) -> TensorCorpusGraph:
    """Points on a noisy circle, each linked to its 4 nearest (float weights): far pairs
    are many hops apart, so the guided pass of the compiled engine has real work."""
    generator = torch.Generator().manual_seed(seed)
    angle = torch.rand(nodes, generator=generator, dtype=torch.float64) * 2 * math.pi
    points = torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(nodes, 2, generator=generator,
                                                                            dtype=torch.float64)
    distance = torch.cdist(points, points)
    distance.fill_diagonal_(math.inf)
    weight, neighbour = distance.topk(4, dim=1, largest=False)
    edge_index = torch.stack([torch.arange(nodes).repeat_interleave(4), neighbour.reshape(-1)])
    return TensorCorpusGraph.from_edge_index(
        edge_index, weight.reshape(-1), chunk_ids=[f"p{i:04d}" for i in range(nodes)], maximum_distance=2.5,
        directed=directed,
    )


@pytest.mark.parametrize("directed", [False, True])
def test_compiled_guided_searches_equal_full_searches_on_trellis_batches(directed) -> None:
    graph = knn_like_graph(600, seed=1, directed=directed)
    generator = torch.Generator().manual_seed(2)
    # turns of 6 candidates around a walking topic, with jumps: near and far turn pairs
    topic = torch.randint(0, 600, (40,), generator=generator)
    turns = []
    for _ in range(5):
        jump = torch.rand(40, generator=generator) < 0.3
        topic = torch.where(jump, torch.randint(0, 600, (40,), generator=generator), (topic + 3) % 600)
        turns.append((topic[:, None] + torch.randint(-8, 9, (40, 6), generator=generator)) % 600)
    chunk_index = torch.stack(turns, 1)
    expected = graph.trellis_distances(chunk_index, engine="scipy", target_aware=False, use_cache=False)
    assert bool((expected < graph.maximum_distance).any()) and bool((expected == graph.maximum_distance).any())
    batch, steps = chunk_index.shape[0], chunk_index.shape[1] - 1
    sources = chunk_index[:, :-1, :, None].expand(batch, steps, 6, 6)
    targets = chunk_index[:, 1:, None, :].expand(batch, steps, 6, 6)
    groups = torch.arange(batch * steps).view(batch, steps, 1, 1).expand(batch, steps, 6, 6)
    for options in GROUPED_VARIANTS + [{"settle_limit": 8, "ball_limit": 40}]:
        found = pair_distances(
            graph.adjacency, sources, targets, maximum_distance=graph.maximum_distance, engine="compiled",
            groups=groups, **options,
        )
        assert torch.equal(found, expected), options
    assert torch.equal(graph.trellis_distances(chunk_index, engine="compiled", use_cache=False), expected)


def test_compiled_threads_and_tiny_arcs_keep_the_values() -> None:
    graph = knn_like_graph(300, seed=3)
    sources = torch.randint(0, 300, (2000,), generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, 300, (2000,), generator=torch.Generator().manual_seed(5))
    expected = source_target_distances(graph.adjacency, sources, targets, bound=2.5, engine="scipy")
    rows, pair_row, pair_target = _grouped(sources, targets, 300)
    groups = torch.randint(0, 7, pair_row.shape, generator=torch.Generator().manual_seed(6))
    inverse = torch.unique(sources * 300 + targets, return_inverse=True)[1]
    pairs = GroupedPairs(rows, pair_row, pair_target, groups)
    for threads in (1, 2, 5):
        options = SearchOptions(2.5, settle_limit=4, threads=threads)
        found = _compiled.COMPILED_ENGINE.pairs(graph.adjacency, pairs, options)
        assert torch.equal(found[inverse], expected), threads
    # an arc too small for a safe heuristic margin turns the guidance off (same values)
    edge_index, weight = graph.to_edge_index()
    weight = weight.clone()
    weight[0] = 1e-300
    tiny = TensorCorpusGraph.from_edge_index(edge_index, weight, chunk_ids=list(graph.nodes), maximum_distance=2.5)
    assert _compiled._heuristic_scale(tiny.adjacency, 2.5) is None
    assert _compiled._heuristic_scale(graph.adjacency, 2.5) is not None
    expected = source_target_distances(tiny.adjacency, sources, targets, bound=2.5, engine="scipy")
    found = _compiled.COMPILED_ENGINE.pairs(tiny.adjacency, pairs, SearchOptions(2.5, settle_limit=4))
    assert torch.equal(found[inverse], expected)


@pytest.mark.parametrize("directed", [False, True])
def test_compiled_pairs_across_components_are_never_searched(directed, monkeypatch) -> None:
    # three copies of a kNN-like graph: pairs between copies are unreachable, and a
    # search for one would cover its source's whole bounded ball
    copy = knn_like_graph(200, seed=7, directed=directed)
    edge_index, weight = copy.to_edge_index()
    shifted = torch.cat([edge_index + 200 * part for part in range(3)], 1)
    graph = TensorCorpusGraph.from_edge_index(
        shifted, weight.repeat(3), chunk_ids=[f"n{i:03d}" for i in range(600)], maximum_distance=2.5,
        directed=directed,
    )
    generator = torch.Generator().manual_seed(8)
    sources = torch.randint(0, 600, (3000,), generator=generator)
    targets = torch.randint(0, 600, (3000,), generator=generator)
    sources[:50] = 5  # a source whose every target is in another copy
    targets[:50] = torch.randint(200, 600, (50,), generator=generator)
    groups = torch.randint(0, 9, (3000,), generator=generator)
    expected = source_target_distances(graph.adjacency, sources, targets, bound=2.5, engine="scipy", target_aware=False)
    # distinct pairs joined by an undirected path (the copies may fall apart themselves)
    labels = torch.from_numpy(connected_components(graph.adjacency.scipy_matrix(), connection="weak")[1])
    connected = torch.unique((sources * 600 + targets)[labels[sources] == labels[targets]]).numel()
    assert connected < torch.unique(sources * 600 + targets).numel()
    searched = []
    kernels = _compiled._Kernels

    class Counting(kernels):
        def pairs(self, *args):
            searched.append(args[5].size)  # the targets handed to the kernel
            super().pairs(*args)

    monkeypatch.setattr(_compiled, "_kernels", lambda: Counting(__import__(
        "mapmatched_torch.graph.engines.compiled_kernels", fromlist=["pairs"])))
    for options in GROUPED_VARIANTS:
        searched.clear()
        found = source_target_distances(graph.adjacency, sources, targets, bound=2.5, engine="compiled",
                                        groups=groups, **options)
        assert torch.equal(found, expected), options
        assert searched[0] == connected, options  # the first pass gets only pairs with a path
    assert bool(torch.isinf(expected[sources // 200 != targets // 200]).all())


def _grouped(sources: torch.Tensor, targets: torch.Tensor, nodes: int):
    keys = torch.unique(sources * nodes + targets)
    pair_source, pair_target = keys // nodes, keys % nodes
    rows, pair_row = torch.unique_consecutive(pair_source, return_inverse=True)
    return rows, pair_row, pair_target


def test_auto_prefers_the_compiled_engine_on_cpu_and_falls_back_without_numba(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_engine("auto", cpu) == "compiled"
    monkeypatch.setattr(_compiled, "available", lambda: False)
    assert resolve_engine("auto", cpu) == "hybrid"


def test_the_compiled_engine_without_numba_names_the_extra(monkeypatch) -> None:
    from mapmatched_torch.core import optional as _optional
    from mapmatched_torch.core.errors import MissingDependencyError

    monkeypatch.setitem(_optional._PROBED, "numba", ImportError("no numba here"))
    with pytest.raises(MissingDependencyError, match=r"mapmatched-torch\[numba\]"):
        resolve_engine("compiled", torch.device("cpu"))


def test_groups_are_validated() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")])
    pair = torch.zeros(3, dtype=torch.long)
    with pytest.raises(MapMatchedValueError, match="groups must be an int64 tensor"):
        pair_distances(graph.adjacency, pair, pair, maximum_distance=1.0, groups=pair.float())
    with pytest.raises(MapMatchedValueError, match="groups must have the pairs' shape"):
        source_target_distances(graph.adjacency, pair, pair, bound=1.0, groups=pair[:2])


@pytest.mark.parametrize("engine", ["torch", "scipy", "compiled"])
def test_bounded_rows_match_the_standalone_rows(device, engine) -> None:
    for seed in range(4):
        reference = random_reference(seed, "float", seed % 2 == 0)
        graph = TensorCorpusGraph.from_graph(reference, device=device)
        sources = torch.arange(len(reference), device=device)
        rows = bounded_rows(graph.adjacency, sources, limit=reference.maximum_distance, engine=engine, memory_budget=64)
        assert rows.shape == (len(reference), len(reference)) and rows.dtype == torch.float64
        for source, row in zip(reference.nodes, rows.cpu().tolist()):
            expected = reference.distances_from(source)
            assert {reference.nodes[i]: d for i, d in enumerate(row) if d != math.inf} == expected


def test_arc_batches_split_large_frontiers(device, monkeypatch) -> None:
    monkeypatch.setattr(frontier, "_MIN_ARC_BATCH", 3)
    reference = random_reference(3, "dyadic", False, nodes=20)
    graph = TensorCorpusGraph.from_graph(reference, device=device)
    sources, targets, expected = all_pairs(reference, device)
    for target_aware in (False, True):
        found = source_target_distances(
            graph.adjacency, sources, targets, bound=reference.maximum_distance, engine="torch",
            target_aware=target_aware, memory_budget=1,
        )
        assert torch.equal(found.cpu(), expected)


def test_unit_grid_ties_do_not_duplicate_the_frontier(device) -> None:
    # a unit grid has combinatorially many shortest paths: every frontier entry must stay unique
    side = 12
    edges = [(f"{r}-{c}", f"{r}-{c + 1}") for r in range(side) for c in range(side - 1)]
    edges += [(f"{r}-{c}", f"{r + 1}-{c}") for r in range(side - 1) for c in range(side)]
    reference = InMemoryCorpusGraph.from_edges(edges, maximum_distance=30.0)
    graph = TensorCorpusGraph.from_graph(reference, device=device)
    rows = bounded_rows(graph.adjacency, torch.tensor([0], device=device), limit=30.0, engine="torch")
    assert rows.max().item() == 2 * (side - 1)
    assert graph.distance("0-0", f"{side - 1}-{side - 1}") == reference.distance("0-0", f"{side - 1}-{side - 1}")


def test_every_engine_implements_the_one_contract(device) -> None:
    # one name per engine; rows and pairs with one signature, called directly == the standalone
    import inspect

    assert tuple(SEARCH_ENGINES) == ("torch", "scipy", "hybrid", "compiled")
    signatures = {
        method: {str(inspect.signature(getattr(type(engine), method))) for engine in SEARCH_ENGINES.values()}
        for method in ("rows", "pairs")
    }
    assert all(len(found) == 1 for found in signatures.values()), signatures
    reference = random_reference(4, "float", True)
    graph = TensorCorpusGraph.from_graph(reference, device=device)
    sources, targets, expected = all_pairs(reference, device)
    nodes = len(reference)
    rows, pair_row, pair_target = _grouped(sources, targets, nodes)
    pairs = GroupedPairs(rows.to(device), pair_row.to(device), pair_target.to(device))
    options = SearchOptions(reference.maximum_distance)
    for name, engine in SEARCH_ENGINES.items():
        assert engine.name == name
        found = engine.pairs(graph.adjacency, pairs, options)
        assert found.device.type == device.type and torch.equal(found.cpu(), expected), name
        table = engine.rows(graph.adjacency, torch.arange(nodes, device=device), options)
        assert torch.equal(table.cpu().reshape(-1), expected), name


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"bound": -1.0}, r"bound must be a number >= 0 \(inf allowed\), got -1.0"),
        ({"bound": math.nan}, "bound must be a number >= 0"),
        ({"bound": "2"}, "bound must be a number >= 0"),
        ({"bound": 1.0, "target_aware": 1}, "target_aware must be True or False, got 1"),
        ({"bound": 1.0, "memory_budget": 0}, "memory_budget must be greater than zero, got 0"),
        ({"bound": 1.0, "initial_radius": math.inf}, "initial_radius must be finite and greater than zero"),
        ({"bound": 1.0, "work_limit": -1}, "work_limit must be nonnegative, got -1"),
        ({"bound": 1.0, "settle_limit": 2.5}, "settle_limit must be an integer, got 2.5"),
        ({"bound": 1.0, "ball_limit": 0}, "ball_limit must be greater than zero, got 0"),
        ({"bound": 1.0, "threads": True}, "threads must be an integer, got True"),
    ],
)
def test_search_options_are_validated_once_naming_the_option(options, words) -> None:
    with pytest.raises(MapMatchedValueError, match=words):
        SearchOptions(**options)
    # the public functions build one SearchOptions: the same message, whatever the engine
    # (threads is the compiled engine's own option, not a public keyword)
    graph = TensorCorpusGraph.from_edges([("a", "b")])
    pair = graph.index(["a", "b"])
    tuning = {key: value for key, value in options.items() if key not in ("bound", "threads")}
    if tuning:
        for engine in ("torch", "scipy", "dense"):
            if engine == "dense":
                graph.precompute_dense()
            with pytest.raises(MapMatchedValueError, match=words):
                pair_distances(graph.adjacency, pair, pair.flip(0), maximum_distance=1.0, engine=engine,
                               table=graph.dense_table, **tuning)


def test_search_options_are_frozen_and_normalized() -> None:
    options = SearchOptions(2, memory_budget=np.int64(64))
    assert options.bound == 2.0 and type(options.bound) is float and type(options.memory_budget) is int
    with pytest.raises(AttributeError):
        options.bound = 3.0
    with pytest.raises(TypeError, match="unexpected keyword argument 'work_limits'"):
        pair_distances(TensorCorpusGraph.from_edges([("a", "b")]).adjacency, torch.zeros(1, dtype=torch.long),
                       torch.ones(1, dtype=torch.long), maximum_distance=1.0, work_limits=3)


def test_a_path_exactly_at_the_bound_counts_in_every_engine(device) -> None:
    # a -0.5- b -0.25- c -0.25- d -0.5- e ; maximum_distance 1.0: d is exactly at the bound, e beyond
    edges = [("a", "b", 0.5), ("b", "c", 0.25), ("c", "d", 0.25), ("d", "e", 0.5)]
    graph = TensorCorpusGraph.from_edges(edges, maximum_distance=1.0, device=device)
    sources = torch.zeros(2, dtype=torch.long, device=device)
    targets = graph.index(["d", "e"])
    for engine, target_aware, options in VARIANTS:
        found = source_target_distances(
            graph.adjacency, sources, targets, bound=1.0, engine=engine, target_aware=target_aware, **options
        )
        assert found.tolist() == [1.0, math.inf], (engine, target_aware, options)
    assert graph.neighborhood_distances("a", 1e300) == (("b", 0.5), ("c", 0.75), ("d", 1.0))


def test_scipy_limit_is_inclusive() -> None:
    # the engine relies on it: scipy keeps a node whose distance equals `limit`
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.5), ("b", "c", 0.25), ("c", "d", 1.25)], directed=True)
    assert scipy_rows(graph.adjacency, np.array([0]), 0.75).tolist() == [[0.0, 0.5, 0.75, math.inf]]
    below = np.nextafter(0.75, 0.0)
    assert scipy_rows(graph.adjacency, np.array([0]), below).tolist() == [[0.0, 0.5, math.inf, math.inf]]


def test_float_rounding_follows_the_left_fold_from_the_source(device) -> None:
    # 0.1 + 0.2 + 0.3 (left fold) != 0.1 + (0.2 + 0.3): the engines must give the former
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.1), ("b", "c", 0.2), ("c", "d", 0.3)], device=device)
    forward = (0.1 + 0.2) + 0.3
    assert forward != 0.1 + (0.2 + 0.3)
    for engine in ("torch", "scipy", "hybrid", "compiled"):
        found = source_target_distances(
            graph.adjacency, graph.index(["a", "d"]), graph.index(["d", "a"]), bound=10.0, engine=engine
        )
        assert found.tolist() == [forward, (0.3 + 0.2) + 0.1]


def test_pair_distances_index_codes(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.5)], nodes=["z"], maximum_distance=2.0, device=device)
    a, b, z = graph.index(["a", "b", "z"]).tolist()
    sources = torch.tensor([[a, a, a, -2, -2, -1, -1, -3, a, z]], device=device)
    targets = torch.tensor([[b, a, z, -2, -3, -1, a, a, -1, z]], device=device)
    for engine in ("torch", "scipy", "hybrid", "compiled"):
        found = pair_distances(graph.adjacency, sources, targets, maximum_distance=2.0, engine=engine)
        assert found.shape == sources.shape and found.device.type == device.type
        assert found.tolist() == [[0.5, 0.0, 2.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0]]


def test_pair_distances_validates_its_inputs(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")], device=device)
    pair = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(MapMatchedValueError, match="sources must be an int64 tensor"):
        pair_distances(graph.adjacency, pair.float(), pair, maximum_distance=1.0)
    with pytest.raises(MapMatchedValueError, match="same shape"):
        pair_distances(graph.adjacency, pair, pair[:2], maximum_distance=1.0)
    with pytest.raises(MapMatchedValueError, match="node index 2 is out of range for a graph of 2 nodes"):
        pair_distances(graph.adjacency, pair, pair + 2, maximum_distance=1.0)
    with pytest.raises(MapMatchedValueError, match="unsupported distance engine: fast"):
        pair_distances(graph.adjacency, pair, pair, maximum_distance=1.0, engine="fast")
    with pytest.raises(MapMatchedValueError, match="needs a precomputed table"):
        pair_distances(graph.adjacency, pair, pair, maximum_distance=1.0, engine="dense")


def test_resolve_engine() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_engine("auto", cpu) in ("compiled", "hybrid") and resolve_engine("auto", cuda) == "torch"
    assert resolve_engine("auto", cpu, has_table=True) == "dense"
    assert all(resolve_engine(name, cpu, has_table=True) == name for name in ENGINES if name != "auto")
    with pytest.raises(MapMatchedValueError, match="unsupported search engine: dense"):
        bounded_rows(TensorCorpusGraph.from_edges([("a", "b")]).adjacency, torch.tensor([0]), limit=1.0, engine="dense")


def test_empty_inputs(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")], device=device)
    empty = torch.empty(0, dtype=torch.long, device=device)
    for engine in ("torch", "scipy", "hybrid", "compiled"):
        assert source_target_distances(graph.adjacency, empty, empty, bound=1.0, engine=engine).shape == (0,)
        assert bounded_rows(graph.adjacency, empty, limit=1.0, engine=engine).shape == (0, 2)


def test_compiled_engine_calls_from_many_threads_agree() -> None:
    # concurrent callers (e.g. servers in threads) must neither crash nor mix results
    from concurrent.futures import ThreadPoolExecutor

    graph = knn_like_graph(300, seed=7)
    generator = torch.Generator().manual_seed(8)
    batches = [torch.randint(0, 300, (6, 3, 4), generator=generator) for _ in range(6)]
    expected = [graph.trellis_distances(b, engine="scipy", target_aware=False, use_cache=False) for b in batches]
    with ThreadPoolExecutor(max_workers=4) as pool:
        found = list(pool.map(lambda b: graph.trellis_distances(b, engine="compiled", use_cache=False), batches))
    assert all(torch.equal(a, b) for a, b in zip(found, expected))


def test_compiled_guidance_survives_a_path_that_sums_larger_backwards() -> None:
    # A chain s -> u0 -> ... -> u600 whose arcs' low bits make the sum from the target's
    # end 73 ulp larger than the left fold from the source (found by hill-climbing; the
    # first arc is just above the smallest arc that keeps guidance on). With the bound
    # just above the path, a complete backward ball bounded at `bound` missed the path's
    # first nodes and the A* pruned them: the pair came back beyond the bound.
    path = Path(__file__).parent / "data" / "adversarial_chain.txt"
    weights = [float.fromhex(line) for line in path.read_text().splitlines() if line and not line.startswith("#")]
    first = 128 * math.ulp(1.0) * 1.0001
    total = 0.0
    for weight in [first] + weights:
        total += weight
    edges = [("s", "u0", first)] + [(f"u{j}", f"u{j + 1}", w) for j, w in enumerate(weights)]
    for bound in (total, total + 30 * math.ulp(total)):
        reference = InMemoryCorpusGraph(edges, directed=True, maximum_distance=bound)
        graph = TensorCorpusGraph.from_graph(reference)
        assert _compiled._heuristic_scale(graph.adjacency, bound) is not None  # guidance is on
        source, target = graph.index(["s"]), graph.index([f"u{len(weights)}"])
        expected = reference.distance("s", f"u{len(weights)}")
        assert expected == total
        for options in ({}, {"settle_limit": 1}, {"settle_limit": 1, "ball_limit": 10**6}):
            found = source_target_distances(
                graph.adjacency, source, target, bound=bound, engine="compiled",
                groups=torch.zeros(1, dtype=torch.long), **options,
            )
            assert found.item() == expected, options


def test_compiled_engine_leaves_torch_threads_alone() -> None:
    # numba's OpenMP layer sets the process's OpenMP thread count, which torch shares
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPUs for a parallel kernel call")
    graph = knn_like_graph(300, seed=9)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        graph.neighborhoods(list(graph.nodes[:64]), 0.5)  # 64 balls: the parallel kernel
        sources = torch.arange(300).repeat_interleave(4)
        source_target_distances(graph.adjacency, sources, (sources + 7) % 300, bound=2.5, engine="compiled",
                                groups=sources // 10)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("seed", range(6))
def test_grid_distances_equal_pair_distances_of_the_expanded_pairs(seed, device) -> None:
    # every path of grid_distances (dense table, warm CPU cache kernel, no cache) gives
    # pair_distances of the expanded (G, M, M') pairs, codes of every kind included
    from mapmatched_torch.graph import grid_distances

    reference = random_reference(300 + seed, WEIGHTS[seed % 3], seed % 2 == 0)
    graph = TensorCorpusGraph.from_graph(reference, device=device, distance_cache_size=3)
    generator = torch.Generator().manual_seed(seed)
    groups, width, columns = 7, 4, 5
    sources = torch.randint(-3, len(reference), (groups, width), generator=generator).to(device)
    targets = torch.randint(-3, len(reference), (groups, columns), generator=generator).to(device)
    targets[:, 0] = sources[:, 0]  # equal codes, padding and unknown IDs among them
    shape = (groups, width, columns)
    expected = pair_distances(
        graph.adjacency, sources[:, :, None].expand(shape), targets[:, None, :].expand(shape),
        maximum_distance=graph.maximum_distance,
    )
    for cache in (None, graph._cache, graph._cache):  # no cache, then cold and warm (3 rows: evictions)
        found = grid_distances(graph.adjacency, sources, targets, maximum_distance=graph.maximum_distance, cache=cache)
        assert torch.equal(found, expected)
    graph.precompute_dense()
    found = grid_distances(
        graph.adjacency, sources, targets, maximum_distance=graph.maximum_distance, table=graph.dense_table
    )
    assert torch.equal(found, expected)


@pytest.mark.skipif(not _compiled.available(), reason="numba is not installed")
@pytest.mark.parametrize("groups", [3, 2048])  # the serial kernel, and the parallel one (>= 65536 pairs)
def test_compiled_table_grid_equals_table_distances(groups) -> None:
    from mapmatched_torch.graph.shortest_paths import table_distances

    generator = torch.Generator().manual_seed(groups)
    nodes, width, columns, bound = 40, 6, 7, 2.5
    table = torch.rand(nodes, nodes, generator=generator, dtype=torch.float64) * 4  # entries above the bound too
    table[torch.rand(nodes, nodes, generator=generator) < 0.2] = math.inf
    sources = torch.randint(-4, nodes, (groups, width), generator=generator)
    targets = torch.randint(-4, nodes, (groups, columns), generator=generator)
    targets[:, 0] = sources[:, 0]  # equal codes: nodes, padding and unknown IDs
    found = _compiled.compiled_table_grid(table, sources, targets, bound)
    expected = table_distances(table, sources[:, :, None], targets[:, None, :], bound)
    assert found.dtype == torch.float64 and torch.equal(found, expected)
    assert (found == 0.0).any() and (found == bound).any() and ((found > 0) & (found < bound)).any()


def test_grid_distances_validates_its_codes(device) -> None:
    from mapmatched_torch.graph import grid_distances

    graph = TensorCorpusGraph.from_edges([("a", "b", 1.0)], device=device)
    codes = torch.zeros(2, 3, dtype=torch.long, device=device)
    call = lambda s, t: grid_distances(graph.adjacency, s, t, maximum_distance=1.0)  # noqa: E731
    with pytest.raises(MapMatchedValueError, match=r"\(G, M\) and \(G, M'\)"):
        call(codes, codes[:1])
    with pytest.raises(MapMatchedValueError, match=r"\(G, M\) and \(G, M'\)"):
        call(codes.view(-1), codes)
    with pytest.raises(MapMatchedValueError, match="node index 5 is out of range"):
        call(codes, torch.full((2, 1), 5, dtype=torch.long, device=device))
    with pytest.raises(MapMatchedValueError, match="int64"):
        call(codes.int(), codes)
