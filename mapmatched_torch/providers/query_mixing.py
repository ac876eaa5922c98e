"""Gated context in the query: the previous decoded chunk (and query) mixed into the new query.

An underspecified follow-up ("and on a GPU?") says little by itself; the chunk the
conversation decoded at the previous turn says where it was, and so does the previous
query. :class:`QueryMixing` mixes up to two context sources into the query embedding
``q``, each with its own gate fitted on data: the previous decoded chunk's embedding
``e`` and the previous query's embedding ``p``::

    z_e   = (cos(q, e) - cosine_mean) / cosine_std              (statistics of training data)
    a_t   = mix_weight * sigmoid(gate_bias + gate_weight * z_e)
    z_p   = (cos(q, p) - query_cosine_mean) / query_cosine_std
    c_t   = query_mix_weight * sigmoid(query_gate_bias + query_gate_weight * z_p)
    q'    = normalize((1 - a_t - c_t) * q/|q| + a_t * e/|e| + c_t * p/|p|)

(``mix_weight + query_mix_weight <= 1``; with ``query_mix_weight = 0``, the default, the
mix is the chunk alone, ``c_t = 0``). ``q``, ``e`` and ``p`` are unit-normalized before
the mix, so the gates alone decide the shares of context. The mixed query is searched
like any query; with both weights 0 (or no context: the first turn) the query vector is
passed on unchanged, so the results equal the unmixed provider's bit for bit. The
parameters are fitted by :func:`mapmatched_torch.fit.query_mixing.fit_query_mixing`.

Any provider that can embed a query, look up a chunk's embedding and search by vector
(:class:`VectorSearchProvider`: :class:`~mapmatched_torch.providers.dense.DenseProvider`,
:class:`~mapmatched_torch.providers.faiss.FAISSProvider`,
:class:`~mapmatched_torch.providers.qdrant.QdrantProvider` and
:class:`~mapmatched_torch.providers.chroma.ChromaProvider`) can be wrapped in
:class:`QueryMixingProvider`, whose ``retrieve_in_context(query, limit,
context_chunk_id, previous_query=None)`` a :class:`~mapmatched_torch.MapMatchedSession`
(and a :class:`~mapmatched_torch.MapMatchedServer`) calls with the chunk it decoded at
the previous turn, and with the previous turn's query text when the wrapper's
:attr:`~QueryMixingProvider.uses_previous_query` is true (:class:`ContextualProvider`).

**The recurrent state** (``QueryMixing.recurrent``, issue 33): ``p`` is then the vector
the previous turn *searched* (``s_t = q'_t``, one vector per conversation) instead of
its raw query. The provider answers with a :class:`SearchedAnswer` that carries the
query text with that vector (a :class:`SearchedQuery`, a ``str``); sessions and the
server keep it as their previous query
(:func:`~mapmatched_torch.core.protocols.searched_query`) and hand it back at the next
turn, and the server saves its vector in its state (:func:`previous_query_entry`). A
plain previous-query string (a state saved without the vector) is embedded, the raw
previous query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

import torch
from torch import Tensor

from ..core.checks import check_chunk_id, check_finite, check_positive_finite
from ..core.errors import MapMatchedTypeError, MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.protocols import CandidatesMethod
from .base import check_batch, check_query, check_request

__all__ = [
    "QueryMixing",
    "VectorSearchProvider",
    "ContextualProvider",
    "QueryMixingProvider",
    "mixing_weights",
    "mixed_queries",
    "SearchedQuery",
    "SearchedAnswer",
    "previous_query_entry",
    "previous_query_of_entry",
]

Number = Union[float, Tensor]


def mixing_weights(
    cosines: Tensor, mix_weight: Number, gate_bias: Number, gate_weight: Number, cosine_mean: Number, cosine_std: Number
) -> Tensor:
    """The gate ``mix_weight * sigmoid(gate_bias + gate_weight * z)`` of every query and source.

    Args:
        cosines: ``(N,)`` ``cos(q, e)`` of each query with its context, or ``(N, S)``
            with each of S context sources.
        mix_weight, gate_bias, gate_weight, cosine_mean, cosine_std: floats, 0-dim or
            ``(S,)`` tensors (one value per source; differentiable:
            :mod:`mapmatched_torch.fit.query_mixing` passes parameters);
            ``z = (cosines - cosine_mean) / cosine_std``.

    Returns:
        weights shaped like ``cosines``, each in ``[0, mix_weight]``, in the cosines' dtype.
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
    present: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``q' = normalize((1 - sum_s w_s) q/|q| + sum_s w_s c_s/|c_s|)`` for every query (differentiable).

    The one implementation of the mix: :meth:`QueryMixing.apply` (providers, sessions,
    the evaluation harness) and the fitting objective both call it.

    Args:
        queries: ``(N, D)`` float query embeddings (any norm; zero rows stay zero).
        contexts: ``(N, D)`` embeddings of each query's context chunk (one source), or
            ``(N, S, D)``: S context sources per query (the chunk, the previous query).
        mix_weight, gate_bias, gate_weight, cosine_mean, cosine_std: as
            :func:`mixing_weights` (scalars for one source, ``(S,)`` for S; the mix
            weights must sum to at most 1).
        present: ``(N, S)`` bool (or ``(N,)`` for one source), the sources each query
            has (default all); an absent source gets weight 0 and its row is not read.

    Returns:
        ``(mixed, weights, cosines)``: ``(N, D)`` unit mixed queries, the gates ``w``
        and ``cos(q, c)`` (``(N,)`` for ``(N, D)`` contexts, ``(N, S)`` for
        ``(N, S, D)``), all in the inputs' dtype.
    """
    single = contexts.dim() == 2
    sources = contexts.unsqueeze(1) if single else contexts
    if present is not None:
        present = present.to(device=sources.device, dtype=torch.bool).reshape(sources.shape[:2])
        # an absent row is never read: a NaN there must not reach the mix (or its gradient) through 0 * NaN
        sources = torch.where(present.unsqueeze(-1), sources, torch.zeros((), dtype=sources.dtype,
                                                                           device=sources.device))
    # shape: (N, D) and (N, S, D) unit rows (zero rows stay zero)
    unit_queries = torch.nn.functional.normalize(queries, dim=-1)
    unit_sources = torch.nn.functional.normalize(sources, dim=-1)
    # shape: (N, S)
    cosines = (unit_queries.unsqueeze(1) * unit_sources).sum(dim=-1)
    weights = mixing_weights(cosines, mix_weight, gate_bias, gate_weight, cosine_mean, cosine_std)
    if present is not None:
        weights = torch.where(present, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    # shape: (N, D)
    mixed = (1.0 - weights.sum(dim=-1, keepdim=True)) * unit_queries + (weights.unsqueeze(-1) * unit_sources).sum(dim=1)
    mixed = torch.nn.functional.normalize(mixed, dim=-1)
    if single:
        return mixed, weights.squeeze(1), cosines.squeeze(1)
    return mixed, weights, cosines


_CHUNK_FIELDS = ("mix_weight", "gate_bias", "gate_weight", "cosine_mean", "cosine_std")
_QUERY_FIELDS = ("query_mix_weight", "query_gate_bias", "query_gate_weight", "query_cosine_mean", "query_cosine_std")


@dataclass(frozen=True)
class QueryMixing:
    """Fitted gates of the query mix (see the module docstring).

    Attributes:
        mix_weight: ``a`` in ``[0, 1]``, the most of the previous decoded chunk a query
            can take (0: off).
        gate_bias: ``g0``. gate_weight: ``g1`` (its sign says whether queries far from
            the previous chunk take more context (< 0) or less (> 0)).
        cosine_mean, cosine_std: standardization of ``cos(q, e)`` (training data
            only; ``cosine_std > 0``).
        query_mix_weight, query_gate_bias, query_gate_weight, query_cosine_mean,
            query_cosine_std: the same five for the previous query's embedding ``p``
            (default 0: the chunk alone); ``mix_weight + query_mix_weight <= 1``.
        recurrent: the second source ``p`` is the vector the previous turn *searched*
            (its mixed query, a recurrent state of the conversation ``s_t = q'_t``)
            instead of the previous raw query (default False). Sessions and the server
            then hand the provider back the vector it searched at the previous turn
            (:meth:`QueryMixingProvider.retrieve_with_state`).

    Example:
        >>> mixing = QueryMixing(0.5, 0.0, 0.0)  # a_t = 0.5 * sigmoid(0) = 0.25 for every query
        >>> mixing.apply(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))  # (0.75, 0.25) normalized
        tensor([[0.9487, 0.3162]])
        >>> both = QueryMixing(0.5, 0.0, 0.0, query_mix_weight=0.5)  # a_t = c_t = 0.25
        >>> both.apply(torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[0.0, 1.0, 0.0]]),
        ...            previous_queries=torch.tensor([[0.0, 0.0, 1.0]]))  # (0.5, 0.25, 0.25) normalized
        tensor([[0.8165, 0.4082, 0.4082]])
    """

    mix_weight: float = 0.0
    gate_bias: float = 0.0
    gate_weight: float = 0.0
    cosine_mean: float = 0.0
    cosine_std: float = 1.0
    query_mix_weight: float = 0.0
    query_gate_bias: float = 0.0
    query_gate_weight: float = 0.0
    query_cosine_mean: float = 0.0
    query_cosine_std: float = 1.0
    recurrent: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.recurrent, bool):
            raise MapMatchedTypeError(f"recurrent must be True or False, got {self.recurrent!r}")
        for fields in (_CHUNK_FIELDS, _QUERY_FIELDS):
            weight_name, *gate_names, std_name = fields
            weight = check_finite(getattr(self, weight_name), weight_name)
            if not 0.0 <= weight <= 1.0:
                raise MapMatchedValueError(
                    f"{weight_name} must be in [0, 1] (the most context a query takes), got {weight}")
            object.__setattr__(self, weight_name, weight)
            for name in gate_names:
                object.__setattr__(self, name, check_finite(getattr(self, name), name))
            object.__setattr__(self, std_name, check_positive_finite(getattr(self, std_name), std_name))
        if self.mix_weight + self.query_mix_weight > 1.0:
            raise MapMatchedValueError(
                f"mix_weight + query_mix_weight must be at most 1 (the query keeps the rest), got "
                f"{self.mix_weight} + {self.query_mix_weight}"
            )

    @property
    def is_zero(self) -> bool:
        """Both mix weights are 0: every query is passed on unchanged."""
        return self.mix_weight == 0.0 and self.query_mix_weight == 0.0

    @property
    def uses_previous_query(self) -> bool:
        """``query_mix_weight > 0``: the previous query's embedding is mixed in too."""
        return self.query_mix_weight > 0.0

    def to_dict(self) -> Dict[str, Any]:
        """The ten values and ``recurrent`` by name (JSON-friendly); ``QueryMixing(**d)`` rebuilds it."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def gate_values(self) -> Tuple[Tensor, ...]:
        """``(mix_weight, gate_bias, gate_weight, cosine_mean, cosine_std)`` as ``(2,)``
        float64 tensors (source 0 the chunk, source 1 the previous query): the gate
        arguments of :func:`mixed_queries` for ``(N, 2, D)`` contexts."""
        return tuple(torch.tensor([getattr(self, chunk), getattr(self, query)], dtype=torch.float64)
                     for chunk, query in zip(_CHUNK_FIELDS, _QUERY_FIELDS))

    def weights(self, cosines: Tensor) -> Tensor:
        """``(N,)`` chunk gate values ``a_t`` of ``(N,)`` cosines ``cos(q, e)`` (see :func:`mixing_weights`)."""
        return mixing_weights(cosines, *(getattr(self, name) for name in _CHUNK_FIELDS))

    def apply(
        self,
        queries: Tensor,
        contexts: Tensor,
        has_context: Optional[Tensor] = None,
        previous_queries: Optional[Tensor] = None,
        has_previous_query: Optional[Tensor] = None,
    ) -> Tensor:
        """The queries to search with: mixed where there is context, else unchanged.

        Args:
            queries: ``(N, D)`` float query embeddings.
            contexts: ``(N, D)`` context chunk embeddings (rows without context are
                not read).
            has_context: ``(N,)`` bool, the rows that have a context chunk (default
                all); a row without one is not mixed at all.
            previous_queries: ``(N, D)`` embeddings of each row's previous query, or
                None (then the previous-query source is off for every row). Read only
                when :attr:`uses_previous_query`.
            has_previous_query: ``(N,)`` bool, the rows whose previous query is known
                (default all, when ``previous_queries`` is given).

        Returns:
            ``(N, D)`` in the queries' dtype and device: a row with context and some
            weight ``> 0`` is the unit mixed query (computed in float64); every other
            row is the query itself, bit for bit (so zero weights change nothing).
        """
        if queries.dim() != 2 or contexts.shape != queries.shape:
            raise MapMatchedValueError(
                f"queries and contexts must both be (N, D), got {tuple(queries.shape)} and {tuple(contexts.shape)}"
            )
        if self.is_zero:
            return queries
        device, double = queries.device, torch.float64
        rows = torch.ones(queries.shape[0], dtype=torch.bool, device=device) if has_context is None else (
            has_context.to(device=device, dtype=torch.bool))
        sources = [contexts.to(device=device, dtype=double)]
        present = [rows]
        if self.uses_previous_query and previous_queries is not None:
            if previous_queries.shape != queries.shape:
                raise MapMatchedValueError(
                    f"previous_queries must be (N, D) = {tuple(queries.shape)}, got {tuple(previous_queries.shape)}")
            known = rows if has_previous_query is None else rows & has_previous_query.to(device=device,
                                                                                           dtype=torch.bool)
            sources.append(previous_queries.to(device=device, dtype=double))
            present.append(known)
        # the first len(sources) sources' gates (the chunk; the previous query when it is mixed in)
        gates = [value[: len(sources)].to(device) for value in self.gate_values()]
        mixed, weights, _ = mixed_queries(queries.to(double), torch.stack(sources, dim=1), *gates,
                                          present=torch.stack(present, dim=1))
        keep = rows & (weights > 0).any(dim=1)
        return torch.where(keep.unsqueeze(-1), mixed.to(queries.dtype), queries)


class SearchedQuery(str):
    """A query's text that also carries the vector a recurrent :class:`QueryMixingProvider`
    searched for it (``QueryMixing.recurrent``): the conversation's state.

    It is a ``str`` (the query text), so sessions and the server keep it as their
    previous query and hand it back at the next turn unchanged; the provider then mixes
    :attr:`vector` in, where a plain string would be embedded again (the raw previous
    query, e.g. after restoring a state saved without it).

    Attributes:
        vector: ``(D,)`` float tensor, the searched (mixed) query vector.

    Example:
        >>> state = SearchedQuery("and on a GPU?", torch.tensor([0.6, 0.8]))
        >>> state == "and on a GPU?", state.vector.tolist()
        (True, [0.6000000238418579, 0.800000011920929])
    """

    vector: Tensor

    def __new__(cls, text: str, vector: Tensor) -> "SearchedQuery":
        if not isinstance(vector, Tensor) or vector.dim() != 1:
            raise MapMatchedTypeError(f"a searched query's vector must be a (D,) tensor, got {vector!r}")
        made = str.__new__(cls, text)
        made.vector = vector
        return made

    def __reduce__(self) -> Tuple[Any, ...]:
        return SearchedQuery, (str(self), self.vector)


class SearchedAnswer(tuple):
    """A provider's answer (a tuple of :class:`ScoredCandidate`, equal to the plain
    tuple) that also carries :attr:`searched_query`, the :class:`SearchedQuery` a
    session keeps as its previous query
    (:func:`~mapmatched_torch.core.protocols.searched_query`)."""

    searched_query: SearchedQuery

    def __new__(cls, candidates: Sequence[ScoredCandidate], searched: SearchedQuery) -> "SearchedAnswer":
        made = tuple.__new__(cls, candidates)
        made.searched_query = searched
        return made

    def __reduce__(self) -> Tuple[Any, ...]:
        return SearchedAnswer, (tuple(self), self.searched_query)


def previous_query_entry(previous: str) -> List[Any]:
    """How a saved server state stores a previous query: ``[text]``, or ``[text, vector
    as floats]`` for a :class:`SearchedQuery` (exact: a float64 list holds any float32
    or float64 vector); :func:`previous_query_of_entry` reverses it."""
    if isinstance(previous, SearchedQuery):
        return [str(previous), previous.vector.detach().to("cpu", torch.float64).tolist()]
    return [str(previous)]


def previous_query_of_entry(entry: Sequence[Any]) -> Optional[str]:
    """The previous query of a saved ``[text]`` or ``[text, floats]`` (None: malformed)."""
    if len(entry) == 1 and isinstance(entry[0], str) and entry[0]:
        return entry[0]
    if len(entry) == 2 and isinstance(entry[0], str) and entry[0] and isinstance(entry[1], (list, tuple)) and (
            entry[1] and all(type(value) is float for value in entry[1])):
        return SearchedQuery(entry[0], torch.tensor(entry[1], dtype=torch.float64))
    return None


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
    ``retrieve`` (``context_chunk_id``: None at the first turn). A provider whose
    ``uses_previous_query`` attribute is true is also passed ``previous_query=`` (the
    previous turn's query text; None at the first turn or when that turn was given as
    candidates)."""

    def retrieve_in_context(
        self, query: str, limit: int, context_chunk_id: Optional[str]
    ) -> Tuple[ScoredCandidate, ...]:
        ...


