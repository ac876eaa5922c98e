"""The corpus graph as tensors: CSR on a device, exact bounded distances in batches.

:class:`TensorCorpusGraph` implements the
:class:`~mapmatched_torch.core.protocols.CorpusGraph` protocol with exactly the values of
:class:`~mapmatched_torch.standalone.graph.InMemoryCorpusGraph` (docs/spec.md section 4),
and adds the batched API the tensor decoders use: :meth:`TensorCorpusGraph.trellis_distances`
fills the ``(B, T-1, M, M)`` distances of a padded trellis with one search per
distinct source (see :mod:`.shortest_paths` for the engines).

Conventions:

- Nodes are numbered by a :class:`~.vocabulary.ChunkVocabulary`. ``from_edges`` and
  ``from_graph`` number them like ``InMemoryCorpusGraph.nodes`` (declared nodes first,
  then endpoints as edges first mention them), so the CSR order is the standalone's.
- Index codes in tensors: ``>= 0`` a node, ``-1`` padding, ``<= -2`` an unknown chunk
  ID (equal codes = equal IDs). :meth:`TensorCorpusGraph.index_trellis` produces them
  from chunk IDs. Distances: 0.0 between equal non-padding codes (so an unknown ID is
  0.0 from itself, as docs/spec.md asks), ``maximum_distance`` for any other pair with a
  negative code. Padding gets ``maximum_distance`` everywhere (the decoder masks it).
- Single-pair :meth:`TensorCorpusGraph.distance` always reads the source's row (never
  the target's), so values never depend on the cache.
- A ball table (:meth:`TensorCorpusGraph.precompute_balls`, :mod:`.balls`) stores those
  source rows cut at the bound: with one attached, every distance is a binary search in
  the source's ball, with the same values.

Conversions from and to edges, torch_geometric and networkx live in :mod:`.convert`;
the ``from_*`` / ``to_*`` methods here are thin wrappers over them.

Why over 700 lines: it is one class, the graph's whole public API (the protocol, the
batched distances, neighbourhoods, the dense and ball tables); about 330 of its lines
are the docstrings of those public methods.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..core.checks import check_chunk_id, check_not_a_string, check_positive_finite, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.graph_types import (
    CacheInfo,
    EdgeLike,
    check_neighborhood_centre,
    check_neighborhood_radius,
    empty_distance_ids_error,
)
from ..kernels.ragged import padded_rows
from ..standalone.graph import InMemoryCorpusGraph
from ._csr import CSRAdjacency, csr_fingerprint
from ._memory import rows_per_chunk
from . import convert
from .cache import DistanceCache
from .balls import BallTable, ball_distances, build_ball_table
from .dense import DEFAULT_DENSE_BUDGET, build_dense_table
from .neighborhood_table import NeighborhoodTable, build_neighborhood_table
from .engines.compiled import compiled_balls
from .shortest_paths import _check_code_tensors, bounded_rows, grid_distances, pair_distances, resolve_engine
from .vocabulary import ChunkVocabulary

__all__ = ["TensorCorpusGraph"]

Device = Union[torch.device, str, None]


class TensorCorpusGraph:
    """A corpus graph on a device with exact, batched bounded distances.

    Build it with :meth:`from_edges`, :meth:`from_graph`, :meth:`from_edge_index` or
    :meth:`from_networkx`; the constructor takes a ready :class:`~._csr.CSRAdjacency`.

    Args:
        adjacency: the CSR arcs (no self-loops, no duplicates, positive finite float64).
        vocabulary: the chunk IDs of the N nodes.
        maximum_distance: the bound, finite and > 0 (default 10.0).
        directed: whether edges are one-way (an undirected adjacency stores both directions).
        distance_cache_size: most source rows the distance cache keeps (default 65536).
        distance_cache_entries: most ``(source, target)`` entries it keeps (default
            2**24, 256 MiB); where every node's complete row fits in those bytes (8 N**2,
            N <= 5,792 by default, on the CPU) the cache keeps complete rows densely
            instead (see :mod:`.cache`): a small graph's distances are then searched
            once per source.
        memory_budget: bytes of search state per chunk of sources (default 1 GiB).

    Raises:
        ValueError: a bad ``maximum_distance``, cache size or ``memory_budget``, or a
            vocabulary whose size is not the adjacency's N.

    The graph is immutable after construction, and safe to query from several threads
    at once (a server's sessions): its distance cache guards every update with a lock
    (see :mod:`.cache`), and searches share no mutable state. Pickling keeps the cache.

    Example:
        >>> graph = TensorCorpusGraph.from_edges([("a", "b", 0.5), ("b", "c", 0.25)], maximum_distance=1.0)
        >>> graph.distance("a", "c"), graph.distance("a", "zzz"), graph.distance("x", "x")
        (0.75, 1.0, 0.0)
        >>> graph.neighborhood("b", 1.0), graph.neighborhood_distances("b", 1.0)
        (('c', 'a'), (('c', 0.25), ('a', 0.5)))
        >>> chunk_index = graph.index_trellis([[["a", "q"], ["c"]]])  # B=1, T=2, M=2
        >>> chunk_index.tolist()
        [[[0, -2], [2, -1]]]
        >>> graph.trellis_distances(chunk_index)[0, 0].tolist()  # [from j, to i]
        [[0.75, 1.0], [1.0, 1.0]]
    """

    def __init__(
        self,
        adjacency: CSRAdjacency,
        vocabulary: ChunkVocabulary,
        *,
        maximum_distance: float = 10.0,
        directed: bool = False,
        distance_cache_size: int = 65536,
        distance_cache_entries: int = 1 << 24,
        memory_budget: Optional[int] = None,
    ) -> None:
        self._maximum_distance = check_positive_finite(maximum_distance, "maximum_distance")
        if len(vocabulary) != adjacency.num_nodes:
            raise MapMatchedValueError(
                f"the vocabulary has {len(vocabulary)} chunk IDs but the adjacency has {adjacency.num_nodes} nodes"
            )
        self._adjacency = adjacency
        self._vocabulary = vocabulary
        self._directed = bool(directed)
        self._memory_budget = None if memory_budget is None else check_positive_int(memory_budget, "memory_budget")
        self._cache = DistanceCache(
            adjacency.num_nodes, max_rows=distance_cache_size, max_entries=distance_cache_entries,
            device=adjacency.device,
        )
        self._table: Optional[torch.Tensor] = None
        self._ball_table: Optional[BallTable] = None
        self._contexts: Optional[NeighborhoodTable] = None

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_edges(
        cls,
        edges: Iterable[EdgeLike],
        *,
        nodes: Iterable[str] = (),
        directed: bool = False,
        maximum_distance: float = 10.0,
        device: Device = None,
        **options: Any,
    ) -> "TensorCorpusGraph":
        """A graph from edges, numbered like :class:`InMemoryCorpusGraph`.

        Args:
            edges: :class:`GraphEdge` objects or ``(a, b)`` / ``(a, b, distance)`` tuples
                (distance default 1.0).
            nodes: IDs declared as nodes even without edges (numbered first).
            directed: if False (default) every edge is stored in both directions.
            maximum_distance: the bound (default 10.0).
            device: where the tensors go (default CPU).
            **options: ``distance_cache_size``, ``distance_cache_entries``, ``memory_budget``.

        Raises:
            ValueError: empty IDs, non-positive or non-finite distances (naming the
                edge), a malformed edge, a bad ``maximum_distance``.

        Cost: O(E) Python work to read the edges, then :func:`~._csr.build_csr`.
        """
        parts = convert.from_edges(
            edges, nodes=nodes, directed=directed, maximum_distance=maximum_distance, device=device
        )
        return cls._build(parts, options)

    @classmethod
    def from_graph(cls, graph: InMemoryCorpusGraph, *, device: Device = None, **options: Any) -> "TensorCorpusGraph":
        """The tensor twin of an :class:`InMemoryCorpusGraph` (or a :class:`KNNGraph`).

        Same nodes (vocabulary order = ``graph.nodes``), arcs, direction and
        ``maximum_distance``; hence the same distances, bit for bit.

        Args:
            graph: an object with ``nodes``, ``edges()``, ``directed`` and ``maximum_distance``.
            device: where the tensors go (default CPU).
            **options: ``distance_cache_size``, ``distance_cache_entries``, ``memory_budget``.
        """
        return cls.from_edges(
            graph.edges(), nodes=graph.nodes, directed=graph.directed,
            maximum_distance=graph.maximum_distance, device=device, **options,
        )

    @classmethod
    def from_edge_index(
        cls,
        edge_index: torch.Tensor,
        edge_weight: Optional[torch.Tensor] = None,
        *,
        chunk_ids: Optional[Sequence[str]] = None,
        num_nodes: Optional[int] = None,
        directed: bool = False,
        maximum_distance: float = 10.0,
        **options: Any,
    ) -> "TensorCorpusGraph":
        """A graph from a torch_geometric ``edge_index`` (on its device).

        Args:
            edge_index: ``(2, E)`` integer tensor ``[sources; targets]``.
            edge_weight: ``(E,)`` real distances (default all 1.0), converted to float64.
            chunk_ids: the N node IDs in index order (default ``"0"``, ``"1"``, ...).
            num_nodes: N (default ``len(chunk_ids)``, else ``edge_index.max() + 1``,
                refused when far beyond the distinct nodes the edges name: see
                :func:`~._csr.infer_num_nodes`).
            directed: if False (default) every edge is stored in both directions.
            maximum_distance: the bound (default 10.0).
            **options: ``distance_cache_size``, ``distance_cache_entries``, ``memory_budget``.

        Raises:
            ValueError: bad shapes or dtypes, a node outside ``[0, N)`` (naming the
                edge), an inferred N far beyond the nodes named (a stray index),
                ``num_nodes`` disagreeing with ``chunk_ids``, a bad distance (naming the edge).
        """
        parts = convert.from_edge_index(
            edge_index, edge_weight, chunk_ids=chunk_ids, num_nodes=num_nodes, directed=directed,
            maximum_distance=maximum_distance,
        )
        return cls._build(parts, options)

    @classmethod
    def from_networkx(
        cls,
        graph: Any,
        *,
        weight: str = "weight",
        maximum_distance: float = 10.0,
        device: Device = None,
        **options: Any,
    ) -> "TensorCorpusGraph":
        """A graph from a networkx (Multi)(Di)Graph whose nodes are chunk-ID strings.

        Args:
            graph: the networkx graph; ``graph.is_directed()`` sets the direction,
                node order sets the vocabulary, parallel edges keep the smallest distance.
            weight: the edge attribute holding the distance (missing: 1.0).
            maximum_distance: the bound (default 10.0).
            device: where the tensors go (default CPU).
            **options: ``distance_cache_size``, ``distance_cache_entries``, ``memory_budget``.

        Raises:
            NetworkXNotInstalledError: networkx is missing (the ``[networkx]`` extra).
            ValueError: a node that is not a non-empty string (relabel with
                ``networkx.relabel_nodes(graph, str)``), a bad distance.
        """
        parts = convert.from_networkx(graph, weight=weight, maximum_distance=maximum_distance, device=device)
        return cls._build(parts, options)

    @classmethod
    def _build(cls, parts: convert.GraphParts, options: dict) -> "TensorCorpusGraph":
        return cls(
            parts.adjacency, parts.vocabulary, maximum_distance=parts.maximum_distance, directed=parts.directed,
            **options,
        )

    # ------------------------------------------------------------------ structure

    @property
    def maximum_distance(self) -> float:
        """The bound: unreachable, too-far and unknown pairs get this distance."""
        return self._maximum_distance

    @property
    def directed(self) -> bool:
        """Whether edges are one-way (False: every edge is stored in both directions)."""
        return self._directed

    @property
    def vocabulary(self) -> ChunkVocabulary:
        """The chunk IDs <-> node indices."""
        return self._vocabulary

    @property
    def nodes(self) -> Tuple[str, ...]:
        """Every node ID in index order."""
        return self._vocabulary.chunk_ids

    @property
    def num_nodes(self) -> int:
        """N."""
        return self._adjacency.num_nodes

    @property
    def edge_count(self) -> int:
        """E, the number of stored arcs (an undirected edge counts twice)."""
        return self._adjacency.edge_count

    @property
    def device(self) -> torch.device:
        """Where the tensors live; outputs are allocated here."""
        return self._adjacency.device

    @property
    def adjacency(self) -> CSRAdjacency:
        """The CSR arcs (read-only)."""
        return self._adjacency

    @property
    def indptr(self) -> torch.Tensor:
        """``(N + 1,)`` int64 CSR row pointers."""
        return self._adjacency.indptr

    @property
    def indices(self) -> torch.Tensor:
        """``(E,)`` int64 arc targets, sorted within each source."""
        return self._adjacency.indices

    @property
    def weights(self) -> torch.Tensor:
        """``(E,)`` float64 arc distances."""
        return self._adjacency.weights

    @property
    def dense_table(self) -> Optional[torch.Tensor]:
        """The ``(N, N)`` table of :meth:`precompute_dense`, or None."""
        return self._table

    def __len__(self) -> int:
        """N, the number of nodes."""
        return self.num_nodes

    def __contains__(self, chunk_id: object) -> bool:
        """Whether ``chunk_id`` is a node."""
        return chunk_id in self._vocabulary

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(nodes={self.num_nodes}, arcs={self.edge_count}, directed={self._directed}, "
            f"maximum_distance={self._maximum_distance!r}, device={str(self.device)!r})"
        )

    def to(self, device: Device) -> "TensorCorpusGraph":
        """The same graph on ``device`` (``self`` if already there), with an empty cache."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = TensorCorpusGraph(
            self._adjacency.to(device), self._vocabulary, maximum_distance=self._maximum_distance,
            directed=self._directed, distance_cache_size=self._cache.max_rows,
            distance_cache_entries=self._cache.max_entries, memory_budget=self._memory_budget,
        )
        moved._table = None if self._table is None else self._table.to(device)
        moved._ball_table = None if self._ball_table is None else self._ball_table.to(device)
        moved._contexts = self._contexts
        return moved

    # ------------------------------------------------------------------ interop

    def to_edge_index(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(edge_index (2, E) int64, edge_weight (E,) float64)`` of every stored arc,
        sorted by (source, target); an undirected graph lists both directions."""
        return convert.to_edge_index(self)

    def to_data(self) -> Any:
        """A ``torch_geometric.data.Data`` with ``edge_index``, ``edge_weight``,
        ``num_nodes`` and ``chunk_ids`` (a list of the N IDs)."""
        return convert.to_data(self)

    def to_networkx(self) -> Any:
        """A ``networkx.DiGraph`` (directed) or ``Graph`` with the nodes in index order
        and each edge's distance in the ``"weight"`` attribute.

        Raises:
            NetworkXNotInstalledError: networkx is missing (the ``[networkx]`` extra).
        """
        return convert.to_networkx(self)

    # ------------------------------------------------------------------ indexing

    def index(self, chunk_ids: Iterable[str], *, distinct_unknown: bool = False) -> torch.Tensor:
        """``(n,)`` int64 index codes of IDs on the graph's device (see
        :meth:`ChunkVocabulary.index`).

        Unknown-ID codes are numbered per call: index every ID that will be compared
        (both sides of the pairs) in one call, or two different unknown IDs may get
        the same code and a distance of 0.0.
        """
        return self._vocabulary.index(chunk_ids, distinct_unknown=distinct_unknown, device=self.device)

    def index_trellis(self, conversations: Sequence[Sequence[Sequence[str]]]) -> torch.Tensor:
        """Pack ragged chunk-ID trellises into a padded index-code tensor.

        Args:
            conversations: B conversations, each a list of turns, each a list of
                candidate chunk IDs (non-empty strings).

        Returns:
            ``(B, T, M)`` int64 on the graph's device (T, M the largest counts):
            node indices, ``-1`` for padding, and ``-2, -3, ...`` for unknown IDs
            (one code per distinct unknown ID across the whole batch).

        Raises:
            ValueError: a chunk ID that is not a non-empty string (naming its place).
        """
        conversations = [[list(turn) for turn in check_not_a_string(c, "conversation")] for c in conversations]
        turns = max((len(c) for c in conversations), default=0)
        width = max((len(turn) for c in conversations for turn in c), default=0)
        unknown: dict = {}
        # shape: (B, T, M) nested lists
        codes = [[[-1] * width for _ in range(turns)] for _ in conversations]
        for b, conversation in enumerate(conversations):
            for t, turn in enumerate(conversation):
                for m, chunk_id in enumerate(turn):
                    check_chunk_id(chunk_id, f"conversation {b} turn {t} candidate {m} chunk ID")
                    code = self._vocabulary.index_of(chunk_id)
                    codes[b][t][m] = code if code >= 0 else unknown.setdefault(chunk_id, -2 - len(unknown))
        return torch.tensor(codes, dtype=torch.long, device=self.device).view(len(codes), turns, width)

    # ------------------------------------------------------------------ batched distances

    def pair_distances(
        self,
        sources: torch.Tensor,
        targets: torch.Tensor,
        *,
        engine: str = "auto",
        target_aware: bool = True,
        use_cache: bool = True,
        groups: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """docs/spec.md distances between index codes, elementwise.

        Args:
            sources: int64 index codes (any shape) on the graph's device.
            targets: int64 index codes, the same shape.
            engine: ``"auto"`` (the dense table if present, else the ball table if
                attached, else ``"torch"`` on an accelerator, and on CPU ``"compiled"``
                when numba is installed, else ``"hybrid"``), ``"torch"``, ``"scipy"``,
                ``"hybrid"``, ``"compiled"``, ``"dense"`` (see :mod:`.shortest_paths`)
                or ``"balls"`` (:meth:`precompute_balls`; the same values).
            target_aware: stop searches once their targets are exact (same values).
            use_cache: answer from / feed the graph's distance cache.
            groups: int64, the pairs' shape: pairs of one group have targets close
                together (one trellis turn pair); guides the compiled engine's far
                searches, never changes a value. :meth:`trellis_distances` sets it.

        Returns:
            float64 of the same shape on the graph's device (see the module docstring
            for codes).

        Cost: one bounded search per distinct source not answered by the cache; with a
        ball table (:meth:`attach_balls`, ``engine="auto"`` or ``"balls"``) a binary
        search per pair instead.
        """
        if self._use_balls(engine):
            _check_code_tensors(self._adjacency, sources=sources, targets=targets)
            if sources.shape != targets.shape:
                raise MapMatchedValueError(
                    f"sources and targets must have the same shape, got {tuple(sources.shape)} and "
                    f"{tuple(targets.shape)}"
                )
            return ball_distances(self._ball_table, sources, targets, self._maximum_distance)
        return pair_distances(
            self._adjacency, sources, targets, maximum_distance=self._maximum_distance, engine=engine,
            cache=self._cache if use_cache else None, table=self._table, target_aware=target_aware,
            memory_budget=self._memory_budget, groups=groups,
        )

    def trellis_distances(
        self,
        chunk_index: torch.Tensor,
        *,
        engine: str = "auto",
        target_aware: bool = True,
        use_cache: bool = True,
        validate: bool = True,
    ) -> torch.Tensor:
        """Distances between consecutive turns' candidates of a padded trellis batch.

        Args:
            chunk_index: ``(B, T, M)`` int64 index codes on the graph's device (``-1``
                padding, ``<= -2`` unknown IDs; :meth:`index_trellis` makes them).
            engine, target_aware, use_cache: as for :meth:`pair_distances`.
            validate: False: the caller guarantees the codes (< N), which are then not
                read back to check them; with a dense table (:meth:`precompute_dense`) or
                a ball table (:meth:`precompute_balls`) on the graph's device the answer
                then reads nothing back to the host (a gather; a binary search of fixed
                depth).

        Returns:
            ``(B, T-1, M, M)`` float64 on the graph's device, indexed
            ``[b, t, from j, to i]`` = d(candidate j of turn t, candidate i of turn
            t+1). Padding rows and columns hold ``maximum_distance``.

        Raises:
            ValueError: a tensor that is not 3-D int64, on another device, or with a
                node index ``>= N``.

        Cost: each distinct source is searched once per batch (with the union of its
        targets), except those the cache answers; memory O(B T M^2) for the result.
        """
        if not isinstance(chunk_index, torch.Tensor) or chunk_index.dim() != 3 or chunk_index.dtype != torch.long:
            what = (
                f"a {chunk_index.dim()}-D {chunk_index.dtype} tensor" if isinstance(chunk_index, torch.Tensor)
                else type(chunk_index).__name__
            )
            raise MapMatchedValueError(f"chunk_index must be a (B, T, M) int64 tensor, got {what}")
        batch, turns, width = chunk_index.shape
        steps = max(turns - 1, 0)
        if validate:
            _check_code_tensors(self._adjacency, chunk_index=chunk_index)  # every turn, the last included
        # shape: (B * (T-1), M) the codes of each turn pair, one group each
        sources = chunk_index[:, :-1].reshape(batch * steps, width)
        targets = chunk_index[:, 1:].reshape(batch * steps, width)
        if self._use_balls(engine):
            distances = ball_distances(self._ball_table, sources[:, :, None], targets[:, None, :], self._maximum_distance,
                                       synchronize=validate)
            return distances.view(batch, steps, width, width)
        distances = grid_distances(
            self._adjacency, sources, targets, maximum_distance=self._maximum_distance, engine=engine,
            cache=self._cache if use_cache else None, table=self._table, target_aware=target_aware,
            memory_budget=self._memory_budget, validate=validate,
        )
        return distances.view(batch, steps, width, width)

    def precompute_dense(
        self, memory_budget: int = DEFAULT_DENSE_BUDGET, *, engine: str = "auto"
    ) -> "TensorCorpusGraph":
        """Precompute the ``(N, N)`` table of every distance (see :mod:`.dense` for sizes).

        Afterwards ``engine="auto"`` answers every pair by a gather. Worth it when
        batches touch most nodes as sources (then a batch costs about N searches
        anyway): in ``benchmarks/distances.py`` a 20k-node graph's table (3 GB) took
        62 s to build with scipy, 38.6 s with the compiled engine (2 CPU cores), and
        then filled a (1024, 12, 32) batch in 0.24 s (on the CPU the table sits in
        transparent huge pages where the OS allows: gathers are TLB-bound otherwise).

        Args:
            memory_budget: the most bytes the table may take (default 128 MiB: N <= 4096).
            engine: ``"auto"``, ``"torch"``, ``"scipy"``, ``"hybrid"`` or ``"compiled"`` for the N searches.

        Returns:
            ``self``.

        Raises:
            ValueError: the table would not fit in ``memory_budget``.
        """
        self._table = build_dense_table(
            self._adjacency, self._maximum_distance, memory_budget=memory_budget,
            engine=engine, search_budget=self._memory_budget,
        )
        return self

    def drop_dense(self) -> None:
        """Free the dense table."""
        self._table = None

    def precompute_balls(
        self, bound: Optional[float] = None, *, directory: Any = None, batch_size: int = 1 << 16,
        progress: Optional[bool] = None,
    ) -> "TensorCorpusGraph":
        """Build and attach a :class:`~.balls.BallTable` (every node's ball within ``bound``).

        Afterwards ``engine="auto"`` (without a dense table) and ``engine="balls"``
        answer every pair by a binary search in its source's ball: the same values as
        the searches, at a cost that does not grow with N (see :mod:`.balls`).

        Args:
            bound: the balls' bound (default: ``maximum_distance``); >= ``maximum_distance``.
            directory: build resumably there and memory-map the result (None: in memory).
            batch_size: centres per batch.
            progress: progress lines (None: from 100,000 nodes on).

        Returns:
            ``self``.
        """
        bound = self._maximum_distance if bound is None else check_positive_finite(bound, "bound")
        structure = (self.num_nodes, self.directed, self.indptr, self.indices, self.weights)
        table = build_ball_table(
            self._adjacency, bound, directory=directory, batch_size=batch_size,
            fingerprint=csr_fingerprint(*structure) if directory is not None else "",
            memory_budget=self._memory_budget, progress=progress,
        )
        return self.attach_balls(table)

    def attach_balls(self, table: BallTable) -> "TensorCorpusGraph":
        """Use ``table`` (built from this graph, with ``bound >= maximum_distance``) for distances.

        Raises:
            ValueError: a table of another size or a smaller bound.
        """
        if table.num_nodes != self.num_nodes:
            raise MapMatchedValueError(
                f"the ball table has {table.num_nodes} nodes but the graph has {self.num_nodes}"
            )
        if table.bound < self._maximum_distance:
            raise MapMatchedValueError(
                f"the ball table was built for bound {table.bound!r}, below maximum_distance {self._maximum_distance!r}"
            )
        self._ball_table = table.to(self.device)
        return self

    def precompute_neighborhoods(self, radius: float, *, batch_size: int = 4096,
                                 progress: Optional[bool] = None) -> "TensorCorpusGraph":
        """Build and attach a :class:`~.neighborhood_table.NeighborhoodTable`: every
        node's neighbourhood within ``radius`` (the contexts a server reads; a graph
        artifact carries it). Afterwards :meth:`neighborhood_indices` at a radius with
        the same limit (``engine="auto"``) slices its rows: the same values, no search.

        Args:
            radius: the context radius (finite, >= 0).
            batch_size: centres per batch.
            progress: progress lines (None: from 100,000 nodes on).

        Returns:
            ``self``.
        """
        return self.attach_neighborhoods(build_neighborhood_table(self, radius, batch_size=batch_size,
                                                                  progress=progress))

    def attach_neighborhoods(self, table: NeighborhoodTable) -> "TensorCorpusGraph":
        """Use ``table`` (built from this graph) for :meth:`neighborhood_indices`.

        Raises:
            ValueError: a table of another size.
        """
        if table.num_nodes != self.num_nodes:
            raise MapMatchedValueError(
                f"the neighbourhood table has {table.num_nodes} nodes but the graph has {self.num_nodes}"
            )
        self._contexts = table.to_cpu()
        return self

    @property
    def neighborhood_table(self) -> Optional[NeighborhoodTable]:
        """The attached :class:`~.neighborhood_table.NeighborhoodTable`, or None."""
        return self._contexts

    def drop_balls(self) -> None:
        """Stop using the ball table."""
        self._ball_table = None

    @property
    def ball_table(self) -> Optional[BallTable]:
        """The attached :class:`~.balls.BallTable`, or None."""
        return self._ball_table

    def _use_balls(self, engine: str) -> bool:
        """Whether ``engine`` is answered by the ball table (``"balls"`` needs one)."""
        if engine == "balls":
            if self._ball_table is None:
                raise MapMatchedValueError(
                    "engine 'balls' needs a ball table: call TensorCorpusGraph.precompute_balls() or attach_balls()"
                )
            return True
        return engine == "auto" and self._ball_table is not None and self._table is None

    # ------------------------------------------------------------------ CorpusGraph protocol

    def distance(self, source_chunk_id: str, target_chunk_id: str) -> float:
        """The bounded shortest-path distance from source to target (docs/spec.md section 4).

        Returns:
            0.0 when the IDs are equal (even unknown ones); the shortest path length
            when ``<= maximum_distance``; else ``maximum_distance``. Always read from
            the source's row: equal to ``InMemoryCorpusGraph.distance`` bit for bit
            whenever that one reads the source's row too (an undirected reference
            graph may answer from the target's cached row instead; the two agree
            except in the last bit of a path of three or more non-dyadic edges).

        Raises:
            ValueError: an empty chunk ID (``distance chunk IDs must not be empty``).

        Cost: a cache hit is a few tensor ops; a miss runs one full bounded search from
        the source and caches the complete row.
        """
        if not source_chunk_id or not target_chunk_id:
            raise empty_distance_ids_error(source_chunk_id, target_chunk_id)
        if source_chunk_id == target_chunk_id:
            return 0.0
        source = self._vocabulary.index_of(source_chunk_id)
        target = self._vocabulary.index_of(target_chunk_id)
        if source < 0 or target < 0:
            return self._maximum_distance
        if self._table is not None:
            value = float(self._table[source, target])
        elif self._ball_table is not None:
            codes = torch.tensor([source, target], dtype=torch.long)
            return float(ball_distances(self._ball_table, codes[:1], codes[1:], self._maximum_distance)[0])
        else:
            value = float(self._row_value(source, target))
        return self._maximum_distance if math.isinf(value) else value

    def _row_value(self, source: int, target: int) -> torch.Tensor:
        """d(source, target) (``inf`` beyond the bound) from the cache, or from a new full row."""
        # shape: (1,)
        sources = torch.tensor([source], dtype=torch.long, device=self.device)
        targets = torch.tensor([target], dtype=torch.long, device=self.device)
        values, answered = self._cache.lookup(sources, targets)
        if bool(answered[0]):
            return values[0]
        # shape: (N,)
        rows = bounded_rows(self._adjacency, sources, limit=self._maximum_distance, memory_budget=self._memory_budget)
        self._cache.insert_rows(sources, rows)
        return rows[0, target]

    def neighborhood(self, chunk_id: str, radius: float) -> Tuple[str, ...]:
        """The chunk IDs within ``min(radius, maximum_distance)`` of ``chunk_id``, ordered
        by (distance, chunk ID), itself excluded; ``()`` for an unknown centre. As
        :meth:`InMemoryCorpusGraph.neighborhood <mapmatched_torch.standalone.graph.InMemoryCorpusGraph.neighborhood>`.

        Raises:
            ValueError: an empty ``chunk_id``; a ``radius`` that is not a finite
                number >= 0.
        """
        return self.neighborhoods([chunk_id], radius)[0]

    def neighborhood_distances(self, chunk_id: str, radius: float) -> Tuple[Tuple[str, float], ...]:
        """:meth:`neighborhood` with distances: ``(chunk_id, distance)`` pairs in the same
        order, equal to the reference graph's ``neighborhood_distances`` bit for bit."""
        return self.neighborhoods([chunk_id], radius, distances=True)[0]

    def neighborhoods(
        self, chunk_ids: Sequence[str], radius: float, *, engine: str = "auto", distances: bool = False
    ) -> Tuple[Tuple[Any, ...], ...]:
        """:meth:`neighborhood` of many centres with batched searches (context expansion).

        Args:
            chunk_ids: the centres (unknown ones get ``()``; empty ones are refused).
            radius: a finite number >= 0; the search limit is ``min(radius,
                maximum_distance)``, inclusive.
            engine: ``"auto"``, ``"torch"``, ``"scipy"``, ``"hybrid"`` or ``"compiled"``
                (``"compiled"``, the CPU ``auto`` with numba, searches each ball in
                O(ball); otherwise the dense table's rows are used when present).
            distances: False (default): each centre's chunk IDs, as :meth:`neighborhood`;
                True: ``(chunk_id, distance)`` pairs, as :meth:`neighborhood_distances`.

        Returns:
            One tuple per centre, in input order.

        Raises:
            ValueError: an empty chunk ID, or a radius that is not a finite number >= 0.

        Cost: one search bounded by the limit per distinct known centre, in chunks of
        ``memory_budget`` bytes; O(ball) per centre with ``"compiled"``, else O(N) per
        centre to collect its ``(N,)`` row.
        """
        centres = list(check_not_a_string(chunk_ids, "chunk_ids"))
        limit = min(check_neighborhood_radius(radius), self._maximum_distance)
        for centre in centres:
            check_neighborhood_centre(centre)
        codes = self._vocabulary.index(centres).tolist()
        known = sorted({code for code in codes if code >= 0})
        counts, nodes, found_distances = self._ordered_balls(np.asarray(known, dtype=np.int64), limit, engine)
        ids = self.nodes
        names = [ids[node] for node in nodes.tolist()]
        values = found_distances.tolist() if distances else None
        found, start = {}, 0
        for source, count in zip(known, counts.tolist()):
            stop = start + count
            found[source] = tuple(zip(names[start:stop], values[start:stop])) if distances else tuple(names[start:stop])
            start = stop
        return tuple(found[code] if code >= 0 else () for code in codes)

    def neighborhood_indices(self, centres: torch.Tensor, radius: float, *, engine: str = "auto") -> torch.Tensor:
        """:meth:`neighborhoods` as node indices, for index codes: no chunk ID is built.

        Args:
            centres: ``(C,)`` int64 index codes on the graph's device (``< 0``, i.e.
                padding or an unknown chunk: an empty neighbourhood).
            radius: a finite number >= 0 (the limit is ``min(radius, maximum_distance)``).
            engine: as for :meth:`neighborhoods`.

        Returns:
            ``(C, W)`` int64 on the graph's device: row ``c`` holds the nodes within the
            limit of ``centres[c]``, itself excluded, ordered by (distance, chunk ID),
            then ``-1``; ``W`` is the largest neighbourhood (0 when all are empty). Row
            ``c`` names the chunks of ``neighborhood(nodes[centres[c]], radius)``, in order.

        Raises:
            ValueError: ``centres`` not an int64 tensor of index codes on the graph's
                device (or a node index >= N), or a bad radius.
        """
        limit = min(check_neighborhood_radius(radius), self._maximum_distance)
        _check_code_tensors(self._adjacency, centres=centres)
        if centres.dim() != 1:
            raise MapMatchedValueError(f"centres must be a (C,) tensor, got shape {tuple(centres.shape)}")
        if engine == "auto" and self._contexts is not None and self._contexts.limit == limit:
            return self._contexts.rows(centres).to(self.device)  # slices of the precomputed rows
        # shape: (K,) the distinct known centres, and each centre's place among them
        known, place = torch.unique(centres.clamp_min(-1), return_inverse=True)
        counts, nodes, _ = self._ordered_balls(known[known >= 0].cpu().numpy(), limit, engine)
        counts = torch.from_numpy(counts)
        if known.numel() and int(known[0]) < 0:
            counts = torch.cat([torch.zeros(1, dtype=torch.long), counts])  # the unknown centres' empty row
        rows = padded_rows(torch.from_numpy(nodes), counts, int(counts.max()) if counts.numel() else 0, -1)
        return rows.to(self.device)[place]

    def _ordered_balls(
        self, known: np.ndarray, limit: float, engine: str
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The neighbourhood of each of the ``(K,)`` int64 node indices ``known``:
        ``(counts (K,), nodes, distances)`` with the neighbourhoods one after another,
        each without its centre and ordered by (distance, chunk ID)."""
        counts, nodes, distances = self._balls(known, limit, engine)
        owner = np.repeat(np.arange(known.size), counts)
        keep = nodes != known[owner]
        owner, nodes, distances = owner[keep], nodes[keep], distances[keep]
        if not nodes.size:
            return np.zeros(known.size, dtype=np.int64), nodes, distances
        # the balls come by centre, then nondecreasing distance: only equal distances need
        # the ID order, so one sort by (run of equal (centre, distance), ID rank)
        run = np.cumsum(np.concatenate([[False], (owner[1:] != owner[:-1]) | (distances[1:] != distances[:-1])]))
        order = np.argsort(run * self.num_nodes + self._vocabulary.rank().numpy()[nodes])
        return np.bincount(owner, minlength=known.size).astype(np.int64), nodes[order], distances[order]

    def _balls(self, known: np.ndarray, limit: float, engine: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each centre's ball within ``limit`` (the centre included): ``(counts (K,),
        nodes, distances)``, the balls one after another, each in nondecreasing distance (numpy)."""
        if known.size and self._ball_table is not None and engine in ("auto", "balls") and self._table is None:
            return self._table_balls(known, limit)
        if engine == "balls":
            self._use_balls(engine)  # raises: no table
        if known.size and resolve_engine(engine, self.device) == "compiled":
            # O(ball) per centre instead of O(N) (a table row is O(N) too)
            return compiled_balls(self._adjacency, torch.from_numpy(known), limit, self._memory_budget)
        counts, nodes, distances = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)], [np.zeros(0)]
        step = rows_per_chunk(self.num_nodes, max(known.size, 1), self._memory_budget)
        for first in range(0, known.size, step):
            # shape: (C,) centres of this chunk, (C, N) their rows
            sources = torch.from_numpy(known[first:first + step]).to(self.device)
            if self._table is not None:
                rows = self._table[sources]
            else:
                rows = bounded_rows(
                    self._adjacency, sources, limit=limit, engine=engine, memory_budget=self._memory_budget
                )
            # shape: (C, N) the balls; (K,) their (centre, node) entries, row by row
            inside = rows <= limit
            row, node = inside.nonzero(as_tuple=True)
            row, node, value = row.cpu().numpy(), node.cpu().numpy(), rows[inside].double().cpu().numpy()
            order = np.lexsort((value, row))  # each row's ball by distance
            counts.append(inside.sum(dim=1).cpu().numpy())
            nodes.append(node[order])
            distances.append(value[order])
        return np.concatenate(counts), np.concatenate(nodes), np.concatenate(distances)

    def _table_balls(self, known: np.ndarray, limit: float) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_balls` from the ball table: rows cut at ``limit``, by distance (centre left out)."""
        table = self._ball_table
        starts, stops = table.indptr[known].numpy(), table.indptr[known + 1].numpy()
        lengths = stops - starts
        places = np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
        owner = np.repeat(np.arange(known.size), lengths)
        nodes = table.neighbors.numpy()[places].astype(np.int64)
        values = table.distances.numpy()[places]
        keep = values <= limit
        owner, nodes, values = owner[keep], nodes[keep], values[keep]
        order = np.lexsort((values, owner))
        return np.bincount(owner, minlength=known.size).astype(np.int64), nodes[order], values[order]

    # ------------------------------------------------------------------ cache

    def cache_info(self) -> CacheInfo:
        """Hits, misses (per distinct source and lookup), rows cached, row capacity."""
        return self._cache.cache_info()

    def clear_cache(self) -> None:
        """Drop every cached distance and reset the counters."""
        self._cache.clear()
