"""Precomputed context neighbourhoods: every node's neighbourhood within one radius.

A :class:`NeighborhoodTable` holds, for every node, the nodes within ``limit`` of it
(itself excluded) ordered by (distance, chunk ID): exactly
:meth:`~mapmatched_torch.graph.TensorCorpusGraph.neighborhood_indices` at a radius whose
limit ``min(radius, maximum_distance)`` is ``limit``, as a CSR of node indices. A graph
with one attached answers those neighbourhoods by slicing rows (no search), and a graph
artifact carries it (:func:`~.artifacts.save_graph`), so a server over a big graph reads
its context rows instead of searching them on start. The table is plain tensors: the
serving layer reads it through the graph's ``neighborhood_indices``.

Size: 4 bytes per entry (int32 node indices; int64 from 2**31 nodes on) plus 8 bytes
per node.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..core.checks import check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.progress import progress_bar
from ..kernels.ragged import padded_rows

__all__ = ["NeighborhoodTable", "build_neighborhood_table", "CONTEXT_FILES"]

#: File names of a table inside a graph artifact.
CONTEXT_FILES = {"indptr": "context_indptr.npy", "nodes": "context_nodes.npy"}


class NeighborhoodTable:
    """Every node's ordered neighbourhood within ``limit`` (module docstring).

    Attributes:
        indptr: ``(N + 1,)`` int64; node ``s``'s neighbourhood is ``nodes[indptr[s]:indptr[s + 1]]``.
        nodes: ``(nnz,)`` int32 or int64 node indices, each row by (distance, chunk ID).
        radius: the radius it was built for; ``limit``: ``min(radius, maximum_distance)``
            of the graph it was built from (the neighbourhoods' actual bound).

    Raises:
        ValueError: arrays that do not fit together, a bad radius or limit.
    """

    __slots__ = ("indptr", "nodes", "radius", "limit")

    def __init__(self, indptr: torch.Tensor, nodes: torch.Tensor, radius: float, limit: float) -> None:
        if indptr.dim() != 1 or indptr.numel() < 1 or nodes.dim() != 1 or int(indptr[-1]) != nodes.numel():
            raise MapMatchedValueError("a neighbourhood table needs (N + 1,) indptr ending at its (nnz,) nodes")
        if radius < 0 or limit < 0 or limit > radius:
            raise MapMatchedValueError(f"a neighbourhood table needs 0 <= limit <= radius, got {limit!r} and {radius!r}")
        self.indptr, self.nodes = indptr, nodes
        self.radius, self.limit = float(radius), float(limit)

    @property
    def num_nodes(self) -> int:
        """N."""
        return self.indptr.numel() - 1

    def rows(self, centres: torch.Tensor) -> torch.Tensor:
        """``(C, W)`` int64: the neighbourhoods of ``(C,)`` int64 index codes (``< 0``:
        empty), ``-1`` padded, ``W`` the largest of them (0 when all are empty).

        Cost: O(C + the entries read); the rows are slices, nothing is searched or sorted.
        """
        centres = centres.cpu()
        known = centres >= 0
        starts = torch.where(known, self.indptr[centres.clamp_min(0)], 0)
        counts = torch.where(known, self.indptr[centres.clamp_min(0) + 1], 0) - starts
        total = int(counts.sum())
        # shape: (total,) the entries of every row, one row after another
        offsets = torch.repeat_interleave(starts - (torch.cumsum(counts, 0) - counts), counts)
        entries = self.nodes[offsets + torch.arange(total)].long()
        return padded_rows(entries, counts, int(counts.max()) if counts.numel() else 0, -1)

    def to_cpu(self) -> "NeighborhoodTable":
        """The table with its arrays on the CPU (where :meth:`rows` reads them)."""
        return NeighborhoodTable(self.indptr.cpu(), self.nodes.cpu(), self.radius, self.limit)


def build_neighborhood_table(graph: Any, radius: float, *, batch_size: int = 4096,
                             progress: Optional[bool] = None) -> NeighborhoodTable:
    """Every node's neighbourhood within ``radius`` of a
    :class:`~mapmatched_torch.graph.TensorCorpusGraph` (its ``neighborhood_indices``, in
    batches of ``batch_size`` centres), with progress per batch (``progress``: None
    from 100,000 nodes on, as the ball table's build; plain lines when stderr is not a
    terminal).

    Returns:
        The table, on the CPU, with ``limit = min(radius, graph.maximum_distance)``.

    Cost: one bounded search per node (a slice per node with a ball table attached);
    memory 4 bytes per entry, plus one batch's padded rows.
    """
    radius = float(radius)
    if not radius >= 0 or radius == float("inf"):
        raise MapMatchedValueError(f"the context radius must be a finite number >= 0, got {radius!r}")
    batch_size = check_positive_int(batch_size, "batch_size")
    nodes = graph.num_nodes
    counts, parts = [torch.zeros(1, dtype=torch.long)], []
    kind = torch.int32 if nodes < 2**31 else torch.int64
    show = nodes >= 100_000 if progress is None else bool(progress)
    with progress_bar(total=nodes, unit="node", desc="context table", show=show) as bar:
        for first in range(0, nodes, batch_size):
            centres = torch.arange(first, min(nodes, first + batch_size), device=graph.device)
            rows = graph.neighborhood_indices(centres, radius, engine="auto").cpu()
            inside = rows >= 0
            counts.append(inside.sum(dim=1))
            parts.append(rows[inside].to(kind))  # row-major: each row's order kept
            bar.update(centres.numel())
    indptr = torch.cumsum(torch.cat(counts), 0)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=kind)
    return NeighborhoodTable(indptr, flat, radius, min(radius, graph.maximum_distance))
