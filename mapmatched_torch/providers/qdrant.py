"""A :class:`~mapmatched_torch.core.protocols.CandidateProvider` over a Qdrant collection.

qdrant-client is an optional dependency (the ``[qdrant]`` extra): this module imports
without it, and :class:`QdrantProvider` fails at construction with
:class:`~mapmatched_torch.core.errors.MissingDependencyError` (an ``ImportError`` naming
``[qdrant]``) when it is missing. Any ``QdrantClient`` works: a server, Qdrant Cloud,
or local mode (``QdrantClient(":memory:")`` or ``QdrantClient(path=...)``), which
needs no server.

Scores are "higher is better" (docs/spec.md 9 does the same for FAISS). What Qdrant returns
as ``score`` depends on the collection's distance, read from the collection when the
provider is built:

- ``Cosine``: the cosine similarity, kept as is.
- ``Dot``: the inner product, kept as is.
- ``Euclid``: the Euclidean (not squared) distance, negated: ``0.0 - d``.
- ``Manhattan``: the L1 distance, negated: ``0.0 - d``.

``0.0 - d`` (not ``-d``) keeps a zero distance at ``+0.0``.

Decisions where docs/spec.md is silent:

- Ties are sorted by Qdrant's rank (its result order); which of several equally scored
  points make it into the top ``limit`` is Qdrant's choice. Qdrant's HNSW search is
  approximate on a server; pass ``search_params=models.SearchParams(exact=True)`` for
  exact results. Local mode always searches exactly.
- An empty collection gives an empty result (SPEC: at most ``min(limit, n)``); a
  session then fails that turn with "trellis turn i must contain candidates".
- The collection's distance, dimension and vector name are read once, at construction;
  build a new provider after recreating the collection.
- Two points with one chunk ID are an error when a query returns both (the mapping to
  graph nodes would be ambiguous); the provider does not scan the whole collection.
- Only the empty string is an empty query; whitespace is passed to ``embed_query``.
- Query vectors are sent as float32 values (Qdrant stores float32), checked for
  dimension and finiteness first.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..core.checks import check_choice, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.optional import import_optional
from .base import (
    QueryEmbedder,
    SearchProvider,
    as_query_vector,
    check_name,
    check_result_count,
    chunk_id_from_field,
    distance_to_score,
    missing_chunk_error,
    ranked_candidates,
    stored_vector,
)

__all__ = ["QdrantProvider", "QDRANT_DISTANCES"]

#: Qdrant's distance name -> whether its score is a distance (negated here).
QDRANT_DISTANCES = {"Cosine": False, "Dot": False, "Euclid": True, "Manhattan": True}


class QdrantProvider(SearchProvider):
    """Retrieve scored chunk candidates from a Qdrant collection.

    The caller embeds the query (``embed_query``); the provider searches the
    collection's dense vector with Qdrant's query API and turns the points into
    :class:`~mapmatched_torch.core.models.ScoredCandidate` objects whose scores are "higher
    is better": similarities (``Cosine``, ``Dot``) are kept, distances (``Euclid``,
    ``Manhattan``) become ``0.0 - d``.

    A point's chunk ID is ``str(point.id)`` (an unsigned integer as decimal digits, a
    UUID in Qdrant's lower-case hyphenated form), or the value of the top-level payload
    key ``chunk_id_field``, which must be a non-empty string.

    Results are sorted by (-score, Qdrant's rank) and hold at most ``min(limit, n)``
    candidates for a collection of ``n`` points (fewer with ``query_filter``).

    Cost: one ``embed_query`` call per query; one ``query_points`` request per
    :meth:`retrieve`, one ``query_batch_points`` request per :meth:`retrieve_batch`.

    Args:
        client: a ``qdrant_client.QdrantClient``.
        collection_name: an existing collection with dense vectors.
        embed_query: maps a query string to a 1-D vector of the collection's dimension
            (shape ``(1, D)`` is accepted too): a numpy array, a list, or a torch
            tensor (detached and moved to the CPU here).
        chunk_id_field: ``None`` (default): the point ID is the chunk ID; else the
            payload key holding it.
        using: the named vector to search; may be omitted when the collection has one
            vector (named or not). Required when it has several.
        query_filter: an optional ``qdrant_client.models.Filter`` applied to every
            query (e.g. one tenant's points).
        search_params: optional ``qdrant_client.models.SearchParams`` passed to every
            query (e.g. ``exact=True``, ``hnsw_ef``).

    Raises:
        MissingDependencyError: qdrant-client is not installed (an ``ImportError``
            naming the ``[qdrant]`` extra).
        ValueError: a missing collection, a collection without a usable dense vector
            (multivectors and sparse vectors are not supported), an unknown or
            ambiguous ``using``, or a bad ``embed_query`` / ``chunk_id_field``.

    Example:
        >>> from qdrant_client import QdrantClient, models
        >>> client = QdrantClient(":memory:")
        >>> client.create_collection(
        ...     "docs", vectors_config=models.VectorParams(size=3, distance=models.Distance.EUCLID))
        True
        >>> client.upsert("docs", [
        ...     models.PointStruct(id=i, vector=v, payload={"chunk": name})
        ...     for i, (name, v) in enumerate([("intro", [1, 0, 0]), ("install", [0, 1, 0]), ("usage", [0, 0, 1])])
        ... ]).status.value
        'completed'
        >>> embeddings = {"how do I install it?": [0.0, 1.0, 0.0]}
        >>> provider = QdrantProvider(client, "docs", embeddings.__getitem__, chunk_id_field="chunk")
        >>> provider.retrieve("how do I install it?", limit=2)[0]
        ScoredCandidate(chunk_id='install', score=0.0)
        >>> provider.distance
        'Euclid'
    """

    def __init__(
        self,
        client: Any,
        collection_name: str,
        embed_query: QueryEmbedder,
        *,
        chunk_id_field: Optional[str] = None,
        using: Optional[str] = None,
        query_filter: Any = None,
        search_params: Any = None,
    ) -> None:
        import_optional("qdrant_client", "qdrant", "QdrantProvider")
        from qdrant_client import models

        self._models = models
        if not callable(embed_query):
            raise MapMatchedValueError(f"embed_query must be callable, got {type(embed_query).__name__}")
        check_name(collection_name, "collection_name")
        check_name(chunk_id_field, "chunk_id_field", optional=True)
        check_name(using, "using", optional=True)
        for method in ("collection_exists", "get_collection", "query_points", "query_batch_points"):
            if not callable(getattr(client, method, None)):
                raise MapMatchedValueError(f"client has no {method}() method; pass a qdrant_client.QdrantClient")
        if not client.collection_exists(collection_name):
            raise MapMatchedValueError(f"Qdrant collection {collection_name!r} does not exist")
        vectors = client.get_collection(collection_name).config.params.vectors
        self._using, params = _pick_vector(vectors, using, collection_name)
        if getattr(params, "multivector_config", None) is not None:
            raise MapMatchedValueError(
                f"{_vector_label(self._using, collection_name)} is a multivector; QdrantProvider searches "
                "single dense vectors only"
            )
        distance = check_choice(
            f"Qdrant distance of {_vector_label(self._using, collection_name)}",
            getattr(params.distance, "value", params.distance),
            QDRANT_DISTANCES,
        )
        self._distance = distance
        self._negate = QDRANT_DISTANCES[distance]
        self._dimension = check_positive_int(params.size, f"dimension of {_vector_label(self._using, collection_name)}")
        self._client = client
        self._collection_name = collection_name
        self._embed_query = embed_query
        self._chunk_id_field = chunk_id_field
        self._query_filter = query_filter
        self._search_params = search_params

    @property
    def collection_name(self) -> str:
        """The collection searched."""
        return self._collection_name

    @property
    def distance(self) -> str:
        """The collection's distance: ``"Cosine"``, ``"Dot"``, ``"Euclid"`` or ``"Manhattan"``."""
        return self._distance

    @property
    def dimension(self) -> int:
        """The dimension of the searched vector."""
        return self._dimension

    @property
    def using(self) -> Optional[str]:
        """The named vector searched (None: the collection's unnamed vector)."""
        return self._using

    @property
    def chunk_id_field(self) -> Optional[str]:
        """The payload key holding the chunk ID (None: the point ID)."""
        return self._chunk_id_field

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(collection_name={self._collection_name!r}, using={self._using!r}, "
            f"distance={self._distance!r}, dimension={self._dimension}, chunk_id_field={self._chunk_id_field!r})"
        )

    def _search_one(self, query: str, limit: int, name: str) -> Tuple[ScoredCandidate, ...]:
        """One query in one ``query_points`` request."""
        response = self._client.query_points(
            self._collection_name,
            query=self._embed(query, name).tolist(),
            using=self._using,
            query_filter=self._query_filter,
            search_params=self._search_params,
            limit=limit,
            with_payload=self._with_payload(),
            with_vectors=False,
        )
        return self._candidates(response.points, limit, name)

    def _search_rows(self, matrix: np.ndarray, limit: int, names: Tuple[str, ...]) -> List[Tuple[ScoredCandidate, ...]]:
        """All the (Q, D) query vectors in one ``query_batch_points`` request."""
        requests = [
            self._models.QueryRequest(
                query=row.tolist(),
                using=self._using,
                filter=self._query_filter,
                params=self._search_params,
                limit=limit,
                with_payload=self._with_payload(),
                with_vector=False,
            )
            for row in matrix
        ]
        responses = self._client.query_batch_points(self._collection_name, requests=requests)
        if len(responses) != len(names):
            raise MapMatchedValueError(
                f"invalid Qdrant result: {len(responses)} responses for {len(names)} queries"
            )
        return [self._candidates(response.points, limit, name) for response, name in zip(responses, names)]

    def _vector_dimension(self) -> int:
        return self._dimension

    def _store_name(self) -> str:
        return _vector_label(self._using, self._collection_name)

    def _stored_vectors(self, chunk_ids: List[str]) -> List[np.ndarray]:
        """The searched vector of each chunk's point: one ``scroll`` by point ID, or with
        ``chunk_id_field`` by the payload field (``MatchAny``), within ``query_filter``.

        Raises:
            MapMatchedValueError: a chunk without a point, a chunk ID that is no Qdrant
                point ID (an unsigned integer or a UUID), or two points with one chunk ID.
        """
        wanted = list(dict.fromkeys(chunk_ids))
        vectors = [self._using] if self._using is not None else True
        store = self._store_name()
        models = self._models
        if self._chunk_id_field is None:
            condition = models.HasIdCondition(has_id=[_point_id(c) for c in wanted])
        else:
            condition = models.FieldCondition(key=self._chunk_id_field, match=models.MatchAny(any=wanted))
        # the provider's query_filter applies here too: only points a search could return are context
        conditions = [condition] if self._query_filter is None else [condition, self._query_filter]
        try:
            points, _ = self._client.scroll(self._collection_name, scroll_filter=models.Filter(must=conditions),
                                            limit=len(wanted) + 1, with_payload=self._with_payload(),
                                            with_vectors=vectors)
        except MapMatchedValueError:
            raise
        except Exception as error:  # e.g. a malformed point ID the client or server refuses
            raise MapMatchedValueError(f"Qdrant could not look up the points of chunks {wanted!r}: {error}") from error
        if self._chunk_id_field is None:
            found = {str(point.id): point for point in points}
        else:
            found = {}
            for rank, point in enumerate(points):
                chunk_id = self._chunk_id(point, rank, "the stored vectors")
                if chunk_id in found:
                    raise MapMatchedValueError(
                        f"chunk ID {chunk_id!r} is held by two points of {store} ({found[chunk_id].id!r} and "
                        f"{point.id!r}); chunk IDs must be unique in the store")
                found[chunk_id] = point
        rows = []
        for chunk_id in chunk_ids:
            point = found.get(chunk_id)
            if point is None:
                raise missing_chunk_error(chunk_id, store)
            vector = point.vector[self._using] if isinstance(point.vector, dict) else point.vector
            rows.append(stored_vector(vector, self._dimension, chunk_id, store))
        return rows

    def _embed(self, query: str, name: str) -> np.ndarray:
        return as_query_vector(
            self._embed_query(query), self._dimension, name, store=_vector_label(self._using, self._collection_name)
        )

    def _with_payload(self) -> Any:
        return [self._chunk_id_field] if self._chunk_id_field is not None else False

    def _candidates(self, points: Sequence[Any], limit: int, name: str) -> Tuple[ScoredCandidate, ...]:
        source = f"Qdrant collection {self._collection_name!r}, {name}"
        check_result_count(len(points), limit, "Qdrant", name, "points")
        return ranked_candidates(
            ((self._chunk_id(point, rank, name), self._to_score(point.score)) for rank, point in enumerate(points)),
            limit,
            source,
        )

    def _chunk_id(self, point: Any, rank: int, name: str) -> Any:
        if self._chunk_id_field is None:
            return str(point.id)
        where = f"Qdrant point {point.id!r} of collection {self._collection_name!r} ({name}, rank {rank})"
        return chunk_id_from_field(point.payload or {}, self._chunk_id_field, where, "payload")

    def _to_score(self, value: Any) -> Any:
        return distance_to_score(value) if self._negate else value


def _point_id(chunk_id: str) -> Any:
    """The Qdrant point ID whose ``str`` is ``chunk_id``: an unsigned integer, else the
    string itself (a UUID; Qdrant refuses anything else)."""
    return int(chunk_id) if chunk_id.isdigit() and chunk_id.isascii() else chunk_id


def _vector_label(using: Optional[str], collection_name: str) -> str:
    if using is None:
        return f"Qdrant collection {collection_name!r}"
    return f"vector {using!r} of Qdrant collection {collection_name!r}"


def _pick_vector(vectors: Any, using: Optional[str], collection_name: str) -> Tuple[Optional[str], Any]:
    """The vector name to search (None: the unnamed vector) and its ``VectorParams``."""
    if isinstance(vectors, dict):
        names = ", ".join(map(repr, vectors))
        if not vectors:
            raise MapMatchedValueError(f"Qdrant collection {collection_name!r} has no dense vectors")
        if using is None:
            if len(vectors) > 1:
                raise MapMatchedValueError(
                    f"Qdrant collection {collection_name!r} has several named vectors ({names}); pass using= to pick one"
                )
            using = next(iter(vectors))
        if using not in vectors:
            raise MapMatchedValueError(
                f"Qdrant collection {collection_name!r} has no dense vector named {using!r} (it has {names})"
            )
        return using, vectors[using]
    if vectors is None:
        raise MapMatchedValueError(f"Qdrant collection {collection_name!r} has no dense vectors")
    if using is not None:
        raise MapMatchedValueError(
            f"Qdrant collection {collection_name!r} has one unnamed vector; leave using=None (got {using!r})"
        )
    return None, vectors
