"""Precomputed bounded balls: distances whose cost does not grow with the corpus.

A :class:`BallTable` holds, for every node ``s``, its *ball*: every other node ``t``
with ``d(s, t) <= bound``, as a CSR row sorted by ``t`` with the exact float64
distance (the value of a bounded Dijkstra from ``s``: the source's row, as
:meth:`~mapmatched_torch.graph.TensorCorpusGraph.distance` reads it). Then

    d(s, t) = the row entry when ``t`` is in ``s``'s ball, else ``maximum_distance``

for any ``maximum_distance <= bound``: exactly docs/spec.md section 4, clamping, ties
and unknown IDs included (0.0 between equal codes, ``maximum_distance`` for any pair
with an unknown ID; see :func:`ball_distances`). A lookup is a binary search in one
row: O(log ball) per pair, whatever N is. Size: 12 bytes per ball entry (int32
neighbour + float64 distance; int64 neighbours from 2**31 nodes on) plus 8 bytes per node.

Building runs the compiled engine's bounded searches (numba; scipy otherwise) in
batches of centres. Given a directory, each finished batch is written there first
(atomically), so an interrupted build resumes where it stopped; the final arrays
are ``.npy`` files that :meth:`BallTable.load` memory-maps.

:func:`calibrate_bound` picks a bound that means something: the median (or another
quantile) over sampled nodes of the distance to their ``ball_size``-th nearest
other node, so a typical ball holds ``ball_size`` nodes (a jump further than that
costs the full bound), and the table's size is about ``12 * ball_size`` bytes per node.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import torch

from ..core.checks import broadcast_shape, check_positive_finite, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.progress import progress_bar
from ._csr import CSRAdjacency
from ._memory import load_vector

__all__ = ["BallTable", "build_ball_table", "ball_distances", "calibrate_bound", "ball_size_summary"]

PathLike = Union[str, "os.PathLike[str]"]

#: File names of a table inside its directory.
FILES = {"indptr": "ball_indptr.npy", "neighbors": "ball_neighbors.npy", "distances": "ball_distances.npy"}
#: The resumable build's progress record and its batches' folder.
_BUILD_STATE = "ball_build.json"
_PARTS = "ball_parts"


class BallTable:
    """Every node's bounded ball as a CSR (module docstring).

    Attributes:
        indptr: ``(N + 1,)`` int64; node ``s``'s ball is ``indptr[s]:indptr[s + 1]``.
        neighbors: ``(nnz,)`` int32 or int64 ball members, sorted within each row
            (the centre itself is not stored).
        distances: ``(nnz,)`` float64 exact distances, ``<= bound``.
        bound: the search bound the balls were built with.

    Example:
        >>> from mapmatched_torch.graph import TensorCorpusGraph
        >>> graph = TensorCorpusGraph.from_edges([("a", "b", 0.5), ("b", "c", 0.25), ("c", "d", 2.0)], maximum_distance=1.0)
        >>> table = build_ball_table(graph.adjacency, 1.0)
        >>> table.ball_sizes().tolist()
        [2, 2, 2, 0]
        >>> ball_distances(table, torch.tensor([0, 0, 3, -2]), torch.tensor([2, 3, 3, -2]), 1.0).tolist()
        [0.75, 1.0, 0.0, 0.0]
    """

    __slots__ = ("indptr", "neighbors", "distances", "bound", "directory", "_rows")

    def __init__(self, indptr: torch.Tensor, neighbors: torch.Tensor, distances: torch.Tensor, bound: float) -> None:
        if indptr.dim() != 1 or indptr.numel() < 1 or neighbors.shape != distances.shape:
            raise MapMatchedValueError("a ball table needs (N + 1,) indptr and equally long neighbors and distances")
        if int(indptr[-1]) != neighbors.numel():
            raise MapMatchedValueError(
                f"ball table indptr ends at {int(indptr[-1])} but there are {neighbors.numel()} entries"
            )
        self.indptr = indptr
        self.neighbors = neighbors
        self.distances = distances
        self.bound = check_positive_finite(bound, "bound")
        #: the folder the arrays are memory-mapped from (:meth:`load`), else None
        self.directory: Optional[Path] = None
        self._rows: Optional[int] = None

    @property
    def num_nodes(self) -> int:
        """N."""
        return self.indptr.numel() - 1

    @property
    def nbytes(self) -> int:
        """Bytes of the three arrays."""
        return sum(array.numel() * array.element_size() for array in (self.indptr, self.neighbors, self.distances))

    def ball_sizes(self) -> torch.Tensor:
        """``(N,)`` int64: the members of each ball (the centre not counted)."""
        return self.indptr[1:] - self.indptr[:-1]

    def widest_row(self) -> int:
        """The largest ball (computed once)."""
        if self._rows is None:
            self._rows = int(self.ball_sizes().max()) if self.num_nodes else 0
        return self._rows

    def to(self, device: Any) -> "BallTable":
        """The table on ``device`` (``self`` when already there; a memory-mapped table
        stays mapped on the CPU), its widest ball counted now (one host read, here, so
        that lookups need none)."""
        device = torch.device(device)
        if self.indptr.device == device:
            self.widest_row()
            return self
        moved = BallTable(self.indptr.to(device), self.neighbors.to(device), self.distances.to(device), self.bound)
        moved._rows = self.widest_row()
        return moved

    def row(self, node: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(members, distances)`` of one node's ball, sorted by member."""
        start, stop = int(self.indptr[node]), int(self.indptr[node + 1])
        return self.neighbors[start:stop].long(), self.distances[start:stop]

    def save(self, directory: PathLike) -> Dict[str, str]:
        """Write the arrays as ``.npy`` files into ``directory``; returns their names."""
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        for key, name in FILES.items():
            _save_atomic(folder / name, getattr(self, key).numpy())
        return dict(FILES)

    @classmethod
    def load(cls, directory: PathLike, bound: float, *, mmap: bool = True) -> "BallTable":
        """The table in ``directory`` (memory-mapped unless ``mmap`` is False)."""
        folder = Path(directory)
        arrays = {key: load_vector(folder / name, mmap, _DTYPES[key], "ball table") for key, name in FILES.items()}
        table = cls(arrays["indptr"], arrays["neighbors"], arrays["distances"], bound)
        table.directory = folder.resolve() if mmap else None
        return table

    def __repr__(self) -> str:
        return f"BallTable(nodes={self.num_nodes}, entries={self.neighbors.numel()}, bound={self.bound!r})"


