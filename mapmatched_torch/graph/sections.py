"""Section graphs: corpus graphs from document structure, without embeddings.

A structured corpus (as ``../shared/data/inscit_dev``) gives every passage a
document ID, a position in its document and a section path (the section titles from
the document down to the passage, e.g. ``["Cheese", "Nutrition and health",
"Pasteurization"]``; ``[]`` is the document root, such as a table of contents).
Three linear rules, all inside one document, connect the passages:

- **adjacent** (``adjacent_distance``, default 1.0): consecutive passages in position
  order whose positions differ by at most ``max_position_gap`` (default 1: only
  truly adjacent positions; ``None``: any gap, the reading order of what the corpus
  holds).
- **same section** (``same_section_distance``, default 1.0): the passages sharing
  the exact same section path, as a chain in position order (consecutive members
  only, not a clique, so E stays linear in N; any two members are still connected).
  In a complete corpus this mostly repeats the adjacent edges; in a sampled one it
  bridges the gaps inside a section.
- **hierarchy** (``hierarchy_distance``, default 2.0): every passage links to the
  head (first passage in position order) of its nearest ancestor section that has a
  passage: ``path[:-1]``, else ``path[:-2]``, ... down to ``()``. A missing
  intermediate level costs nothing extra (corpora are often sampled).

Why these defaults: adjacent and same-section passages continue one another (one
reading step, 1.0); a parent section's head is broader, so climbing costs 2.0 and
moving to a sibling section through the parent costs 4.0, more than any move inside
a section, while a whole article stays well inside the default ``maximum_distance``
of 10.0. On the cosine scale of a kNN graph (distances in [0, 2]) 1.0 is
"orthogonal" and 2.0 "opposite": a section hop is a deliberate, not a free, move.
Pass ``None`` as a distance to switch that rule off.

The graph is undirected; a pair linked by several rules keeps the smallest distance
(docs/spec.md section 4's parallel-edge rule). Every passage is a node, in input order,
even without edges. E <= 3 N undirected edges; building costs O(N log N).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import check_chunk_id, check_positive_finite, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.graph_types import GraphEdge
from .tensor_graph import TensorCorpusGraph

__all__ = ["SectionPassage", "section_edges", "section_graph"]

_MISSING = object()

#: An index pair (smaller input index first) -> the smallest distance linking it.
_PairDistances = Dict[Tuple[int, int], float]


class SectionPassage(NamedTuple):
    """The fields of a passage that a section graph uses (validated).

    Attributes:
        chunk_id: the passage's non-empty ID (field ``id``, or ``chunk_id``).
        doc_id: the non-empty ID of its document.
        position: its position (an ``int``) in the document, unique per document.
        section_path: section titles from the document down to the passage.
    """

    chunk_id: str
    doc_id: str
    position: int
    section_path: Tuple[str, ...]


def section_edges(
    passages: Iterable[Any],
    *,
    adjacent_distance: Optional[float] = 1.0,
    same_section_distance: Optional[float] = 1.0,
    hierarchy_distance: Optional[float] = 2.0,
    max_position_gap: Optional[int] = 1,
) -> List[GraphEdge]:
    """The undirected edges of the section graph (module docstring), one per linked pair.

    Args:
        passages: dicts or objects with ``id`` (or ``chunk_id``), ``doc_id``,
            ``position`` and ``section_path`` (a list or tuple of strings; ``[]`` is
            the document root). Other fields (title, text) are ignored.
        adjacent_distance: distance of the adjacent rule, positive and finite, or
            None to switch it off (default 1.0).
        same_section_distance: distance of the same-section chain, or None (default
            1.0).
        hierarchy_distance: distance of a passage to its nearest ancestor section's
            head, or None (default 2.0).
        max_position_gap: the largest position difference the adjacent rule links,
            an ``int`` > 0, or None for any gap (default 1).

    Returns:
        :class:`~mapmatched_torch.standalone.graph.GraphEdge` objects, one per linked
        pair with the smallest distance of its rules, ordered by the input positions
        of (source, target); the source is the passage given first. Feed them to
        ``InMemoryCorpusGraph(edges, nodes=ids)`` (undirected) for the reference graph.

    Raises:
        ValueError: a missing or malformed field, a duplicate ID or a duplicate
            (doc_id, position) (the message names the passage), a bad distance or gap.

    Cost: O(N (log N + depth^2)) time, O(N) memory; at most 3 N edges.

    Example:
        >>> passages = [
        ...     {"id": "a:1", "doc_id": "a", "position": 1, "section_path": ["A"]},
        ...     {"id": "a:2", "doc_id": "a", "position": 2, "section_path": ["A", "History"]},
        ...     {"id": "a:3", "doc_id": "a", "position": 3, "section_path": ["A", "History"]},
        ... ]
        >>> [(e.source_chunk_id, e.target_chunk_id, e.distance) for e in section_edges(passages)]
        [('a:1', 'a:2', 1.0), ('a:1', 'a:3', 2.0), ('a:2', 'a:3', 1.0)]
    """
    records, pairs = _sections(passages, adjacent_distance, same_section_distance, hierarchy_distance, max_position_gap)
    return [GraphEdge(records[a].chunk_id, records[b].chunk_id, distance) for (a, b), distance in sorted(pairs.items())]


def section_graph(
    passages: Iterable[Any],
    *,
    adjacent_distance: Optional[float] = 1.0,
    same_section_distance: Optional[float] = 1.0,
    hierarchy_distance: Optional[float] = 2.0,
    max_position_gap: Optional[int] = 1,
    maximum_distance: float = 10.0,
    device: Union[torch.device, str, None] = None,
) -> TensorCorpusGraph:
    """The section graph as a :class:`~mapmatched_torch.graph.TensorCorpusGraph`.

    Args:
        passages, adjacent_distance, same_section_distance, hierarchy_distance,
            max_position_gap: as for :func:`section_edges`.
        maximum_distance: the graph bound, finite and > 0 (default 10.0).
        device: where the graph lives (default: CPU).

    Returns:
        An undirected graph whose nodes are all passage IDs in input order and whose
        edges are those of :func:`section_edges` (both directions stored).

    Raises:
        ValueError: as :func:`section_edges`, or a bad ``maximum_distance``.
    """
    maximum = check_positive_finite(maximum_distance, "maximum_distance")
    records, pairs = _sections(passages, adjacent_distance, same_section_distance, hierarchy_distance, max_position_gap)
    edge_index, edge_weight = _undirected_tensors(pairs, len(records))
    if device is not None:
        edge_index, edge_weight = edge_index.to(device), edge_weight.to(device)
    return TensorCorpusGraph.from_edge_index(
        edge_index,
        edge_weight,
        chunk_ids=[record.chunk_id for record in records],
        num_nodes=len(records),
        directed=False,
        maximum_distance=maximum,
    )


# ---------------------------------------------------------------------- reading


def _sections(
    passages: Iterable[Any],
    adjacent_distance: Any,
    same_section_distance: Any,
    hierarchy_distance: Any,
    max_position_gap: Any,
) -> Tuple[List[SectionPassage], _PairDistances]:
    """Validated options and passages -> (records in input order, linked index pairs)."""
    adjacent = _check_rule_distance(adjacent_distance, "adjacent_distance")
    same_section = _check_rule_distance(same_section_distance, "same_section_distance")
    hierarchy = _check_rule_distance(hierarchy_distance, "hierarchy_distance")
    gap = None if max_position_gap is None else check_positive_int(max_position_gap, "max_position_gap")
    records = _read_passages(passages)
    return records, _pair_distances(records, adjacent, same_section, hierarchy, gap)




def _read_passages(passages: Iterable[Any]) -> List[SectionPassage]:
    """Validated records in input order; IDs and (doc_id, position) unique. O(N)."""
    if isinstance(passages, (str, bytes, Mapping)):
        raise MapMatchedValueError(f"passages must be an iterable of passages, got {type(passages).__name__}")
    records = [_read_passage(passage, index) for index, passage in enumerate(passages)]
    _check_unique(records, lambda record: record.chunk_id, "ID")
    _check_unique(records, lambda record: (record.doc_id, record.position), "(doc_id, position)")
    return records


def _read_passage(passage: Any, index: int) -> SectionPassage:
    """One passage (a mapping or an object with attributes) as a validated :class:`SectionPassage`."""
    chunk_id = _field(passage, "id")
    if chunk_id is _MISSING:
        chunk_id = _field(passage, "chunk_id")
    label = f"passage {index}" + ("" if chunk_id is _MISSING or chunk_id is None else f" ({chunk_id!r})")
    chunk_id = check_chunk_id(_required(chunk_id, label, "id"), f"{label} id")
    doc_id = check_chunk_id(_required(_field(passage, "doc_id"), label, "doc_id"), f"{label} doc_id")
    return SectionPassage(
        chunk_id,
        doc_id,
        _read_position(_required(_field(passage, "position"), label, "position"), label),
        _read_section_path(_required(_field(passage, "section_path"), label, "section_path"), label),
    )


def _field(passage: Any, name: str) -> Any:
    """``passage[name]`` for a mapping, ``passage.name`` otherwise; ``_MISSING`` if absent."""
    if isinstance(passage, Mapping):
        return passage.get(name, _MISSING)
    return getattr(passage, name, _MISSING)


def _required(value: Any, label: str, name: str) -> Any:
    if value is _MISSING or value is None:
        raise MapMatchedValueError(f"{label} has no {name}")
    return value


def _read_position(value: Any, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MapMatchedValueError(f"{label} position must be an int, got {value!r}")
    return int(value)


def _read_section_path(value: Any, label: str) -> Tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise MapMatchedValueError(f"{label} section_path must be a list of strings, got {value!r}")
    path = tuple(value)
    if not all(isinstance(part, str) for part in path):
        raise MapMatchedValueError(f"{label} section_path must hold strings, got {path!r}")
    return path


def _check_unique(records: List[SectionPassage], key: Any, what: str) -> None:
    """Raise on the first repeated key, naming both passages."""
    first: Dict[Any, int] = {}
    for index, record in enumerate(records):
        earlier = first.setdefault(key(record), index)
        if earlier != index:
            raise MapMatchedValueError(
                f"duplicate {what} {key(record)!r}: passage {earlier} ({records[earlier].chunk_id!r}) "
                f"and passage {index} ({record.chunk_id!r})"
            )


def _check_rule_distance(value: Any, name: str) -> Optional[float]:
    """None (rule off) or a positive finite distance."""
    return None if value is None else check_positive_finite(value, name)


# ---------------------------------------------------------------------- rules


def _pair_distances(
    records: List[SectionPassage],
    adjacent: Optional[float],
    same_section: Optional[float],
    hierarchy: Optional[float],
    gap: Optional[int],
) -> _PairDistances:
    """Every linked index pair with the smallest distance of the rules that link it."""
    pairs: _PairDistances = {}
    for document in _documents(records):
        if adjacent is not None:
            _link(pairs, _adjacent_pairs(document, records, gap), adjacent)
        if same_section is not None:
            _link(pairs, _same_section_pairs(document, records), same_section)
        if hierarchy is not None:
            _link(pairs, _hierarchy_pairs(document, records), hierarchy)
    return pairs


def _documents(records: List[SectionPassage]) -> Iterator[List[int]]:
    """Each document's passage indices in position order (documents in first-seen order)."""
    documents: Dict[str, List[int]] = {}
    for index, record in enumerate(records):
        documents.setdefault(record.doc_id, []).append(index)
    for members in documents.values():
        yield sorted(members, key=lambda index: records[index].position)


