"""Exact top-k over an embedding matrix on a torch device.

:class:`DenseProvider` is the provider for serving next to a GPU embedder: the chunk
embeddings live on the device, queries arrive as embeddings (the caller embeds), and a
whole batch of queries is scored by one matrix product.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from ..core.checks import check_choice, check_positive_int
from ..core.embeddings import norm_overflow_error, zero_vector_error
from ..core.errors import MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.protocols import CandidatesMethod
from .base import check_batch, check_chunk_ids, dimension_mismatch_error

__all__ = ["DenseProvider", "DENSE_METRICS", "exact_top_k"]

#: The accepted values of ``metric``.
DENSE_METRICS = ("inner_product", "cosine")


def exact_top_k(scores: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Deterministic top-k: sorted by (-score, position), ties at the cut to the lower position.

    Args:
        scores: (Q, N) float scores, higher is better.
        k: 1 <= k <= N.

    Returns:
        ``(values, indices)``, both (Q, k), on the scores' device. ``torch.topk`` alone
        leaves the order among equal scores unspecified; here the k-th value is found
        with topk, every strictly better entry is kept, and the remaining slots go to the
        tied entries of lowest position. Cost: O(Q N) beyond the topk.
    """
    # shape: (Q, 1)
    kth = torch.topk(scores, k, dim=1).values[:, -1:]
    better = scores > kth
    tied = scores == kth
    # shape: (Q, 1) slots left for tied entries
    room = k - better.sum(dim=1, keepdim=True)
    keep = better | (tied & (torch.cumsum(tied.to(torch.long), dim=1) <= room))
    # shape: (Q, k) positions in increasing order (exactly k per row)
    positions = torch.sort(torch.where(keep, torch.arange(scores.shape[1], device=scores.device), scores.shape[1]), dim=1).values[:, :k]
    values = scores.gather(1, positions)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    return values.gather(1, order), positions.gather(1, order)


def _check_metric(metric: Any) -> str:
    return check_choice("metric", metric, DENSE_METRICS)


