"""Exact bounded shortest paths for batches of sources (docs/spec.md section 4).

Every engine returns, for a pair ``(s, t)``, the minimum over paths from ``s`` to ``t``
of the path's float64 left-fold length ``((w1 + w2) + w3) + ...``, among paths no
longer than the bound (a path exactly at the bound counts). Float addition is
monotone and the distances are positive, so Dijkstra (the standalone graph, scipy)
and frontier relaxation (Bellman-Ford style, the torch engine) compute exactly that
minimum: every engine agrees bit for bit with
:class:`~mapmatched_torch.standalone.graph.InMemoryCorpusGraph`.

Engines (``engine=``), each implementing one contract (:mod:`.engines.base`: ``rows``
and ``pairs`` methods taking one validated :class:`~.engines.base.SearchOptions`):

- ``"torch"``: batched frontier relaxation with ``scatter_reduce("amin")`` on the
  graph's device (:mod:`.engines.frontier`). Work is proportional to the arcs relaxed (no
  O(N) per source); on CPU each relaxed arc costs ~10x what it costs in scipy's C
  loop, on a GPU it runs thousands of sources at once.
- ``"scipy"``: ``scipy.sparse.csgraph.dijkstra`` on CPU for many sources per call.
  scipy's ``limit`` is inclusive (checked by the tests), and the CSR it reads has no
  duplicate arcs and no explicit zeros. Each source costs at least O(N) in scipy
  (its per-source initialisation), however small the search.
- ``"hybrid"`` (CPU): target-aware torch searches settle the sources whose search
  stays small (no O(N) set-up); a source whose search grows past ``work_limit``
  expanded entries (default ``N // 64``) is abandoned and gets scipy's full bounded
  search instead, where scipy's per-arc speed wins. Below 64 (N < 4096) the torch
  pass cannot pay for itself and scipy runs alone (:mod:`.engines.hybrid`).
- ``"compiled"`` (CPU, needs numba: the ``[numba]`` extra): a target-aware
  Dijkstra per source in compiled code, sources spread over the CPU threads, no O(N)
  set-up per source (:mod:`.engines.compiled`). Given pair groups (a trellis's turn pairs,
  whose targets lie close together), the pairs a source's search does not reach
  within ``settle_limit`` nodes are answered by A* searches guided by a backward ball
  around each group's targets, which settle a small fraction of what a full bounded
  search settles. Values are unchanged by the guidance (the heuristic is made
  strictly consistent; see :func:`.engines.compiled._heuristic_scale`).
- ``"dense"``: gathers from a precomputed ``(N, N)`` table (:mod:`.dense`).
- ``"auto"``: ``"dense"`` when a table is given, else ``"torch"`` on an accelerator,
  and on CPU ``"compiled"`` when numba is installed, else ``"hybrid"``. In
  ``benchmarks/distances.py`` (2 CPU cores) the compiled engine is the fastest CPU
  engine (see the table in docs/performance.md); of the numba-free ones the hybrid was the fastest
  in every regime measured (1.01x to 1.8x the predecessor's full scipy searches),
  while scipy's widening lost up to 21% on saturated batches and a pure torch
  relaxation costs ~10x scipy's C loop per arc.

Target-aware search (``target_aware=True``, the default) answers pairs without
completing whole bounded rows:

- torch: each source keeps a cap, the largest current distance among its targets
  (``inf`` while one is unreached); candidates and frontier entries at or past the cap
  are dropped (they cannot shorten a target). When the frontier empties, every target
  is exact.
- scipy: searches with a small limit first (``initial_radius``, default twice the
  median arc distance), then ``4x`` wider up to the bound, repeating only the sources
  with a target not reached yet. A target reached within limit ``r`` is exact, since
  every path up to ``r`` was explored.
- hybrid: the torch pass uses caps; the scipy pass for abandoned sources is full.

``target_aware=False`` runs one full bounded search per distinct source (the
predecessor's way; ``"hybrid"`` then means plain scipy). Either way the values are
identical.

Index codes (see :mod:`.vocabulary`): ``>= 0`` a node, ``-1`` padding, ``<= -2`` an
unknown chunk ID (equal codes are the same ID). :func:`pair_distances` gives 0.0 to
equal non-padding codes (SPEC's ``d(a, a) = 0``, unknown IDs included) and
``maximum_distance`` to every other pair involving a negative code; padding is
``maximum_distance`` even to itself (the decoder masks it anyway).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..core.checks import broadcast_shape, check_choice
from ..core.errors import MapMatchedValueError
from ..core.optional import import_optional
from ..kernels.backend import backend_for
from ._csr import CSRAdjacency
from ._memory import DEFAULT_MEMORY_BUDGET, rows_per_chunk
from .cache import DistanceCache
from .engines import SEARCH_ENGINES, GroupedPairs, SearchOptions
from .engines import compiled as _compiled

__all__ = [
    "ENGINES",
    "DEFAULT_MEMORY_BUDGET",
    "resolve_engine",
    "bounded_rows",
    "source_target_distances",
    "pair_distances",
    "grid_distances",
    "SearchOptions",
]

#: The accepted ``engine`` values.
ENGINES = ("auto", "torch", "scipy", "hybrid", "compiled", "dense")
#: The engines that search (the others resolve to one of these, or gather).
_SEARCH_ENGINES = tuple(SEARCH_ENGINES)


def resolve_engine(engine: str, device: torch.device, *, has_table: bool = False) -> str:
    """The concrete engine for ``engine`` on ``device``.

    Args:
        engine: one of :data:`ENGINES`.
        device: the graph's device.
        has_table: whether a dense table is available.

    Returns:
        ``"torch"``, ``"scipy"``, ``"hybrid"``, ``"compiled"`` or ``"dense"``.

    Raises:
        ValueError: an unknown engine, or ``"dense"`` without a table.
        MissingDependencyError: ``"compiled"`` without numba (the ``[numba]`` extra).
    """
    check_choice("distance engine", engine, ENGINES)
    if engine == "auto":
        if has_table:
            return "dense"
        if torch.device(device).type != "cpu":
            return "torch"
        return "compiled" if _compiled.available() else "hybrid"
    if engine == "compiled":
        import_optional("numba", "numba", "the compiled distance engine")
    if engine == "dense" and not has_table:
        raise MapMatchedValueError(
            "engine 'dense' needs a precomputed table: call TensorCorpusGraph.precompute_dense() first"
        )
    return engine


def _search_engine(engine: str, device: torch.device) -> str:
    """A search engine (never ``"dense"``): ``"auto"`` resolves as without a table."""
    resolved = resolve_engine(engine, device) if engine != "dense" else engine
    if resolved not in _SEARCH_ENGINES:
        check_choice("search engine", engine, ("auto",) + _SEARCH_ENGINES)
    return resolved


# ---------------------------------------------------------------------- public API


def bounded_rows(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    *,
    limit: float,
    engine: str = "auto",
    memory_budget: Optional[int] = None,
) -> torch.Tensor:
    """Full bounded distance rows of S sources.

    Args:
        adjacency: the graph.
        sources: ``(S,)`` int64 node indices in ``[0, N)``, on the graph's device.
        limit: the bound (``inf`` allowed): paths longer than it are not searched.
        engine: ``"auto"``, ``"torch"``, ``"scipy"``, ``"hybrid"`` (= scipy here) or
            ``"compiled"`` (complete ball searches on every thread).
        memory_budget: bytes of search state per chunk of sources (torch engine).

    Returns:
        ``(S, N)`` float64 on the graph's device: ``[s, v]`` = the shortest path length
        from ``sources[s]`` to ``v`` when it is ``<= limit``, else ``inf``.

    Raises:
        ValueError: an unknown engine, a bad ``limit`` or ``memory_budget`` (see
            :class:`~.engines.base.SearchOptions`).

    Cost: O(S * N) memory for the result; one bounded search per source.
    """
    engine = _search_engine(engine, adjacency.device)
    options = SearchOptions(limit, memory_budget=memory_budget)
    return SEARCH_ENGINES[engine].rows(adjacency, sources, options)


def source_target_distances(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    targets: torch.Tensor,
    *,
    bound: float,
    engine: str = "auto",
    target_aware: bool = True,
    memory_budget: Optional[int] = None,
    initial_radius: Optional[float] = None,
    work_limit: Optional[int] = None,
    groups: Optional[torch.Tensor] = None,
    settle_limit: Optional[int] = None,
    ball_limit: Optional[int] = None,
) -> torch.Tensor:
    """Bounded distances of Q node pairs, one search per distinct source.

    Args:
        adjacency: the graph.
        sources: ``(Q,)`` int64 node indices in ``[0, N)``, on the graph's device.
        targets: ``(Q,)`` int64 node indices in ``[0, N)``.
        bound: the bound (finite, > 0).
        engine: ``"auto"``, ``"torch"``, ``"scipy"``, ``"hybrid"`` or ``"compiled"``.
        target_aware: stop each search once its targets are exact (see the module
            docstring); False runs full bounded searches (the predecessor's way;
            the compiled engine is always target-aware).
        memory_budget: bytes of search state per chunk of sources.
        initial_radius: first radius of the scipy target-aware search (default twice
            the median arc distance).
        work_limit: frontier entries a hybrid torch search may expand before its
            source goes to scipy (default ``N // 64``; scipy alone when N < 4096).
        groups: ``(Q,)`` int64, the group of each pair (e.g. its trellis turn pair:
            pairs of one group have targets close together), or None. Only the
            compiled engine uses it, to guide the searches for far pairs.
        settle_limit, ball_limit: the compiled engine's guided-search sizes (see
            :meth:`.engines.compiled.CompiledEngine.pairs`).

    Returns:
        ``(Q,)`` float64: the shortest path length when ``<= bound``, else ``inf``.
        Identical for every engine, ``target_aware`` setting and grouping.

    Raises:
        ValueError: an unknown engine, a bad option (see
            :class:`~.engines.base.SearchOptions`), ``groups`` of the wrong dtype or shape.
    """
    engine = _search_engine(engine, adjacency.device)
    _check_groups(groups, sources.shape)
    options = SearchOptions(
        bound, target_aware=target_aware, memory_budget=memory_budget, initial_radius=initial_radius,
        work_limit=work_limit, settle_limit=settle_limit, ball_limit=ball_limit,
    )
    return _distances(adjacency, sources, targets, engine, options, groups)


def _distances(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    targets: torch.Tensor,
    engine: str,
    options: SearchOptions,
    groups: Optional[torch.Tensor],
) -> torch.Tensor:
    """:func:`source_target_distances` after the checks: ``engine`` is a search engine's name."""
    # shape: (S,), (P,), (P,), (Q,): distinct sources, distinct pairs, pair of each query
    row_sources, pair_row, pair_target, inverse = _group_by_source(sources, targets, adjacency.num_nodes)
    pair_group = None
    if groups is not None:
        # shape: (P,) any group of a repeated pair will do
        pair_group = torch.empty(pair_row.shape, dtype=torch.long, device=groups.device)
        pair_group[inverse.to(groups.device)] = groups.reshape(-1)
    pairs = GroupedPairs(row_sources, pair_row, pair_target, pair_group)
    values = SEARCH_ENGINES[engine].pairs(adjacency, pairs, options)
    return values[inverse]


