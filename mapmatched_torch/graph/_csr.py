"""The compressed sparse row (CSR) adjacency behind a tensor corpus graph.

:func:`build_csr` turns a torch_geometric-style ``(edge_index, edge_weight)`` into a
:class:`CSRAdjacency` with docs/spec.md section 4's rules: edge distances must be positive
and finite (checked before anything else, naming the first bad edge), self-loops are
dropped (a positive loop never shortens a path), an undirected graph stores both
directions, and parallel arcs keep the smallest distance (coalesced with
``reduce="min"``, so scipy never sums duplicates). Arcs are sorted by (source,
target), the order of :meth:`InMemoryCorpusGraph.edges`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, Optional, Union

import torch

from ..core.errors import MapMatchedValueError

__all__ = ["CSRAdjacency", "build_csr", "infer_num_nodes", "INFERRED_NODES_FLOOR", "csr_fingerprint"]

#: :func:`infer_num_nodes` accepts any N up to this many nodes; beyond it, only an N at
#: most :data:`_INFERRED_NODES_PER_REFERENCED` times the distinct nodes the edges name.
INFERRED_NODES_FLOOR = 1 << 20
_INFERRED_NODES_PER_REFERENCED = 64


class CSRAdjacency:
    """Out-arcs of N nodes in CSR form, on one device.

    Attributes:
        indptr: ``(N + 1,)`` int64; the arcs of node ``u`` are ``indptr[u]:indptr[u + 1]``.
        indices: ``(E,)`` int64 arc targets, sorted within each node.
        weights: ``(E,)`` float64 arc distances, positive and finite.
        num_nodes: N.

    No duplicate arcs, no self-loops. Immutable (do not write into the tensors).
    """

    __slots__ = ("indptr", "indices", "weights", "num_nodes", "_scipy", "_typical", "derived")

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, num_nodes: int) -> None:
        self.indptr = indptr
        self.indices = indices
        self.weights = weights
        self.num_nodes = int(num_nodes)
        self._scipy: Any = None
        self._typical: Optional[float] = None
        #: arrays engines derive from the arcs once (e.g. the compiled engine's CSR)
        self.derived: Dict[str, Any] = {}

    @property
    def device(self) -> torch.device:
        """Where the tensors live."""
        return self.indices.device

    @property
    def edge_count(self) -> int:
        """E, the number of stored arcs (an undirected edge counts twice)."""
        return int(self.indices.numel())

    def arc_sources(self) -> torch.Tensor:
        """``(E,)`` int64: the source node of every arc."""
        degree = self.indptr[1:] - self.indptr[:-1]
        return torch.repeat_interleave(torch.arange(self.num_nodes, device=self.device), degree)

    def edge_index(self) -> torch.Tensor:
        """``(2, E)`` int64 ``[sources; targets]``, sorted by (source, target)."""
        return torch.stack([self.arc_sources(), self.indices])

    def typical_weight(self) -> float:
        """The median arc distance (1.0 without arcs); used to size first search radii."""
        if self._typical is None:
            self._typical = float(self.weights.median()) if self.edge_count else 1.0
        return self._typical

    def scipy_matrix(self) -> Any:
        """The adjacency as a ``scipy.sparse.csr_matrix`` of float64 (built once, on CPU).

        It has no duplicate entries and no explicit zeros, so scipy's csgraph routines
        read exactly the arcs stored here.
        """
        if self._scipy is None:
            from scipy.sparse import csr_matrix

            self._scipy = csr_matrix(
                (
                    self.weights.cpu().numpy(),
                    self.indices.cpu().numpy(),
                    self.indptr.cpu().numpy(),
                ),
                shape=(self.num_nodes, self.num_nodes),
            )
        return self._scipy

    def to(self, device: Union[torch.device, str]) -> "CSRAdjacency":
        """The same adjacency on ``device`` (``self`` when it is already there)."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = CSRAdjacency(self.indptr.to(device), self.indices.to(device), self.weights.to(device), self.num_nodes)
        moved._scipy, moved._typical = self._scipy, self._typical
        return moved


def build_csr(
    edge_index: torch.Tensor,
    edge_weight: torch.Tensor,
    num_nodes: int,
    *,
    directed: bool,
    describe_node: Optional[Callable[[int], str]] = None,
) -> CSRAdjacency:
    """Validate, clean and compress a list of arcs.

    Args:
        edge_index: ``(2, E)`` integer tensor of ``[sources; targets]`` in ``[0, num_nodes)``.
        edge_weight: ``(E,)`` real tensor of edge distances (converted to float64).
        num_nodes: N.
        directed: if False every edge is stored in both directions.
        describe_node: turns a node index into text for error messages (default: the index).

    Returns:
        The :class:`CSRAdjacency` on ``edge_index``'s device.

    Raises:
        ValueError: a malformed ``edge_index`` / ``edge_weight`` (shape, dtype,
            out-of-range node), or a distance that is not positive and finite (the
            message names the edge's position, its endpoints and the value).

    Cost: O(E log E) (one coalescing sort).
    """
    describe = describe_node or str
    _check_edge_tensors(edge_index, edge_weight, num_nodes)
    weights = edge_weight.to(torch.float64)
    bad = ~(torch.isfinite(weights) & (weights > 0))
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        source, target = (int(value) for value in edge_index[:, position])
        raise MapMatchedValueError(
            f"graph edge distance must be finite and greater than zero, got {float(weights[position])!r} "
            f"(edge {position}: {describe(source)!r} -> {describe(target)!r})"
        )
    edge_index = edge_index.to(torch.long)
    # shape: (E',) arcs that are not self-loops
    keep = edge_index[0] != edge_index[1]
    edge_index, weights = edge_index[:, keep], weights[keep]
    # imported here: torch_geometric takes seconds to import, and importing the graph
    # package (its protocols, for the decoders and the server) should not
    from torch_geometric.utils import coalesce, to_undirected

    if directed:
        edge_index, weights = coalesce(edge_index, weights, num_nodes, reduce="min")
    else:
        edge_index, weights = to_undirected(edge_index, weights, num_nodes, reduce="min")
    # shape: (N + 1,)
    indptr = torch.zeros(num_nodes + 1, dtype=torch.long, device=edge_index.device)
    indptr[1:] = torch.cumsum(torch.bincount(edge_index[0], minlength=num_nodes), 0)
    return CSRAdjacency(indptr, edge_index[1].contiguous(), weights.contiguous(), num_nodes)


