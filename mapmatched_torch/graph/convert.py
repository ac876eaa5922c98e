"""Conversions between :class:`~.tensor_graph.TensorCorpusGraph` and other graph formats.

Into the graph: plain edges (``GraphEdge`` objects or tuples, numbered like
:class:`~mapmatched_torch.standalone.graph.InMemoryCorpusGraph`), a torch_geometric
``edge_index`` / ``edge_weight``, a networkx graph. Each conversion validates its input
and returns the :class:`GraphParts` the graph's constructor takes (a CSR adjacency and
its vocabulary); :meth:`TensorCorpusGraph.from_edges`,
:meth:`~TensorCorpusGraph.from_edge_index` and :meth:`~TensorCorpusGraph.from_networkx`
are thin classmethods over them, and the way users call them.

Out of the graph: ``(edge_index, edge_weight)``, a ``torch_geometric.data.Data``, a
networkx ``Graph`` / ``DiGraph`` (:meth:`TensorCorpusGraph.to_edge_index`,
:meth:`~TensorCorpusGraph.to_data`, :meth:`~TensorCorpusGraph.to_networkx`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ..core.checks import check_not_a_string, check_positive_finite
from ..core.errors import MapMatchedValueError, MissingDependencyError, NetworkXNotInstalledError
from ..core.graph_types import EdgeLike, check_node_id, coerce_edge
from ..core.optional import import_optional
from ._csr import CSRAdjacency, build_csr, infer_num_nodes
from .vocabulary import ChunkVocabulary

if TYPE_CHECKING:  # pragma: no cover
    from .tensor_graph import TensorCorpusGraph

__all__ = [
    "GraphParts",
    "from_edges",
    "from_edge_index",
    "from_networkx",
    "to_edge_index",
    "to_data",
    "to_networkx",
]

Device = Union[torch.device, str, None]


class GraphParts(NamedTuple):
    """What a conversion hands :class:`~.tensor_graph.TensorCorpusGraph`'s constructor.

    Attributes:
        adjacency: the CSR arcs (no self-loops, no duplicates, positive finite float64).
        vocabulary: the chunk IDs of the N nodes.
        directed: whether edges are one-way (as the source said it).
        maximum_distance: the bound, checked finite and > 0.
    """

    adjacency: CSRAdjacency
    vocabulary: ChunkVocabulary
    directed: Any
    maximum_distance: float


def _parts(
    edge_index: torch.Tensor,
    edge_weight: Optional[torch.Tensor],
    vocabulary: ChunkVocabulary,
    directed: Any,
    maximum_distance: float,
) -> GraphParts:
    adjacency = build_csr(
        edge_index, edge_weight, len(vocabulary), directed=directed, describe_node=vocabulary.__getitem__
    )
    return GraphParts(adjacency, vocabulary, directed, maximum_distance)


# ---------------------------------------------------------------------- into the graph


def from_edges(
    edges: Iterable[EdgeLike],
    *,
    nodes: Iterable[str] = (),
    directed: bool = False,
    maximum_distance: float = 10.0,
    device: Device = None,
) -> GraphParts:
    """The parts of :meth:`TensorCorpusGraph.from_edges` (see it for the arguments and
    errors): nodes numbered like :class:`InMemoryCorpusGraph` (declared nodes first,
    then endpoints as edges first mention them).

    Cost: O(E) Python work to read the edges, then :func:`~._csr.build_csr`.
    """
    maximum_distance = check_positive_finite(maximum_distance, "maximum_distance")
    positions: dict = {}
    for node in check_not_a_string(nodes, "nodes"):
        positions.setdefault(check_node_id(node), len(positions))
    sources: List[int] = []
    targets: List[int] = []
    weights: List[float] = []
    for position, item in enumerate(check_not_a_string(edges, "edges")):
        edge = coerce_edge(item, position)
        sources.append(positions.setdefault(edge.source_chunk_id, len(positions)))
        targets.append(positions.setdefault(edge.target_chunk_id, len(positions)))
        weights.append(edge.distance)
    edge_index = torch.tensor([sources, targets], dtype=torch.long, device=device).view(2, -1)
    edge_weight = torch.tensor(weights, dtype=torch.float64, device=device)
    return _parts(edge_index, edge_weight, ChunkVocabulary(positions), directed, maximum_distance)


def from_edge_index(
    edge_index: torch.Tensor,
    edge_weight: Optional[torch.Tensor] = None,
    *,
    chunk_ids: Optional[Sequence[str]] = None,
    num_nodes: Optional[int] = None,
    directed: bool = False,
    maximum_distance: float = 10.0,
) -> GraphParts:
    """The parts of :meth:`TensorCorpusGraph.from_edge_index` (see it for the arguments
    and errors), on ``edge_index``'s device."""
    maximum_distance = check_positive_finite(maximum_distance, "maximum_distance")
    if not isinstance(edge_index, torch.Tensor):
        raise MapMatchedValueError(f"edge_index must be a (2, E) tensor, got {type(edge_index).__name__}")
    if chunk_ids is not None:
        vocabulary = ChunkVocabulary(chunk_ids)
        if num_nodes is not None and num_nodes != len(vocabulary):
            raise MapMatchedValueError(f"num_nodes={num_nodes!r} but {len(vocabulary)} chunk_ids were given")
    else:
        if num_nodes is None:
            num_nodes = infer_num_nodes(edge_index)
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 0:
            raise MapMatchedValueError(f"num_nodes must be a nonnegative int, got {num_nodes!r}")
        vocabulary = ChunkVocabulary(str(index) for index in range(num_nodes))
    if edge_weight is None and edge_index.dim() == 2:
        edge_weight = torch.ones(edge_index.shape[-1], dtype=torch.float64, device=edge_index.device)
    return _parts(edge_index, edge_weight, vocabulary, directed, maximum_distance)