def pair_distances(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    targets: torch.Tensor,
    *,
    maximum_distance: float,
    engine: str = "auto",
    cache: Optional[DistanceCache] = None,
    table: Optional[torch.Tensor] = None,
    groups: Optional[torch.Tensor] = None,
    target_aware: bool = True,
    memory_budget: Optional[int] = None,
    initial_radius: Optional[float] = None,
    work_limit: Optional[int] = None,
    settle_limit: Optional[int] = None,
    ball_limit: Optional[int] = None,
) -> torch.Tensor:
    """docs/spec.md distances ``d(sources[...], targets[...])`` of index codes, elementwise.

    Args:
        adjacency: the graph.
        sources: int64 index codes of any shape, on the graph's device (``>= 0`` a
            node, ``-1`` padding, ``<= -2`` an unknown ID; see the module docstring).
        targets: int64 index codes, the same shape.
        maximum_distance: the bound, and the distance of everything not within it.
        engine: one of :data:`ENGINES`.
        cache: answers the pairs it holds first; receives the pairs computed here.
        table: an ``(N, N)`` dense table (:func:`~.dense.build_dense_table`).
        groups: int64 of the same shape, the group of each pair (see
            :func:`source_target_distances`), or None.
        target_aware, memory_budget, initial_radius, work_limit, settle_limit,
            ball_limit: the tuning options of :func:`source_target_distances` (one
            :class:`~.engines.base.SearchOptions`; they never change a value).

    Returns:
        float64 tensor of the same shape on the graph's device: 0.0 for equal
        non-padding codes, the bounded shortest path length between nodes, and
        ``maximum_distance`` otherwise.

    Raises:
        ValueError: mismatched shapes, a non-integer dtype, another device, a node
            index ``>= N``, an unknown engine, a bad option.

    Cost: one search per distinct source among the pairs the cache does not hold.
    """
    _check_codes(sources, targets, adjacency)
    _check_groups(groups, sources.shape)
    options = SearchOptions(
        maximum_distance, target_aware=target_aware, memory_budget=memory_budget, initial_radius=initial_radius,
        work_limit=work_limit, settle_limit=settle_limit, ball_limit=ball_limit,
    )
    engine = resolve_engine(engine, adjacency.device, has_table=table is not None)
    return _code_distances(adjacency, sources, targets, engine, cache, table, options, groups)


