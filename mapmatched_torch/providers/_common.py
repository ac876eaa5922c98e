"""Checks shared by every provider (IDs, queries, embeddings as arrays)."""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Tuple

import numpy as np

from .._validation import check_chunk_id
from ..errors import MapMatchedValueError
from ..models import ScoredCandidate

__all__ = ["check_chunk_ids", "check_query", "as_array", "ranked_candidates"]


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


def ranked_candidates(hits: Iterable[Tuple[Any, Any]], limit: int, source: str) -> Tuple[ScoredCandidate, ...]:
    """Candidates from an external store's hits, checked and in SPEC's order.

    Args:
        hits: ``(chunk_id, score)`` pairs in the store's own rank order, scores already
            "higher is better" (distances converted by the caller).
        limit: at most this many candidates are returned (checked by the caller).
        source: names the store and query in error messages, e.g. ``"Qdrant, query 0"``.

    Returns:
        ``ScoredCandidate`` tuples sorted by (-score, the store's rank), cut at ``limit``.

    Raises:
        MapMatchedValueError: an empty or non-string chunk ID, a score that is not a
            finite real number, or a chunk ID returned twice (two entries of the store
            share one chunk ID, so the mapping to graph nodes would be ambiguous).
    """
    ranked = []  # (score, rank, chunk_id)
    first_rank = {}
    for rank, (chunk_id, score) in enumerate(hits):
        where = f"{source}, rank {rank}"
        check_chunk_id(chunk_id, f"chunk ID from {where}")
        if isinstance(score, bool) or not isinstance(score, numbers.Real):
            raise MapMatchedValueError(f"score from {where} must be a real number, got {type(score).__name__}")
        score = float(score)
        if not math.isfinite(score):
            raise MapMatchedValueError(f"score from {where} must be finite, got {score} (chunk {chunk_id!r})")
        if chunk_id in first_rank:
            raise MapMatchedValueError(
                f"chunk ID {chunk_id!r} returned twice by {source} (ranks {first_rank[chunk_id]} and {rank}); "
                "chunk IDs must be unique in the store"
            )
        first_rank[chunk_id] = rank
        ranked.append((score, rank, chunk_id))
    ranked.sort(key=lambda hit: (-hit[0], hit[1]))
    return tuple(ScoredCandidate(chunk_id, score) for score, _, chunk_id in ranked[:limit])
