"""The optional dense (N, N) distance table."""

from __future__ import annotations

import math

import pytest
import torch

from mapmatched_torch.graph import (
    DEFAULT_DENSE_BUDGET,
    TensorCorpusGraph,
    build_dense_table,
    dense_table_bytes,
    max_dense_nodes,
)

from .conftest import random_reference


def test_sizes() -> None:
    assert dense_table_bytes(4096) == 128 * 2**20 == DEFAULT_DENSE_BUDGET
    assert max_dense_nodes() == 4096 and max_dense_nodes(8 * 20000**2) == 20000


@pytest.mark.parametrize("engine", ["auto", "torch", "scipy", "compiled"])
def test_table_equals_the_standalone(device, engine) -> None:
    reference = random_reference(5, "dyadic", False)
    graph = TensorCorpusGraph.from_graph(reference, device=device)
    table = build_dense_table(graph.adjacency, reference.maximum_distance, engine=engine)
    assert table.shape == (len(reference),) * 2 and table.device.type == device.type
    for a, row in zip(reference.nodes, table.cpu().tolist()):
        assert {b: d for b, d in zip(reference.nodes, row) if d != math.inf} == reference.distances_from(a)


def test_graph_uses_its_table(device) -> None:
    reference = random_reference(7, "float", True)
    graph = TensorCorpusGraph.from_graph(reference, device=device).precompute_dense()
    assert graph.dense_table is not None
    ids = list(reference.nodes) + ["unknown"]
    assert [graph.distance(a, b) for a in ids for b in ids] == [reference.distance(a, b) for a in ids for b in ids]
    assert [graph.neighborhood(a, 1.5) for a in ids] == [reference.neighborhood(a, 1.5) for a in ids]
    index = graph.index_trellis([[ids[:3], ids[3:6]]])
    dense = graph.trellis_distances(index, engine="dense")
    assert torch.equal(dense, graph.trellis_distances(index))
    graph.drop_dense()
    assert graph.dense_table is None and torch.equal(dense, graph.trellis_distances(index, engine="torch"))


def test_a_table_over_budget_is_refused() -> None:
    graph = TensorCorpusGraph.from_edges([("a", "b"), ("b", "c")])
    with pytest.raises(ValueError, match=r"3 nodes takes 72 bytes, more than memory_budget=64 \(at most 2 nodes fit\)"):
        graph.precompute_dense(64)
    assert graph.precompute_dense(72).dense_table is not None