def infer_num_nodes(edge_index: Any) -> int:
    """N of an ``edge_index`` given without chunk IDs or a node count: its largest index + 1.

    Args:
        edge_index: ``(2, E)`` integer tensor of ``[sources; targets]``.

    Returns:
        ``edge_index.max() + 1`` (0 without edges; nodes below it that no edge names
        are isolated nodes).

    Raises:
        ValueError: a malformed ``edge_index``, or an N above
            :data:`INFERRED_NODES_FLOOR` that is more than 64 times the distinct nodes
            the edges name: one stray index (say ``2**40``) would otherwise make
            ``2**40`` node IDs and run out of memory. The message names the edge;
            pass ``num_nodes`` (or ``chunk_ids``) to declare a sparse numbering.
    """
    _check_edge_index(edge_index)
    if not edge_index.numel():
        return 0
    largest = int(edge_index.max())
    count = max(largest + 1, 0)  # all negative: the range check names the bad node
    if count > INFERRED_NODES_FLOOR:
        distinct = int(torch.unique(edge_index).numel())
        if count > _INFERRED_NODES_PER_REFERENCED * distinct:
            position = int((edge_index == largest).any(0).nonzero()[0, 0])
            source, target = (int(value) for value in edge_index[:, position])
            raise MapMatchedValueError(
                f"edge {position} ({source} -> {target}) of edge_index has node {largest}, so N would be {count}, "
                f"but the edges name only {distinct} distinct nodes: a stray index? Fix the edge, or pass "
                f"num_nodes (or chunk_ids) to declare the nodes"
            )
    return count


def _check_edge_index(edge_index: Any) -> None:
    """A ``(2, E)`` integer tensor."""
    if not isinstance(edge_index, torch.Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
        shape = tuple(edge_index.shape) if isinstance(edge_index, torch.Tensor) else type(edge_index).__name__
        raise MapMatchedValueError(f"edge_index must be a (2, E) tensor, got {shape}")
    if edge_index.dtype.is_floating_point or edge_index.dtype.is_complex or edge_index.dtype == torch.bool:
        raise MapMatchedValueError(f"edge_index must have an integer dtype, got {edge_index.dtype}")


def _check_edge_tensors(edge_index: Any, edge_weight: Any, num_nodes: int) -> None:
    """Shapes, dtypes, devices and node range of an ``(edge_index, edge_weight)`` pair."""
    _check_edge_index(edge_index)
    if not isinstance(edge_weight, torch.Tensor) or tuple(edge_weight.shape) != (edge_index.shape[1],):
        shape = tuple(edge_weight.shape) if isinstance(edge_weight, torch.Tensor) else type(edge_weight).__name__
        raise MapMatchedValueError(
            f"edge_weight must be a ({edge_index.shape[1]},) tensor matching edge_index, got {shape}"
        )
    if edge_weight.dtype.is_complex or edge_weight.dtype == torch.bool:
        raise MapMatchedValueError(f"edge_weight must have a real dtype, got {edge_weight.dtype}")
    if edge_weight.device != edge_index.device:
        raise MapMatchedValueError(
            f"edge_weight is on {edge_weight.device} but edge_index is on {edge_index.device}"
        )
    # shape: (E,) edges with an endpoint outside [0, N)
    outside = ((edge_index < 0) | (edge_index >= num_nodes)).any(0)
    if bool(outside.any()):
        position = int(outside.nonzero()[0, 0])
        source, target = (int(value) for value in edge_index[:, position])
        value = source if not 0 <= source < num_nodes else target
        raise MapMatchedValueError(
            f"edge {position} ({source} -> {target}) of edge_index has node {value}, outside [0, {num_nodes}); "
            f"node indices must be below the number of nodes"
        )


def csr_fingerprint(num_nodes: int, directed: bool, indptr: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> str:
    """A SHA-256 of a graph's structure: N, direction and the CSR arcs (not the bound, not
    the IDs): what :func:`~mapmatched_torch.graph.artifacts.graph_fingerprint` gives and a
    ball table records of the graph it was built from."""
    digest = hashlib.sha256(f"{int(num_nodes)}:{int(directed)}".encode())
    for array in (indptr, indices, weights):
        digest.update(array.detach().cpu().contiguous().numpy().data)
    return digest.hexdigest()
