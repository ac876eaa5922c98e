"""A :class:`~mapmatched_torch.core.protocols.CandidateProvider` over a Chroma collection.

chromadb is an optional dependency (the ``[chroma]`` extra): this module imports
without it, and :class:`ChromaProvider` fails at construction with
:class:`~mapmatched_torch.core.errors.MissingDependencyError` (an ``ImportError`` naming
``[chroma]``) when it is missing. Any Chroma collection works: in-process
(``chromadb.EphemeralClient()``, ``chromadb.PersistentClient(path)``) or remote
(``chromadb.HttpClient``).

Chroma returns distances, smaller is nearer, in the collection's space (read from
the collection's configuration -- ``{"hnsw": {"space": ...}}`` or ``{"spann": {...}}``
-- or, for Chroma versions without one, the ``"hnsw:space"`` metadata key; Chroma's
default is ``"l2"``). They become "higher is better" scores here (docs/spec.md 9 does the
same for FAISS):

- ``"l2"``: ``d`` is the squared Euclidean distance; score ``0.0 - d`` (a zero
  distance stays ``+0.0``), the same number FAISS's ``IndexFlatL2`` gives in
  ``score_mode="distance"``.
- ``"cosine"``: ``d = 1 - cos(q, x)``; score ``1.0 - d``, the cosine similarity.
- ``"ip"``: ``d = 1 - <q, x>``; score ``1.0 - d``, the inner product.

Both maps are monotone, so Chroma's order is kept; the recovered similarities equal
the exact ones up to Chroma's float32 rounding.

Decisions where docs/spec.md is silent:

- Ties are sorted by Chroma's rank (its result order); which of several equally close
  records make it into the top ``limit`` is Chroma's choice. Chroma's HNSW index is
  approximate, so a large collection may miss a true neighbour; the tests' small
  collections give the brute-force answer.
- An empty collection gives an empty result (SPEC: at most ``min(limit, n)``) without
  calling ``embed_query``; a session then fails that turn with "trellis turn i must
  contain candidates".
- The collection's space is read once, at construction. Its dimension is read from one
  stored embedding the first time the collection is not empty, then kept; build a new
  provider after recreating the collection.
- Two records with one chunk ID (possible with ``chunk_id_field``) are an error when a
  query returns both; the provider does not scan the whole collection.
- Query embeddings are always computed by ``embed_query`` and passed to Chroma, so the
  collection's own embedding function is never called (nothing is downloaded).
- Only the empty string is an empty query; whitespace is passed to ``embed_query``.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..core.checks import check_choice, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.optional import import_optional
from .base import (
    QueryEmbedder,
    SearchProvider,
    as_array,
    as_query_vector,
    check_name,
    check_result_count,
    chunk_id_from_field,
    distance_to_score,
    missing_chunk_error,
    ranked_candidates,
    stored_vector,
)

__all__ = ["ChromaProvider", "CHROMA_SPACES"]

#: Chroma's space -> the offset of its score: score = offset - distance.
CHROMA_SPACES = {"l2": 0.0, "cosine": 1.0, "ip": 1.0}


class ChromaProvider(SearchProvider):
    """Retrieve scored chunk candidates from a Chroma collection.

    The caller embeds the query (``embed_query``); the provider asks Chroma for the
    nearest records and turns its distances into "higher is better" scores: ``0.0 - d``
    for ``"l2"`` (negated squared distance), ``1.0 - d`` for ``"cosine"`` (the cosine
    similarity) and ``"ip"`` (the inner product).

    A record's chunk ID is its Chroma ID, or the value of the metadata key
    ``chunk_id_field``, which must be a non-empty string.

    Results are sorted by (-score, Chroma's rank) and hold at most ``min(limit, n)``
    candidates for a collection of ``n`` records (fewer with ``where``).

    Cost: one ``embed_query`` call per query and one ``collection.query`` call per
    :meth:`retrieve` or :meth:`retrieve_batch` (all the batch's embeddings at once),
    plus one ``collection.get`` of a single embedding until the dimension is known.

    Args:
        collection: a ``chromadb`` collection (``client.get_collection(name)``); its
            embedding function is never used.
        embed_query: maps a query string to a 1-D vector of the collection's dimension
            (shape ``(1, D)`` is accepted too): a numpy array, a list, or a torch
            tensor (detached and moved to the CPU here).
        chunk_id_field: ``None`` (default): the Chroma ID is the chunk ID; else the
            metadata key holding it.
        where: an optional Chroma metadata filter applied to every query, e.g.
            ``{"tenant": "acme"}``.

    Raises:
        MissingDependencyError: chromadb is not installed (an ``ImportError`` naming
            the ``[chroma]`` extra).
        ValueError: an unsupported space, or a bad collection, ``embed_query`` or
            ``chunk_id_field``.

    Example:
        >>> import chromadb
        >>> from chromadb.config import Settings
        >>> client = chromadb.EphemeralClient(Settings(anonymized_telemetry=False))
        >>> collection = client.create_collection(
        ...     "example-docs", configuration={"hnsw": {"space": "ip"}}, embedding_function=None)
        >>> collection.add(ids=["intro", "install", "usage"], embeddings=[[1, 0, 0], [0, 1, 0], [0, 0, 1]])
        >>> embeddings = {"how do I install it?": [0.25, 0.75, 0.5]}
        >>> provider = ChromaProvider(collection, embeddings.__getitem__)
        >>> provider.retrieve("how do I install it?", limit=2)
        (ScoredCandidate(chunk_id='install', score=0.75), ScoredCandidate(chunk_id='usage', score=0.5))
        >>> provider.space
        'ip'
        >>> client.delete_collection("example-docs")
    """

    def __init__(
        self,
        collection: Any,
        embed_query: QueryEmbedder,
        *,
        chunk_id_field: Optional[str] = None,
        where: Optional[Mapping[str, Any]] = None,
    ) -> None:
        import_optional("chromadb", "chroma", "ChromaProvider")
        if not callable(embed_query):
            raise MapMatchedValueError(f"embed_query must be callable, got {type(embed_query).__name__}")
        check_name(chunk_id_field, "chunk_id_field", optional=True)
        for method in ("query", "get"):
            if not callable(getattr(collection, method, None)):
                raise MapMatchedValueError(f"collection has no {method}() method; pass a chromadb collection")
        self._collection = collection
        self._name = str(getattr(collection, "name", "?"))
        space = check_choice(f"Chroma space of collection {self._name!r}", _read_space(collection), CHROMA_SPACES)
        self._space = space
        self._offset = CHROMA_SPACES[space]
        self._embed_query = embed_query
        self._chunk_id_field = chunk_id_field
        if where is not None and not isinstance(where, Mapping):
            raise MapMatchedValueError(f"where must be a Chroma metadata filter (a dict), got {type(where).__name__}")
        self._where = None if where is None else dict(where)
        self._dimension: Optional[int] = None
        self._stored_dimension()

    @property
    def collection(self) -> Any:
        """The collection searched."""
        return self._collection

    @property
    def space(self) -> str:
        """The collection's distance space: ``"l2"``, ``"cosine"`` or ``"ip"``."""
        return self._space

    @property
    def dimension(self) -> Optional[int]:
        """The collection's embedding dimension (None while it is empty)."""
        return self._stored_dimension()

    @property
    def chunk_id_field(self) -> Optional[str]:
        """The metadata key holding the chunk ID (None: the Chroma ID)."""
        return self._chunk_id_field

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(collection={self._name!r}, space={self._space!r}, "
            f"dimension={self._dimension}, chunk_id_field={self._chunk_id_field!r})"
        )

    def _search(self, queries: List[str], limit: int, names: Tuple[str, ...]) -> List[Tuple[ScoredCandidate, ...]]:
        """All the queries in one ``collection.query`` call (no call while the collection is empty)."""
        if self._stored_dimension() is None:  # an empty collection: nothing to search
            return [() for _ in queries]
        return super()._search(queries, limit, names)

    def _embed(self, query: str, name: str) -> np.ndarray:
        vector = self._embed_query(query)
        dimension = self._stored_dimension()
        if dimension is None:  # an empty collection: any dimension (nothing is searched)
            dimension = int(np.shape(as_array(vector))[-1]) if np.ndim(as_array(vector)) in (1, 2) else 0
        return as_query_vector(vector, dimension, name, self._store_name())

    def _search_rows(self, matrix: np.ndarray, limit: int, names: Tuple[str, ...]) -> List[Tuple[ScoredCandidate, ...]]:
        """One ``collection.query`` of (Q, D) float32 query vectors."""
        count = len(names)
        include = ["distances", "metadatas"] if self._chunk_id_field is not None else ["distances"]
        result = self._collection.query(query_embeddings=matrix, n_results=limit, where=self._where, include=include)
        ids, distances = _rows(result, "ids", count), _rows(result, "distances", count)
        metadatas = _rows(result, "metadatas", count) if self._chunk_id_field is not None else None
        return [
            self._candidates(ids[row], distances[row], None if metadatas is None else metadatas[row], limit, name)
            for row, name in enumerate(names)
        ]

    def _vector_dimension(self) -> Optional[int]:
        return self._stored_dimension()

    def _store_name(self) -> str:
        return f"Chroma collection {self._name!r}"

    def _stored_vectors(self, chunk_ids: List[str]) -> List[np.ndarray]:
        """Each chunk's stored embedding: one ``collection.get`` by ID, or with
        ``chunk_id_field`` by the metadata field (``{field: {"$in": [...]}}``), within
        ``where``.

        Raises:
            MapMatchedValueError: a chunk the collection does not hold, or two records
                with one chunk ID.
        """
        wanted = list(dict.fromkeys(chunk_ids))
        store = self._store_name()
        if self._chunk_id_field is None:
            result = self._collection.get(ids=wanted, where=self._where, include=["embeddings"])
            keys = list(result.get("ids") or [])
        else:
            # the provider's where filter applies here too: only records a search could return are context
            by_field = {self._chunk_id_field: {"$in": wanted}}
            where = by_field if self._where is None else {"$and": [by_field, self._where]}
            result = self._collection.get(where=where, include=["embeddings", "metadatas"])
            records, metadatas = list(result.get("ids") or []), list(result.get("metadatas") or [])
            if len(metadatas) != len(records):
                raise MapMatchedValueError(f"invalid Chroma result: {len(records)} IDs, {len(metadatas)} metadatas")
            keys = [self._chunk_id(record, metadata, rank, "the stored vectors")
                    for rank, (record, metadata) in enumerate(zip(records, metadatas))]
        embeddings = result.get("embeddings")
        if embeddings is None or len(embeddings) != len(keys):
            raise MapMatchedValueError(f"invalid Chroma result: {len(keys)} records but "
                                       f"{'no' if embeddings is None else len(embeddings)} embeddings")
        found: dict = {}
        for key, embedding in zip(keys, embeddings):
            if key in found:
                raise MapMatchedValueError(f"chunk ID {key!r} is held by two records of {store}; chunk IDs must be "
                                           "unique in the store")
            found[key] = embedding
        dimension = self._stored_dimension()
        rows = []
        for chunk_id in chunk_ids:
            if chunk_id not in found:
                raise missing_chunk_error(chunk_id, store)
            rows.append(stored_vector(found[chunk_id], dimension, chunk_id, store))
        return rows

    def _stored_dimension(self) -> Optional[int]:
        """The dimension of a stored embedding (cached once known; None while empty)."""
        if self._dimension is None:
            stored = self._collection.get(limit=1, include=["embeddings"]).get("embeddings")
            if stored is not None and len(stored) > 0:
                self._dimension = check_positive_int(len(stored[0]), f"dimension of Chroma collection {self._name!r}")
        return self._dimension

    def _candidates(
        self, ids: Sequence[Any], distances: Sequence[Any], metadatas: Optional[Sequence[Any]], limit: int, name: str
    ) -> Tuple[ScoredCandidate, ...]:
        if len(ids) != len(distances) or (metadatas is not None and len(metadatas) != len(ids)):
            raise MapMatchedValueError(
                f"invalid Chroma result for {name}: {len(ids)} IDs, {len(distances)} distances"
                + ("" if metadatas is None else f", {len(metadatas)} metadatas")
            )
        check_result_count(len(ids), limit, "Chroma", name, "records")
        hits = []
        for rank, (record_id, distance) in enumerate(zip(ids, distances)):
            chunk_id = record_id if metadatas is None else self._chunk_id(record_id, metadatas[rank], rank, name)
            hits.append((chunk_id, distance_to_score(distance, self._offset)))
        return ranked_candidates(hits, limit, f"Chroma collection {self._name!r}, {name}")

    def _chunk_id(self, record_id: Any, metadata: Any, rank: int, name: str) -> str:
        where = f"Chroma record {record_id!r} of collection {self._name!r} ({name}, rank {rank})"
        return chunk_id_from_field(metadata, self._chunk_id_field, where)


def _read_space(collection: Any) -> str:
    """The collection's distance space: configuration first, then legacy metadata, else "l2".

    The raw ``configuration_json`` is read before the parsed ``configuration``, whose
    parsing warns about collections made with ``embedding_function=None``.
    """
    for attribute in ("configuration_json", "configuration"):
        try:
            configuration = getattr(collection, attribute, None)
        except Exception:  # an older client may fail to parse a newer configuration
            configuration = None
        if isinstance(configuration, Mapping):
            for index in ("hnsw", "spann"):
                settings = configuration.get(index)
                if isinstance(settings, Mapping) and settings.get("space") is not None:
                    return settings["space"]
    metadata = getattr(collection, "metadata", None)
    if isinstance(metadata, Mapping) and metadata.get("hnsw:space") is not None:
        return metadata["hnsw:space"]
    return "l2"


def _rows(result: Mapping[str, Any], key: str, count: int) -> Sequence[Any]:
    """``result[key]``: one row per query, or an invalid-result error."""
    rows = result.get(key) if isinstance(result, Mapping) else None
    if rows is None or len(rows) != count:
        got = "nothing" if rows is None else f"{len(rows)} rows"
        raise MapMatchedValueError(f"invalid Chroma result: {key!r} has {got} for {count} queries")
    return rows