def _save_atomic(path: Path, array: np.ndarray) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        np.save(handle, np.ascontiguousarray(array), allow_pickle=False)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


#: The dtypes a saved table's arrays may hold.
_DTYPES = {"indptr": [np.int64], "neighbors": [np.int32, np.int64], "distances": [np.float64]}


# ---------------------------------------------------------------------- building


def _search_balls(adjacency: CSRAdjacency, centres: np.ndarray, bound: float, memory_budget: Optional[int]):
    """``(counts, nodes, distances)`` of each centre's ball (centre included), by the
    compiled engine when numba is there, else by scipy's bounded rows."""
    from .engines.compiled import compiled_balls
    from .shortest_paths import bounded_rows, resolve_engine

    if resolve_engine("auto", torch.device("cpu")) == "compiled":
        return compiled_balls(adjacency, torch.from_numpy(centres), bound, memory_budget)
    rows = bounded_rows(adjacency, torch.from_numpy(centres), limit=bound, engine="scipy")
    inside = rows <= bound
    row, node = inside.nonzero(as_tuple=True)
    return inside.sum(dim=1).numpy(), node.numpy(), rows[inside].numpy()


def _batch_rows(adjacency: CSRAdjacency, centres: np.ndarray, bound: float, memory_budget: Optional[int]):
    """``(counts, members, distances)`` of the centres' balls without the centres,
    each row sorted by member (int64 members)."""
    counts, nodes, distances = _search_balls(adjacency, centres, bound, memory_budget)
    owner = np.repeat(np.arange(centres.size), counts)
    keep = nodes != centres[owner]
    owner, nodes, distances = owner[keep], nodes[keep], distances[keep]
    order = np.lexsort((nodes, owner))
    return np.bincount(owner, minlength=centres.size).astype(np.int64), nodes[order], distances[order]


