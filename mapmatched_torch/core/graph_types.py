"""The corpus graph's plain types (SPEC section 4): edges and row-cache statistics.

Shared by the reference graph (:mod:`mapmatched_torch.standalone.graph`) and the tensor
graph (:mod:`mapmatched_torch.graph`), so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Tuple, Union

from .checks import check_chunk_id, check_positive_finite
from .errors import MapMatchedValueError

__all__ = ["GraphEdge", "EdgeLike", "CacheInfo", "coerce_edge"]


@dataclass(frozen=True, slots=True)
class GraphEdge:
    """One edge of a corpus graph.

    Attributes:
        source_chunk_id: non-empty ID of the node the edge leaves.
        target_chunk_id: non-empty ID of the node the edge enters.
        distance: positive, finite edge length (stored as ``float``; default 1.0).

    Raises:
        ValueError: an empty or non-string ID, or a distance that is not a positive
            finite number (the message names the edge and the value).
    """

    source_chunk_id: str
    target_chunk_id: str
    distance: float = 1.0

    def __post_init__(self) -> None:
        check_chunk_id(self.source_chunk_id, "edge source chunk ID")
        check_chunk_id(self.target_chunk_id, "edge target chunk ID")
        what = f"edge distance of {self.source_chunk_id!r} -> {self.target_chunk_id!r}"
        object.__setattr__(self, "distance", check_positive_finite(self.distance, what))


#: What the graph constructor accepts as an edge.
EdgeLike = Union[GraphEdge, Tuple[str, str], Tuple[str, str, float]]


class CacheInfo(NamedTuple):
    """Statistics of the distance-row cache of an :class:`InMemoryCorpusGraph`.

    Attributes:
        hits: row lookups answered from the cache.
        misses: row lookups that ran a bounded Dijkstra.
        size: rows currently cached.
        capacity: the most rows the cache holds (``distance_cache_size``).
    """

    hits: int
    misses: int
    size: int
    capacity: int


def coerce_edge(item: Any, position: int) -> GraphEdge:
    """A :class:`GraphEdge` from a GraphEdge or an ``(a, b)`` / ``(a, b, distance)`` tuple."""
    if isinstance(item, GraphEdge):
        return item
    if isinstance(item, (tuple, list)) and len(item) in (2, 3):
        return GraphEdge(*item)
    raise MapMatchedValueError(
        f"edge {position} must be a GraphEdge or an (a, b) / (a, b, distance) tuple, got {item!r}"
    )
