"""The pure-Python reference kNN graph (docs/spec.md section 4, "kNN graph").

The exact rules, which tensor engines must reproduce bit for bit:

1. Each embedding row is L2-normalized: ``norm = sqrt(s)`` where ``s`` is the
   left-to-right float64 sum of ``x * x`` over the columns (each square rounded on
   its own, then added in column order, no fused multiply-add), then every entry
   becomes ``x / norm``.
2. The cosine similarity of two normalized rows is the left-to-right float64 sum of
   ``a_i * b_i`` in column order (symmetric, since ``a_i * b_i == b_i * a_i``),
   clipped to ``[-1, 1]``. The cosine distance is ``1.0 - similarity``, in ``[0, 2]``.
   Column order (not an exactly rounded ``fsum``) is the rule because a tensor engine
   can reproduce it bit for bit with one elementwise multiply and one add per column.
3. Each chunk picks ``k = min(neighbor_count, n - 1)`` neighbours other than itself,
   ordered by (cosine distance, chunk ID): equal distances go to the smaller ID.
4. The graph is the undirected union of all picks. An edge's distance is
   ``min(max(cosine distance, minimum_edge_distance), maximum_distance)``, so
   identical vectors get ``minimum_edge_distance``, never 0. When both ends pick each
   other the smaller distance stays (the parallel-edge rule; the two are equal anyway,
   since the cosine distance is symmetric).

Because of (2) and (3), the result does not depend on the order of the input rows.

This is the reference implementation: O(n^2 D) time and O(n^2) memory in pure
Python. A tensor engine replaces it for large n.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from typing import Any, Iterable, List, Tuple

from ..core.checks import check_positive_int
from ..core.embeddings import check_embedding_ids, check_knn_options, column_sum, normalized_rows
from ..core.graph_types import EdgeLike, GraphEdge
from .graph import InMemoryCorpusGraph

__all__ = ["KNNGraph", "knn_neighbors"]


def knn_neighbors(
    chunk_ids: Sequence[str], embeddings: Any, neighbor_count: int
) -> List[List[Tuple[str, float]]]:
    """Every chunk's k nearest neighbours by cosine distance (rules 1-3 of the module).

    Args:
        chunk_ids: n unique, non-empty chunk IDs, one per embedding row.
        embeddings: an n x D matrix: a sequence of rows of real numbers, or anything
            with ``.tolist()`` (a numpy array, a torch tensor).
        neighbor_count: the k wanted, an ``int`` > 0 (capped at n - 1).

    Returns:
        One list per chunk, in input order: its ``min(neighbor_count, n - 1)`` picks as
        ``(chunk_id, raw cosine distance)`` in pick order (distance, then ID). The raw
        distance is unclamped (``0.0`` for identical directions).

    Raises:
        ValueError: see :meth:`KNNGraph.from_embeddings`.

    Cost: O(n^2 D) time, O(n^2) memory, pure Python (the reference, not for large n).
    """
    count = check_positive_int(neighbor_count, "neighbor_count")
    return _picks(check_embedding_ids(chunk_ids), embeddings, count)


def _picks(ids: Tuple[str, ...], embeddings: Any, count: int) -> List[List[Tuple[str, float]]]:
    """:func:`knn_neighbors` of already-checked IDs and a checked ``count``."""
    distances = _cosine_distance_matrix(normalized_rows(ids, embeddings))
    k = min(count, len(ids) - 1)
    return [_pick(index, ids, row, k) for index, row in enumerate(distances)]


class KNNGraph(InMemoryCorpusGraph):
    """An undirected corpus graph built from embeddings by the kNN rules of the module.

    Build it with :meth:`from_embeddings`. The constructor takes ready-made edges (for
    example the :meth:`edges` of a saved graph) and only records the kNN parameters;
    it has :class:`InMemoryCorpusGraph`'s signature (mapmatched 0.1.0's), plus the kNN
    parameters.

    Args:
        edges: as for :class:`InMemoryCorpusGraph`.
        nodes: as for :class:`InMemoryCorpusGraph` (``from_embeddings`` declares every
            chunk, in input order, so :attr:`nodes` follows ``chunk_ids``).
        directed: as for :class:`InMemoryCorpusGraph` (default False; a kNN graph of
            :meth:`from_embeddings` is undirected).
        neighbor_count: the k the graph was built with, an ``int`` > 0.
        maximum_distance: the bound, finite and > 0.
        minimum_edge_distance: the smallest edge distance, in (0, maximum_distance].
        distance_cache_size: rows kept by the LRU cache, an ``int`` > 0.

    Raises:
        ValueError: a bad parameter or edge.
    """

    def __init__(
        self,
        edges: Iterable[EdgeLike] = (),
        *,
        nodes: Iterable[str] = (),
        directed: bool = False,
        maximum_distance: float = 10.0,
        distance_cache_size: int = 256,
        neighbor_count: int = 10,
        minimum_edge_distance: float = 1e-6,
    ) -> None:
        self._neighbor_count, _, self._minimum_edge_distance = check_knn_options(
            neighbor_count, maximum_distance, minimum_edge_distance
        )
        super().__init__(
            edges,
            nodes=nodes,
            directed=directed,
            maximum_distance=maximum_distance,
            distance_cache_size=distance_cache_size,
        )

    @classmethod
    def from_embeddings(
        cls,
        chunk_ids: Sequence[str],
        embeddings: Any,
        *,
        neighbor_count: int = 10,
        maximum_distance: float = 10.0,
        minimum_edge_distance: float = 1e-6,
        distance_cache_size: int = 256,
    ) -> "KNNGraph":
        """The kNN graph of a set of embeddings (docs/spec.md section 4).

        Args:
            chunk_ids: n unique, non-empty chunk IDs, one per row (n >= 1).
            embeddings: an n x D matrix (D >= 1) of finite reals: a sequence of rows,
                or anything with ``.tolist()`` (numpy array, torch tensor).
            neighbor_count: k, an ``int`` > 0 (default 10; capped at n - 1).
            maximum_distance: the bound, finite and > 0 (default 10.0); also the
                largest edge distance.
            minimum_edge_distance: the smallest edge distance, in
                (0, maximum_distance] (default 1e-6).
            distance_cache_size: rows kept by the LRU cache (default 256).

        Returns:
            The undirected graph of all picks, every chunk a node (n = 1: one node, no
            edges).

        Raises:
            ValueError: bad options; no, empty or duplicate IDs; embeddings that are
                not 2-D, ragged, of dimension 0, with a row count other than n, with
                a non-finite value or a zero row (messages name the row and ID).

        Cost: O(n^2 D) time and O(n^2) memory in pure Python (:func:`knn_neighbors`):
        this is the reference, independent of the tensor engines it checks. For
        large n, :func:`mapmatched_torch.graph.knn_graph` builds the same graph
        (identical edges) as a :class:`~mapmatched_torch.graph.TensorCorpusGraph`
        at BLAS speed.

        Example:
            >>> graph = KNNGraph.from_embeddings(["a", "b", "c"], [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], neighbor_count=1)
            >>> graph.neighbors("a")  # a picked b; c picked a (the union is undirected)
            (('b', 1e-06), ('c', 1.0))
            >>> graph.neighbors("c")
            (('a', 1.0),)
        """
        ids = check_embedding_ids(chunk_ids)  # mapmatched's order: the IDs, then the options
        count, maximum, minimum = check_knn_options(neighbor_count, maximum_distance, minimum_edge_distance)
        check_positive_int(distance_cache_size, "distance_cache_size")
        picks = _picks(ids, embeddings, count)
        edges = [
            GraphEdge(source, target, min(max(distance, minimum), maximum))
            for source, row in zip(ids, picks)
            for target, distance in row
        ]
        return cls(
            edges,
            nodes=ids,
            neighbor_count=count,
            maximum_distance=maximum,
            minimum_edge_distance=minimum,
            distance_cache_size=distance_cache_size,
        )

    @property
    def neighbor_count(self) -> int:
        """The k the graph was built with (each chunk picked ``min(k, n - 1)``)."""
        return self._neighbor_count

    @property
    def minimum_edge_distance(self) -> float:
        """The smallest edge distance (identical vectors get exactly this)."""
        return self._minimum_edge_distance


def _cosine_distance(left: List[float], right: List[float]) -> float:
    """``1 - clip(sum(a_i * b_i), -1, 1)`` of two normalized rows, summed in column order."""
    similarity = column_sum(map(operator.mul, left, right))
    return 1.0 - min(1.0, max(-1.0, similarity))


def _cosine_distance_matrix(rows: List[List[float]]) -> List[List[float]]:
    """The n x n cosine distances (diagonal 0.0, unused); each pair computed once."""
    size = len(rows)
    matrix = [[0.0] * size for _ in range(size)]
    for i in range(size):
        for j in range(i + 1, size):
            matrix[i][j] = matrix[j][i] = _cosine_distance(rows[i], rows[j])
    return matrix


def _pick(index: int, ids: Tuple[str, ...], distances: List[float], k: int) -> List[Tuple[str, float]]:
    """The k smallest (distance, ID) among the chunks other than ``index``."""
    others = ((distance, chunk_id) for j, (chunk_id, distance) in enumerate(zip(ids, distances)) if j != index)
    return [(chunk_id, distance) for distance, chunk_id in heapq.nsmallest(k, others)]
