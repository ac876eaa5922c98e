"""A :class:`~mapmatched_torch.core.protocols.CandidateProvider` over a FAISS index (docs/spec.md 9).

:class:`FAISSProvider` is upstream ``mapmatched``'s ``FAISSProvider`` (same constructor,
``candidates(query, limit)``, same error classes; messages start with upstream's text),
plus ``retrieve`` / ``retrieve_batch``. It never imports faiss: it needs only the index
object it is given (any :class:`FAISSIndex`: ``d``, ``ntotal`` and ``search``), so a
wrapped or fake index works without the ``[faiss]`` extra. numpy is loaded when a search
runs; if it cannot be, the search raises
:class:`~mapmatched_torch.core.errors.FAISSDependencyUnavailableError` (an
``ImportError`` naming the ``[faiss]`` extra) before ``index.search`` is called.

Decisions where docs/spec.md is silent:

- Ties are sorted by index position among the hits FAISS returns; which of several
  equally scored vectors make it into the top ``limit`` is FAISS's choice.
- An empty ``chunk_ids`` (an empty index) is rejected: it could never return a
  candidate.
- The index size is checked again on every search, so an index that grew or shrank
  after construction fails loudly instead of mapping labels to the wrong chunk IDs.
- Only the empty string is an empty query; whitespace is passed to ``embed_query``.
- Vectors are searched as float32 (what FAISS takes); finiteness is checked after that
  conversion, so a float64 value beyond float32's range is reported as infinite.
- ``index.metric_type`` is not inspected (wrapped and custom indexes work too): pick
  the ``score_mode`` that matches the index's metric.
- ``search``'s two results are read as upstream reads them, row by row with
  ``result[row].tolist()``, so they need not be numpy arrays. A query may get fewer
  hits than asked for (not more); a bad hit is a
  :class:`~mapmatched_torch.core.errors.MapMatchedBackendError` (a ``ValueError`` and,
  as upstream raises, a ``RuntimeError``), a label that is not an integer a
  :class:`~mapmatched_torch.core.errors.MapMatchedTypeError` (ValueError and TypeError).
- ``score_mode="distance"`` scores are ``0.0 - d``, so a zero distance scores ``+0.0``
  (upstream's ``-d`` gives ``-0.0``).
"""

from __future__ import annotations

import importlib
import math
import numbers
from types import ModuleType
from typing import Any, Iterable, List, Literal, Optional, Protocol, Tuple

from ..core.checks import check_choice
from ..core.errors import FAISSDependencyUnavailableError, MapMatchedBackendError, MapMatchedTypeError, MapMatchedValueError
from ..core.models import ScoredCandidate
from .base import (
    QueryEmbedder,
    SearchProvider,
    as_query_vector,
    check_chunk_ids,
    distance_to_score,
    missing_chunk_error,
    stored_vector,
)

__all__ = [
    "FAISSProvider",
    "FAISSIndex",
    "FAISSScoreMode",
    "FAISSDependencyUnavailableError",
    "QueryEmbedder",
    "SCORE_MODES",
]

#: The accepted values of ``score_mode``.
SCORE_MODES = ("similarity", "distance")

#: The type of ``score_mode`` (upstream ``mapmatched``'s alias): one of :data:`SCORE_MODES`.
FAISSScoreMode = Literal["similarity", "distance"]


class SearchMatrix(Protocol):
    """What :meth:`FAISSIndex.search` returns twice (scores, labels): rows by position,
    each row's values by ``tolist()`` -- a numpy array, or anything that reads the same."""

    def __getitem__(self, index: int) -> "SearchMatrix":
        ...

    def tolist(self) -> List[object]:
        ...


class FAISSIndex(Protocol):
    """The index :class:`FAISSProvider` searches (upstream ``mapmatched``'s protocol):
    any FAISS index, CPU or GPU, or an object that answers like one.

    Attributes:
        d: the vector dimension D (an int > 0).
        ntotal: how many vectors it holds (an int; label i is ``chunk_ids[i]``).
    """

    d: int
    ntotal: int

    def search(self, query_vectors: object, limit: int) -> Tuple[SearchMatrix, SearchMatrix]:
        """``query_vectors``: a (Q, D) float32 C-contiguous numpy array; returns (scores,
        labels), each (Q, k) with k <= ``limit``, rows best first."""
        ...


