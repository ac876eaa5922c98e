"""Weighted reciprocal rank fusion of several providers (hybrid lexical + dense).

The usual way conversational systems combine a lexical retriever (BM25) with a dense
one: each provider ranks its own candidates, and a chunk's fused score is

    score(c) = sum_p  w_p / (rank_constant + rank_p(c))

over the providers that returned c (ranks start at 1). Scores from different
retrievers are never compared directly, so no calibration is needed; the decoder's
per-turn normalization then works on the fused scores.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.checks import check_positive_int, check_weight
from ..core.errors import MapMatchedTypeError, MapMatchedValueError
from ..core.models import ScoredCandidate
from ..core.protocols import CandidatesMethod, as_scored_candidates, provider_answer
from .base import check_batch

__all__ = ["FusionProvider", "reciprocal_rank_fusion"]


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[ScoredCandidate]],
    weights: Sequence[float],
    rank_constant: float,
    limit: int,
) -> Tuple[ScoredCandidate, ...]:
    """Fuse ranked lists (each best first) into one, by weighted reciprocal rank.

    Returns:
        At most ``limit`` candidates with their fused scores, sorted by
        (-score, chunk ID). A chunk repeated within one ranking counts at its best rank.
    """
    fused: Dict[str, float] = {}
    for ranking, weight in zip(rankings, weights):
        seen = set()
        for rank, candidate in enumerate(ranking, start=1):
            if candidate.chunk_id in seen:
                continue
            seen.add(candidate.chunk_id)
            fused[candidate.chunk_id] = fused.get(candidate.chunk_id, 0.0) + weight / (rank_constant + rank)
    ordered = sorted(fused.items(), key=lambda item: (-item[1], item[0]))
    return tuple(ScoredCandidate(chunk_id, score) for chunk_id, score in ordered[:limit])


class FusionProvider(CandidatesMethod):
    """A ``CandidateProvider`` fusing other providers by weighted reciprocal rank.

    Args:
        providers: one or more providers (``retrieve(query, limit)`` or
            ``candidates(query, limit)``, asked as
            :func:`~mapmatched_torch.core.protocols.provider_answer` says; their
            ``retrieve_batch`` when they have one).
        weights: one weight >= 0 per provider (default all 1.0; not all zero).
        rank_constant: the ``k`` of reciprocal rank fusion (default 60, the value of
            Cormack et al. 2009); finite, >= 0.
        depth: how many candidates to ask each provider for (default: the limit).

    Example:
        >>> from mapmatched_torch import ScoredCandidate
        >>> class Fixed:
        ...     def __init__(self, ids): self.ids = ids
        ...     def retrieve(self, query, limit): return [ScoredCandidate(i, 1.0) for i in self.ids[:limit]]
        >>> fusion = FusionProvider([Fixed(["a", "b"]), Fixed(["b", "c"])], rank_constant=0)
        >>> [(c.chunk_id, c.score) for c in fusion.retrieve("q", 3)]
        [('b', 1.5), ('a', 1.0), ('c', 0.5)]
    """

    def __init__(
        self,
        providers: Sequence[Any],
        *,
        weights: Optional[Sequence[float]] = None,
        rank_constant: float = 60.0,
        depth: Optional[int] = None,
    ) -> None:
        providers = list(providers)
        if not providers:
            raise MapMatchedValueError("FusionProvider needs at least one provider")
        for position, provider in enumerate(providers):
            try:
                provider_answer(provider)
            except MapMatchedTypeError as error:
                raise MapMatchedTypeError(f"provider {position}: {error}") from None
        if weights is None:
            weights = [1.0] * len(providers)
        weights = [check_weight(weight, f"weight {position}") for position, weight in enumerate(weights)]
        if len(weights) != len(providers):
            raise MapMatchedValueError(f"got {len(weights)} weights for {len(providers)} providers")
        if not any(weights):
            raise MapMatchedValueError("at least one fusion weight must be positive")
        self._providers = providers
        self._weights = weights
        self._rank_constant = check_weight(rank_constant, "rank_constant")
        self._depth = None if depth is None else check_positive_int(depth, "depth")

    @property
    def weights(self) -> Tuple[float, ...]:
        return tuple(self._weights)

    def retrieve(self, query: str, limit: int) -> Tuple[ScoredCandidate, ...]:
        """Ask every provider, fuse, return the best ``limit`` (sorted by (-score, ID))."""
        return self.retrieve_batch([query], limit)[0]

    def retrieve_batch(self, queries: Sequence[str], limit: int) -> List[Tuple[ScoredCandidate, ...]]:
        """:meth:`retrieve` for many queries (providers' own ``retrieve_batch`` when they have one)."""
        queries, limit = check_batch(queries, limit)
        depth = self._depth or limit
        per_provider = [_ask(provider, queries, depth) for provider in self._providers]
        return [
            reciprocal_rank_fusion([rankings[q] for rankings in per_provider], self._weights, self._rank_constant, limit)
            for q in range(len(queries))
        ]


def _ask(provider: Any, queries: List[str], depth: int) -> List[Sequence[ScoredCandidate]]:
    batch = getattr(provider, "retrieve_batch", None)
    if callable(batch):
        results, name = list(batch(queries, depth)), "retrieve_batch(queries, limit)"
    else:
        method, answer = provider_answer(provider)
        results, name = [answer(q, depth) for q in queries], f"{method}(query, limit)"
    what = f"candidates from {type(provider).__name__}.{name}"
    return [as_scored_candidates(result, what) for result in results]
