"""Gated context in the query: the previous decoded chunk mixed into the new query.

An underspecified follow-up ("and on a GPU?") says little by itself; the chunk the
conversation decoded at the previous turn says where it was. :class:`QueryMixing` mixes
that chunk's embedding ``e`` into the query embedding ``q`` with a gate fitted on data::

    z     = (cos(q, e) - cosine_mean) / cosine_std        (statistics of training data)
    a_t   = mix_weight * sigmoid(gate_bias + gate_weight * z)
    q'    = normalize((1 - a_t) * q / |q| + a_t * e / |e|)

``q`` and ``e`` are unit-normalized before the mix, so the gate alone decides the share
of context. The mixed query is searched like any query; with ``mix_weight = 0`` (or no
previous chunk: the first turn) the query vector is passed on unchanged, so the results
equal the unmixed provider's bit for bit. The parameters are fitted by
:func:`mapmatched_torch.fit.query_mixing.fit_query_mixing`.

Any provider that can embed a query, look up a chunk's embedding and search by vector
(:class:`VectorSearchProvider`: :class:`~mapmatched_torch.providers.dense.DenseProvider`
and :class:`~mapmatched_torch.providers.faiss.FAISSProvider`) can be wrapped in
:class:`QueryMixingProvider`, whose ``retrieve_in_context(query, limit,
context_chunk_id)`` a :class:`~mapmatched_torch.MapMatchedSession` calls with the chunk
it decoded at the previous turn (:class:`ContextualProvider`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch
from torch import Tensor

from ..core.checks import check_chunk_id, check_finite, check_positive_finite
from ..core.errors import MapMatchedTypeError, MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.protocols import CandidatesMethod
from .base import check_batch, check_request

__all__ = [
    "QueryMixing",
    "VectorSearchProvider",
    "ContextualProvider",
    "QueryMixingProvider",
    "mixing_weights",
    "mixed_queries",
]

Number = Union[float, Tensor]


def mixing_weights(
    cosines: Tensor, mix_weight: Number, gate_bias: Number, gate_weight: Number, cosine_mean: Number, cosine_std: Number
) -> Tensor:
    """The gate ``a_t = mix_weight * sigmoid(gate_bias + gate_weight * z)`` of every query.

    Args:
        cosines: ``(N,)`` ``cos(q, e)`` of each query with its context chunk.
        mix_weight, gate_bias, gate_weight, cosine_mean, cosine_std: floats or 0-dim
            tensors (differentiable: :mod:`mapmatched_torch.fit.query_mixing` passes
            parameters); ``z = (cosines - cosine_mean) / cosine_std``.

    Returns:
        ``(N,)`` weights in ``[0, mix_weight]``, in the cosines' dtype.
    """
    standardized = (cosines - cosine_mean) / cosine_std
    return mix_weight * torch.sigmoid(gate_bias + gate_weight * standardized)


def mixed_queries(
    queries: Tensor,
    contexts: Tensor,
    mix_weight: Number,
    gate_bias: Number,
    gate_weight: Number,
    cosine_mean: Number,
    cosine_std: Number,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``q' = normalize((1 - a_t) q/|q| + a_t e/|e|)`` for every query (differentiable).

    The one implementation of the mix: :meth:`QueryMixing.apply` (providers, sessions,
    the evaluation harness) and the fitting objective both call it.

    Args:
        queries: ``(N, D)`` float query embeddings (any norm; zero rows stay zero).
        contexts: ``(N, D)`` embeddings of each query's context chunk.
        mix_weight, gate_bias, gate_weight, cosine_mean, cosine_std: as
            :func:`mixing_weights`.

    Returns:
        ``(mixed, weights, cosines)``: ``(N, D)`` unit mixed queries, ``(N,)`` the gate
        ``a_t`` and ``(N,)`` ``cos(q, e)``, all in the inputs' dtype.
    """
    # shape: (N, D) unit rows (zero rows stay zero)
    unit_queries = torch.nn.functional.normalize(queries, dim=-1)
    unit_contexts = torch.nn.functional.normalize(contexts, dim=-1)
    # shape: (N,)
    cosines = (unit_queries * unit_contexts).sum(dim=-1)
    weights = mixing_weights(cosines, mix_weight, gate_bias, gate_weight, cosine_mean, cosine_std)
    # shape: (N, D)
    mixed = (1.0 - weights).unsqueeze(-1) * unit_queries + weights.unsqueeze(-1) * unit_contexts
    return torch.nn.functional.normalize(mixed, dim=-1), weights, cosines