def _adjacent_pairs(
    document: List[int], records: List[SectionPassage], gap: Optional[int]
) -> Iterator[Tuple[int, int]]:
    """Consecutive passages whose positions differ by at most ``gap`` (None: any)."""
    for left, right in zip(document, document[1:]):
        if gap is None or records[right].position - records[left].position <= gap:
            yield left, right


def _same_section_pairs(document: List[int], records: List[SectionPassage]) -> Iterator[Tuple[int, int]]:
    """Consecutive members (position order) of each section path: a chain per section."""
    sections: Dict[Tuple[str, ...], List[int]] = {}
    for index in document:
        sections.setdefault(records[index].section_path, []).append(index)
    for members in sections.values():
        yield from zip(members, members[1:])


def _hierarchy_pairs(document: List[int], records: List[SectionPassage]) -> Iterator[Tuple[int, int]]:
    """Each passage and the head of its nearest ancestor section that has a passage."""
    heads: Dict[Tuple[str, ...], int] = {}
    for index in document:
        heads.setdefault(records[index].section_path, index)
    for index in document:
        path = records[index].section_path
        for depth in range(len(path) - 1, -1, -1):
            head = heads.get(path[:depth])
            if head is not None:
                yield index, head
                break


def _link(pairs: _PairDistances, links: Iterable[Tuple[int, int]], distance: float) -> None:
    """Record each link as an ordered pair, keeping the smaller distance."""
    for a, b in links:
        key = (a, b) if a < b else (b, a)
        if distance < pairs.get(key, float("inf")):
            pairs[key] = distance


def _undirected_tensors(pairs: _PairDistances, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Linked pairs -> (2, 2E) int64 edge_index (both directions, coalesced), (2E,) float64 weights."""
    ordered = sorted(pairs.items())
    edge_index = torch.tensor([pair for pair, _ in ordered], dtype=torch.long).reshape(-1, 2).T  # shape: (2, E)
    edge_weight = torch.tensor([distance for _, distance in ordered], dtype=torch.float64)  # shape: (E,)
    from torch_geometric.utils import to_undirected  # slow to import: on first use (see _csr.build_csr)

    return to_undirected(edge_index, edge_weight, num_nodes=size, reduce="min")
