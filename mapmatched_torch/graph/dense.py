"""A precomputed dense ``(N, N)`` table of docs/spec.md distances, for small graphs.

With the table, trellis distances are one gather: no search at all. It costs
``8 * N**2`` bytes (float64) and N bounded searches to build:

======  ==========  ==============================================
N       table       remark
======  ==========  ==============================================
1,024   8 MiB
4,096   128 MiB     the default budget (:data:`DEFAULT_DENSE_BUDGET`)
8,192   512 MiB
16,384  2 GiB
20,000  3.2 GB      opt in with ``memory_budget=4 * 2**30``
46,340  16 GiB
======  ==========  ==============================================

Building is opt-in (:meth:`TensorCorpusGraph.precompute_dense`); a graph larger than
the budget raises instead of silently allocating. Entry ``[a, b]`` is the bounded
shortest path length from ``a`` to ``b`` (0.0 on the diagonal) and ``inf`` when there
is none within the bound; :func:`~.shortest_paths.pair_distances` turns ``inf`` into
``maximum_distance`` (keeping ``inf`` lets the table also answer neighbourhoods, where
"exactly at the bound" and "unreachable" differ).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.checks import check_positive_int
from ..core.errors import MapMatchedValueError
from ._csr import CSRAdjacency
from ._memory import empty_in_huge_pages, rows_per_chunk
from .shortest_paths import bounded_rows

__all__ = ["DEFAULT_DENSE_BUDGET", "dense_table_bytes", "max_dense_nodes", "build_dense_table"]

#: Default memory budget of a dense table: 128 MiB, i.e. N <= 4096.
DEFAULT_DENSE_BUDGET = 128 * 2**20

#: Rows of a CPU table are computed this many bytes at a time, then copied in.
_FILL_BLOCK_BYTES = 256 << 20


def dense_table_bytes(num_nodes: int) -> int:
    """Bytes of a float64 ``(N, N)`` table: ``8 * N**2``."""
    return 8 * int(num_nodes) ** 2


def max_dense_nodes(memory_budget: int = DEFAULT_DENSE_BUDGET) -> int:
    """The largest N whose table fits in ``memory_budget`` bytes (4096 for the default)."""
    return math.isqrt(int(memory_budget) // 8)


def build_dense_table(
    adjacency: CSRAdjacency,
    maximum_distance: float,
    *,
    memory_budget: int = DEFAULT_DENSE_BUDGET,
    engine: str = "auto",
    search_budget: Optional[int] = None,
) -> torch.Tensor:
    """Every pair's docs/spec.md distance.

    Args:
        adjacency: the graph (N nodes).
        maximum_distance: the bound.
        memory_budget: the most bytes the table may take (default 128 MiB).
        engine: ``"auto"``, ``"torch"``, ``"scipy"``, ``"hybrid"`` or ``"compiled"`` for the N bounded
            searches (see :func:`~.shortest_paths.bounded_rows`).
        search_budget: bytes of search state per chunk of sources.

    Returns:
        ``(N, N)`` float64 on the graph's device: ``[a, b]`` = the bounded shortest path
        length, ``inf`` when none is within the bound.

    Raises:
        ValueError: the table would exceed ``memory_budget`` (the message gives both sizes).

    Cost: ``8 * N**2`` bytes; N full bounded searches.
    """
    budget = check_positive_int(memory_budget, "memory_budget")
    size = dense_table_bytes(adjacency.num_nodes)
    if size > budget:
        raise MapMatchedValueError(
            f"a dense table of {adjacency.num_nodes} nodes takes {size} bytes, more than memory_budget={budget} "
            f"(at most {max_dense_nodes(budget)} nodes fit); raise memory_budget to opt in"
        )
    nodes = adjacency.num_nodes
    sources = torch.arange(nodes, device=adjacency.device)
    if adjacency.device.type != "cpu":
        return bounded_rows(adjacency, sources, limit=maximum_distance, engine=engine, memory_budget=search_budget)
    # on the CPU, filled a block of rows at a time into memory advised for huge pages
    # (gathers from the table are TLB-bound otherwise; see empty_in_huge_pages)
    table = empty_in_huge_pages((nodes, nodes), torch.float64)
    block = rows_per_chunk(nodes, max(nodes, 1), _FILL_BLOCK_BYTES)
    for first in range(0, nodes, block):
        table[first:first + block] = bounded_rows(
            adjacency, sources[first:first + block], limit=maximum_distance, engine=engine,
            memory_budget=search_budget,
        )
    return table