def _code_distances(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    targets: torch.Tensor,
    engine: str,
    cache: Optional[DistanceCache],
    table: Optional[torch.Tensor],
    options: SearchOptions,
    groups: Optional[torch.Tensor],
) -> torch.Tensor:
    """:func:`pair_distances` after the checks (``engine`` resolved, the bound
    ``options.bound`` is the maximum distance)."""
    maximum_distance = options.bound
    if engine == "dense":
        return table_distances(table, sources, targets, maximum_distance)
    # shape: (Q,)
    flat_sources, flat_targets = sources.reshape(-1), targets.reshape(-1)
    equal = (flat_sources == flat_targets) & (flat_sources != -1)
    zero = torch.zeros((), dtype=torch.float64, device=adjacency.device)
    result = torch.where(equal, zero, torch.full_like(zero, maximum_distance))
    need = (flat_sources >= 0) & (flat_targets >= 0) & ~equal
    if bool(need.any()):
        node_sources, node_targets = flat_sources[need], flat_targets[need]
        node_groups = None if groups is None else groups.reshape(-1)[need]
        values = _cached_distances(adjacency, node_sources, node_targets, engine, cache, options, node_groups)
        result[need] = torch.where(torch.isinf(values), maximum_distance, values)
    return result.view(sources.shape)


