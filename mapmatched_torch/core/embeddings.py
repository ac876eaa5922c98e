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
]


def check_knn_options(
    neighbor_count: Any, maximum_distance: Any, minimum_edge_distance: Any
) -> Tuple[int, float, float]:
    """Validated ``(neighbor_count, maximum_distance, minimum_edge_distance)``."""
    count = check_positive_int(neighbor_count, "neighbor_count")
    maximum = check_positive_finite(maximum_distance, "maximum_distance")
    minimum = check_positive_finite(minimum_edge_distance, "minimum_edge_distance")
    if minimum > maximum:
        raise MapMatchedValueError(
            f"minimum_edge_distance must be in (0, maximum_distance={maximum!r}], got {minimum!r}"
        )
    return count, maximum, minimum


def check_embedding_ids(chunk_ids: Any) -> Tuple[str, ...]:
    """The chunk ID of every row of an embedding matrix or index position, as a tuple.

    At least one chunk ID; each a non-empty string; no duplicates (the message names
    both positions). Shared by the kNN graphs and the providers (dense, FAISS).
    """
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
        f"{label} is a zero vector (its norm is 0, or its entries are too small to square in {dtype})"
    )


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
        raise MapMatchedValueError("embeddings must have at least one column (dimension 0)")
    return [_normalize(_row_values(row, label, dimension), label) for row, label in zip(rows, labels)]


def column_sum(values: Iterable[float]) -> float:
    """The left-to-right float64 sum (column order), the rule a tensor engine reproduces."""
    total = 0.0
    for value in values:
        total += value
    return total