class DenseProvider(CandidatesMethod):
    """Candidates by exact inner-product or cosine top-k over an embedding matrix.

    Args:
        embeddings: (N, D) chunk embeddings (tensor, array or nested lists); kept on
            ``device`` in ``dtype``. Rows must be finite; with ``metric="cosine"`` they
            are L2-normalized once here and must be non-zero.
        chunk_ids: N non-empty, unique chunk IDs (row order).
        embed_query: optional ``str -> (D,) vector``; needed by :meth:`retrieve` /
            :meth:`retrieve_batch`, not by :meth:`search`, which takes query embeddings.
        metric: ``"inner_product"`` (default) or ``"cosine"``.
        device: where the matrix lives (default: the embeddings' device, else CPU).
        dtype: float dtype of the matrix (default float32).
        query_block: queries are scored in zero-padded blocks of this many rows
            (default 16), so a query's scores do not depend on how many other queries
            share its batch (a lone query would otherwise take the matrix-vector
            kernel, whose rounding differs from the matrix-matrix one). Larger blocks
            amortize better on big batches; a lone query pays for one block.

    Results are sorted by (-score, row position) and hold ``min(limit, N)`` candidates.

    Example:
        >>> import torch
        >>> provider = DenseProvider(torch.eye(3), ["a", "b", "c"], metric="cosine")
        >>> provider.search(torch.tensor([[0.0, 2.0, 1.0]]), limit=2)[0]
        (ScoredCandidate(chunk_id='b', score=0.894427...), ScoredCandidate(chunk_id='c', score=0.447213...))
    """

    def __init__(
        self,
        embeddings: Any,
        chunk_ids: Iterable[str],
        embed_query: Optional[Callable[[str], Any]] = None,
        *,
        metric: str = "inner_product",
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        query_block: int = 16,
    ) -> None:
        self._metric = _check_metric(metric)
        self._query_block = check_positive_int(query_block, "query_block")
        self._chunk_ids = check_chunk_ids(chunk_ids)
        if embed_query is not None and not callable(embed_query):
            raise MapMatchedValueError(f"embed_query must be callable, got {type(embed_query).__name__}")
        self._embed_query = embed_query
        matrix = torch.as_tensor(embeddings, dtype=dtype, device=device)
        if matrix.dim() != 2 or matrix.shape[1] == 0:
            raise MapMatchedValueError(f"embeddings must be a (N, D) matrix with D > 0, got shape {tuple(matrix.shape)}")
        if matrix.shape[0] != len(self._chunk_ids):
            raise MapMatchedValueError(
                f"embeddings has {matrix.shape[0]} rows but {len(self._chunk_ids)} chunk IDs were given"
            )
        _check_finite_rows(matrix, "embeddings row")
        self._matrix = _normalize(matrix, "embeddings row") if self._metric == "cosine" else matrix
        self._rows: Optional[dict] = None  # chunk ID -> row, built by chunk_embeddings

    @property
    def chunk_ids(self) -> Tuple[str, ...]:
        return self._chunk_ids

    @property
    def metric(self) -> str:
        return self._metric

    @property
    def device(self) -> torch.device:
        return self._matrix.device

    @property
    def dimension(self) -> int:
        return int(self._matrix.shape[1])

    def __repr__(self) -> str:
        return f"DenseProvider(size={len(self._chunk_ids)}, dimension={self.dimension}, metric={self._metric!r}, device={self.device})"

    def search_tensors(self, queries: torch.Tensor, limit: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Top-k on the device, without leaving tensor land.

        Args:
            queries: (Q, D) query embeddings (moved to the provider's device and dtype).
            limit: positive int; k = min(limit, N).

        Returns:
            ``(scores, indices)``: (Q, k) each, sorted by (-score, row position).
        """
        limit = check_positive_int(limit, "limit")
        queries = torch.as_tensor(queries).to(device=self._matrix.device, dtype=self._matrix.dtype)
        if queries.dim() == 1:
            queries = queries.unsqueeze(0)
        if queries.dim() != 2 or queries.shape[1] != self.dimension:
            raise MapMatchedValueError(
                f"query embeddings must have shape (Q, {self.dimension}), got {tuple(queries.shape)}"
            )
        _check_finite_rows(queries, "query")
        if self._metric == "cosine":
            queries = _normalize(queries, "query")
        # shape: (Q, N)
        scores = self._scores(queries)
        return exact_top_k(scores, min(limit, len(self._chunk_ids)))

    def _scores(self, queries: torch.Tensor) -> torch.Tensor:
        """(Q, N) scores, computed in fixed-size zero-padded blocks of queries."""
        count, block = queries.shape[0], self._query_block
        padded_count = -(-count // block) * block
        # shape: (Q_padded, D)
        padded = torch.zeros((padded_count, queries.shape[1]), dtype=queries.dtype, device=queries.device)
        padded[:count] = queries
        blocks = [part @ self._matrix.T for part in padded.split(block)]
        return torch.cat(blocks)[:count]

    def search(self, queries: Any, limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`search_tensors`, converted to one tuple of ScoredCandidate per query."""
        scores, indices = self.search_tensors(queries, limit)
        ids = self._chunk_ids
        return [
            tuple(ScoredCandidate(ids[index], score) for score, index in zip(row_scores, row_indices))
            for row_scores, row_indices in zip(scores.double().tolist(), indices.tolist())
        ]

    def retrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """The ``CandidateProvider`` protocol: embed ``query`` and search."""
        return self.retrieve_batch([query], limit)[0]

    def retrieve_batch(self, queries: Sequence[str], limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """Embed every query with ``embed_query`` and search them in one matrix product."""
        if self._embed_query is None:
            raise MapMatchedValueError("retrieve needs embed_query; pass it to DenseProvider or call search(embeddings)")
        queries, limit = check_batch(queries, limit)
        if not queries:
            return []
        return self.search(self.embed_queries(queries), limit)

    def embed_queries(self, queries: Sequence[str]) -> torch.Tensor:
        """``(Q, D)`` embeddings of Q checked query strings by ``embed_query``, in the
        matrix's dtype (on the device ``embed_query`` returns); the
        :class:`~mapmatched_torch.providers.query_mixing.VectorSearchProvider` method.

        Raises:
            MapMatchedValueError: no ``embed_query``, or a vector of the wrong dimension.
        """
        if self._embed_query is None:
            raise MapMatchedValueError("embedding queries needs embed_query; pass it to DenseProvider")
        vectors = [torch.as_tensor(self._embed_query(query)).reshape(-1) for query in queries]
        for position, vector in enumerate(vectors):
            if vector.shape[0] != self.dimension:
                raise dimension_mismatch_error(
                    f"query {position}", vector.shape[0], self.dimension, "the embedding matrix"
                )
        return torch.stack([v.to(self._matrix.dtype) for v in vectors])

    def chunk_embeddings(self, chunk_ids: Sequence[str]) -> torch.Tensor:
        """``(Q, D)`` rows of the embedding matrix for the given chunk IDs (unit rows
        with ``metric="cosine"``), on the provider's device.

        Raises:
            MapMatchedValueError: a chunk ID that is not a row, named.
        """
        if self._rows is None:
            self._rows = {chunk_id: row for row, chunk_id in enumerate(self._chunk_ids)}
        rows = []
        for chunk_id in chunk_ids:
            row = self._rows.get(chunk_id)
            if row is None:
                raise MapMatchedValueError(f"chunk {chunk_id!r} is not a row of this DenseProvider's embedding matrix")
            rows.append(row)
        return self._matrix[torch.tensor(rows, dtype=torch.long, device=self._matrix.device)]

    def search_vectors(self, vectors: Any, limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`search` (the :class:`~mapmatched_torch.providers.query_mixing.VectorSearchProvider` name)."""
        return self.search(vectors, limit)


def _check_finite_rows(matrix: torch.Tensor, what: str) -> None:
    bad = (~torch.isfinite(matrix)).any(dim=1).nonzero()
    if bad.numel():
        raise MapMatchedValueError(f"{what} {int(bad[0, 0])} contains a non-finite value")


def _normalize(matrix: torch.Tensor, what: str) -> torch.Tensor:
    """(R, D) rows divided by their L2 norms; a zero norm or one that overflows the
    dtype (which would silently give a zero row) is refused, as the kNN graphs do."""
    # shape: (R, 1)
    norms = torch.linalg.vector_norm(matrix, dim=1, keepdim=True)
    bad = ((norms == 0) | ~torch.isfinite(norms)).squeeze(1).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        dtype = str(matrix.dtype).replace("torch.", "")
        error = zero_vector_error if float(norms[row, 0]) == 0.0 else norm_overflow_error
        raise error(f"{what} {row}", dtype)
    return matrix / norms
