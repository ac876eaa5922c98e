"""The scipy engine: ``scipy.sparse.csgraph.dijkstra`` for many sources per call (CPU).

scipy's ``limit`` is inclusive (a node exactly at ``limit`` is kept; the tests check
it), and :meth:`CSRAdjacency.scipy_matrix` has no duplicate arcs and no explicit
zeros, so scipy reads exactly the stored arcs. Each source costs at least O(N)
(scipy initialises a node array per source), however small its search.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .._csr import CSRAdjacency
from .._memory import rows_per_chunk

__all__ = ["scipy_rows", "scipy_pairs"]

#: How much the target-aware search widens its limit each round.
GROWTH = 4.0


def scipy_rows(adjacency: CSRAdjacency, sources: np.ndarray, limit: float) -> np.ndarray:
    """``(S, N)`` float64 numpy rows from scipy's Dijkstra, ``inf`` past ``limit``."""
    if not sources.size:
        return np.empty((0, adjacency.num_nodes), dtype=np.float64)
    from scipy.sparse.csgraph import dijkstra

    return dijkstra(adjacency.scipy_matrix(), directed=True, indices=sources, limit=float(limit))


def scipy_pairs(
    adjacency: CSRAdjacency,
    row_sources: torch.Tensor,
    pair_row: torch.Tensor,
    pair_target: torch.Tensor,
    bound: float,
    target_aware: bool,
    memory_budget: Optional[int],
    initial_radius: Optional[float],
) -> torch.Tensor:
    """``(P,)`` distances of grouped pairs (see :func:`~.shortest_paths.source_target_distances`).

    Args:
        adjacency: the graph.
        row_sources: ``(S,)`` distinct source nodes.
        pair_row: ``(P,)`` sorted source row of each pair.
        pair_target: ``(P,)`` target node of each pair.
        bound: the bound.
        target_aware: search with limit ``initial_radius`` first (default twice the
            median arc distance), then ``4x`` wider up to the bound, repeating only
            the sources with a target not reached; else one search at the bound.
        memory_budget: bytes of scipy output per call (``8 N`` per source).
        initial_radius: see ``target_aware``.

    Returns:
        ``(P,)`` float64 on the graph's device, ``inf`` beyond the bound.
    """
    sources = row_sources.cpu().numpy()
    rows, targets = pair_row.cpu().numpy(), pair_target.cpu().numpy()
    values = np.full(rows.shape, np.inf)
    radius = bound
    if target_aware:
        radius = 2.0 * adjacency.typical_weight() if initial_radius is None else float(initial_radius)
    # shape: (P',) the pairs still searched, sorted by row
    pending = np.arange(rows.size)
    chunk = rows_per_chunk(adjacency.num_nodes, max(sources.size, 1), memory_budget)
    while pending.size:
        limit = min(radius, bound)
        # shape: (P',) the row of each pending pair (sorted), and the distinct pending rows
        pending_row = rows[pending]
        pending_rows = np.unique(pending_row)
        for first in range(0, pending_rows.size, chunk):
            block_rows = pending_rows[first:first + chunk]
            block = scipy_rows(adjacency, sources[block_rows], limit)
            lo, hi = np.searchsorted(pending_row, [block_rows[0], block_rows[-1] + 1])
            pairs = pending[lo:hi]
            values[pairs] = block[np.searchsorted(block_rows, pending_row[lo:hi]), targets[pairs]]
        if limit >= bound:
            break
        unresolved = np.unique(pending_row[np.isinf(values[pending])])
        pending = pending[np.isin(pending_row, unresolved)]
        radius *= GROWTH
    return torch.from_numpy(values).to(adjacency.device)
