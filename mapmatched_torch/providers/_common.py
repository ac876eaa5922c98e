"""Checks shared by every provider (IDs, queries, embeddings as arrays)."""

from __future__ import annotations

from typing import Any, Iterable, Tuple

import numpy as np

from .._validation import check_chunk_id
from ..errors import MapMatchedValueError

__all__ = ["check_chunk_ids", "check_query", "as_array"]


def check_chunk_ids(chunk_ids: Iterable[str]) -> Tuple[str, ...]:
    """Non-empty, unique chunk IDs (one per index position), as a tuple."""
    if isinstance(chunk_ids, (str, bytes)):
        raise MapMatchedValueError("chunk_ids must be a sequence of chunk IDs, not a single string")
    ids = tuple(chunk_ids)
    if not ids:
        raise MapMatchedValueError("chunk_ids must contain at least one chunk ID")
    first_position = {}
    for position, chunk_id in enumerate(ids):
        check_chunk_id(chunk_id, f"chunk ID at index position {position}")
        if chunk_id in first_position:
            raise MapMatchedValueError(
                f"duplicate chunk ID {chunk_id!r} at index positions {first_position[chunk_id]} and {position}"
            )
        first_position[chunk_id] = position
    return ids


def check_query(query: Any, name: str) -> None:
    """A query must be a non-empty ``str``; ``name`` says which one in the message."""
    if not isinstance(query, str):
        raise MapMatchedValueError(f"{name} must be a string, got {type(query).__name__}")
    if not query:
        raise MapMatchedValueError(f"{name} must be a non-empty string")


def as_array(vector: Any) -> np.ndarray:
    """numpy view of an embedding; torch-like tensors are detached and moved to the CPU."""
    if hasattr(vector, "detach"):
        vector = vector.detach().cpu()
        if hasattr(vector, "float"):
            vector = vector.float()  # bfloat16 has no numpy dtype
        vector = vector.numpy()
    return np.asarray(vector)
