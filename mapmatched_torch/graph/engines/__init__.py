"""Bounded shortest-path engines over a CSR adjacency (dispatched by
:mod:`mapmatched_torch.graph.shortest_paths`).

Every engine implements one contract (:mod:`.base`): an object with a ``name`` and
``rows(adjacency, sources, options)`` / ``pairs(adjacency, pairs, options)``, taking
one validated :class:`~.base.SearchOptions`.

- :mod:`.frontier`: frontier relaxation with scatter-min in torch (any device);
- :mod:`.scipy_dijkstra`: scipy's Dijkstra (CPU; the predecessor's engine and an oracle);
- :mod:`.hybrid`: target-aware torch searches for small balls, scipy for large ones (CPU);
- :mod:`.compiled` with :mod:`.compiled_kernels`: target-aware Dijkstra and guided A*
  compiled by numba (CPU, the ``[numba]`` extra).
"""

from __future__ import annotations

from typing import Dict

from .base import DistanceEngine, GroupedPairs, SearchOptions
from .compiled import COMPILED_ENGINE
from .frontier import FRONTIER_ENGINE
from .hybrid import HYBRID_ENGINE
from .scipy_dijkstra import SCIPY_ENGINE

__all__ = ["DistanceEngine", "GroupedPairs", "SearchOptions", "SEARCH_ENGINES"]

#: The search engines by ``engine=`` name, in the order error messages list them.
SEARCH_ENGINES: Dict[str, DistanceEngine] = {
    engine.name: engine for engine in (FRONTIER_ENGINE, SCIPY_ENGINE, HYBRID_ENGINE, COMPILED_ENGINE)
}
