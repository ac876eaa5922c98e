"""The corpus graph as tensors: vocabulary, CSR graph, exact bounded shortest paths.

Public names (import them from here; the modules behind them are implementation):

- :class:`ChunkVocabulary`: chunk IDs <-> int64 node indices (``-1`` padding,
  ``<= -2`` distinct unknown IDs).
- :class:`TensorCorpusGraph`: CSR graph on a device implementing the ``CorpusGraph``
  protocol bit for bit like ``InMemoryCorpusGraph``, plus batched
  ``trellis_distances`` / ``pair_distances`` / ``neighborhoods``, PyG and networkx
  interop.
- :class:`TensorGraph`, :class:`TrellisGraph`, :class:`NeighborhoodGraph`: the
  Protocols of that batched API (what the decoders, the server and the evaluation
  check for, with :func:`implements`).
- :func:`bounded_rows`, :func:`source_target_distances`, :func:`pair_distances`,
  :func:`grid_distances` (every source of a turn pair to every target): the
  shortest-path engines (``"torch"`` frontier relaxation, ``"scipy"`` Dijkstra,
  target-aware early stopping), on a :class:`CSRAdjacency`; :class:`SearchOptions`,
  the engines' one validated set of tuning options.
- :class:`DistanceCache`: the LRU of exact distance rows.
- :func:`build_dense_table` and its size helpers: the optional ``(N, N)`` table.
"""

from __future__ import annotations

from ._csr import CSRAdjacency, build_csr
from .cache import CacheInfo, DistanceCache
from .dense import DEFAULT_DENSE_BUDGET, build_dense_table, dense_table_bytes, max_dense_nodes
from .knn import knn_edges, knn_graph, knn_neighbors_tensor
from .sections import SectionPassage, section_edges, section_graph
from .shortest_paths import (
    DEFAULT_MEMORY_BUDGET,
    ENGINES,
    SearchOptions,
    bounded_rows,
    grid_distances,
    pair_distances,
    resolve_engine,
    source_target_distances,
)
from .protocols import NeighborhoodGraph, TensorGraph, TrellisGraph, implements
from .tensor_graph import TensorCorpusGraph
from .vocabulary import PADDING_INDEX, ChunkVocabulary

__all__ = [
    "ChunkVocabulary",
    "PADDING_INDEX",
    "TensorCorpusGraph",
    "TensorGraph",
    "TrellisGraph",
    "NeighborhoodGraph",
    "implements",
    "CSRAdjacency",
    "build_csr",
    "ENGINES",
    "DEFAULT_MEMORY_BUDGET",
    "resolve_engine",
    "bounded_rows",
    "source_target_distances",
    "pair_distances",
    "grid_distances",
    "SearchOptions",
    "DistanceCache",
    "CacheInfo",
    "DEFAULT_DENSE_BUDGET",
    "build_dense_table",
    "dense_table_bytes",
    "max_dense_nodes",
    "knn_neighbors_tensor",
    "knn_edges",
    "knn_graph",
    "SectionPassage",
    "section_edges",
    "section_graph",
]
