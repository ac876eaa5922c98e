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
- :class:`BallTable`, :func:`build_ball_table`, :func:`ball_distances`,
  :func:`calibrate_bound`: every node's bounded ball, precomputed (distances whose
  cost does not grow with N); :func:`save_graph` / :func:`load_graph`: graph
  artifacts (a checked, memory-mapped directory).
- :class:`NeighborhoodTable`: every node's context neighbourhood within one radius,
  precomputed (``TensorCorpusGraph.precompute_neighborhoods``), carried by an artifact.
- :func:`faiss_knn_neighbors`, :func:`knn_recall`: approximate kNN picks through FAISS
  (``knn_graph(..., backend="faiss")``) and their measured recall;
  :class:`FAISSCorpusIndex`: the same index searched by outside queries (candidates).
"""

from __future__ import annotations

from ._csr import CSRAdjacency, build_csr
from .artifacts import graph_fingerprint, load_graph, read_manifest, save_graph
from .balls import BallTable, ball_distances, ball_size_summary, build_ball_table, calibrate_bound
from .cache import CacheInfo, DistanceCache
from .dense import DEFAULT_DENSE_BUDGET, build_dense_table, dense_table_bytes, max_dense_nodes
from .knn import knn_edges, knn_graph, knn_neighbors_tensor
from .knn_faiss import FAISSCorpusIndex, faiss_knn_neighbors, knn_recall
from .neighborhood_table import NeighborhoodTable
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
    "faiss_knn_neighbors",
    "FAISSCorpusIndex",
    "knn_recall",
    "BallTable",
    "build_ball_table",
    "ball_distances",
    "ball_size_summary",
    "calibrate_bound",
    "save_graph",
    "load_graph",
    "read_manifest",
    "graph_fingerprint",
    "NeighborhoodTable",
]
