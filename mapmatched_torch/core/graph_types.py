"""The corpus graph's plain types (SPEC section 4): edges and row-cache statistics.

Shared by the reference graph (:mod:`mapmatched_torch.standalone.graph`) and the tensor
graph (:mod:`mapmatched_torch.graph`), so neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Tuple, Union

from .checks import check_chunk_id, check_positive_finite, check_weight
from .errors import MapMatchedValueError

__all__ = [
    "GraphEdge",
    "EdgeLike",
    "CacheInfo",
    "coerce_edge",
    "check_node_id",
    "check_neighborhood_centre",
    "check_neighborhood_radius",
    "empty_distance_ids_error",
]


@dataclass(frozen=True, slots=True)
class GraphEdge:
    """One edge of a corpus graph.

    Attributes:
        source_chunk_id: non-empty ID of the node the edge leaves.
        target_chunk_id: non-empty ID of the node the edge enters.
        distance: positive, finite edge length (stored as ``float``; default 1.0).

    Raises:
        ValueError: an empty ID (``graph edge chunk IDs must not be empty``), a
            non-string ID, or a distance that is not a finite number > 0 (``graph edge
            distance must be finite and greater than zero``); mapmatched 0.1.0's text,
            then the value and the edge.
    """

    source_chunk_id: str
    target_chunk_id: str
    distance: float = 1.0

    def __post_init__(self) -> None:
        for name in ("source_chunk_id", "target_chunk_id"):
            value = getattr(self, name)
            if isinstance(value, str) and not value:
                raise MapMatchedValueError(f"graph edge chunk IDs must not be empty ({name} is '')")
            check_chunk_id(value, f"graph edge {name}")
        try:
            distance = check_positive_finite(self.distance, "graph edge distance")
        except MapMatchedValueError as error:
            raise MapMatchedValueError(f"{error} (edge {self.source_chunk_id!r} -> {self.target_chunk_id!r})") from None
        object.__setattr__(self, "distance", distance)


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


def check_node_id(value: Any) -> str:
    """A declared node ID: a non-empty ``str`` (``graph node IDs must not be empty``)."""
    if isinstance(value, str) and not value:
        raise MapMatchedValueError("graph node IDs must not be empty")
    return check_chunk_id(value, "graph node ID")


def empty_distance_ids_error(source_chunk_id: Any, target_chunk_id: Any) -> MapMatchedValueError:
    """The error of ``distance(a, b)`` with an empty (falsy) ID, mapmatched 0.1.0's text."""
    return MapMatchedValueError(
        f"distance chunk IDs must not be empty, got {source_chunk_id!r} -> {target_chunk_id!r}"
    )


def check_neighborhood_centre(chunk_id: Any) -> Any:
    """``neighborhood``'s centre: a falsy one is refused (``neighborhood chunk_id must not
    be empty``, mapmatched 0.1.0's text); an unknown one is fine (its neighbourhood is
    empty)."""
    if not chunk_id:
        raise MapMatchedValueError(f"neighborhood chunk_id must not be empty, got {chunk_id!r}")
    return chunk_id


def check_neighborhood_radius(radius: Any) -> float:
    """``neighborhood``'s radius as a float: a finite number >= 0; NaN, ``inf``, negatives
    and non-numbers are refused (``neighborhood radius must be finite and nonnegative``,
    mapmatched 0.1.0's text, then the value)."""
    return check_weight(radius, "neighborhood radius")
