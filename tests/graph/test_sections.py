"""Section graphs from document structure (adjacent positions, shared sections, hierarchy)."""

from __future__ import annotations

import json
import math
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.data import Passage
from mapmatched_torch.graph import SectionPassage, TensorCorpusGraph, section_edges, section_graph
from mapmatched_torch.standalone.graph import GraphEdge, InMemoryCorpusGraph

INSCIT = Path(__file__).parents[2].parent / "shared/data/inscit_dev/inscit_dev.passages.jsonl"


def passage(chunk_id: str, path: List[str]) -> Dict:
    doc_id, position = chunk_id.split(":")
    return {"id": chunk_id, "doc_id": doc_id, "position": int(position), "section_path": path, "text": "..."}


# Document A: a table of contents at 0, the lead, a "History" section interrupted by a
# subsection and resumed at 9, a "Use" section. Document B: sections with missing
# levels (the corpus is a sample). Document C: one passage, no edges. Input order is
# shuffled on purpose.
FIXTURE = [
    passage("B:4", ["B", "Intro", "Deep", "Deeper"]),
    passage("A:3", ["A", "History"]),
    passage("A:0", []),
    passage("B:2", ["B"]),
    passage("A:9", ["A", "History"]),
    passage("A:1", ["A"]),
    passage("C:1", ["C"]),
    passage("A:5", ["A", "History", "Early"]),
    passage("B:7", ["B", "Other", "X"]),
    passage("A:2", ["A", "History"]),
    passage("A:6", ["A", "Use"]),
    passage("B:3", ["B", "Intro"]),
]
IDS = [p["id"] for p in FIXTURE]

ADJACENT = {("A:0", "A:1"), ("A:1", "A:2"), ("A:2", "A:3"), ("A:5", "A:6"), ("B:2", "B:3"), ("B:3", "B:4")}
SAME_SECTION = {("A:2", "A:3"), ("A:3", "A:9")}  # History's chain (2, 3, 9), not a clique
# Each passage -> head of its nearest ancestor section that has a passage.
HIERARCHY = {
    ("A:1", "A:0"), ("A:2", "A:1"), ("A:3", "A:1"), ("A:9", "A:1"), ("A:6", "A:1"),
    ("A:5", "A:2"),  # Early -> History's head
    ("B:3", "B:2"),
    ("B:4", "B:3"),  # ["B", "Intro", "Deep"] has no passage: up to Intro
    ("B:7", "B:2"),  # ["B", "Other"] has no passage: up to the lead
}  # fmt: skip


def as_map(edges: List[GraphEdge]) -> Dict[frozenset, float]:
    result = {frozenset((e.source_chunk_id, e.target_chunk_id)): e.distance for e in edges}
    assert len(result) == len(edges)  # one edge per linked pair
    return result


def expected_map(rules: Dict[float, set]) -> Dict[frozenset, float]:
    """The union of rule pairs, each pair at the smallest distance of its rules."""
    result: Dict[frozenset, float] = {}
    for distance, pairs in rules.items():
        for pair in pairs:
            key = frozenset(pair)
            result[key] = min(result.get(key, math.inf), distance)
    return result


def test_hand_checked_edges_with_default_distances() -> None:
    edges = section_edges(FIXTURE)
    assert as_map(edges) == expected_map({1.0: ADJACENT | SAME_SECTION, 2.0: HIERARCHY})
    assert as_map(edges)[frozenset(("A:1", "A:9"))] == 2.0
    assert as_map(edges)[frozenset(("A:1", "A:2"))] == 1.0  # adjacent beats hierarchy
    # deterministic order: by input positions, the source is the passage given first
    keys = [(IDS.index(e.source_chunk_id), IDS.index(e.target_chunk_id)) for e in edges]
    assert keys == sorted(keys) and all(a < b for a, b in keys)


def test_each_rule_alone_and_custom_distances() -> None:
    only = {"adjacent_distance": None, "same_section_distance": None, "hierarchy_distance": None}
    assert as_map(section_edges(FIXTURE, **{**only, "adjacent_distance": 0.5})) == expected_map({0.5: ADJACENT})
    assert as_map(section_edges(FIXTURE, **{**only, "same_section_distance": 3})) == expected_map({3.0: SAME_SECTION})
    assert as_map(section_edges(FIXTURE, **{**only, "hierarchy_distance": 0.25})) == expected_map({0.25: HIERARCHY})
    assert section_edges(FIXTURE, **only) == []
    mixed = section_edges(FIXTURE, adjacent_distance=3.0, same_section_distance=5.0, hierarchy_distance=2.0)
    assert as_map(mixed) == expected_map({3.0: ADJACENT, 5.0: SAME_SECTION, 2.0: HIERARCHY})


def test_position_gap() -> None:
    any_gap = as_map(section_edges(FIXTURE, max_position_gap=None))
    extra = {("A:3", "A:5"), ("A:6", "A:9"), ("B:4", "B:7")}
    assert any_gap == expected_map({1.0: ADJACENT | SAME_SECTION | extra, 2.0: HIERARCHY})
    assert as_map(section_edges(FIXTURE, max_position_gap=2)) == expected_map(
        {1.0: ADJACENT | SAME_SECTION | {("A:3", "A:5")}, 2.0: HIERARCHY}
    )


def test_a_long_section_is_a_chain_so_edges_stay_linear() -> None:
    passages = [passage(f"D:{i}", ["D", "Body"]) for i in range(0, 40, 2)]  # no adjacent positions
    edges = section_edges(passages, hierarchy_distance=None)
    assert as_map(edges) == {frozenset((f"D:{i}", f"D:{i + 2}")): 1.0 for i in range(0, 38, 2)}
    assert len(section_edges(passages)) <= 3 * len(passages)


