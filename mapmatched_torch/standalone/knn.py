"""The pure-Python reference kNN graph (SPEC.md section 4, "kNN graph").

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
import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any, Dict, Iterable, List, Tuple

from .._validation import check_chunk_id, check_positive_int
from ..errors import MapMatchedValueError
from .graph import EdgeLike, GraphEdge, InMemoryCorpusGraph, _check_positive_finite

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
    ids = _check_chunk_ids(chunk_ids)
    distances = _cosine_distance_matrix(_normalized_rows(ids, embeddings))
    k = min(count, len(ids) - 1)
    return [_pick(index, ids, row, k) for index, row in enumerate(distances)]


class KNNGraph(InMemoryCorpusGraph):
    """An undirected corpus graph built from embeddings by the kNN rules of the module.

    Build it with :meth:`from_embeddings`. The constructor takes ready-made edges (for
    example the :meth:`edges` of a saved graph) and only records the kNN parameters;
    it is always undirected.

    Args:
        edges: as for :class:`InMemoryCorpusGraph`.
        nodes: as for :class:`InMemoryCorpusGraph` (``from_embeddings`` declares every
            chunk, in input order, so :attr:`nodes` follows ``chunk_ids``).
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
        neighbor_count: int = 10,
        maximum_distance: float = 10.0,
        minimum_edge_distance: float = 1e-6,
        distance_cache_size: int = 256,
    ) -> None:
        self._neighbor_count, _, self._minimum_edge_distance = _check_knn_options(
            neighbor_count, maximum_distance, minimum_edge_distance
        )
        super().__init__(
            edges,
            nodes=nodes,
            directed=False,
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
        """The kNN graph of a set of embeddings (SPEC.md section 4).

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

        Cost: with torch importable, the picks come from
        :func:`mapmatched_torch.graph.knn.knn_neighbors_tensor` on CPU (blockwise
        GEMM plus exact re-scoring: O(n^2 D) flops at BLAS speed, O(n D) memory),
        identical to the pure-Python rules; building the in-memory graph is then
        O(n k) Python. Without torch: O(n^2 D) time and O(n^2) memory (the
        pure-Python reference, :func:`knn_neighbors`).

        Example:
            >>> graph = KNNGraph.from_embeddings(["a", "b", "c"], [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], neighbor_count=1)
            >>> graph.neighbors("a")  # a picked b; c picked a (the union is undirected)
            (('b', 1e-06), ('c', 1.0))
            >>> graph.neighbors("c")
            (('a', 1.0),)
        """
        count, maximum, minimum = _check_knn_options(neighbor_count, maximum_distance, minimum_edge_distance)
        check_positive_int(distance_cache_size, "distance_cache_size")
        ids = _check_chunk_ids(chunk_ids)
        try:  # lazily: the standalone package must import without torch
            import torch
        except ImportError:
            picks = knn_neighbors(ids, embeddings, count)
        else:
            from ..graph.knn import knn_neighbors_tensor

            if isinstance(embeddings, torch.Tensor):
                embeddings = embeddings.detach().cpu()
            neighbors, distances = knn_neighbors_tensor(embeddings, ids, count)
            picks = [
                [(ids[j], distance) for j, distance in zip(row, row_distances)]
                for row, row_distances in zip(neighbors.tolist(), distances.tolist())
            ]
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


def _check_knn_options(
    neighbor_count: Any, maximum_distance: Any, minimum_edge_distance: Any
) -> Tuple[int, float, float]:
    """Validated ``(neighbor_count, maximum_distance, minimum_edge_distance)``."""
    count = check_positive_int(neighbor_count, "neighbor_count")
    maximum = _check_positive_finite(maximum_distance, "maximum_distance")
    minimum = _check_positive_finite(minimum_edge_distance, "minimum_edge_distance")
    if minimum > maximum:
        raise MapMatchedValueError(
            f"minimum_edge_distance must be in (0, maximum_distance={maximum!r}], got {minimum!r}"
        )
    return count, maximum, minimum


def _check_chunk_ids(chunk_ids: Any) -> Tuple[str, ...]:
    """At least one chunk ID; each non-empty; no duplicates (the message names both positions)."""
    if isinstance(chunk_ids, (str, bytes)):
        raise MapMatchedValueError(f"chunk_ids must be a sequence of chunk IDs, not a string: {chunk_ids!r}")
    ids = tuple(chunk_ids)
    if not ids:
        raise MapMatchedValueError("chunk_ids must contain at least one chunk ID")
    first_seen: Dict[str, int] = {}
    for position, chunk_id in enumerate(ids):
        check_chunk_id(chunk_id, f"chunk ID at position {position}")
        if chunk_id in first_seen:
            raise MapMatchedValueError(
                f"duplicate chunk ID {chunk_id!r} at positions {first_seen[chunk_id]} and {position}"
            )
        first_seen[chunk_id] = position
    return ids


def _as_rows(embeddings: Any, count: int) -> List[Any]:
    """The rows of a 2-D matrix (``.tolist()`` applied), exactly ``count`` of them."""
    if hasattr(embeddings, "tolist"):
        embeddings = embeddings.tolist()
    if isinstance(embeddings, (str, bytes)) or not isinstance(embeddings, Sequence):
        raise MapMatchedValueError(
            f"embeddings must be a 2-D matrix (a sequence of rows), got {type(embeddings).__name__}"
        )
    if len(embeddings) != count:
        raise MapMatchedValueError(f"embeddings have {len(embeddings)} rows but there are {count} chunk IDs")
    return list(embeddings)


def _as_sequence(row: Any, label: str) -> Sequence[Any]:
    """One row as a sequence (``.tolist()`` applied); anything else means the matrix is not 2-D."""
    if hasattr(row, "tolist"):
        row = row.tolist()
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise MapMatchedValueError(
            f"embeddings must be a 2-D matrix: {label} is a {type(row).__name__}, not a sequence of numbers"
        )
    return row


def _row_values(row: Sequence[Any], label: str, dimension: int) -> List[float]:
    """One row as finite floats, checked against the matrix dimension."""
    if len(row) != dimension:
        raise MapMatchedValueError(
            f"embeddings rows must all have {dimension} columns (ragged matrix): {label} has {len(row)}"
        )
    values = []
    for column, value in enumerate(row):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise MapMatchedValueError(
                f"embeddings must be a 2-D matrix of numbers: {label}, column {column} is {value!r}"
            )
        value = float(value)
        if not math.isfinite(value):
            raise MapMatchedValueError(f"{label} contains a non-finite value at column {column}: {value!r}")
        values.append(value)
    return values


def _normalize(values: List[float], label: str) -> List[float]:
    """``x / norm`` for every entry, ``norm = sqrt(left-fold sum of x * x)``; a zero norm is an error."""
    norm = math.sqrt(_column_sum(value * value for value in values))
    if norm == 0.0:
        raise MapMatchedValueError(
            f"{label} is a zero vector (its norm is 0, or its entries are too small to square in float64)"
        )
    if not math.isfinite(norm):
        raise MapMatchedValueError(f"{label} has a norm too large for float64")
    return [value / norm for value in values]


def _normalized_rows(ids: Tuple[str, ...], embeddings: Any) -> List[List[float]]:
    """The validated, L2-normalized rows of the embedding matrix."""
    labels = [f"embeddings row {index} (chunk {chunk_id!r})" for index, chunk_id in enumerate(ids)]
    rows = [_as_sequence(row, label) for row, label in zip(_as_rows(embeddings, len(ids)), labels)]
    dimension = len(rows[0])
    if dimension == 0:
        raise MapMatchedValueError("embeddings must have at least one column (dimension 0)")
    return [_normalize(_row_values(row, label, dimension), label) for row, label in zip(rows, labels)]


def _column_sum(values: Iterable[float]) -> float:
    """The left-to-right float64 sum (column order), the rule a tensor engine reproduces."""
    total = 0.0
    for value in values:
        total += value
    return total


def _cosine_distance(left: List[float], right: List[float]) -> float:
    """``1 - clip(sum(a_i * b_i), -1, 1)`` of two normalized rows, summed in column order."""
    similarity = _column_sum(map(operator.mul, left, right))
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