class QueryMixingProvider(CandidatesMethod):
    """A :class:`VectorSearchProvider` whose queries take the previous decoded chunk
    (and, when the mix has that source, the previous query) in.

    Args:
        provider: a :class:`VectorSearchProvider` (e.g. a DenseProvider with
            ``embed_query``, or a FAISSProvider).
        mixing: the fitted :class:`QueryMixing` (both weights 0: the provider's own
            answers, bit for bit).

    :meth:`retrieve` (and ``candidates``) answer without context, as the wrapped
    provider does; :meth:`retrieve_in_context` mixes the context chunk's stored
    embedding (and the previous query's embedding) into the query. A
    :class:`~mapmatched_torch.MapMatchedSession` over this provider calls
    :meth:`retrieve_in_context` with the chunk it decoded at the previous turn and,
    when :attr:`uses_previous_query`, the previous turn's query. Cost: one embedding
    call (the query, and the previous query when used), one chunk lookup and one vector
    search per call.

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

    @property
    def uses_previous_query(self) -> bool:
        """Whether the mix reads the previous query (sessions and the server then pass it)."""
        return self.mixing.uses_previous_query

    def _embed_previous(self, previous: List[Any], rows: List[int]) -> Tensor:
        """``(K, D)`` embeddings of the known previous queries of ``rows``; a bad one is
        named as the previous query of its row."""
        for text, row in zip(previous, rows):
            check_query(text, f"the previous query of query {row}")
        try:
            return self.provider.embed_queries(previous)
        except MapMatchedValueError:  # find the one that failed, to name it by its row
            for text, row in zip(previous, rows):
                try:
                    self.provider.embed_queries([text])
                except MapMatchedValueError as error:
                    raise MapMatchedValueError(f"the previous query of query {row}: {error}") from error
            raise

    def retrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """The wrapped provider's answer for ``query`` alone (no context)."""
        return self.retrieve_in_context(query, limit, None)

    def retrieve_batch(self, queries: Sequence[str], limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve` for many queries (one embedding call, one search)."""
        queries, limit = check_batch(queries, limit)
        return self.retrieve_batch_in_context(queries, limit, [None] * len(queries))

    def retrieve_in_context(
        self, query: str, limit: int, context_chunk_id: Optional[str], previous_query: Optional[str] = None
    ) -> Tuple[ScoredCandidate, ...]:
        """The best ``limit`` candidates for ``query`` mixed with ``context_chunk_id``.

        Args:
            query: a non-empty query string. limit: a positive int.
            context_chunk_id: the chunk decoded at the previous turn, or None (no mix).
            previous_query: the previous turn's query text, or None (that source is off
                for this call); read only when :attr:`uses_previous_query`. With a
                recurrent mix, a :class:`SearchedQuery` (what the previous call answered
                with) is mixed in by its vector.

        Returns:
            the candidates, best first; with a recurrent mix a :class:`SearchedAnswer`
            (equal to that tuple) whose ``searched_query`` is this query's state.

        Raises:
            ValueError: a bad query or limit, or a context chunk the provider does not
                hold (the wrapped provider's message).
        """
        query, limit = check_request(query, limit)
        return self.retrieve_batch_in_context([query], limit, [context_chunk_id], [previous_query])[0]

    def retrieve_batch_in_context(
        self,
        queries: Sequence[str],
        limit: int,
        context_chunk_ids: Sequence[Optional[str]],
        previous_queries: Optional[Sequence[Optional[str]]] = None,
    ) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve_in_context` for Q queries, each with its own context chunk (or
        None) and previous query (or None; ``previous_queries`` None: none known)."""
        queries, limit = check_batch(queries, limit)
        contexts = list(context_chunk_ids)
        if len(contexts) != len(queries):
            raise MapMatchedValueError(f"{len(contexts)} context chunk IDs for {len(queries)} queries")
        earlier = [None] * len(queries) if previous_queries is None else list(previous_queries)
        if len(earlier) != len(queries):
            raise MapMatchedValueError(f"{len(earlier)} previous queries for {len(queries)} queries")
        if not queries:
            return []
        present = [i for i, chunk_id in enumerate(contexts) if chunk_id is not None]
        known = [i for i in present if earlier[i] is not None] if self.uses_previous_query else []
        vectors = self.provider.embed_queries(queries)
        if known:
            previous_vectors = self._previous_vectors([earlier[i] for i in known], known, vectors)
        if present and not self.mixing.is_zero:
            ids = [check_chunk_id(contexts[i], f"context chunk ID {i}") for i in present]
            context_rows = torch.zeros_like(vectors)
            context_rows[present] = self.provider.chunk_embeddings(ids).to(vectors)
            has_context = torch.zeros(len(queries), dtype=torch.bool, device=vectors.device)
            has_context[present] = True
            previous_rows, has_previous = None, None
            if known:
                previous_rows = torch.zeros_like(vectors)
                previous_rows[known] = previous_vectors.to(vectors)
                has_previous = torch.zeros_like(has_context)
                has_previous[known] = True
            vectors = self.mixing.apply(vectors, context_rows, has_context, previous_rows, has_previous)
        answers = self.provider.search_vectors(vectors, limit)
        if not self.mixing.recurrent:
            return answers
        # the state each conversation hands back at its next turn: the vector searched now
        return [SearchedAnswer(answer, SearchedQuery(query, vector.detach().clone()))
                for answer, query, vector in zip(answers, queries, vectors)]

    def _previous_vectors(self, previous: List[Any], rows: List[int], like: Tensor) -> Tensor:
        """``(K, D)`` previous-source rows of ``rows``: a :class:`SearchedQuery`'s vector
        where the mix is recurrent and has one, else the previous query embedded."""
        searched = [self.mixing.recurrent and isinstance(text, SearchedQuery) for text in previous]
        out = torch.empty((len(rows), like.shape[1]), dtype=like.dtype, device=like.device)
        plain = [k for k, state in enumerate(searched) if not state]
        if plain:
            out[plain] = self._embed_previous([previous[k] for k in plain], [rows[k] for k in plain]).to(like)
        for k, state in enumerate(searched):
            if state:
                vector = previous[k].vector
                if vector.shape != (like.shape[1],):
                    raise MapMatchedValueError(f"the searched previous query of query {rows[k]} has "
                                               f"{tuple(vector.shape)} values, the queries {like.shape[1]}")
                out[k] = vector.to(like)
        return out
