"""Checks of an embedding matrix and the kNN options (SPEC section 4, "kNN graph").

Rule 1 of :mod:`mapmatched_torch.standalone.knn` (row normalization) and the input
checks with their messages, shared by the reference kNN graph and the tensor one
(:mod:`mapmatched_torch.graph.knn`), so both give the same error for the same input.
Pure Python.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Dict, Iterable, List, Tuple

from .checks import check_chunk_id, check_positive_finite, check_positive_int
from .errors import MapMatchedValueError

__all__ = [
    "check_knn_options",
    "check_embedding_ids",
    "normalized_rows",
    "column_sum",
    "zero_vector_error",
    "norm_overflow_error",
    "row_count_error",
    "dimension_error",
    "nonfinite_value_error",
]


def check_knn_options(
    neighbor_count: Any, maximum_distance: Any, minimum_edge_distance: Any
) -> Tuple[int, float, float]:
    """Validated ``(neighbor_count, maximum_distance, minimum_edge_distance)``, checked in
    that order with mapmatched 0.1.0's messages (then the value): ``neighbor_count must be
    greater than zero``, ``maximum_distance must be finite and greater than zero``,
    ``minimum_edge_distance must be finite, greater than zero, and no greater than
    maximum_distance``."""
    count = check_positive_int(neighbor_count, "neighbor_count")
    maximum = check_positive_finite(maximum_distance, "maximum_distance")
    minimum = minimum_edge_distance
    if isinstance(minimum, bool) or not isinstance(minimum, numbers.Real) or not (
        math.isfinite(float(minimum)) and 0.0 < float(minimum) <= maximum
    ):
        raise MapMatchedValueError(
            "minimum_edge_distance must be finite, greater than zero, and no greater than maximum_distance, "
            f"got {minimum!r} (maximum_distance={maximum!r})"
        )
    return count, maximum, float(minimum)


def check_embedding_ids(chunk_ids: Any) -> Tuple[str, ...]:
    """The chunk ID of every row of an embedding matrix or index position, as a tuple.

    At least one chunk ID (``chunk_ids must contain at least one ID``); each a
    non-empty string (``chunk IDs must not be empty``); no duplicates (``chunk IDs must
    be unique``): mapmatched 0.1.0's messages, then the positions. Shared by the kNN
    graphs and the providers (dense, FAISS).
    """
    if isinstance(chunk_ids, (str, bytes)):
        raise MapMatchedValueError(f"chunk_ids must be a sequence of chunk IDs, not a string: {chunk_ids!r}")
    ids = tuple(chunk_ids)
    if not ids:
        raise MapMatchedValueError("chunk_ids must contain at least one ID")
    first_seen: Dict[str, int] = {}
    for position, chunk_id in enumerate(ids):
        if isinstance(chunk_id, str) and not chunk_id:
            raise MapMatchedValueError(f"chunk IDs must not be empty (position {position})")
        check_chunk_id(chunk_id, f"chunk ID at position {position}")
        if chunk_id in first_seen:
            raise MapMatchedValueError(
                f"chunk IDs must be unique: {chunk_id!r} at positions {first_seen[chunk_id]} and {position}"
            )
        first_seen[chunk_id] = position
    return ids


def _as_rows(embeddings: Any, count: int) -> List[Any]:
    """The rows of a 2-D matrix (``.tolist()`` applied), exactly ``count`` of them."""
    if hasattr(embeddings, "tolist"):
        embeddings = embeddings.tolist()
    if isinstance(embeddings, (str, bytes)) or not isinstance(embeddings, Sequence):
        raise MapMatchedValueError(
            f"embeddings must be a two-dimensional matrix (a sequence of rows), got {type(embeddings).__name__}"
        )
    if not embeddings:  # what numpy reads as a 1-D array of shape (0,)
        raise MapMatchedValueError("embeddings must be a two-dimensional matrix, got an empty sequence")
    if len(embeddings) != count:
        raise row_count_error(len(embeddings), count)
    return list(embeddings)


def _as_sequence(row: Any, label: str) -> Sequence[Any]:
    """One row as a sequence (``.tolist()`` applied); anything else means the matrix is not 2-D."""
    if hasattr(row, "tolist"):
        row = row.tolist()
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise MapMatchedValueError(
            f"embeddings must be a two-dimensional matrix: {label} is a {type(row).__name__}, "
            "not a sequence of numbers"
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
                f"embeddings must be a two-dimensional matrix of numbers: {label}, column {column} is {value!r}"
            )
        value = float(value)
        if not math.isfinite(value):
            raise nonfinite_value_error(label, column, value)
        values.append(value)
    return values


def _normalize(values: List[float], label: str) -> List[float]:
    """``x / norm`` for every entry, ``norm = sqrt(left-fold sum of x * x)``; a zero norm is an error."""
    norm = math.sqrt(column_sum(value * value for value in values))
    if norm == 0.0:
        raise zero_vector_error(label)
    if not math.isfinite(norm):
        raise norm_overflow_error(label)
    return [value / norm for value in values]


def zero_vector_error(label: str, dtype: str = "float64") -> MapMatchedValueError:
    """The error for an embedding row (``label``, e.g. ``"embeddings row 3 (chunk 'x')"``)
    whose norm is 0 in ``dtype``: it has no direction, so its cosine is undefined."""
    return MapMatchedValueError(
        f"embedding vectors must have nonzero magnitude: {label} is a zero vector "
        f"(its norm is 0, or its entries are too small to square in {dtype})"
    )


def row_count_error(rows: int, count: int) -> MapMatchedValueError:
    """The error for an embedding matrix with ``rows`` rows for ``count`` chunk IDs."""
    return MapMatchedValueError(f"received {rows} embeddings for {count} chunk IDs")


def dimension_error() -> MapMatchedValueError:
    """The error for an embedding matrix without columns."""
    return MapMatchedValueError("embedding dimension must be greater than zero (the rows have no columns)")


def nonfinite_value_error(label: str, column: int, value: float) -> MapMatchedValueError:
    """The error for a NaN or infinite entry of an embedding row (``label``)."""
    return MapMatchedValueError(f"embedding values must be finite: {label} has {value!r} at column {column}")


def norm_overflow_error(label: str, dtype: str = "float64") -> MapMatchedValueError:
    """The error for an embedding row whose norm overflows ``dtype`` (normalizing it would
    silently give zeros)."""
    return MapMatchedValueError(f"{label} has a norm too large for {dtype}")


def normalized_rows(ids: Tuple[str, ...], embeddings: Any) -> List[List[float]]:
    """The validated, L2-normalized rows of the embedding matrix."""
    labels = [f"embeddings row {index} (chunk {chunk_id!r})" for index, chunk_id in enumerate(ids)]
    rows = [_as_sequence(row, label) for row, label in zip(_as_rows(embeddings, len(ids)), labels)]
    dimension = len(rows[0])
    if dimension == 0:
        raise dimension_error()
    return [_normalize(_row_values(row, label, dimension), label) for row, label in zip(rows, labels)]


def column_sum(values: Iterable[float]) -> float:
    """The left-to-right float64 sum (column order), the rule a tensor engine reproduces."""
    total = 0.0
    for value in values:
        total += value
    return total