def from_networkx(
    graph: Any,
    *,
    weight: str = "weight",
    maximum_distance: float = 10.0,
    device: Device = None,
) -> GraphParts:
    """The parts of :meth:`TensorCorpusGraph.from_networkx` (see it for the arguments
    and errors): the direction from ``graph.is_directed()``, the vocabulary in node
    order, parallel edges keeping the smallest distance."""
    _networkx("TensorCorpusGraph.from_networkx")
    maximum_distance = check_positive_finite(maximum_distance, "maximum_distance")
    vocabulary = ChunkVocabulary(graph.nodes)
    sources: List[int] = []
    targets: List[int] = []
    weights: List[float] = []
    for source, target, distance in graph.edges(data=weight, default=1.0):
        sources.append(vocabulary.index_of(source))
        targets.append(vocabulary.index_of(target))
        weights.append(_edge_distance(distance, source, target))
    edge_index = torch.tensor([sources, targets], dtype=torch.long, device=device).view(2, -1)
    edge_weight = torch.tensor(weights, dtype=torch.float64, device=device)
    return _parts(edge_index, edge_weight, vocabulary, graph.is_directed(), maximum_distance)


# ---------------------------------------------------------------------- out of the graph


def to_edge_index(graph: "TensorCorpusGraph") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(edge_index (2, E) int64, edge_weight (E,) float64)`` of every stored arc,
    sorted by (source, target); an undirected graph lists both directions."""
    return graph.adjacency.edge_index(), graph.adjacency.weights.clone()


def to_data(graph: "TensorCorpusGraph") -> Any:
    """A ``torch_geometric.data.Data`` with ``edge_index``, ``edge_weight``,
    ``num_nodes`` and ``chunk_ids`` (a list of the N IDs)."""
    from torch_geometric.data import Data

    edge_index, edge_weight = to_edge_index(graph)
    return Data(
        edge_index=edge_index, edge_weight=edge_weight, num_nodes=graph.num_nodes, chunk_ids=list(graph.nodes)
    )


def to_networkx(graph: "TensorCorpusGraph") -> Any:
    """A ``networkx.DiGraph`` (directed) or ``Graph`` with the nodes in index order
    and each edge's distance in the ``"weight"`` attribute.

    Raises:
        NetworkXNotInstalledError: networkx is missing (the ``[networkx]`` extra).
    """
    nx = _networkx("TensorCorpusGraph.to_networkx")
    directed = graph.directed
    result = nx.DiGraph() if directed else nx.Graph()
    result.add_nodes_from(graph.nodes)
    edge_index, edge_weight = to_edge_index(graph)
    keep = torch.ones_like(edge_weight, dtype=torch.bool) if directed else edge_index[0] < edge_index[1]
    ids = graph.nodes
    result.add_weighted_edges_from(
        (ids[source], ids[target], weight)
        for source, target, weight in zip(
            edge_index[0, keep].tolist(), edge_index[1, keep].tolist(), edge_weight[keep].tolist()
        )
    )
    return result


def _networkx(feature: str) -> Any:
    """The networkx module, or :class:`NetworkXNotInstalledError` naming the extra."""
    try:
        return import_optional("networkx", "networkx", feature)
    except MissingDependencyError as exc:
        raise NetworkXNotInstalledError(feature) from exc.__cause__


def _edge_distance(value: Any, source: Any, target: Any) -> float:
    """A networkx edge attribute as a float (validated later with the other distances)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise MapMatchedValueError(
            f"edge {source!r} -> {target!r} has a non-numeric distance {value!r}"
        ) from None
