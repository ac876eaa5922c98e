"""The one contract of the distance engines: their options, their input, their interface.

Every engine (:mod:`.frontier`, :mod:`.scipy_dijkstra`, :mod:`.hybrid`,
:mod:`.compiled`) is an object with a ``name`` and two methods of the same signature,
:meth:`DistanceEngine.rows` and :meth:`DistanceEngine.pairs`, taking one
:class:`SearchOptions` (validated once, when it is made) instead of loose positional
tuning arguments. :mod:`~mapmatched_torch.graph.shortest_paths` picks the engine by
name and calls it; the values are those of docs/spec.md section 4 whatever the engine
or options (the tests compare every engine with the standalone graph, bit for bit).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

import torch

from ...core.checks import check_nonnegative_int, check_positive_finite, check_positive_int
from ...core.errors import MapMatchedValueError
from .._csr import CSRAdjacency

__all__ = ["SearchOptions", "GroupedPairs", "DistanceEngine"]


@dataclass(frozen=True, slots=True)
class SearchOptions:
    """How a bounded search runs; never what it returns (the values are exact anyway).

    Args:
        bound: the search bound, a number >= 0 (``inf`` allowed for rows): paths longer
            than it are not searched; a path exactly at it counts.
        target_aware: stop each search once its targets are exact (default True;
            ``False`` runs one full bounded search per source, the predecessor's way;
            the compiled engine is always target-aware).
        memory_budget: bytes of search state per chunk of sources (None: 1 GiB).
        initial_radius: first radius of the scipy target-aware search, finite > 0
            (None: twice the median arc distance).
        work_limit: frontier entries a hybrid torch search may expand before its source
            goes to scipy, >= 0 (None: ``N // 64``, and scipy alone when N < 4096).
        settle_limit: nodes the compiled engine's first search of a source may settle
            before its far pairs go to the guided pass, >= 0 (None: ``max(64, N // 64)``).
        ball_limit: nodes of each pair group's backward ball in the compiled engine,
            > 0 (None: ``max(256, N // 8)``).
        threads: the compiled engine's parallel blocks, >= 0 (None or 0: numba's
            thread count).

    Raises:
        ValueError: an option of the wrong type or out of range (naming it).

    Example:
        >>> SearchOptions(2.5, memory_budget=1 << 20).target_aware
        True
        >>> SearchOptions(-1.0)
        Traceback (most recent call last):
        ...
        mapmatched_torch.core.errors.MapMatchedValueError: bound must be a number >= 0 (inf allowed), got -1.0
    """

    bound: float
    target_aware: bool = True
    memory_budget: Optional[int] = None
    initial_radius: Optional[float] = None
    work_limit: Optional[int] = None
    settle_limit: Optional[int] = None
    ball_limit: Optional[int] = None
    threads: Optional[int] = None

    def __post_init__(self) -> None:
        bound = self.bound
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or math.isnan(bound) or bound < 0:
            raise MapMatchedValueError(f"bound must be a number >= 0 (inf allowed), got {bound!r}")
        object.__setattr__(self, "bound", float(bound))
        if not isinstance(self.target_aware, bool):
            raise MapMatchedValueError(f"target_aware must be True or False, got {self.target_aware!r}")
        _optional(self, "memory_budget", check_positive_int)
        _optional(self, "initial_radius", check_positive_finite)
        _optional(self, "work_limit", check_nonnegative_int)
        _optional(self, "settle_limit", check_nonnegative_int)
        _optional(self, "ball_limit", check_positive_int)
        _optional(self, "threads", check_nonnegative_int)


def _optional(options: SearchOptions, name: str, check: Any) -> None:
    """Validate (and normalize) the optional field ``name`` unless it is None."""
    value = getattr(options, name)
    if value is not None:
        object.__setattr__(options, name, check(value, name))


class GroupedPairs(NamedTuple):
    """Distinct node pairs grouped by distinct source: what :meth:`DistanceEngine.pairs` answers.

    Attributes:
        row_sources: ``(S,)`` int64 sorted distinct source nodes.
        pair_row: ``(P,)`` int64 sorted row (index into ``row_sources``) of each pair.
        pair_target: ``(P,)`` int64 target node of each pair.
        pair_group: ``(P,)`` int64 group of each pair (pairs of one group have targets
            close together, e.g. one trellis turn pair), or None. Only guides the
            compiled engine's far searches; never changes a value.
    """

    row_sources: torch.Tensor
    pair_row: torch.Tensor
    pair_target: torch.Tensor
    pair_group: Optional[torch.Tensor] = None


class DistanceEngine(Protocol):
    """A bounded shortest-path engine over a :class:`~.._csr.CSRAdjacency`.

    Attributes:
        name: the ``engine=`` value that selects it.
    """

    name: str

    def rows(self, adjacency: CSRAdjacency, sources: torch.Tensor, options: SearchOptions) -> torch.Tensor:
        """Full bounded rows of S sources.

        Args:
            adjacency: the graph (N nodes).
            sources: ``(S,)`` int64 node indices in ``[0, N)``, on the graph's device.
            options: ``options.bound`` is the limit; engines read the options they use.

        Returns:
            ``(S, N)`` float64 on the graph's device: ``[s, v]`` = the shortest path
            length from ``sources[s]`` to ``v`` when ``<= bound``, else ``inf``.
        """
        ...

    def pairs(self, adjacency: CSRAdjacency, pairs: GroupedPairs, options: SearchOptions) -> torch.Tensor:
        """Bounded distances of grouped pairs.

        Args:
            adjacency: the graph (N nodes).
            pairs: the distinct pairs, grouped by source, on the graph's device.
            options: the bound and the tuning options (see :class:`SearchOptions`).

        Returns:
            ``(P,)`` float64 on the graph's device: the shortest path length of each
            pair when ``<= bound``, else ``inf``; identical for every engine and option.
        """
        ...