def build_ball_table(
    adjacency: CSRAdjacency,
    bound: float,
    *,
    directory: Optional[PathLike] = None,
    batch_size: int = 1 << 16,
    fingerprint: str = "",
    memory_budget: Optional[int] = None,
    progress: Optional[bool] = None,
) -> BallTable:
    """Every node's ball within ``bound`` (module docstring).

    Args:
        adjacency: the graph (CPU; an accelerator graph's CSR is copied to the CPU).
        bound: the search bound, finite and > 0 (the largest ``maximum_distance`` the
            table can answer for).
        directory: where to build resumably and keep the result (memory-mapped);
            None: in memory.
        batch_size: centres searched (and written) per batch.
        fingerprint: the graph's fingerprint; a resumed build whose record names
            another graph, bound or batch size starts over.
        memory_budget: bytes of search state per round.
        progress: progress lines (None: from 100,000 nodes on).

    Returns:
        The :class:`BallTable` (memory-mapped from ``directory`` when given).

    Cost: one bounded search per node, O(ball) each with numba; memory: one batch of
    balls (plus, at the end, the arrays are assembled one at a time into memory maps).
    """
    bound = check_positive_finite(bound, "bound")
    batch = check_positive_int(batch_size, "batch_size")
    if adjacency.device.type != "cpu":
        adjacency = adjacency.to("cpu")
    nodes = adjacency.num_nodes
    show = nodes >= 100_000 if progress is None else bool(progress)
    starts = range(0, nodes, batch)
    if directory is None:
        parts = []
        with progress_bar(total=nodes, unit="node", desc="ball table", show=show) as bar:
            for start in starts:
                parts.append(_batch_rows(adjacency, np.arange(start, min(start + batch, nodes)), bound, memory_budget))
                bar.update(min(start + batch, nodes) - start)
        counts = np.concatenate([part[0] for part in parts]) if parts else np.zeros(0, dtype=np.int64)
        members = np.concatenate([part[1] for part in parts]) if parts else np.zeros(0, dtype=np.int64)
        values = np.concatenate([part[2] for part in parts]) if parts else np.zeros(0)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return BallTable(torch.from_numpy(indptr), torch.from_numpy(members.astype(_member_dtype(nodes))),
                         torch.from_numpy(values), bound)
    folder = Path(directory)
    parts_dir = folder / _PARTS
    parts_dir.mkdir(parents=True, exist_ok=True)
    state = {"bound": bound, "batch_size": batch, "num_nodes": nodes, "fingerprint": fingerprint}
    state_path = folder / _BUILD_STATE
    if state_path.exists():
        try:
            previous = json.loads(state_path.read_text())
        except ValueError:
            previous = None
        if previous != state:  # another graph or layout: start over
            for stale in parts_dir.glob("*.npz"):
                stale.unlink()
    state_path.write_text(json.dumps(state, sort_keys=True))
    with progress_bar(total=nodes, unit="node", desc="ball table", show=show) as bar:
        for number, start in enumerate(starts):
            stop = min(start + batch, nodes)
            part = parts_dir / f"part-{number:06d}.npz"
            if not part.exists():
                counts, members, values = _batch_rows(adjacency, np.arange(start, stop), bound, memory_budget)
                temporary = parts_dir / f"part-{number:06d}.tmp.npz"
                np.savez(temporary, counts=counts, members=members, values=values)
                os.replace(temporary, part)
            bar.update(stop - start)
    return _assemble(folder, parts_dir, len(starts), nodes, bound, state_path)


def _member_dtype(nodes: int) -> Any:
    return np.int32 if nodes < 2**31 else np.int64


def _assemble(folder: Path, parts_dir: Path, batches: int, nodes: int, bound: float, state_path: Path) -> BallTable:
    """Join the batches into the three ``.npy`` memory maps, then drop the batches."""
    counts = [np.load(parts_dir / f"part-{number:06d}.npz")["counts"] for number in range(batches)]
    sizes = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    indptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    _save_atomic(folder / FILES["indptr"], indptr)
    for key, dtype in (("members", _member_dtype(nodes)), ("values", np.float64)):
        name = FILES["neighbors" if key == "members" else "distances"]
        temporary = folder / (name + ".tmp")
        out = np.lib.format.open_memmap(temporary, mode="w+", dtype=dtype, shape=(int(indptr[-1]),))
        place = 0
        for number in range(batches):
            chunk = np.load(parts_dir / f"part-{number:06d}.npz")[key]
            out[place:place + chunk.size] = chunk
            place += chunk.size
        out.flush()
        del out
        os.replace(temporary, folder / name)
    for number in range(batches):
        (parts_dir / f"part-{number:06d}.npz").unlink()
    parts_dir.rmdir()
    state_path.unlink()
    return BallTable.load(folder, bound)


# ---------------------------------------------------------------------- lookups


