"""Checks shared by every provider (IDs, queries, batches, embeddings as arrays, scores),
and :class:`SearchProvider`, the ``retrieve`` / ``retrieve_batch`` of the vector-store
providers."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..core.checks import check_chunk_id, check_positive_int
from ..core.embeddings import check_embedding_ids
from ..core.errors import MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.protocols import CandidatesMethod

__all__ = [
    "QueryEmbedder",
    "SearchProvider",
    "as_array",
    "as_query_vector",
    "check_batch",
    "check_chunk_ids",
    "chunk_id_from_field",
    "check_name",
    "check_query",
    "check_request",
    "check_result_count",
    "dimension_mismatch_error",
    "distance_to_score",
    "ranked_candidates",
    "stored_vector",
    "missing_chunk_error",
]

#: ``embed_query``: a query string -> a 1-D vector. Upstream mapmatched's alias, as it
#: spells it; at run time a numpy array or a torch tensor is accepted too.
QueryEmbedder = Callable[[str], Sequence[float]]


#: Non-empty, unique chunk IDs (one per index position or matrix row), as a tuple: the
#: kNN graphs' check (:func:`mapmatched_torch.core.embeddings.check_embedding_ids`).
check_chunk_ids = check_embedding_ids


def check_query(query: Any, name: str) -> None:
    """A query must be a non-empty ``str``; ``name`` says which one in the message (an
    empty one: ``"query must not be empty"``, upstream mapmatched's words; a whitespace
    query is a query, as upstream's)."""
    if not isinstance(query, str):
        raise MapMatchedValueError(f"{name} must be a string, got {type(query).__name__}")
    if not query:
        raise MapMatchedValueError(f"{name} must not be empty")


def check_request(query: Any, limit: Any) -> Tuple[str, int]:
    """One ``retrieve(query, limit)`` call's arguments: a non-empty query string and a
    positive int limit (messages say ``query`` and ``limit``)."""
    check_query(query, "query")
    return query, check_positive_int(limit, "limit")


def check_batch(queries: Any, limit: Any) -> Tuple[List[str], int]:
    """One ``retrieve_batch(queries, limit)`` call's arguments, checked in this order.

    Returns:
        ``(queries as a list, limit)``.

    Raises:
        MapMatchedValueError: ``queries`` is a single string (or bytes) rather than a
            sequence of them; a bad ``limit``; a bad query, named by its position
            (``"query 1 must be a non-empty string"``).
    """
    if isinstance(queries, (str, bytes)):
        raise MapMatchedValueError("queries must be a sequence of query strings, not a single string")
    queries = list(queries)
    limit = check_positive_int(limit, "limit")
    for position, query in enumerate(queries):
        check_query(query, f"query {position}")
    return queries, limit


class SearchProvider(CandidatesMethod):
    """``retrieve`` (also named ``candidates``, upstream mapmatched's method) and
    ``retrieve_batch`` of a provider that embeds queries and searches a store (Chroma,
    Qdrant, FAISS): both check their arguments, then hand the queries to
    :meth:`_search` with the names error messages give them -- ``"query"`` for
    :meth:`retrieve`, ``"query 0"``, ``"query 1"``, ... by position for
    :meth:`retrieve_batch`. A subclass implements :meth:`_search`; its class docstring
    says what the scores mean, how ties are ordered and what a call costs.
    """

    def retrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """The best ``min(limit, n)`` candidates for one query, best first.

        Args:
            query: a non-empty query string, passed to ``embed_query``.
            limit: the most candidates to return, a positive int.

        Returns:
            :class:`~mapmatched_torch.core.models.ScoredCandidate` sorted by (-score, the
            store's rank or index position); scores as in the class docstring.

        Raises:
            ValueError: a bad query, query vector or limit, or an invalid result from
                the store (e.g. a hit without a valid chunk ID, one chunk ID returned
                twice, a non-finite score or distance).
        """
        query, limit = check_request(query, limit)
        return self._search_one(query, limit, "query")

    def retrieve_batch(self, queries: Sequence[str], limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve` for many queries with a single search of the store (see the
        class docstring's cost).

        Args:
            queries: query strings (a list, not one string); may be empty.
            limit: the most candidates per query, a positive int.

        Returns:
            One tuple per query, in query order, each equal to ``retrieve(query, limit)``.

        Raises:
            ValueError: as :meth:`retrieve`; messages name the query's position.
        """
        queries, limit = check_batch(queries, limit)
        if not queries:
            return []
        return self._search(queries, limit, tuple(f"query {i}" for i in range(len(queries))))

    def _search_one(self, query: str, limit: int, name: str) -> Tuple[ScoredCandidate, ...]:
        """One checked query (for :meth:`retrieve`); a batch of one unless overridden."""
        return self._search([query], limit, (name,))[0]

    def _search(self, queries: List[str], limit: int, names: Tuple[str, ...]) -> List[Tuple[ScoredCandidate, ...]]:
        """Checked queries (at least one) and limit -> one tuple of candidates per
        query (``names``: one per query, for error messages): each query embedded
        (:meth:`_embed`), then one :meth:`_search_rows`."""
        return self._search_rows(np.stack([self._embed(query, name) for query, name in zip(queries, names)]), limit,
                                 names)

    # ------------------------------------------------------------ searching by vector
    # The VectorSearchProvider methods (mapmatched_torch.providers.query_mixing): what
    # QueryMixingProvider needs. A subclass implements the four hooks below them.

    def embed_queries(self, queries: Sequence[str]) -> Any:
        """``(Q, D)`` float32 torch tensor of Q query strings embedded by ``embed_query``
        and checked as :meth:`retrieve` checks them (messages name ``query i``)."""
        import torch

        rows = [self._embed(query, f"query {i}") for i, query in enumerate(queries)]
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, self._vector_dimension() or 0))

    def chunk_embeddings(self, chunk_ids: Sequence[str]) -> Any:
        """``(Q, D)`` float32 torch tensor of the stored vectors of the given chunks, in
        the given order (a chunk may be named more than once).

        Raises:
            MapMatchedValueError: a bad chunk ID, a chunk the store does not hold (or
                holds twice), or a stored vector that is not a finite vector of the
                store's dimension.
        """
        import torch

        ids = [check_chunk_id(chunk_id, f"chunk ID {i}") for i, chunk_id in enumerate(chunk_ids)]
        rows = self._stored_vectors(ids) if ids else []
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros((0, self._vector_dimension() or 0))

    def search_vectors(self, vectors: Any, limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """The best ``limit`` candidates of every row of ``(Q, D)`` query vectors (numpy
        or torch), each row checked as :meth:`retrieve` checks an embedded query, in one
        search of the store; equal to :meth:`retrieve_batch` for the queries the rows
        embed."""
        limit = check_positive_int(limit, "limit")
        dimension = self._vector_dimension()
        if dimension is None:  # an empty store: nothing to search
            return [() for _ in range(len(vectors))]
        names = tuple(f"query vector {i}" for i in range(len(vectors)))
        rows = [as_query_vector(vector, dimension, name, self._store_name()) for vector, name in zip(vectors, names)]
        return self._search_rows(np.stack(rows), limit, names) if rows else []

    def _embed(self, query: str, name: str) -> np.ndarray:
        """One checked query embedded: a (D,) float32 vector (or a ValueError naming ``name``)."""
        raise NotImplementedError

    def _search_rows(self, matrix: np.ndarray, limit: int, names: Tuple[str, ...]) -> List[Tuple[ScoredCandidate, ...]]:
        """One search of the store for a checked ``(Q, D)`` float32 matrix (Q >= 1)."""
        raise NotImplementedError

    def _stored_vectors(self, chunk_ids: List[str]) -> List[np.ndarray]:
        """The checked (D,) float32 stored vector of each of the (checked) chunk IDs."""
        raise NotImplementedError

    def _vector_dimension(self) -> Optional[int]:
        """The store's vector dimension (None while an empty store cannot tell)."""
        raise NotImplementedError

    def _store_name(self) -> str:
        """The store as error messages name it."""
        return "the index"


def stored_vector(vector: Any, dimension: int, chunk_id: str, store: str) -> np.ndarray:
    """A chunk's stored vector as a checked (D,) float32 array (the name in messages:
    ``stored vector of chunk '...'``)."""
    return as_query_vector(vector, dimension, f"stored vector of chunk {chunk_id!r}", store)


def missing_chunk_error(chunk_id: str, store: str) -> MapMatchedValueError:
    """The error for a context chunk the store does not hold."""
    return MapMatchedValueError(f"chunk {chunk_id!r} is not in {store}")


def check_name(value: Any, name: str, *, optional: bool = False) -> Optional[str]:
    """A non-empty string naming a field, collection or vector (None allowed when
    ``optional``); ``name`` says which argument in the message."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        allowed = "a non-empty string or None" if optional else "a non-empty string"
        raise MapMatchedValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def chunk_id_from_field(fields: Any, field: str, where: str, kind: str = "metadata") -> str:
    """The chunk ID a store keeps under ``field`` of a hit's metadata (or payload:
    ``kind``), for providers built with ``chunk_id_field=``.

    Raises:
        MapMatchedValueError: naming the hit (``where``, e.g. ``"Qdrant point 3 of
            collection 'docs' (query, rank 0)"``): the field is missing (the message
            lists the keys the hit has), or it holds something other than a non-empty
            string.
    """
    if not isinstance(fields, Mapping) or field not in fields:
        keys = sorted(fields) if isinstance(fields, Mapping) else []
        raise MapMatchedValueError(
            f"{where} has no {kind} field {field!r} (its {kind} keys: {keys}); "
            "chunk_id_field= names the field that holds chunk IDs"
        )
    value = fields[field]
    if not isinstance(value, str) or not value:
        raise MapMatchedValueError(f"{where} has {kind} field {field!r} = {value!r}, not a non-empty string chunk ID")
    return value


def distance_to_score(distance: Any, offset: float = 0.0) -> Any:
    """A "higher is better" score from a "lower is better" distance: ``offset - d``.

    ``0.0 - d`` (not ``-d``) keeps a zero distance at ``+0.0``; ``offset=1.0`` turns a
    Chroma cosine or inner-product distance (``1 - similarity``) back into the
    similarity. Anything that is not a finite real number (None, a string, NaN, inf,
    a bool) is returned unchanged, for :func:`ranked_candidates` to reject with its
    position and original value.
    """
    if isinstance(distance, numbers.Real) and not isinstance(distance, bool) and math.isfinite(distance):
        return offset - float(distance)
    return distance


def check_result_count(count: int, limit: int, store: str, name: str, unit: str) -> None:
    """A store must not answer a query with more than ``limit`` hits (``unit``: what a
    hit is called, e.g. ``"points"``); else an invalid-result error naming the query."""
    if count > limit:
        raise MapMatchedValueError(f"invalid {store} result for {name}: {count} {unit} for limit {limit}")


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


def dimension_mismatch_error(name: str, found: int, dimension: int, store: str) -> MapMatchedValueError:
    """The error for a query embedding of ``found`` entries searched against ``store``
    (e.g. ``"the index"``) of ``dimension``; ``name`` says which query (``"query 2"``).
    It ends with upstream mapmatched's wording (``dimension 3; expected 2``)."""
    return MapMatchedValueError(
        f"{name} embedding has dimension {found} but {store} has dimension {dimension} "
        f"(the query embedder and {store} disagree: embed queries with the model that embedded {store}); "
        f"query vector has dimension {found}; expected {dimension}"
    )


def as_query_vector(vector: Any, dimension: int, name: str, store: str = "the index") -> np.ndarray:
    """The (D,) float32 query vector, or a ValueError naming what is wrong with it.

    Accepts what ``embed_query`` returns (numpy array, list, torch tensor) of shape
    ``(D,)`` or ``(1, D)``; rejects other shapes, a dimension other than
    ``dimension`` (the message names ``store``), non-numeric dtypes and values that are
    not finite as float32. ``name`` says which query in the message.
    """
    try:
        array = as_array(vector)
    except (TypeError, ValueError) as exc:
        raise MapMatchedValueError(f"embed_query returned no numeric vector for {name}: {exc}") from exc
    if array.dtype.kind not in "biuf":
        raise MapMatchedValueError(f"embed_query returned a vector of dtype {array.dtype} for {name}; expected real numbers")
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise MapMatchedValueError(
            f"embed_query returned shape {tuple(array.shape)} for {name}; expected ({dimension},) or (1, {dimension})"
        )
    if array.shape[0] != dimension:
        raise dimension_mismatch_error(name, array.shape[0], dimension, store)
    with np.errstate(over="ignore"):  # an overflow becomes inf, reported just below
        # shape: (D,)
        array = np.ascontiguousarray(array, dtype=np.float32)
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        position = int(bad[0])
        raise MapMatchedValueError(
            f"query vector values must be finite: the vector for {name} has {array[position]} at dimension "
            f"{position} ({bad.size} non-finite values as float32)"
        )
    return array
