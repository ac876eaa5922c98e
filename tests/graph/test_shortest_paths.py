"""Exact bounded shortest paths: every engine == the standalone graph, bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mapmatched_torch.graph._frontier as frontier
from mapmatched_torch.errors import MapMatchedValueError
from mapmatched_torch.graph import (
    ENGINES,
    TensorCorpusGraph,
    bounded_rows,
    pair_distances,
    resolve_engine,
    source_target_distances,
)
from mapmatched_torch.graph._scipy import scipy_rows
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


@pytest.mark.parametrize("engine", ["torch", "scipy"])
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
    assert graph.neighborhood("a", math.inf) == (("b", 0.5), ("c", 0.75), ("d", 1.0))


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
    for engine in ("torch", "scipy", "hybrid"):
        found = source_target_distances(
            graph.adjacency, graph.index(["a", "d"]), graph.index(["d", "a"]), bound=10.0, engine=engine
        )
        assert found.tolist() == [forward, (0.3 + 0.2) + 0.1]


def test_pair_distances_index_codes(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b", 0.5)], nodes=["z"], maximum_distance=2.0, device=device)
    a, b, z = graph.index(["a", "b", "z"]).tolist()
    sources = torch.tensor([[a, a, a, -2, -2, -1, -1, -3, a, z]], device=device)
    targets = torch.tensor([[b, a, z, -2, -3, -1, a, a, -1, z]], device=device)
    for engine in ("torch", "scipy", "hybrid"):
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
    with pytest.raises(MapMatchedValueError, match="unsupported distance engine: 'fast'"):
        pair_distances(graph.adjacency, pair, pair, maximum_distance=1.0, engine="fast")
    with pytest.raises(MapMatchedValueError, match="needs a precomputed table"):
        pair_distances(graph.adjacency, pair, pair, maximum_distance=1.0, engine="dense")


def test_resolve_engine() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_engine("auto", cpu) == "hybrid" and resolve_engine("auto", cuda) == "torch"
    assert resolve_engine("auto", cpu, has_table=True) == "dense"
    assert all(resolve_engine(name, cpu, has_table=True) == name for name in ENGINES if name != "auto")
    with pytest.raises(MapMatchedValueError, match="unsupported search engine: 'dense'"):
        bounded_rows(TensorCorpusGraph.from_edges([("a", "b")]).adjacency, torch.tensor([0]), limit=1.0, engine="dense")


def test_empty_inputs(device) -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b")], device=device)
    empty = torch.empty(0, dtype=torch.long, device=device)
    for engine in ("torch", "scipy", "hybrid"):
        assert source_target_distances(graph.adjacency, empty, empty, bound=1.0, engine=engine).shape == (0,)
        assert bounded_rows(graph.adjacency, empty, limit=1.0, engine=engine).shape == (0, 2)