def grid_distances(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    targets: torch.Tensor,
    *,
    maximum_distance: float,
    engine: str = "auto",
    cache: Optional[DistanceCache] = None,
    table: Optional[torch.Tensor] = None,
    target_aware: bool = True,
    memory_budget: Optional[int] = None,
    initial_radius: Optional[float] = None,
    work_limit: Optional[int] = None,
    settle_limit: Optional[int] = None,
    ball_limit: Optional[int] = None,
    validate: bool = True,
) -> torch.Tensor:
    """:func:`pair_distances` of every source of a group to every target of it: one
    trellis turn pair per group.

    Args:
        adjacency, maximum_distance, engine, cache, table: as for :func:`pair_distances`.
        target_aware, memory_budget, initial_radius, work_limit, settle_limit,
            ball_limit: as for :func:`pair_distances` (the pairs of one group form
            one search group).
        sources: ``(G, M)`` int64 index codes.
        targets: ``(G, M')`` int64 index codes.
        validate: False: the caller guarantees the codes (< N): they are not read back
            to check them (a dense table then answers with no host read).

    Returns:
        ``(G, M, M')`` float64, ``[g, j, i]`` = d(``sources[g, j]``, ``targets[g, i]``).

    Raises:
        ValueError: tensors that are not ``(G, M)`` and ``(G, M')`` int64 on the graph's
            device, a node index ``>= N``, an unknown engine, a bad option.

    Cost: with a dense table one broadcast gather (one compiled pass on the CPU with
    numba); with a CPU cache and numba one compiled pass answers the cached pairs and
    the codes that need no graph (no ``(G, M, M')`` index tensors), and only the pairs
    it misses are searched;
    otherwise :func:`pair_distances` of the expanded pairs.
    """
    if validate:
        _check_grid(sources, targets, adjacency)
    options = SearchOptions(
        maximum_distance, target_aware=target_aware, memory_budget=memory_budget, initial_radius=initial_radius,
        work_limit=work_limit, settle_limit=settle_limit, ball_limit=ball_limit,
    )
    maximum_distance = options.bound
    engine = resolve_engine(engine, adjacency.device, has_table=table is not None)
    if engine == "dense":
        nodes = adjacency.num_nodes
        compiled = table.device.type == "cpu" and table.dtype == torch.float64 and table.is_contiguous()
        if compiled and tuple(table.shape) == (nodes, nodes) and backend_for(table.device) == "numba":
            return _compiled.compiled_table_grid(table, sources, targets, maximum_distance)  # one compiled pass
        # one gather, broadcasting (G, M, 1) against (G, 1, M'): no expanded copies
        return table_distances(table, sources[:, :, None], targets[:, None, :], maximum_distance)
    shape = (sources.shape[0], sources.shape[1], targets.shape[1])
    # shape: (G, M, M') [g, j, i]: code j of group g -> code i of group g
    pair_sources, pair_targets = sources[:, :, None].expand(shape), targets[:, None, :].expand(shape)
    groups = torch.arange(shape[0], device=sources.device).view(-1, 1, 1).expand(shape)
    if cache is None or not cache.grid_lookup:
        return _code_distances(adjacency, pair_sources, pair_targets, engine, cache, table, options, groups)
    values, answered = cache.lookup_grid(sources, targets, maximum_distance)
    missing = ~answered
    if bool(missing.any()):
        computed = _searched_distances(adjacency, pair_sources, pair_targets, missing, engine, cache, options, groups)
        values[missing] = torch.where(torch.isinf(computed), maximum_distance, computed)
    return values


