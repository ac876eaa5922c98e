"""The pure-Python reference corpus graph (docs/spec.md section 4).

:class:`InMemoryCorpusGraph` is the oracle every tensor graph engine is tested against
bit for bit: a bounded Dijkstra over a dict-of-dicts adjacency, with float64 path
lengths accumulated from the source, and an LRU cache of bounded distance rows.
Pure Python (``math``, ``heapq``, ``collections``): no torch, no numpy.

Semantics, in one place:

- Edges carry positive, finite float64 distances (default 1.0). An undirected graph
  stores every edge in both directions. Parallel edges keep the smallest distance.
  Self-loops are accepted (their distance is still validated, and their endpoint
  becomes a node) but ignored: a positive-length loop can never shorten a path.
- ``distance(a, b)`` is 0.0 when ``a == b``, even for IDs the graph does not know.
  Otherwise it is the shortest path length from ``a`` to ``b`` among the paths whose
  length is ``<= maximum_distance`` (a path exactly at the bound counts). A path's
  length is the left fold ``((w1 + w2) + w3) + ...`` of its edge distances from the
  source, so ``dist[v] = dist[u] + w`` along the search. Unreachable pairs, pairs
  beyond the bound and unknown IDs all get ``maximum_distance``.
- ``distance(a, b)`` is answered from the row of the source ``a``, except in an
  undirected graph whose cache holds ``b``'s row but not ``a``'s: then from ``b``'s row
  with no second search (mapmatched 0.1.0's rule), when that gives the identical
  float. It does whenever every path sum the search can form is exact, i.e. all edge
  distances are multiples of one power of two ``2**-k`` with ``(maximum_distance +
  the longest edge) * 2**k < 2**53`` (unit, integer and dyadic distances such as 0.25
  or 1.5); then every fold order gives the same sum and ``d(b, a) == d(a, b)`` bit for
  bit. With other distances (0.1, cosine distances) a path's left fold from ``b`` can
  differ from the one from ``a`` in the last bit, so the source's own row is searched
  instead: a value never depends on the state of the cache, and every tensor engine
  (which reads source rows) agrees with it bit for bit.
- ``neighborhood(c, radius)`` returns chunk IDs, ``neighborhood_distances(c, radius)``
  the same nodes with their distances: every node but ``c`` within ``min(radius,
  maximum_distance)`` (inclusive; in a directed graph, the out-reachable ones), ordered
  by (distance, chunk ID).

Node order: :attr:`InMemoryCorpusGraph.nodes` lists the declared ``nodes`` first (in
their input order), then edge endpoints as the edges first mention them (source, then
target). Out-neighbours and :meth:`InMemoryCorpusGraph.edges` follow that node order,
which is the CSR order a tensor engine gets when it numbers nodes by ``nodes``.

The graph is immutable after construction; its row cache is not thread-safe.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from fractions import Fraction
from typing import Any, Dict, Iterable, Optional, Tuple

from ..core.checks import check_not_a_string, check_positive_finite, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.graph_types import (
    CacheInfo,
    EdgeLike,
    GraphEdge,
    check_neighborhood_centre,
    check_neighborhood_radius,
    check_node_id,
    coerce_edge,
    empty_distance_ids_error,
)

__all__ = ["GraphEdge", "EdgeLike", "CacheInfo", "InMemoryCorpusGraph"]


def _unit_edge(pair: Any, position: int) -> GraphEdge:
    """A unit-distance :class:`GraphEdge` from an ``(a, b)`` pair."""
    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        return GraphEdge(pair[0], pair[1])
    raise MapMatchedValueError(f"pair {position} must be an (a, b) pair of chunk IDs, got {pair!r}")


class InMemoryCorpusGraph:
    """A corpus graph in memory with bounded shortest-path distances (docs/spec.md section 4).

    Implements the :class:`~mapmatched_torch.core.protocols.CorpusGraph` protocol. See the
    module docstring for the exact semantics (bound, node order, self-loops).

    Args:
        edges: :class:`GraphEdge` objects or ``(a, b)`` / ``(a, b, distance)`` tuples.
        nodes: chunk IDs declared as nodes even without edges (they come first in
            :attr:`nodes`).
        directed: if False (default), every edge is stored in both directions.
        maximum_distance: the bound, finite and > 0 (default 10.0).
        distance_cache_size: how many bounded distance rows (one per source) the LRU
            cache keeps, a positive ``int`` (default 256).

    Raises:
        ValueError: empty IDs, non-positive or non-finite edge distances, a bad
            ``maximum_distance`` or ``distance_cache_size``, a malformed edge.

    Cost: construction is O(N + E log E) time and O(N + E) memory (N nodes, E stored
    arcs); each cached row is O(ball) memory, where the ball is the set of nodes within
    ``maximum_distance`` of the row's source.

    Example:
        >>> graph = InMemoryCorpusGraph([("a", "b", 0.5), ("b", "c", 0.25)], maximum_distance=1.0)
        >>> graph.distance("a", "c"), graph.distance("a", "zzz"), graph.distance("x", "x")
        (0.75, 1.0, 0.0)
        >>> graph.neighborhood("b", 1.0)
        ('c', 'a')
        >>> graph.neighborhood_distances("b", 1.0)
        (('c', 0.25), ('a', 0.5))
    """

    def __init__(
        self,
        edges: Iterable[EdgeLike] = (),
        *,
        nodes: Iterable[str] = (),
        directed: bool = False,
        maximum_distance: float = 10.0,
        distance_cache_size: int = 256,
    ) -> None:
        self._maximum_distance = check_positive_finite(maximum_distance, "maximum_distance")
        self._distance_cache_size = check_positive_int(distance_cache_size, "distance_cache_size")
        self._directed = bool(directed)
        self._adjacency = self._build_adjacency(edges, nodes)
        self._nodes: Tuple[str, ...] = tuple(self._adjacency)
        self._edge_count = sum(len(arcs) for arcs in self._adjacency.values())
        self._reverse_rows = not self._directed and _exact_path_sums(self._adjacency, self._maximum_distance)
        self._rows: "OrderedDict[str, Dict[str, float]]" = OrderedDict()
        self._hits = 0
        self._misses = 0

    @classmethod
    def from_edges(
        cls,
        edges: Iterable[Tuple[str, str]],
        *,
        nodes: Iterable[str] = (),
        directed: bool = False,
        maximum_distance: float = 10.0,
        distance_cache_size: int = 256,
    ) -> "InMemoryCorpusGraph":
        """A graph with a unit-distance edge for every ``(a, b)`` pair (mapmatched
        0.1.0's signature).

        Args:
            edges: ``(a, b)`` chunk-ID pairs.
            nodes, directed, maximum_distance, distance_cache_size: as for the
                constructor.

        Returns:
            The new graph.
        """
        edges = check_not_a_string(edges, "edges")
        return cls(
            [_unit_edge(pair, position) for position, pair in enumerate(edges)],
            nodes=nodes,
            directed=directed,
            maximum_distance=maximum_distance,
            distance_cache_size=distance_cache_size,
        )

    def _build_adjacency(self, edges: Iterable[EdgeLike], nodes: Iterable[str]) -> Dict[str, Dict[str, float]]:
        """The adjacency ``{source: {target: distance}}`` in node order, arcs sorted by target order."""
        adjacency: Dict[str, Dict[str, float]] = {}
        for node in check_not_a_string(nodes, "nodes"):
            adjacency.setdefault(check_node_id(node), {})
        for position, item in enumerate(check_not_a_string(edges, "edges")):
            edge = coerce_edge(item, position)
            _add_arc(adjacency, edge.source_chunk_id, edge.target_chunk_id, edge.distance)
            if not self._directed:
                _add_arc(adjacency, edge.target_chunk_id, edge.source_chunk_id, edge.distance)
        order = {node: index for index, node in enumerate(adjacency)}
        return {
            node: dict(sorted(arcs.items(), key=lambda arc: order[arc[0]]))
            for node, arcs in adjacency.items()
        }

    # ------------------------------------------------------------------ structure

    @property
    def maximum_distance(self) -> float:
        """The bound: unreachable, too-far and unknown pairs get this distance."""
        return self._maximum_distance

    @property
    def directed(self) -> bool:
        """Whether edges are one-way (False: every edge is stored in both directions)."""
        return self._directed

    @property
    def distance_cache_size(self) -> int:
        """The most bounded distance rows the LRU cache keeps."""
        return self._distance_cache_size

    @property
    def nodes(self) -> Tuple[str, ...]:
        """Every node ID, declared nodes first, then edge endpoints in first-seen order."""
        return self._nodes

    @property
    def edge_count(self) -> int:
        """The number of stored directed arcs, E (an undirected edge counts twice)."""
        return self._edge_count

    def __len__(self) -> int:
        """The number of nodes, N."""
        return len(self._nodes)

    def __contains__(self, chunk_id: object) -> bool:
        """Whether ``chunk_id`` is a node of the graph. O(1)."""
        return chunk_id in self._adjacency

    def neighbors(self, chunk_id: str) -> Tuple[Tuple[str, float], ...]:
        """The out-arcs of a node.

        Args:
            chunk_id: the source node.

        Returns:
            ``(neighbor, distance)`` pairs in :attr:`nodes` order (CSR column order);
            ``()`` for an unknown ID. O(degree).
        """
        return tuple(self._adjacency.get(chunk_id, {}).items())

    def edges(self) -> Tuple[GraphEdge, ...]:
        """Every stored directed arc once.

        Returns:
            One :class:`GraphEdge` per arc, ordered by (source, target) in
            :attr:`nodes` order; an undirected graph lists both directions of each
            edge. Self-loops are not stored. O(E).
        """
        return tuple(
            GraphEdge(source, target, distance)
            for source, arcs in self._adjacency.items()
            for target, distance in arcs.items()
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(nodes={len(self)}, arcs={self._edge_count}, "
            f"directed={self._directed}, maximum_distance={self._maximum_distance!r})"
        )

    # ------------------------------------------------------------------ distances

    def distance(self, source_chunk_id: str, target_chunk_id: str) -> float:
        """The bounded shortest-path distance from source to target.

        Args:
            source_chunk_id: where the path starts (its row is searched or cached).
            target_chunk_id: where the path ends.

        Returns:
            0.0 when the IDs are equal (even unknown ones); the shortest path length
            when it is ``<= maximum_distance``; ``maximum_distance`` for unreachable,
            too-far or unknown pairs. Read from the source's row, or in an undirected
            graph from the target's row when only that one is cached (see the module
            docstring).

        Raises:
            ValueError: an empty chunk ID (``distance chunk IDs must not be empty``),
                checked before the IDs are compared.

        Cost: O(1) on a cache hit; on a miss one bounded Dijkstra from the source,
        O((N_b + E_b) log E_b) for the N_b nodes and E_b arcs within the bound.
        """
        if not source_chunk_id or not target_chunk_id:
            raise empty_distance_ids_error(source_chunk_id, target_chunk_id)
        if source_chunk_id == target_chunk_id:
            return 0.0
        rows = self._rows
        if self._reverse_rows and source_chunk_id not in rows and target_chunk_id in rows:
            self._hits += 1
            rows.move_to_end(target_chunk_id)
            return rows[target_chunk_id].get(source_chunk_id, self._maximum_distance)
        row = self._row(source_chunk_id)
        if row is None:
            return self._maximum_distance
        return row.get(target_chunk_id, self._maximum_distance)

    def distances_from(self, source_chunk_id: str) -> Dict[str, float]:
        """The bounded distance row of a source.

        Args:
            source_chunk_id: the source node.

        Returns:
            A new dict ``{node: distance}`` of every node within ``maximum_distance``
            (the source included, at 0.0), in settling order (distance, then ID);
            ``{source_chunk_id: 0.0}`` for an unknown source. A copy: changing it
            never touches the cache. Cost: :meth:`distance`'s, plus O(N_b) to copy.
        """
        row = self._row(source_chunk_id)
        if row is None:
            return {source_chunk_id: 0.0}
        return dict(row)

    def neighborhood(self, chunk_id: str, radius: float) -> Tuple[str, ...]:
        """The chunk IDs within ``min(radius, maximum_distance)`` of ``chunk_id``: the
        IDs of :meth:`neighborhood_distances`, in its order (mapmatched 0.1.0's
        ``neighborhood``; what the library's context expansion calls).

        Returns:
            Chunk IDs ordered by (distance, chunk ID), ``chunk_id`` itself excluded;
            ``()`` for an unknown centre or radius 0.

        Raises:
            ValueError: an empty ``chunk_id``, or a ``radius`` that is not a finite
                number >= 0.
        """
        return tuple(node for node, _ in self.neighborhood_distances(chunk_id, radius))

    def neighborhood_distances(self, chunk_id: str, radius: float) -> Tuple[Tuple[str, float], ...]:
        """Every other node within ``min(radius, maximum_distance)`` of ``chunk_id``, with
        its distance.

        Args:
            chunk_id: the centre, a non-empty ID.
            radius: a finite number >= 0; the bound is inclusive.

        Returns:
            ``(chunk_id, distance)`` pairs ordered by (distance, chunk ID), the centre
            excluded (in a directed graph, the nodes reachable from it); ``()`` for an
            unknown centre. Cost: :meth:`distance`'s, plus O(N_b log N_b) to sort.

        Raises:
            ValueError: an empty ``chunk_id`` (``neighborhood chunk_id must not be
                empty``); a ``radius`` that is NaN, infinite, negative or not a number
                (``neighborhood radius must be finite and nonnegative``).
        """
        check_neighborhood_centre(chunk_id)
        limit = min(check_neighborhood_radius(radius), self._maximum_distance)
        row = self._row(chunk_id)
        if row is None:
            return ()
        reached = [(distance, node) for node, distance in row.items() if node != chunk_id and distance <= limit]
        return tuple((node, distance) for distance, node in sorted(reached))

    # ------------------------------------------------------------------ cache

    def cache_info(self) -> CacheInfo:
        """Hits, misses, size and capacity of the row cache.

        Only row lookups for known sources count (``a == b`` and unknown sources
        never touch the cache).
        """
        return CacheInfo(self._hits, self._misses, len(self._rows), self._distance_cache_size)

    def clear_cache(self) -> None:
        """Drop every cached row and reset the hit and miss counters."""
        self._rows.clear()
        self._hits = 0
        self._misses = 0

    def _row(self, source_chunk_id: str) -> Optional[Dict[str, float]]:
        """The cached bounded row of a known source (None for an unknown one); LRU update."""
        if source_chunk_id not in self._adjacency:
            return None
        row = self._rows.get(source_chunk_id)
        if row is not None:
            self._hits += 1
            self._rows.move_to_end(source_chunk_id)
            return row
        self._misses += 1
        row = self._bounded_distances(source_chunk_id, self._maximum_distance)
        self._rows[source_chunk_id] = row
        if len(self._rows) > self._distance_cache_size:
            self._rows.popitem(last=False)
        return row

    def _bounded_distances(self, source: str, cutoff: float) -> Dict[str, float]:
        """``{node: distance}`` for every node within ``cutoff`` of a known ``source``,
        in settling order (the search hook, as mapmatched 0.1.0 names it; the cache
        calls it with ``cutoff = maximum_distance``).

        Tentative distances are ``dist[u] + w`` (float64 left fold from the source);
        a tentative distance above ``cutoff`` is never queued, so only paths within
        the bound are searched (inclusive). The heap orders by (distance, ID).
        """
        bound = cutoff
        source_chunk_id = source
        settled: Dict[str, float] = {}
        tentative: Dict[str, float] = {source_chunk_id: 0.0}
        heap = [(0.0, source_chunk_id)]
        while heap:
            distance, node = heapq.heappop(heap)
            if node in settled:
                continue
            settled[node] = distance
            for neighbor, weight in self._adjacency[node].items():
                candidate = distance + weight
                if candidate <= bound and neighbor not in settled and candidate < tentative.get(neighbor, math.inf):
                    tentative[neighbor] = candidate
                    heapq.heappush(heap, (candidate, neighbor))
        return settled


def _exact_path_sums(adjacency: Dict[str, Dict[str, float]], bound: float) -> bool:
    """Whether every sum a bounded search forms is exact in float64: all distances are
    multiples of ``1 / D`` (``D``, their largest power-of-two denominator) and ``(bound +
    the longest edge) * D < 2**53``, so any order of adding them gives the same float.
    O(E)."""
    denominator, longest = 1, 0.0
    for arcs in adjacency.values():
        for distance in arcs.values():
            denominator = max(denominator, distance.as_integer_ratio()[1])
            longest = max(longest, distance)
    return (Fraction(bound) + Fraction(longest)) * denominator < 2**53


def _add_arc(adjacency: Dict[str, Dict[str, float]], source: str, target: str, distance: float) -> None:
    """Register both endpoints and store ``source -> target``, keeping the smaller distance.

    A self-loop registers its node but stores nothing (it can never shorten a path).
    """
    arcs = adjacency.setdefault(source, {})
    adjacency.setdefault(target, {})
    if source == target:
        return
    current = arcs.get(target)
    if current is None or distance < current:
        arcs[target] = distance