def _load_numpy() -> ModuleType:
    """numpy, imported when a search runs; a missing (or broken) numpy is
    :class:`FAISSDependencyUnavailableError` naming the ``[faiss]`` extra."""
    try:
        return importlib.import_module("numpy")
    except ImportError as error:
        raise FAISSDependencyUnavailableError("FAISSProvider searches", package="numpy") from error


class FAISSProvider(SearchProvider):
    """Retrieve scored chunk candidates from a FAISS index.

    Label ``i`` of the index is the vector of ``chunk_ids[i]``. The caller embeds the
    query (``embed_query``); the provider searches, maps labels to chunk IDs and turns
    FAISS's numbers into "higher is better" scores:

    - ``score_mode="similarity"`` (default) keeps scores as FAISS returns them: right
      for inner-product and normalized-cosine indexes (``IndexFlatIP`` and friends).
    - ``score_mode="distance"`` negates them: right for L2 indexes
      (``IndexFlatL2`` and friends), whose smaller distances mean nearer.

    Results are sorted by (-score, index position) and hold at most
    ``min(limit, len(chunk_ids))`` candidates. A label of -1 (FAISS found too few
    neighbours, e.g. an IVF index with a small ``nprobe``), a label out of range, a
    repeated label or a non-finite score is an invalid FAISS result
    (:class:`~mapmatched_torch.core.errors.MapMatchedBackendError`: a ValueError and a
    RuntimeError).

    :meth:`candidates` (upstream's method) and :meth:`retrieve` are one method.

    Cost: one ``embed_query`` call per query and one ``index.search`` of a (Q, D)
    float32 matrix per :meth:`retrieve_batch` call, plus O(Q * k log k) Python work.

    Args:
        index: a FAISS index (CPU or GPU), or any :class:`FAISSIndex`: an object with
            int ``ntotal`` and ``d`` and ``search(x, k) -> (scores, labels)`` where
            ``x`` is (Q, D) float32 and both outputs are (Q, k) (numpy arrays, or
            anything whose rows read with ``[row].tolist()``).
        chunk_ids: the chunk ID of every index position; non-empty, unique strings,
            as many as ``index.ntotal``.
        embed_query: maps a query string to a 1-D vector of dimension ``index.d``
            (shape ``(1, d)`` is accepted too): a numpy array, a list, or a torch
            tensor (detached and moved to the CPU here).
        score_mode: ``"similarity"`` (default) or ``"distance"``, see above.

    Raises:
        ValueError: a bad chunk ID list, ``score_mode`` or index size; a
            non-callable ``embed_query`` or an ``index.d`` / ``index.ntotal`` that is
            not an int is a :class:`~mapmatched_torch.core.errors.MapMatchedTypeError`
            (a ValueError and a TypeError).

    Example:
        >>> import faiss
        >>> import numpy as np
        >>> from mapmatched_torch.providers.faiss import FAISSProvider
        >>> chunk_vectors = np.eye(3, dtype=np.float32)
        >>> embeddings = {"how do I install it?": [0.25, 0.75, 0.5]}
        >>> index = faiss.IndexFlatIP(3)
        >>> index.add(chunk_vectors)
        >>> provider = FAISSProvider(index, ["intro", "install", "usage"], embeddings.__getitem__)
        >>> provider.retrieve("how do I install it?", limit=2)
        (ScoredCandidate(chunk_id='install', score=0.75), ScoredCandidate(chunk_id='usage', score=0.5))
        >>> l2_index = faiss.IndexFlatL2(3)
        >>> l2_index.add(chunk_vectors)
        >>> l2 = FAISSProvider(l2_index, provider.chunk_ids, embeddings.__getitem__, score_mode="distance")
        >>> l2.retrieve("how do I install it?", limit=1)
        (ScoredCandidate(chunk_id='install', score=-0.375),)
    """

    def __init__(
        self,
        index: FAISSIndex,
        chunk_ids: Iterable[str],
        embed_query: QueryEmbedder,
        *,
        score_mode: FAISSScoreMode = "similarity",
    ) -> None:
        self._chunk_ids = check_chunk_ids(chunk_ids)
        self._score_mode = check_choice("FAISS score mode", score_mode, SCORE_MODES)
        if not callable(embed_query):
            raise MapMatchedTypeError(f"embed_query must be callable, got {type(embed_query).__name__}")
        self._dimension = _check_index(index, len(self._chunk_ids))
        self._index = index
        self._embed_query = embed_query
        self._labels: Optional[dict] = None  # chunk ID -> label, built by chunk_embeddings

    @property
    def chunk_ids(self) -> Tuple[str, ...]:
        """The chunk ID of every index position."""
        return self._chunk_ids

    @property
    def score_mode(self) -> str:
        """``"similarity"`` (scores kept) or ``"distance"`` (scores negated)."""
        return self._score_mode

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={len(self._chunk_ids)}, dimension={self._dimension}, "
            f"score_mode={self._score_mode!r})"
        )

    def _search(self, queries: List[str], limit: int, names: Tuple[str, ...]) -> List[Tuple[ScoredCandidate, ...]]:
        """All the queries in one ``index.search`` of a (Q, D) float32 matrix."""
        count = self._check_unchanged_size()
        vectors = [self._embed(query, name) for query, name in zip(queries, names)]
        numpy = _load_numpy()  # after the query checks, before the search (upstream's order)
        # shape: (Q, D) float32, C-contiguous
        return self._search_matrix(numpy.stack(vectors), limit, names, count)

    def _search_rows(self, matrix: Any, limit: int, names: Tuple[str, ...]) -> List[Tuple[ScoredCandidate, ...]]:
        """One ``index.search`` of checked query vectors (:meth:`search_vectors`)."""
        return self._search_matrix(matrix, limit, names, self._check_unchanged_size())

    def _vector_dimension(self) -> int:
        return self._dimension

    def _stored_vectors(self, chunk_ids: List[str]) -> List[Any]:
        """``index.reconstruct(label)`` of each chunk (flat indexes; an IVF index needs
        ``index.make_direct_map()`` first).

        Raises:
            MapMatchedValueError: a chunk ID the provider does not map, or an index
                that cannot reconstruct its vectors (the message says what to do).
        """
        if self._labels is None:
            self._labels = {chunk_id: label for label, chunk_id in enumerate(self._chunk_ids)}
        reconstruct = getattr(self._index, "reconstruct", None)
        if not callable(reconstruct):
            raise MapMatchedValueError(
                "this FAISS index has no reconstruct(label): query mixing needs the chunks' stored vectors "
                "(use a flat index, or call make_direct_map() on an IVF index)"
            )
        rows = []
        for chunk_id in chunk_ids:
            label = self._labels.get(chunk_id)
            if label is None:
                raise missing_chunk_error(chunk_id, "this FAISSProvider's chunk IDs")
            try:
                vector = reconstruct(label)
            except RuntimeError as error:
                raise MapMatchedValueError(
                    f"FAISS could not reconstruct the vector of chunk {chunk_id!r} (label {label}): {error} "
                    "(call make_direct_map() on an IVF index)"
                ) from error
            rows.append(stored_vector(vector, self._dimension, chunk_id, "the index"))
        return rows

    def _search_matrix(self, matrix: Any, limit: int, names: Tuple[str, ...], count: int) -> List[Tuple[ScoredCandidate, ...]]:
        """One ``index.search`` of a checked (Q, D) float32 matrix."""
        k = min(limit, count)
        scores, labels = self._index.search(matrix, k)
        return [
            self._candidates(_result_row(scores, row, "scores", name), _result_row(labels, row, "labels", name), k, name)
            for row, name in enumerate(names)
        ]

    def _embed(self, query: str, name: str) -> Any:
        return as_query_vector(self._embed_query(query), self._dimension, name)

    def _check_unchanged_size(self) -> int:
        count = len(self._chunk_ids)
        size = _integer_attribute(self._index, "ntotal", "ntotal")
        if size != count:
            raise MapMatchedBackendError(
                f"FAISS index size changed after provider construction: the index now holds {size} vectors but "
                f"the provider maps {count} chunk IDs (build a new provider after modifying the index)"
            )
        return count

    def _candidates(self, scores: List[object], labels: List[object], k: int, name: str) -> Tuple[ScoredCandidate, ...]:
        if len(scores) != len(labels):
            raise MapMatchedBackendError(
                f"FAISS returned different score and index counts: {len(scores)} scores and {len(labels)} labels for {name}"
            )
        if len(labels) > k:
            raise MapMatchedBackendError(f"FAISS returned more results than asked: {len(labels)} hits for {name}, limit {k}")
        hits = []  # (score, label)
        seen = set()
        for rank, (label, score) in enumerate(zip(labels, scores)):
            value = _check_hit(label, score, rank, seen, len(self._chunk_ids), name)
            seen.add(label)
            hits.append((self._to_score(value), label))
        hits.sort(key=lambda hit: (-hit[0], hit[1]))
        return tuple(ScoredCandidate(self._chunk_ids[label], score) for score, label in hits)

    def _to_score(self, value: float) -> float:
        return distance_to_score(value) if self._score_mode == "distance" else value