def table_distances(
    table: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor, maximum_distance: float
) -> torch.Tensor:
    """:func:`pair_distances` from a dense ``(N, N)`` table, for broadcastable code tensors.

    Args:
        table: ``(N, N)`` float64 (``inf``: no path within the bound; an entry above
            ``maximum_distance`` counts as beyond it).
        sources, targets: int64 index codes whose shapes broadcast, e.g. ``(B, M, 1)``
            and ``(B, 1, M)`` (validated by the caller).
        maximum_distance: the distance of padding, unknown IDs and unreachable pairs.

    Returns:
        float64 of the broadcast shape: 0.0 for equal non-padding codes, else the
        table's entry for two nodes, else ``maximum_distance``.

    Cost: one gather from the flat table and a few elementwise passes over the
    result (a masked 2-D advanced index is several times slower on CPU).
    """
    shape = torch.Size(broadcast_shape(sources.shape, targets.shape))
    # shape: (Q,) flat table position of every slot (padding and unknown read entry 0, masked below)
    keys = (sources.clamp_min(0) * table.shape[1] + targets.clamp_min(0)).expand(shape).reshape(-1)
    values = table.reshape(-1).index_select(0, keys).view(shape)
    # entries are within the bound (= maximum_distance) or inf: inf -> maximum_distance
    values.clamp_max_(maximum_distance)
    # the masks broadcast from the small inputs: no full-size temporaries but one
    values.masked_fill_(sources < 0, maximum_distance).masked_fill_(targets < 0, maximum_distance)
    # equal codes are 0.0 apart, unknown IDs included, padding (-1) not: a target's -1
    # is replaced by a code no source has
    unequal = torch.where(targets == -1, torch.iinfo(torch.long).min, targets)
    return values.masked_fill_(sources == unequal, 0.0)


# ---------------------------------------------------------------------- shared helpers


def _check_codes(sources: torch.Tensor, targets: torch.Tensor, adjacency: CSRAdjacency) -> None:
    """Index-code tensors: same shape, integer dtype, the graph's device, nodes < N."""
    _check_code_tensors(adjacency, sources=sources, targets=targets)
    if sources.shape != targets.shape:
        raise MapMatchedValueError(
            f"sources and targets must have the same shape, got {tuple(sources.shape)} and {tuple(targets.shape)}"
        )


def _check_grid(sources: torch.Tensor, targets: torch.Tensor, adjacency: CSRAdjacency) -> None:
    """Index codes of :func:`grid_distances`: ``(G, M)`` and ``(G, M')`` int64 on the
    graph's device, nodes < N."""
    _check_code_tensors(adjacency, sources=sources, targets=targets)
    if sources.dim() != 2 or targets.dim() != 2 or sources.shape[0] != targets.shape[0]:
        raise MapMatchedValueError(
            f"sources and targets must be (G, M) and (G, M') code tensors, got {tuple(sources.shape)} and "
            f"{tuple(targets.shape)}"
        )


