"""The pure-Python reference: bounded-Dijkstra graph, kNN rules, StandaloneDecoder.

This subpackage is the behaviour spec in code (docs/spec.md sections 4-5): no torch, no
numpy. Every tensor path of mapmatched_torch is tested against it.
"""

from .decoder import StandaloneDecoder
from .graph import GraphEdge, InMemoryCorpusGraph
from .knn import KNNGraph

__all__ = ["StandaloneDecoder", "InMemoryCorpusGraph", "KNNGraph"]  # GraphEdge: core.graph_types
