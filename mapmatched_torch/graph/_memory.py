"""Memory budgets of the search engines: how many sources' (N,) rows fit at once."""

from __future__ import annotations

from typing import Optional

__all__ = ["DEFAULT_MEMORY_BUDGET", "budget", "rows_per_chunk"]

#: Default bytes of search state per chunk of sources (torch workspace, scipy output).
DEFAULT_MEMORY_BUDGET = 1 << 30


def budget(memory_budget: Optional[int]) -> int:
    """The memory budget in bytes (:data:`DEFAULT_MEMORY_BUDGET` when None)."""
    return DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)


def rows_per_chunk(nodes: int, count: int, memory_budget: Optional[int], bytes_per_entry: int = 8) -> int:
    """How many of ``count`` sources' (N,) rows of ``bytes_per_entry`` fit in the budget (in ``[1, count]``)."""
    return max(1, min(count, budget(memory_budget) // (bytes_per_entry * max(nodes, 1))))
