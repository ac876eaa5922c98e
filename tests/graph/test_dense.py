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
    assert [graph.neighborhood_distances(a, 1.5) for a in ids] == [reference.neighborhood_distances(a, 1.5) for a in ids]
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


@pytest.mark.parametrize("seed", range(4))
def test_trellis_gather_equals_the_searches_with_padding_and_unknown_ids(device, seed) -> None:
    # the table's trellis path broadcasts instead of flattening: padding, unknown IDs
    # (equal unknown IDs are 0.0 apart), repeated nodes and unreachable pairs
    reference = random_reference(seed, "float", bool(seed % 2))
    graph = TensorCorpusGraph.from_graph(reference, device=device)
    rng = __import__("random").Random(seed)
    ids = list(reference.nodes) + ["ghost", "spirit"]
    conversations = [
        [rng.sample(ids, rng.randint(1, min(5, len(ids)))) for _ in range(rng.randint(1, 4))] for _ in range(6)
    ]
    index = graph.index_trellis(conversations)
    searched = graph.trellis_distances(index, engine="scipy", use_cache=False)
    graph.precompute_dense()
    gathered = graph.trellis_distances(index)
    assert torch.equal(gathered, searched)
    expected = [
        [reference.distance(a, b) if a and b else reference.maximum_distance for a, b in pair]
        for pair in _slots(conversations, index.shape)
    ]
    assert gathered.reshape(len(expected), -1).cpu().tolist() == expected
    with pytest.raises(ValueError, match="out of range"):
        graph.trellis_distances(torch.full((1, 2, 2), len(reference), dtype=torch.long, device=device))


def _slots(conversations, shape):
    """Per conversation, the (source ID, target ID) of every (T-1, M, M) slot (None: padding)."""
    _, turns, width = shape
    out = []
    for conversation in conversations:
        padded = [list(turn) + [None] * (width - len(turn)) for turn in conversation]
        padded += [[None] * width] * (turns - len(padded))
        out.append([(padded[t][j], padded[t + 1][i]) for t in range(turns - 1) for j in range(width) for i in range(width)])
    return out


def test_huge_page_tensors_behave_like_plain_ones(monkeypatch) -> None:
    # the aligned view over a larger buffer (Linux: advised for huge pages) must be an
    # ordinary contiguous tensor; tables built in it equal the searched rows
    from mapmatched_torch.graph import _memory

    monkeypatch.setattr(_memory, "HUGE_PAGE_MIN_BYTES", 0)
    tensor = _memory.empty_in_huge_pages((37, 11), torch.float64)
    assert tensor.shape == (37, 11) and tensor.dtype == torch.float64 and tensor.is_contiguous()
    tensor.copy_(torch.arange(37 * 11, dtype=torch.float64).view(37, 11))
    assert torch.equal(tensor.reshape(-1), torch.arange(37 * 11, dtype=torch.float64))
    reference = random_reference(3, "float", True)
    graph = TensorCorpusGraph.from_graph(reference)
    monkeypatch.setattr("mapmatched_torch.graph.dense._FILL_BLOCK_BYTES", 8 * 3)  # blocks of a few rows
    table = build_dense_table(graph.adjacency, reference.maximum_distance)
    for a, row in zip(reference.nodes, table.tolist()):
        assert {b: d for b, d in zip(reference.nodes, row) if d != math.inf} == reference.distances_from(a)