def ball_distances(
    table: BallTable, sources: torch.Tensor, targets: torch.Tensor, maximum_distance: float, *,
    synchronize: bool = True,
) -> torch.Tensor:
    """docs/spec.md distances of index codes from a :class:`BallTable`, elementwise.

    Args:
        table: the balls, built with ``bound >= maximum_distance``.
        sources, targets: int64 index codes of broadcastable shapes (``>= 0`` a node,
            ``-1`` padding, ``<= -2`` an unknown ID).
        maximum_distance: the graph's bound.
        synchronize: False: nothing is read back to the host (the torch binary search,
            all of its passes; a table on the codes' device, its widest ball counted
            ahead by :meth:`BallTable.to`), for a step that runs ahead of the host.

    Returns:
        float64 of the broadcast shape on the sources' device: 0.0 for equal
        non-padding codes, the ball entry ``<= maximum_distance`` between two nodes,
        else ``maximum_distance``.

    Cost: a binary search per pair in its source's row, O(log ball): one compiled
    pass on the CPU with numba (for ``(..., A, 1)`` sources against ``(..., 1, C)``
    targets, a trellis turn pair, each source's row is read once for its ``C``
    targets, on torch's thread count: :mod:`._ball_kernels`), else
    ``ceil(log2(widest ball + 1))`` vectorized gather-and-compare passes (any device).
    """
    if table.bound < maximum_distance:
        raise MapMatchedValueError(
            f"the ball table was built for bound {table.bound!r}, below maximum_distance {maximum_distance!r}"
        )
    device = sources.device
    shape = torch.Size(broadcast_shape(sources.shape, targets.shape))
    compiled = _compiled_lookup() if synchronize and table.indptr.device.type == "cpu" else None
    if compiled is not None and _is_grid(sources, targets, shape):
        # shape: (G, A) sources and (G, C) targets of each group: a trellis turn pair
        groups = math.prod(shape[:-2])
        grid_sources = sources.expand(*shape[:-1], 1).reshape(groups, shape[-2])
        grid_targets = targets.expand(*shape[:-2], 1, shape[-1]).reshape(groups, shape[-1])
        grid_sources, grid_targets = (codes.to("cpu", torch.long).contiguous() for codes in (grid_sources, grid_targets))
        values = _compiled_grid()(
            grid_sources.numpy(), grid_targets.numpy(), table.indptr.numpy(), table.neighbors.numpy(),
            table.distances.numpy(), maximum_distance, threads=torch.get_num_threads(),
        )
        return torch.from_numpy(values).view(shape).to(device)
    if compiled is not None:
        # shape: (Q,) contiguous int64 codes (the broadcast made real once)
        flat_sources = sources.expand(shape).reshape(-1).to("cpu", torch.long).contiguous().numpy()
        flat_targets = targets.expand(shape).reshape(-1).to("cpu", torch.long).contiguous().numpy()
        values = compiled(
            flat_sources, flat_targets, table.indptr.numpy(), table.neighbors.numpy(), table.distances.numpy(),
            maximum_distance,
        )
        return torch.from_numpy(values).view(shape).to(device)
    # shape: (Q,) the pairs on the table's device
    flat_sources = sources.expand(shape).reshape(-1).to(table.indptr.device)
    flat_targets = targets.expand(shape).reshape(-1).to(table.indptr.device)
    nodes = (flat_sources >= 0) & (flat_targets >= 0)
    source, target = flat_sources.clamp_min(0), flat_targets.clamp_min(0)
    low = table.indptr[source]
    high = table.indptr[source + 1]
    end = high.clone()
    for _ in range(max(1, int(math.ceil(math.log2(table.widest_row() + 1))) + 1)):
        active = low < high
        if synchronize and not bool(active.any()):
            break
        middle = torch.div(low + high, 2, rounding_mode="floor")
        member = table.neighbors[middle.clamp_max(max(table.neighbors.numel() - 1, 0))].long()
        right = active & (member < target)
        low = torch.where(right, middle + 1, low)
        high = torch.where(active & ~right, middle, high)
    place = low.clamp_max(max(table.neighbors.numel() - 1, 0))
    hit = nodes & (low < end)
    if table.neighbors.numel():
        hit &= table.neighbors[place].long() == target
    values = torch.full(shape, maximum_distance, dtype=torch.float64, device=table.indptr.device).reshape(-1)
    if table.neighbors.numel():
        found = table.distances[place]
        values = torch.where(hit & (found <= maximum_distance), found, values)
    unequal = torch.where(flat_targets == -1, torch.iinfo(torch.long).min, flat_targets)
    values = values.masked_fill(flat_sources == unequal, 0.0)
    return values.view(shape).to(device)


