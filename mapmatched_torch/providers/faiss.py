"""A :class:`~mapmatched_torch.core.protocols.CandidateProvider` over a FAISS index (docs/spec.md 9).

faiss is an optional dependency (the ``[faiss]`` extra, or ``[faiss-gpu]``): this
module imports without it, and :class:`FAISSProvider` fails at construction with
:class:`~mapmatched_torch.core.errors.FAISSNotInstalledError` when it is missing.

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
"""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Tuple

import numpy as np

from ..core.checks import check_choice, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.optional import require_faiss
from .base import QueryEmbedder, SearchProvider, as_query_vector, check_chunk_ids, distance_to_score

__all__ = ["FAISSProvider", "SCORE_MODES"]

#: The accepted values of ``score_mode``.
SCORE_MODES = ("similarity", "distance")


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
    repeated label or a non-finite score is an invalid FAISS result (ValueError).

    Cost: one ``embed_query`` call per query and one ``index.search`` of a (Q, D)
    float32 matrix per :meth:`retrieve_batch` call, plus O(Q * k log k) Python work.

    Args:
        index: a FAISS index (CPU or GPU), or any object with ``ntotal``, ``d`` and
            ``search(x, k) -> (scores, labels)`` where ``x`` is (Q, D) float32 and
            both outputs are (Q, k).
        chunk_ids: the chunk ID of every index position; non-empty, unique strings,
            as many as ``index.ntotal``.
        embed_query: maps a query string to a 1-D vector of dimension ``index.d``
            (shape ``(1, d)`` is accepted too): a numpy array, a list, or a torch
            tensor (detached and moved to the CPU here).
        score_mode: ``"similarity"`` (default) or ``"distance"``, see above.

    Raises:
        FAISSNotInstalledError: faiss is not installed (an ``ImportError`` naming the
            ``[faiss]`` extra).
        ValueError: a bad ``score_mode``, chunk ID list, ``embed_query`` or index.

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
        index: Any,
        chunk_ids: Iterable[str],
        embed_query: QueryEmbedder,
        *,
        score_mode: str = "similarity",
    ) -> None:
        require_faiss("FAISSProvider")
        self._score_mode = _check_score_mode(score_mode)
        self._chunk_ids = check_chunk_ids(chunk_ids)
        if not callable(embed_query):
            raise MapMatchedValueError(f"embed_query must be callable, got {type(embed_query).__name__}")
        self._dimension = _check_index(index, len(self._chunk_ids))
        self._index = index
        self._embed_query = embed_query

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
        # shape: (Q, D) float32, C-contiguous
        matrix = np.stack([self._embed(query, name) for query, name in zip(queries, names)])
        count = self._check_unchanged_size()
        k = min(limit, count)
        scores, labels = _check_result_arrays(*self._index.search(matrix, k), shape=(len(queries), k))
        return [self._candidates(scores[row], labels[row], name) for row, name in enumerate(names)]

    def _embed(self, query: str, name: str) -> np.ndarray:
        return as_query_vector(self._embed_query(query), self._dimension, name)

    def _check_unchanged_size(self) -> int:
        count = len(self._chunk_ids)
        if self._index.ntotal != count:
            raise MapMatchedValueError(
                f"the index now holds {self._index.ntotal} vectors but the provider maps {count} chunk IDs "
                "(was the index modified after the provider was built?)"
            )
        return count

    def _candidates(self, scores: np.ndarray, labels: np.ndarray, name: str) -> Tuple[ScoredCandidate, ...]:
        hits = []  # (score, label)
        seen = set()
        for rank, (label, score) in enumerate(zip(labels.tolist(), scores.tolist())):
            _check_hit(label, score, rank, seen, len(self._chunk_ids), name)
            seen.add(label)
            hits.append((self._to_score(score), label))
        hits.sort(key=lambda hit: (-hit[0], hit[1]))
        return tuple(ScoredCandidate(self._chunk_ids[label], score) for score, label in hits)

    def _to_score(self, value: float) -> float:
        return distance_to_score(value) if self._score_mode == "distance" else value


def _check_score_mode(score_mode: Any) -> str:
    return check_choice("score mode", score_mode, SCORE_MODES)


def _check_index(index: Any, count: int) -> int:
    """Check ``index`` against ``count`` chunk IDs; return its dimension."""
    for attribute in ("ntotal", "d"):
        if not hasattr(index, attribute):
            raise MapMatchedValueError(f"index has no {attribute!r} attribute; pass a FAISS index")
    if not callable(getattr(index, "search", None)):
        raise MapMatchedValueError("index has no search() method; pass a FAISS index")
    if index.ntotal != count:
        raise MapMatchedValueError(f"index holds {index.ntotal} vectors but {count} chunk IDs were given")
    return check_positive_int(index.d, "index dimension (index.d)")


def _check_result_arrays(scores: Any, labels: Any, *, shape: Tuple[int, int]) -> Tuple[np.ndarray, np.ndarray]:
    """``index.search``'s outputs as (Q, k) arrays: float scores, integer labels."""
    scores, labels = np.asarray(scores), np.asarray(labels)
    for what, array in (("scores", scores), ("labels", labels)):
        if array.shape != shape:
            raise MapMatchedValueError(f"invalid FAISS result: {what} have shape {array.shape}, expected {shape}")
    if labels.dtype.kind not in "iu":
        raise MapMatchedValueError(f"invalid FAISS result: labels have dtype {labels.dtype}, expected integers")
    if scores.dtype.kind not in "iuf":
        raise MapMatchedValueError(f"invalid FAISS result: scores have dtype {scores.dtype}, expected real numbers")
    return scores, labels


def _check_hit(label: int, score: float, rank: int, seen: set, count: int, name: str) -> None:
    where = f"for {name} at rank {rank}"
    if label == -1:
        raise MapMatchedValueError(
            f"invalid FAISS result {where}: label -1 (the index returned fewer neighbours than asked; "
            "for IVF indexes raise nprobe)"
        )
    if not 0 <= label < count:
        raise MapMatchedValueError(f"invalid FAISS result {where}: label {label} outside [0, {count})")
    if label in seen:
        raise MapMatchedValueError(f"invalid FAISS result {where}: label {label} repeated")
    if not math.isfinite(score):
        raise MapMatchedValueError(f"invalid FAISS result {where}: score {score} of label {label} is not finite")