def test_dicts_objects_and_records_give_the_same_edges() -> None:
    objects = [SimpleNamespace(**p) for p in FIXTURE]
    passages = [
        Passage(p["id"], p["text"], p["doc_id"], p["position"], None, tuple(p["section_path"])) for p in FIXTURE
    ]
    chunk_ids = [{"chunk_id": p["id"], **{k: v for k, v in p.items() if k != "id"}} for p in FIXTURE]
    records = [SectionPassage(p["id"], p["doc_id"], p["position"], tuple(p["section_path"])) for p in FIXTURE]
    expected = section_edges(FIXTURE)
    for variant in (objects, passages, chunk_ids, records, iter(FIXTURE)):
        assert section_edges(variant) == expected


def test_section_graph_matches_the_in_memory_graph(device: torch.device) -> None:
    graph = section_graph(FIXTURE, maximum_distance=5.0, device=device)
    reference = InMemoryCorpusGraph(section_edges(FIXTURE), nodes=IDS, maximum_distance=5.0)
    assert isinstance(graph, TensorCorpusGraph)
    assert graph.nodes == tuple(IDS)  # every passage, in input order, C:1 included
    assert graph.maximum_distance == 5.0 and not graph.directed
    edge_index, _ = graph.to_edge_index()
    assert edge_index.device.type == device.type and edge_index.shape[1] == 2 * len(section_edges(FIXTURE))
    assert all(graph.distance(a, b) == reference.distance(a, b) for a in IDS for b in IDS)
    assert graph.distance("A:5", "A:9") == 4.0  # Early -> History head A:2 (2) -> A:3 (1) -> A:9 (1)
    assert graph.distance("C:1", "A:1") == 5.0  # other documents are out of reach


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"id": None}, r"passage 1 has no id"),
        ({"id": ""}, r"passage 1 \(''\) id must be non-empty"),
        ({"id": 5}, r"passage 1 \(5\) id must be a string"),
        ({"doc_id": None}, r"passage 1 \('A:3'\) has no doc_id"),
        ({"doc_id": 3}, r"passage 1 \('A:3'\) doc_id must be a string"),
        ({"position": None}, r"passage 1 \('A:3'\) has no position"),
        ({"position": "3"}, r"passage 1 \('A:3'\) position must be an int, got '3'"),
        ({"position": True}, r"position must be an int, got True"),
        ({"position": 3.0}, r"position must be an int, got 3.0"),
        ({"section_path": None}, r"passage 1 \('A:3'\) has no section_path"),
        ({"section_path": "A/History"}, r"section_path must be a list of strings, got 'A/History'"),
        ({"section_path": ["A", 2]}, r"section_path must hold strings, got \('A', 2\)"),
        ({"id": "A:0"}, r"duplicate ID 'A:0': passage 1 \('A:0'\) and passage 2 \('A:0'\)"),
        ({"position": 0}, r"duplicate \(doc_id, position\) \('A', 0\): passage 1 \('A:3'\) and passage 2 \('A:0'\)"),
    ],
)
def test_bad_passages_are_named(change, words) -> None:
    passages = [dict(p) for p in FIXTURE]
    passages[1].update(change)
    for build in (section_edges, section_graph):
        with pytest.raises(MapMatchedValueError, match=words):
            build(passages)


def test_missing_fields_of_objects_are_named() -> None:
    with pytest.raises(MapMatchedValueError, match=r"passage 0 \('x'\) has no doc_id"):
        section_edges([SimpleNamespace(id="x", position=0, section_path=[])])


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"adjacent_distance": 0.0}, "adjacent_distance must be finite and greater than zero"),
        ({"same_section_distance": math.nan}, "same_section_distance must be finite and greater than zero"),
        ({"hierarchy_distance": -2.0}, "hierarchy_distance must be finite and greater than zero"),
        ({"hierarchy_distance": math.inf}, "hierarchy_distance must be finite and greater than zero"),
        ({"max_position_gap": 0}, "max_position_gap must be greater than zero"),
        ({"max_position_gap": 1.5}, "max_position_gap must be an integer"),
    ],
)
def test_bad_options(options, words) -> None:
    for build in (section_edges, section_graph):
        with pytest.raises(MapMatchedValueError, match=words):
            build(FIXTURE, **options)


def test_bad_containers_and_maximum_distance() -> None:
    for passages in ("A:1", FIXTURE[0]):
        with pytest.raises(MapMatchedValueError, match="iterable of passages"):
            section_edges(passages)
    with pytest.raises(MapMatchedValueError, match="maximum_distance must be finite and greater than zero"):
        section_graph(FIXTURE, maximum_distance=0.0)
    assert section_edges([]) == []


@pytest.mark.skipif(not INSCIT.exists(), reason=f"{INSCIT} is not present")
def test_inscit_smoke() -> None:
    with INSCIT.open(encoding="utf-8") as lines:
        passages = [json.loads(line) for line in islice(lines, 100)]
    edges = section_edges(passages)
    documents = {p["id"]: p["doc_id"] for p in passages}
    assert 0 < len(edges) <= 3 * len(passages)
    assert all(documents[e.source_chunk_id] == documents[e.target_chunk_id] for e in edges)
    assert {e.distance for e in edges} <= {1.0, 2.0}
    graph = section_graph(passages)
    reference = InMemoryCorpusGraph(edges, nodes=[p["id"] for p in passages])
    assert graph.nodes == reference.nodes and len(graph) == 100
    sample = [p["id"] for p in passages[::7]]
    assert all(graph.distance(a, b) == reference.distance(a, b) for a in sample for b in reference.nodes)