def _integer_attribute(index: Any, attribute: str, what: str) -> int:
    """``index.<attribute>`` as an int (bools rejected), named ``what`` in messages."""
    if not hasattr(index, attribute):
        raise MapMatchedValueError(f"index has no {attribute!r} attribute; pass a FAISS index")
    value = getattr(index, attribute)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MapMatchedTypeError(f"FAISS index {what} must be an integer, got {value!r} (index.{attribute})")
    return int(value)


def _check_index(index: Any, count: int) -> int:
    """Check ``index`` against ``count`` chunk IDs; return its dimension."""
    dimension = _integer_attribute(index, "d", "dimension")
    if dimension <= 0:
        raise MapMatchedValueError(f"FAISS index dimension must be greater than zero, got {dimension} (index.d)")
    size = _integer_attribute(index, "ntotal", "ntotal")
    if size != count:
        raise MapMatchedValueError(f"FAISS index contains {size} vectors but received {count} chunk IDs")
    if not callable(getattr(index, "search", None)):
        raise MapMatchedValueError("index has no search() method; pass a FAISS index")
    return dimension


def _result_row(matrix: Any, row: int, what: str, name: str) -> List[object]:
    """Row ``row`` of one of ``index.search``'s results, read as upstream reads it:
    ``matrix[row].tolist()``, which must give a list."""
    try:
        values = matrix[row].tolist()
    except (AttributeError, IndexError, KeyError, TypeError) as error:
        raise MapMatchedBackendError(
            f"FAISS returned a malformed result: cannot read row {row} of its {what} for {name} "
            f"as result[{row}].tolist() ({type(error).__name__}: {error})"
        ) from error
    if not isinstance(values, list):
        raise MapMatchedBackendError(
            f"FAISS returned a malformed result: row {row} of its {what} for {name} is {values!r}, not a list "
            "(search must return two (Q, k) matrices)"
        )
    return values


def _check_hit(label: Any, score: Any, rank: int, seen: set, count: int, name: str) -> float:
    """One hit of a query's result row; returns its score as a float. Messages start
    with upstream's text, then say which query, rank and label."""
    where = f"for {name} at rank {rank}"
    if isinstance(label, bool) or not isinstance(label, numbers.Integral):
        raise MapMatchedTypeError(f"FAISS index result index must be an integer: got {label!r} {where}")
    if label == -1:
        raise MapMatchedBackendError(
            f"FAISS returned invalid result index -1 {where} (the index returned fewer neighbours than asked; "
            "for IVF indexes raise nprobe)"
        )
    if not 0 <= label < count:
        raise MapMatchedBackendError(f"FAISS returned invalid result index {label} {where}: labels are in [0, {count})")
    if label in seen:
        raise MapMatchedBackendError(f"FAISS returned duplicate result index {label} {where}")
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        raise MapMatchedBackendError(f"FAISS returned a non-numeric score {where}: {score!r} for label {label}")
    value = float(score)
    if not math.isfinite(value):
        raise MapMatchedBackendError(f"FAISS returned a non-finite score {where}: {value} for label {label}")
    return value
