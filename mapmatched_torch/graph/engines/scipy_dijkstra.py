"""The scipy engine: ``scipy.sparse.csgraph.dijkstra`` for many sources per call (CPU).

scipy's ``limit`` is inclusive (a node exactly at ``limit`` is kept; the tests check
it), and :meth:`CSRAdjacency.scipy_matrix` has no duplicate arcs and no explicit
zeros, so scipy reads exactly the stored arcs. Each source costs at least O(N)
(scipy initialises a node array per source), however small its search.
"""

from __future__ import annotations

import numpy as np
import torch

from .._csr import CSRAdjacency
from .._memory import rows_per_chunk
from .base import GroupedPairs, SearchOptions

__all__ = ["scipy_rows", "ScipyEngine", "SCIPY_ENGINE"]

#: How much the target-aware search widens its limit each round.
GROWTH = 4.0


def scipy_rows(adjacency: CSRAdjacency, sources: np.ndarray, limit: float) -> np.ndarray:
    """``(S, N)`` float64 numpy rows from scipy's Dijkstra, ``inf`` past ``limit``."""
    if not sources.size:
        return np.empty((0, adjacency.num_nodes), dtype=np.float64)
    from scipy.sparse.csgraph import dijkstra

    return dijkstra(adjacency.scipy_matrix(), directed=True, indices=sources, limit=float(limit))


class ScipyEngine:
    """The ``"scipy"`` engine (:class:`~.base.DistanceEngine`): scipy's Dijkstra on the
    CPU, results moved to the graph's device."""

    name = "scipy"

    def rows(self, adjacency: CSRAdjacency, sources: torch.Tensor, options: SearchOptions) -> torch.Tensor:
        """``(S, N)`` bounded rows (see :meth:`.base.DistanceEngine.rows`), one scipy call."""
        return torch.from_numpy(scipy_rows(adjacency, sources.cpu().numpy(), options.bound)).to(adjacency.device)

    def pairs(self, adjacency: CSRAdjacency, pairs: GroupedPairs, options: SearchOptions) -> torch.Tensor:
        """``(P,)`` distances of grouped pairs (see :meth:`.base.DistanceEngine.pairs`).

        With ``options.target_aware``: search with limit ``options.initial_radius``
        first (default twice the median arc distance), then ``4x`` wider up to the
        bound, repeating only the sources with a target not reached; else one search
        at the bound. Sources go to scipy ``memory_budget // (8 N)`` at a time.
        """
        bound = options.bound
        sources = pairs.row_sources.cpu().numpy()
        rows, targets = pairs.pair_row.cpu().numpy(), pairs.pair_target.cpu().numpy()
        values = np.full(rows.shape, np.inf)
        radius = bound
        if options.target_aware:
            radius = 2.0 * adjacency.typical_weight() if options.initial_radius is None else options.initial_radius
        # shape: (P',) the pairs still searched, sorted by row
        pending = np.arange(rows.size)
        chunk = rows_per_chunk(adjacency.num_nodes, max(sources.size, 1), options.memory_budget)
        while pending.size:
            limit = min(radius, bound)
            # shape: (P',) the row of each pending pair (sorted), and the distinct pending rows
            pending_row = rows[pending]
            pending_rows = np.unique(pending_row)
            for first in range(0, pending_rows.size, chunk):
                block_rows = pending_rows[first:first + chunk]
                block = scipy_rows(adjacency, sources[block_rows], limit)
                lo, hi = np.searchsorted(pending_row, [block_rows[0], block_rows[-1] + 1])
                chosen = pending[lo:hi]
                values[chosen] = block[np.searchsorted(block_rows, pending_row[lo:hi]), targets[chosen]]
            if limit >= bound:
                break
            unresolved = np.unique(pending_row[np.isinf(values[pending])])
            pending = pending[np.isin(pending_row, unresolved)]
            radius *= GROWTH
        return torch.from_numpy(values).to(adjacency.device)


#: The engine object :mod:`~mapmatched_torch.graph.shortest_paths` dispatches to.
SCIPY_ENGINE = ScipyEngine()
