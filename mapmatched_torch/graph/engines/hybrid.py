"""The hybrid engine (CPU): target-aware torch searches for small balls, scipy for big ones.

A source whose target-aware frontier search (:mod:`.frontier`) stays small is settled
there, with no O(N) set-up; one that expands more than ``work_limit`` frontier entries
(default ``N // 64``) is abandoned and gets scipy's full bounded search
(:mod:`.scipy_dijkstra`), where scipy's per-arc speed wins. Below
:data:`MIN_WORK_LIMIT` (N < 4096 with the default) the torch pass cannot pay for
itself and scipy runs alone. Values are every engine's (exact either way).
"""

from __future__ import annotations

import dataclasses

import torch

from .._csr import CSRAdjacency
from .base import GroupedPairs, SearchOptions
from .frontier import frontier_pairs
from .scipy_dijkstra import SCIPY_ENGINE

__all__ = ["HybridEngine", "HYBRID_ENGINE", "MIN_WORK_LIMIT"]

#: The smallest default ``work_limit`` worth a torch pass.
MIN_WORK_LIMIT = 64


class HybridEngine:
    """The ``"hybrid"`` engine (:class:`~.base.DistanceEngine`); rows, and pairs with
    ``target_aware=False``, are scipy's."""

    name = "hybrid"

    def rows(self, adjacency: CSRAdjacency, sources: torch.Tensor, options: SearchOptions) -> torch.Tensor:
        """``(S, N)`` bounded rows: scipy's (see :meth:`.base.DistanceEngine.rows`)."""
        return SCIPY_ENGINE.rows(adjacency, sources, options)

    def pairs(self, adjacency: CSRAdjacency, pairs: GroupedPairs, options: SearchOptions) -> torch.Tensor:
        """``(P,)`` distances of grouped pairs (see :meth:`.base.DistanceEngine.pairs`)."""
        full = dataclasses.replace(options, target_aware=False)
        if not options.target_aware:
            return SCIPY_ENGINE.pairs(adjacency, pairs, full)
        limit = adjacency.num_nodes // 64 if options.work_limit is None else options.work_limit
        if options.work_limit is None and limit < MIN_WORK_LIMIT:
            return SCIPY_ENGINE.pairs(adjacency, pairs, full)
        values, abandoned = frontier_pairs(adjacency, pairs, options, abandon_after=limit)
        # shape: (P,) pairs of the abandoned sources
        chosen = abandoned.index_select(0, pairs.pair_row)
        if bool(chosen.any()):
            sub_sources, sub_row = torch.unique_consecutive(
                pairs.row_sources[pairs.pair_row[chosen]], return_inverse=True
            )
            values[chosen] = SCIPY_ENGINE.pairs(
                adjacency, GroupedPairs(sub_sources, sub_row, pairs.pair_target[chosen]), full
            )
        return values


#: The engine object :mod:`~mapmatched_torch.graph.shortest_paths` dispatches to.
HYBRID_ENGINE = HybridEngine()