def _check_code_tensors(adjacency: CSRAdjacency, **tensors: torch.Tensor) -> None:
    """Each named tensor: int64 index codes on the graph's device, no node index >= N."""
    for name, codes in tensors.items():
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.long:
            dtype = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise MapMatchedValueError(f"{name} must be an int64 tensor of index codes, got {dtype}")
        if codes.device != adjacency.device:
            raise MapMatchedValueError(
                f"{name} is on {codes.device} but the graph is on {adjacency.device}; move one of them"
            )
    largest = max((int(codes.max()) for codes in tensors.values() if codes.numel()), default=-1)
    if largest >= adjacency.num_nodes:
        raise MapMatchedValueError(f"node index {largest} is out of range for a graph of {adjacency.num_nodes} nodes")


def _check_groups(groups: Optional[torch.Tensor], shape: torch.Size) -> None:
    """Pair groups: None, or an int64 tensor of the pairs' shape."""
    if groups is None:
        return
    if not isinstance(groups, torch.Tensor) or groups.dtype != torch.long:
        what = groups.dtype if isinstance(groups, torch.Tensor) else type(groups).__name__
        raise MapMatchedValueError(f"groups must be an int64 tensor, got {what}")
    if groups.shape != shape:
        raise MapMatchedValueError(f"groups must have the pairs' shape {tuple(shape)}, got {tuple(groups.shape)}")


def _cached_distances(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    targets: torch.Tensor,
    engine: str,
    cache: Optional[DistanceCache],
    options: SearchOptions,
    groups: Optional[torch.Tensor],
) -> torch.Tensor:
    """``(Q,)`` distances (``inf`` beyond the bound) of node pairs: cache first, then search."""
    if cache is None:
        return _distances(adjacency, sources, targets, engine, options, groups)
    # shape: (Q,)
    values, answered = cache.lookup(sources, targets)
    missing = ~answered
    if bool(missing.any()):
        values[missing] = _searched_distances(adjacency, sources, targets, missing, engine, cache, options, groups)
    return values


def _searched_distances(
    adjacency: CSRAdjacency,
    sources: torch.Tensor,
    targets: torch.Tensor,
    missing: torch.Tensor,
    engine: str,
    cache: DistanceCache,
    options: SearchOptions,
    groups: Optional[torch.Tensor],
) -> torch.Tensor:
    """``(P,)`` distances (``inf`` beyond the bound) of the node pairs the cache missed
    (``missing``: bool, the pairs' shape, as ``groups``), now stored in it.

    Where the cache keeps dense rows (:attr:`~.cache.DistanceCache.dense_rows`: a small
    graph, whose bound typically reaches most of it) each missed source gets one
    complete bounded search, stored whole: its later lookups are all hits. Otherwise
    the searches are target-aware and only the missed pairs are stored."""
    missing_sources, missing_targets = sources[missing], targets[missing]
    if cache.dense_rows:
        # shape: (R,) the distinct missed sources, (P,) each pair's row among them
        row_sources, place = torch.unique(missing_sources, return_inverse=True)
        computed = torch.empty(missing_sources.shape, dtype=torch.float64, device=sources.device)
        step = rows_per_chunk(adjacency.num_nodes, row_sources.numel(), options.memory_budget)
        for first in range(0, row_sources.numel(), step):
            rows = bounded_rows(adjacency, row_sources[first:first + step], limit=options.bound, engine=engine,
                                memory_budget=options.memory_budget)
            cache.insert_rows(row_sources[first:first + step], rows)
            pairs = ((place >= first) & (place < first + step)).nonzero().squeeze(1)
            computed[pairs] = rows[place[pairs] - first, missing_targets[pairs]]
        return computed
    missing_groups = None if groups is None else groups[missing]
    computed = _distances(adjacency, missing_sources, missing_targets, engine, options, missing_groups)
    cache.insert(missing_sources, missing_targets, computed)
    return computed


def _group_by_source(
    sources: torch.Tensor, targets: torch.Tensor, nodes: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct pairs grouped by distinct source.

    Returns:
        ``row_sources`` (S,) sorted distinct sources; ``pair_row`` (P,) sorted row of
        each distinct pair; ``pair_target`` (P,) its target; ``inverse`` (Q,) the
        distinct pair of each input pair.
    """
    # shape: (P,) sorted distinct keys, and (Q,) the key of each input pair
    keys, inverse = torch.unique(sources * nodes + targets, return_inverse=True)
    pair_source = torch.div(keys, nodes, rounding_mode="floor")
    pair_target = keys - pair_source * nodes
    row_sources, pair_row = torch.unique_consecutive(pair_source, return_inverse=True)
    return row_sources, pair_row, pair_target, inverse