@dataclass(frozen=True)
class QueryMixing:
    """Fitted gate of the query mix (see the module docstring).

    Attributes:
        mix_weight: ``a`` in ``[0, 1]``, the most context a query can take (0: off).
        gate_bias: ``g0``. gate_weight: ``g1`` (its sign says whether queries far from
            the previous chunk take more context (< 0) or less (> 0)).
        cosine_mean, cosine_std: standardization of ``cos(q, e)`` (training data
            only; ``cosine_std > 0``).

    Example:
        >>> mixing = QueryMixing(0.5, 0.0, 0.0)  # a_t = 0.5 * sigmoid(0) = 0.25 for every query
        >>> mixing.apply(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))  # (0.75, 0.25) normalized
        tensor([[0.9487, 0.3162]])
    """

    mix_weight: float = 0.0
    gate_bias: float = 0.0
    gate_weight: float = 0.0
    cosine_mean: float = 0.0
    cosine_std: float = 1.0

    def __post_init__(self) -> None:
        weight = check_finite(self.mix_weight, "mix_weight")
        if not 0.0 <= weight <= 1.0:
            raise MapMatchedValueError(f"mix_weight must be in [0, 1] (the most context a query takes), got {weight}")
        object.__setattr__(self, "mix_weight", weight)
        for name in ("gate_bias", "gate_weight", "cosine_mean"):
            object.__setattr__(self, name, check_finite(getattr(self, name), name))
        object.__setattr__(self, "cosine_std", check_positive_finite(self.cosine_std, "cosine_std"))

    @property
    def is_zero(self) -> bool:
        """``mix_weight == 0``: every query is passed on unchanged."""
        return self.mix_weight == 0.0

    def to_dict(self) -> Dict[str, float]:
        """The five values by name (JSON-friendly); ``QueryMixing(**d)`` rebuilds it."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def weights(self, cosines: Tensor) -> Tensor:
        """``(N,)`` gate values ``a_t`` of ``(N,)`` cosines (see :func:`mixing_weights`)."""
        return mixing_weights(cosines, self.mix_weight, self.gate_bias, self.gate_weight, self.cosine_mean,
                              self.cosine_std)

    def apply(self, queries: Tensor, contexts: Tensor, has_context: Optional[Tensor] = None) -> Tensor:
        """The queries to search with: mixed where there is context, else unchanged.

        Args:
            queries: ``(N, D)`` float query embeddings.
            contexts: ``(N, D)`` context chunk embeddings (rows without context are
                not read).
            has_context: ``(N,)`` bool, the rows that have a context chunk (default
                all).

        Returns:
            ``(N, D)`` in the queries' dtype and device: a row with context and
            ``a_t > 0`` is the unit mixed query (computed in float64); every other row
            is the query itself, bit for bit (so ``mix_weight = 0`` changes nothing).
        """
        if queries.dim() != 2 or contexts.shape != queries.shape:
            raise MapMatchedValueError(
                f"queries and contexts must both be (N, D), got {tuple(queries.shape)} and {tuple(contexts.shape)}"
            )
        if self.is_zero:
            return queries
        mixed, weights, _ = mixed_queries(
            queries.to(torch.float64), contexts.to(device=queries.device, dtype=torch.float64), self.mix_weight,
            self.gate_bias, self.gate_weight, self.cosine_mean, self.cosine_std,
        )
        keep = weights > 0
        if has_context is not None:
            keep = keep & has_context.to(device=queries.device, dtype=torch.bool)
        return torch.where(keep.unsqueeze(-1), mixed.to(queries.dtype), queries)


@runtime_checkable
class VectorSearchProvider(Protocol):
    """A provider that can embed queries, look up chunk embeddings and search by vector:
    what :class:`QueryMixingProvider` needs (DenseProvider and FAISSProvider have it).

    ``search_vectors(embed_queries(queries), limit)`` must equal the provider's
    ``retrieve_batch(queries, limit)``, so that an unmixed query gets the provider's
    own answer."""

    def embed_queries(self, queries: Sequence[str]) -> Tensor:
        """``(Q, D)`` embeddings of checked query strings."""
        ...

    def chunk_embeddings(self, chunk_ids: Sequence[str]) -> Tensor:
        """``(Q, D)`` stored embeddings of the given chunks."""
        ...

    def search_vectors(self, vectors: Tensor, limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """The best ``limit`` candidates of every row of ``(Q, D)`` vectors, best first."""
        ...


@runtime_checkable
class ContextualProvider(Protocol):
    """A provider whose answer depends on the conversation's previous decoded chunk:
    a session calls ``retrieve_in_context(query, limit, context_chunk_id)`` instead of
    ``retrieve`` (``context_chunk_id``: None at the first turn)."""

    def retrieve_in_context(
        self, query: str, limit: int, context_chunk_id: Optional[str]
    ) -> Tuple[ScoredCandidate, ...]:
        ...


class QueryMixingProvider(CandidatesMethod):
    """A :class:`VectorSearchProvider` whose queries take the previous decoded chunk in.

    Args:
        provider: a :class:`VectorSearchProvider` (e.g. a DenseProvider with
            ``embed_query``, or a FAISSProvider).
        mixing: the fitted :class:`QueryMixing` (``mix_weight = 0``: the provider's
            own answers, bit for bit).

    :meth:`retrieve` (and ``candidates``) answer without context, as the wrapped
    provider does; :meth:`retrieve_in_context` mixes the context chunk's stored
    embedding into the query. A :class:`~mapmatched_torch.MapMatchedSession` over this
    provider calls :meth:`retrieve_in_context` with the chunk it decoded at the previous
    turn. Cost: one query embedding, one chunk lookup and one vector search per call.

    Example:
        >>> from mapmatched_torch.providers import DenseProvider
        >>> vectors = {"install?": [1.0, 0.2, 0.0], "on a GPU?": [0.0, 0.1, 1.0]}
        >>> dense = DenseProvider(torch.eye(3), ["setup", "billing", "gpu"], vectors.__getitem__, metric="cosine")
        >>> mixed = QueryMixingProvider(dense, QueryMixing(0.6, 0.0, 0.0))
        >>> [c.chunk_id for c in mixed.retrieve_in_context("on a GPU?", 2, "billing")]
        ['gpu', 'billing']
    """

    def __init__(self, provider: VectorSearchProvider, mixing: QueryMixing) -> None:
        missing = [name for name in ("embed_queries", "chunk_embeddings", "search_vectors")
                   if not callable(getattr(provider, name, None))]
        if missing:
            raise MapMatchedTypeError(
                f"QueryMixingProvider needs a provider that embeds queries and searches by vector "
                f"(VectorSearchProvider); {type(provider).__name__} lacks {', '.join(missing)}"
            )
        if not isinstance(mixing, QueryMixing):
            raise MapMatchedTypeError(f"mixing must be a QueryMixing, got {type(mixing).__name__}")
        self.provider = provider
        self.mixing = mixing

    def __repr__(self) -> str:
        return f"QueryMixingProvider({self.provider!r}, {self.mixing!r})"

    def retrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """The wrapped provider's answer for ``query`` alone (no context)."""
        return self.retrieve_in_context(query, limit, None)

    def retrieve_batch(self, queries: Sequence[str], limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve` for many queries (one embedding call, one search)."""
        queries, limit = check_batch(queries, limit)
        return self.retrieve_batch_in_context(queries, limit, [None] * len(queries))

    def retrieve_in_context(
        self, query: str, limit: int, context_chunk_id: Optional[str]
    ) -> Tuple[ScoredCandidate, ...]:
        """The best ``limit`` candidates for ``query`` mixed with ``context_chunk_id``.

        Args:
            query: a non-empty query string. limit: a positive int.
            context_chunk_id: the chunk decoded at the previous turn, or None (no mix).

        Raises:
            ValueError: a bad query or limit, or a context chunk the provider does not
                hold (the wrapped provider's message).
        """
        query, limit = check_request(query, limit)
        return self.retrieve_batch_in_context([query], limit, [context_chunk_id])[0]

    def retrieve_batch_in_context(
        self, queries: Sequence[str], limit: int, context_chunk_ids: Sequence[Optional[str]]
    ) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve_in_context` for Q queries, each with its own context chunk (or None)."""
        queries, limit = check_batch(queries, limit)
        contexts = list(context_chunk_ids)
        if len(contexts) != len(queries):
            raise MapMatchedValueError(f"{len(contexts)} context chunk IDs for {len(queries)} queries")
        if not queries:
            return []
        # shape: (Q, D)
        vectors = self.provider.embed_queries(queries)
        present = [i for i, chunk_id in enumerate(contexts) if chunk_id is not None]
        if present and not self.mixing.is_zero:
            ids = [check_chunk_id(contexts[i], f"context chunk ID {i}") for i in present]
            context_rows = torch.zeros_like(vectors)
            context_rows[present] = self.provider.chunk_embeddings(ids).to(vectors)
            has_context = torch.zeros(len(queries), dtype=torch.bool, device=vectors.device)
            has_context[present] = True
            vectors = self.mixing.apply(vectors, context_rows, has_context)
        return self.provider.search_vectors(vectors, limit)