def _is_grid(sources: torch.Tensor, targets: torch.Tensor, shape: torch.Size) -> bool:
    """Whether the pairs are groups' sources against the same groups' targets:
    ``(..., A, 1)`` against ``(..., 1, C)`` (:meth:`trellis_distances`' question)."""
    return (
        len(shape) >= 3 and sources.dim() >= 2 and targets.dim() >= 2
        and sources.shape[-1] == 1 and targets.shape[-2] == 1 and shape[-1] > 1 and shape[-2] > 1
    )


def _compiled_lookup() -> Any:
    """The numba lookup, or None without numba (the torch binary search answers then)."""
    from .engines.compiled import available

    if not available():
        return None
    from ._ball_kernels import lookup

    return lookup


def _compiled_grid() -> Any:
    """The numba grid lookup (:func:`._ball_kernels.lookup_grid`); only called where
    :func:`_compiled_lookup` found numba."""
    from ._ball_kernels import lookup_grid

    return lookup_grid


# ---------------------------------------------------------------------- calibration


def calibrate_bound(
    adjacency: CSRAdjacency,
    *,
    ball_size: int = 64,
    quantile: float = 0.5,
    sample: int = 1000,
    seed: int = 0,
) -> float:
    """A bound at which a typical ball holds ``ball_size`` nodes (``maximum_distance="auto"``).

    For ``sample`` nodes drawn with ``seed``, the distance to their ``ball_size``-th
    nearest other node (searched without a bound, stopping there; a node whose whole
    component is smaller gives its farthest member); the bound is the ``quantile`` of
    those distances (numpy's linear interpolation).

    Args:
        adjacency: the graph.
        ball_size: the typical ball (default 64; see the README's "Corpus scale"
            section for quality against the bound).
        quantile: in (0, 1] (default 0.5, the median).
        sample: nodes searched (default 1000, all when N is smaller).
        seed: which nodes.

    Returns:
        The bound, a finite float > 0 (1.0 when no sampled node has a neighbour).

    Cost: ``sample`` searches of ``ball_size`` settled nodes each.
    """
    size = check_positive_int(ball_size, "ball_size")
    if not 0.0 < float(quantile) <= 1.0:
        raise MapMatchedValueError(f"quantile must be in (0, 1], got {quantile!r}")
    if adjacency.device.type != "cpu":
        adjacency = adjacency.to("cpu")
    nodes = adjacency.num_nodes
    if nodes < 2:
        return 1.0
    chosen = np.sort(np.random.default_rng(seed).choice(nodes, min(sample, nodes), replace=False))
    reach = _nearest_distances(adjacency, chosen, size)
    reach = reach[np.isfinite(reach) & (reach > 0)]
    if not reach.size:
        return 1.0
    return float(np.quantile(reach, float(quantile)))


def _nearest_distances(adjacency: CSRAdjacency, centres: np.ndarray, size: int) -> np.ndarray:
    """Each centre's distance to its ``size``-th nearest other node (or farthest member
    of a smaller component; 0 for an isolated node)."""
    from .shortest_paths import bounded_rows, resolve_engine

    out = np.zeros(centres.size)
    if resolve_engine("auto", torch.device("cpu")) == "compiled":
        from .engines.compiled import _ball_chunks

        for first, _, values, counts, _ in _ball_chunks(adjacency, centres, math.inf, None, width=size + 1):
            out[first:first + counts.size] = values[np.arange(counts.size), np.maximum(counts - 1, 0)]
        return out
    rows = bounded_rows(adjacency, torch.from_numpy(centres), limit=math.inf, engine="scipy").numpy()
    for position, row in enumerate(rows):
        finite = np.sort(row[np.isfinite(row)])
        out[position] = finite[min(size, finite.size - 1)]
    return out


def ball_size_summary(sizes: Any) -> Dict[str, float]:
    """Mean, quantiles (50, 90, 99), max and zero share of ball sizes ((N,) ints)."""
    values = np.asarray(sizes.cpu() if isinstance(sizes, torch.Tensor) else sizes, dtype=np.float64)
    if not values.size:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "empty_share": 0.0}
    return {
        "mean": float(values.mean()),
        "p50": float(np.quantile(values, 0.5)),
        "p90": float(np.quantile(values, 0.9)),
        "p99": float(np.quantile(values, 0.99)),
        "max": float(values.max()),
        "empty_share": float((values == 0).mean()),
    }
