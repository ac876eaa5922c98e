"""kNN corpus graphs on tensors, bit-identical to the reference rules (docs/spec.md section 4).

The rules are those of :mod:`mapmatched_torch.standalone.knn` (the oracle): rows are
L2-normalized with a column-order float64 sum, the cosine similarity of two unit rows
is the column-order float64 sum of ``a_i * b_i`` clipped to ``[-1, 1]``, the distance
is ``1 - similarity``, each chunk picks ``k = min(k, N - 1)`` others ordered by
(distance, chunk ID), and the graph is the undirected min-union of the picks with
edge distance ``min(max(d, minimum_edge_distance), maximum_distance)``.

How it stays exact and still runs at GEMM speed (N x N is never materialized):

1. **Normalize** in float64 exactly like the reference: a loop over the D columns
   adding ``x * x`` (one multiply kernel and one add kernel per column, so no fused
   multiply-add), then a correctly rounded ``sqrt`` (numpy's: ``torch.sqrt`` on CPU
   is not correctly rounded) and ``x / norm``. Rows are kept transposed, (D, N).
2. **Coarse candidates**: (block, block) tiles of the score matrix, GEMMs in
   ``candidate_dtype`` (float32 on CPU, float64 on CUDA),
   merged with ``topk`` into each row's ``c = k + margin`` best other rows. The
   matrix is symmetric, so only the tiles on and above the block diagonal are
   computed (each serves both of its blocks): half the flops of a flat search.
3. **Exact re-scoring**: the column-order dot products of the ``c`` candidate pairs
   are recomputed in float64 (per column: gather, multiply, add), the distances
   follow the reference formula, and the candidates are sorted by (distance, rank of
   the chunk ID).
4. **Safety check**: the coarse similarity of every non-candidate is at most that
   of the last candidate, ``g``, and differs from its exact value by at most a
   rigorous bound ``tol`` (forward error of a length-D dot product of unit vectors
   in the GEMM's precision, plus the float64 rounding of the exact sum, doubled). So
   every non-candidate is at distance ``>= 1 - clip(g + tol)``; when that bound is
   strictly above the k-th picked distance, no outsider can beat or tie the picks
   and the row is final. Otherwise (a tie region larger than the margin, e.g. many
   duplicated vectors) the row is searched again with twice as many candidates, up
   to all ``N - 1`` other rows, where the answer is exact by construction.

Cost: N^2 D coarse GEMM flops (half a flat search's), O(N c D) for the exact
re-scoring, O(N D) to normalize; memory O(N D) (float64 unit rows and their coarse
copy) plus O(N c) candidate state and O(block^2) for one score tile. A matrix of
identical rows degenerates to the reference's O(N^2 D) exact work (every row is one
tie region).

Nested Python lists are validated and normalized by the reference code itself (same
messages, O(N D) Python time); tensors and numpy arrays are validated on the device,
with the reference's messages and precedence (the first bad row wins; within a row a
non-finite value, then a zero norm, then an overflowing norm).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..core.progress import progress_bar
from ..core.checks import check_choice, check_positive_int
from ..core.embeddings import (
    check_embedding_ids,
    check_knn_options,
    dimension_error,
    nonfinite_value_error,
    norm_overflow_error,
    normalized_rows,
    row_count_error,
    zero_vector_error,
)
from ..core.errors import MapMatchedValueError
from .tensor_graph import TensorCorpusGraph
from .vocabulary import ChunkVocabulary

__all__ = ["knn_neighbors_tensor", "knn_edges", "knn_graph"]

#: The ``backend=`` choices: this module's exact search, or FAISS candidates (:mod:`.knn_faiss`).
KNN_BACKENDS = ("exact", "faiss")
#: The edge clamp of ``maximum_distance="auto"``: the largest cosine distance.
AUTO_EDGE_BOUND = 2.0
#: ``progress=None`` shows a bar from this many rows on.
PROGRESS_THRESHOLD = 50_000

# Default rows per block (= columns per score tile).
_BLOCK_ROWS = {"cpu": 1024, "cuda": 4096}
# Query/candidate pairs re-scored at once (bounds the exact step's memory).
_PAIR_CHUNK = 1 << 16
# numpy dtypes torch.from_numpy takes as they are (others are converted by numpy first).
_TORCH_NATIVE = tuple(
    np.dtype(name) for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8")
)


def knn_neighbors_tensor(
    embeddings: Any,
    chunk_ids: Sequence[str],
    k: int = 10,
    *,
    block_size: Optional[int] = None,
    candidate_dtype: Optional[torch.dtype] = None,
    progress: Optional[bool] = None,
    backend: str = "exact",
    faiss_options: Optional[Dict[str, Any]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's k nearest neighbours, bit-identical to ``standalone.knn.knn_neighbors``.

    Args:
        embeddings: (N, D) real matrix: a torch tensor (any device, any real dtype;
            converted to float64), a numpy array, or nested sequences of numbers.
        chunk_ids: N unique, non-empty chunk IDs, one per row (ties go to the
            smaller ID in Python ``str`` order).
        k: neighbours per chunk, an ``int`` > 0 (capped at N - 1).
        block_size: rows per block and columns per GEMM tile (default 1024 on CPU,
            4096 on CUDA). Only speed and memory depend on it, never the result.
        candidate_dtype: precision of the coarse GEMM, ``torch.float32`` or
            ``torch.float64`` (default: float32 on CPU when float32 matmuls are IEEE,
            float64 otherwise and on CUDA). Never changes the result, only how many
            rows need a wider second search.
        progress: tqdm bars (coarse tiles, then exact rows): True, False, or None
            (default: shown when N >= 50,000).
        backend: ``"exact"`` (default: this module's search, exact per docs/spec.md)
            or ``"faiss"`` (approximate candidates from a FAISS index, re-scored and
            tie-ordered by the same rules, rows read in chunks, embeddings may be a
            memory-mapped ``.npy``; see :mod:`.knn_faiss`; CPU results).
        faiss_options: keyword options of :func:`.knn_faiss.faiss_knn_neighbors`
            (``index``, ``nlist``, ``nprobe``, ``seed``, ``chunk_rows``, ``info``, ...).

    Returns:
        ``(neighbors, distances)``: (N, k') int64 row indices and (N, k') float64 raw
        (unclamped) cosine distances, k' = min(k, N - 1), row i in input order, its
        picks in pick order (distance, then chunk ID); on the embeddings' device (CPU
        for numpy arrays and lists).

    Raises:
        ValueError: a bad ``k`` or search option; no, empty or duplicate IDs;
            embeddings not 2-D, of dimension 0, with a row count other than N, with a
            non-finite value or a zero row (the message names the row and its ID).

    Cost: see the module docstring (O(N^2 D) GEMM, O(N D) memory, blockwise).

    Example:
        >>> neighbors, distances = knn_neighbors_tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], ["a", "b", "c"], k=1)
        >>> neighbors.tolist(), distances.tolist()
        ([[1], [0], [0]], [[0.0], [0.0], [1.0]])
    """
    check_choice("kNN backend", backend, KNN_BACKENDS)
    if backend == "faiss":
        from .knn_faiss import faiss_knn_neighbors

        return faiss_knn_neighbors(embeddings, chunk_ids, k, progress=progress, **(faiss_options or {}))
    count = check_positive_int(k, "k")
    block = _check_optional_size(block_size, "block_size")
    _check_candidate_dtype(candidate_dtype)
    ids = check_embedding_ids(chunk_ids)
    unit = _unit_columns(embeddings, ids)  # shape: (D, N)
    size = unit.shape[1]
    picks = min(count, size - 1)
    coarse_dtype = candidate_dtype or _default_candidate_dtype(unit.device)
    if picks == 0:
        return (
            torch.empty((size, 0), dtype=torch.long, device=unit.device),
            torch.empty((size, 0), dtype=torch.float64, device=unit.device),
        )
    rank = ChunkVocabulary(ids).rank(unit.device)
    search = _Search(unit, unit.to(coarse_dtype), rank, picks, block or _BLOCK_ROWS[_kind(unit.device)])
    return _search_all(search, _show_progress(progress, size))


def knn_edges(
    embeddings: Any,
    chunk_ids: Sequence[str],
    k: int = 10,
    *,
    maximum_distance: float = 10.0,
    minimum_edge_distance: float = 1e-6,
    block_size: Optional[int] = None,
    candidate_dtype: Optional[torch.dtype] = None,
    progress: Optional[bool] = None,
    backend: str = "exact",
    faiss_options: Optional[Dict[str, Any]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kNN graph's edges (docs/spec.md section 4): the undirected min-union of all picks.

    Args:
        embeddings, chunk_ids, k: as for :func:`knn_neighbors_tensor`; node ``i`` is
            row ``i`` / ``chunk_ids[i]``.
        maximum_distance: the graph bound, finite and > 0 (default 10.0); also the
            largest edge distance.
        minimum_edge_distance: the smallest edge distance, in (0, maximum_distance]
            (default 1e-6): identical vectors get exactly this, never 0.
        block_size, candidate_dtype, progress: search options of
            :func:`knn_neighbors_tensor` (they never change the result).
        backend, faiss_options: as for :func:`knn_neighbors_tensor` (``"faiss"``:
            approximate picks).

    Returns:
        ``(edge_index, edge_weight)``: (2, E) int64 and (E,) float64 on the
        embeddings' device; both directions of every edge, coalesced (sorted by
        (source, target), no duplicates), weight ``min(max(d, minimum_edge_distance),
        maximum_distance)``; when both ends pick each other the smaller weight stays.
        E = 0 for a single chunk.

    Raises:
        ValueError: as :func:`knn_neighbors_tensor`, plus a bad ``maximum_distance``
            or ``minimum_edge_distance``.

    Cost: :func:`knn_neighbors_tensor`'s plus O(N k log(N k)) to coalesce.

    Example:
        >>> edge_index, edge_weight = knn_edges([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], ["a", "b", "c"], k=1)
        >>> edge_index.tolist(), edge_weight.tolist()
        ([[0, 0, 1, 2], [1, 2, 0, 0]], [1e-06, 1.0, 1e-06, 1.0])
    """
    maximum, minimum = _check_distances(maximum_distance, minimum_edge_distance)
    neighbors, distances = knn_neighbors_tensor(
        embeddings,
        chunk_ids,
        k,
        block_size=block_size,
        candidate_dtype=candidate_dtype,
        progress=progress,
        backend=backend,
        faiss_options=faiss_options,
    )
    return _union_edges(neighbors, distances, minimum, maximum)


def knn_graph(
    embeddings: Any,
    chunk_ids: Sequence[str],
    k: int = 10,
    *,
    maximum_distance: Union[float, str] = 10.0,
    minimum_edge_distance: float = 1e-6,
    device: Union[torch.device, str, None] = None,
    block_size: Optional[int] = None,
    candidate_dtype: Optional[torch.dtype] = None,
    progress: Optional[bool] = None,
    backend: str = "exact",
    faiss_options: Optional[Dict[str, Any]] = None,
) -> TensorCorpusGraph:
    """The kNN corpus graph as a :class:`~mapmatched_torch.graph.TensorCorpusGraph`.

    The tensor twin of ``KNNGraph.from_embeddings`` (same edges, same distances):
    nodes are ``chunk_ids`` in input order, edges those of :func:`knn_edges`.

    Args:
        embeddings, chunk_ids, k, maximum_distance, minimum_edge_distance: as for
            :func:`knn_edges` (the search runs on the embeddings' device).
            ``maximum_distance="auto"``: a calibrated bound,
            :func:`~.balls.calibrate_bound` with its defaults (the median over 1,000
            sampled chunks of the distance to their 64th nearest chunk in the graph),
            so a typical chunk's ball holds 64 chunks; the edges are then clamped at
            2.0, the largest cosine distance (an edge longer than the bound costs the
            bound either way).
        device: where the graph lives (default: the embeddings' device).
        block_size, candidate_dtype, progress: search options of
            :func:`knn_neighbors_tensor`.
        backend: ``"exact"`` (default) or ``"faiss"`` (approximate neighbours for
            corpora of millions of chunks: :mod:`.knn_faiss`; recall measured by
            :func:`~.knn_faiss.knn_recall`).
        faiss_options: options of :func:`~.knn_faiss.faiss_knn_neighbors`.

    Returns:
        An undirected :class:`~mapmatched_torch.graph.TensorCorpusGraph` with
        ``maximum_distance``.

    Raises:
        ValueError: as :func:`knn_edges`.
    """
    auto = isinstance(maximum_distance, str) and maximum_distance == "auto"
    if auto:
        maximum_distance = AUTO_EDGE_BOUND
    _check_distances(maximum_distance, minimum_edge_distance)
    check_positive_int(k, "k")
    ids = check_embedding_ids(chunk_ids)  # a tuple: chunk_ids may be a one-shot iterable
    edge_index, edge_weight = knn_edges(
        embeddings,
        ids,
        k,
        maximum_distance=maximum_distance,
        minimum_edge_distance=minimum_edge_distance,
        block_size=block_size,
        candidate_dtype=candidate_dtype,
        progress=progress,
        backend=backend,
        faiss_options=faiss_options,
    )
    if device is not None:
        edge_index, edge_weight = edge_index.to(device), edge_weight.to(device)
    graph = TensorCorpusGraph.from_edge_index(
        edge_index, edge_weight, chunk_ids=ids, num_nodes=len(ids), directed=False, maximum_distance=maximum_distance
    )
    if not auto:
        return graph
    from .balls import calibrate_bound

    return TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=calibrate_bound(graph.adjacency))


# ---------------------------------------------------------------------- options


def _check_distances(maximum_distance: Any, minimum_edge_distance: Any) -> Tuple[float, float]:
    """Validated ``(maximum_distance, minimum_edge_distance)`` with the reference's messages."""
    _, maximum, minimum = check_knn_options(1, maximum_distance, minimum_edge_distance)
    return maximum, minimum


def _check_optional_size(value: Any, name: str) -> Optional[int]:
    """None, or an ``int`` > 0."""
    return None if value is None else check_positive_int(value, name)


def _kind(device: torch.device) -> str:
    """``"cuda"`` for CUDA devices, ``"cpu"`` for the rest (the defaults' key)."""
    return "cuda" if device.type == "cuda" else "cpu"


def _float32_matmul_is_ieee(device: torch.device) -> bool:
    """Whether float32 GEMMs on ``device`` round like IEEE float32 (no TF32 / bf16)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    if getattr(torch.backends, "fp32_precision", "none") not in ("none", "ieee"):
        return False
    if device.type == "cuda":
        backend = torch.backends.cuda.matmul
        return not backend.allow_tf32 and getattr(backend, "fp32_precision", "none") in ("none", "ieee")
    backend = getattr(torch.backends.mkldnn, "matmul", None)
    return getattr(backend, "fp32_precision", "none") in ("none", "ieee")


def _check_candidate_dtype(dtype: Any) -> None:
    """None, ``torch.float32`` or ``torch.float64``."""
    if dtype is not None and dtype not in (torch.float32, torch.float64):
        raise MapMatchedValueError(f"candidate_dtype must be torch.float32 or torch.float64, got {dtype!r}")


def _default_candidate_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU while float32 matmuls are IEEE; float64 otherwise and on CUDA (fast FP64)."""
    cheap = device.type != "cuda" and _float32_matmul_is_ieee(device)
    return torch.float32 if cheap else torch.float64


def _coarse_tolerance(dtype: torch.dtype, device: torch.device, dimension: int) -> float:
    """A rigorous bound on |coarse GEMM similarity - exact column-order similarity| of unit rows.

    Inputs rounded to the GEMM's format (relative ``u_in`` each), a length-D dot
    product accumulated in any order (``D u_acc``), and the float64 column-order sum
    (``D 2^-53``), all times sum |a_i b_i| <= 1 (+ a few ulps); doubled for the
    second-order terms, subnormals and the rounding of ``g + tol``.
    """
    double = 2.0**-53
    if dtype == torch.float64:
        u_in, u_acc = 0.0, double
    elif _float32_matmul_is_ieee(device):
        u_in, u_acc = 2.0**-24, 2.0**-24
    else:  # TF32 or bf16 inputs: the coarsest of them
        u_in, u_acc = 2.0**-8, 2.0**-24
    return 2.0 * (2.0 * u_in + (dimension + 1) * (u_acc + double))


def _show_progress(progress: Optional[bool], size: int) -> bool:
    return size >= PROGRESS_THRESHOLD if progress is None else bool(progress)


# ---------------------------------------------------------------------- normalization


def _unit_columns(embeddings: Any, ids: Tuple[str, ...]) -> torch.Tensor:
    """The validated unit rows, transposed: (D, N) float64, exactly the reference's values.

    Real 2-D tensors and arrays are validated and normalized on their device; anything
    else goes through the reference's own Python validation and normalization.
    """
    columns = _as_columns(embeddings)
    if columns is None:
        rows = normalized_rows(ids, embeddings)  # the reference's checks and messages
        return torch.tensor(rows, dtype=torch.float64).T.contiguous()
    if columns.shape[1] != len(ids):
        raise row_count_error(columns.shape[1], len(ids))
    if columns.shape[0] == 0:
        raise dimension_error()
    squares = ((column, column) for column in columns)
    norms = _correctly_rounded_sqrt(_column_order_sum(squares, columns.shape[1:], columns.device))  # shape: (N,)
    _check_rows(columns, norms, ids)
    return columns.div_(norms)


def _as_columns(embeddings: Any) -> Optional[torch.Tensor]:
    """A 2-D real (non-bool) tensor or numpy array as a fresh (D, N) float64 copy; None otherwise.

    The copy is the caller-independent buffer that normalization divides in place.
    """
    if isinstance(embeddings, np.ndarray):
        kind = embeddings.dtype.kind
        if embeddings.ndim != 2 or kind not in "iuf":
            return None
        if embeddings.dtype not in _TORCH_NATIVE or not embeddings.flags.writeable:
            embeddings = np.array(embeddings, dtype=np.float64)
        embeddings = torch.from_numpy(embeddings)
    if not isinstance(embeddings, torch.Tensor):
        return None
    if embeddings.ndim != 2 or embeddings.dtype == torch.bool or embeddings.dtype.is_complex:
        return None
    return embeddings.detach().T.to(dtype=torch.float64, memory_format=torch.contiguous_format, copy=True)


def _column_order_sum(
    factors: Iterable[Tuple[torch.Tensor, torch.Tensor]], shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """``sum_c left_c * right_c`` as a left-to-right float64 fold over the columns ``c``.

    ``factors`` yields one ``(left_c, right_c)`` pair of float64 tensors per column,
    broadcasting to ``shape``. One multiply kernel and one add kernel per column (never
    a fused multiply-add), starting from 0.0 like the reference. Cost: O(D) kernels,
    O(D prod(shape)) work.
    """
    total = torch.zeros(tuple(shape), dtype=torch.float64, device=device)
    for left, right in factors:
        total.add_(left * right)
    return total


def _correctly_rounded_sqrt(values: torch.Tensor) -> torch.Tensor:
    """IEEE ``sqrt`` of float64 values, like ``math.sqrt``, on the values' device.

    ``torch.sqrt`` on CPU is vectorized through SLEEF and is not correctly rounded
    (about 1% of float64 inputs come back one ulp off), so the N square roots are
    taken by numpy on the host (correctly rounded) and moved back. (N,) -> (N,); O(N).
    """
    return torch.from_numpy(np.sqrt(values.cpu().numpy())).to(values.device)


def _check_rows(columns: torch.Tensor, norms: torch.Tensor, ids: Tuple[str, ...]) -> None:
    """Raise the reference's error for the first bad row: non-finite, then zero, then too large."""
    finite = torch.isfinite(columns).all(dim=0)  # shape: (N,)
    bad = ~finite | (norms == 0.0) | ~torch.isfinite(norms)  # shape: (N,)
    if not bool(bad.any()):
        return
    row = int(bad.nonzero()[0])
    label = f"embeddings row {row} (chunk {ids[row]!r})"
    if not bool(finite[row]):
        column = int((~torch.isfinite(columns[:, row])).nonzero()[0])
        value = float(columns[column, row])
        raise nonfinite_value_error(label, column, value)
    if float(norms[row]) == 0.0:
        raise zero_vector_error(label)
    raise norm_overflow_error(label)


# ---------------------------------------------------------------------- search


class _Search:
    """What every block of the search shares.

    Attributes:
        unit: (D, N) float64 unit rows (transposed).
        coarse: (D, N) the same in the coarse GEMM's dtype.
        rank: (N,) int64 rank of each chunk ID in sorted order (the tie-break).
        k: picks per row, 1 <= k <= N - 1.
        block: rows per block, and columns per GEMM tile.
        tolerance: the coarse-vs-exact similarity bound of :func:`_coarse_tolerance`.
    """

    __slots__ = ("unit", "coarse", "rank", "k", "block", "tolerance")

    def __init__(self, unit: torch.Tensor, coarse: torch.Tensor, rank: torch.Tensor, k: int, block: int) -> None:
        self.unit = unit
        self.coarse = coarse
        self.rank = rank
        self.k = k
        self.block = block
        self.tolerance = _coarse_tolerance(coarse.dtype, coarse.device, unit.shape[0])

    @property
    def size(self) -> int:
        """N, the number of rows."""
        return self.unit.shape[1]

    def first_candidates(self) -> int:
        """The first search's candidates per row: k plus a margin, at most N - 1."""
        return min(self.size - 1, self.k + max(4, self.k // 2))

    def blocks(self) -> range:
        """The first row of every block."""
        return range(0, self.size, self.block)


def _search_all(search: _Search, show: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Coarse candidates of every row (:func:`_coarse_all`), then exact picks block by block.

    Returns (N, k) int64 picks and (N, k) float64 distances.
    """
    size, device = search.size, search.unit.device
    scores, candidates = _coarse_all(search, show)  # shape: (N, c), (N, c)
    bounds = scores.amin(dim=1).double()  # shape: (N,)
    neighbors = torch.empty((size, search.k), dtype=torch.long, device=device)
    distances = torch.empty((size, search.k), dtype=torch.float64, device=device)
    with progress_bar(total=size, unit="row", desc="kNN exact", show=show) as bar:
        for start in search.blocks():
            stop = min(start + search.block, size)
            rows = torch.arange(start, stop, device=device)  # shape: (b,)
            neighbors[start:stop], distances[start:stop] = _search_rows(
                search, rows, bounds[start:stop], candidates[start:stop]
            )
            bar.update(stop - start)
    return neighbors, distances


def _coarse_all(search: _Search, show: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every row's ``first_candidates()`` best rows by coarse similarity, itself excluded.

    The score matrix is symmetric, so only the tiles on and above the block diagonal
    are computed: tile (i, j) serves the rows of block i directly and, transposed,
    those of block j (half the GEMM flops of a plain search).

    Returns:
        ``(scores, candidates)``: (N, c) coarse similarities (candidate dtype) and
        (N, c) int64 rows; every other non-self row scores <= the row's smallest.

    Cost: N^2 D coarse flops, (N / block)^2 / 2 tiles of (block, block) scores.
    """
    count, starts = search.first_candidates(), search.blocks()
    scores, candidates = _empty_top(search.size, count, search.coarse)
    with progress_bar(total=len(starts) * (len(starts) + 1) // 2, unit="tile", desc="kNN coarse", show=show) as bar:
        for i in starts:
            rows = slice(i, i + search.block)
            query = search.coarse[:, rows].T  # shape: (b_i, D)
            for j in range(i, search.size, search.block):
                columns = slice(j, j + search.block)
                tile = query @ search.coarse[:, columns]  # shape: (b_i, b_j)
                if i == j:
                    tile.fill_diagonal_(-math.inf)
                _merge_top(scores[rows], candidates[rows], tile, j)
                if i != j:
                    _merge_top(scores[columns], candidates[columns], tile.T.contiguous(), i)
                bar.update(1)
    return scores, candidates


def _search_rows(
    search: _Search, rows: torch.Tensor, bound: torch.Tensor, candidates: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The exact picks of some rows from their coarse candidates, widening unsafe rows.

    Args:
        rows: (b,) int64 query rows.
        bound: (b,) float64 smallest coarse similarity among each row's candidates.
        candidates: (b, c) int64 coarse candidates (c >= k).

    Returns:
        (b, k) int64 neighbours and (b, k) float64 distances, in pick order.
    """
    k, last = search.k, search.size - 1
    neighbors = torch.empty((rows.numel(), k), dtype=torch.long, device=rows.device)
    distances = torch.empty((rows.numel(), k), dtype=torch.float64, device=rows.device)
    pending = torch.arange(rows.numel(), device=rows.device)  # shape: (p,) positions in rows
    while True:
        count = candidates.shape[1]
        distance = _exact_distances(search.unit, rows[pending], candidates)  # shape: (p, c)
        candidates, distance = _pick_order(candidates, distance, search.rank)
        done = _is_final(bound, distance[:, k - 1], search.tolerance) | (count == last)  # shape: (p,)
        neighbors[pending[done]] = candidates[done, :k]
        distances[pending[done]] = distance[done, :k]
        pending = pending[~done]
        if not pending.numel():
            return neighbors, distances
        bound, candidates = _coarse_candidates(search, rows[pending], min(2 * count, last))


def _coarse_candidates(search: _Search, queries: torch.Tensor, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``count`` rows of largest coarse similarity to each query (the widening search).

    Args:
        queries: (p,) int64 query rows.
        count: candidates per query, 1 <= count <= N - 1.

    Returns:
        ``(bound, candidates)``: (p,) float64 smallest kept coarse similarity (every
        other non-self row scores <= it) and (p, count) int64 candidate rows.

    Cost: p N D coarse flops, one (p, block) score tile at a time.
    """
    scores, candidates = _empty_top(queries.numel(), count, search.coarse)
    query = search.coarse[:, queries].T  # shape: (p, D)
    for start in search.blocks():
        stop = min(start + search.block, search.size)
        tile = query @ search.coarse[:, start:stop]  # shape: (p, w)
        _exclude_self(tile, queries, start, stop)
        _merge_top(scores, candidates, tile, start)
    return scores.amin(dim=1).double(), candidates


def _empty_top(rows: int, count: int, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A running top-``count`` state: (rows, count) -inf scores and placeholder rows 0.

    Every row eventually sees N - 1 >= count finite scores, which evict every -inf.
    """
    scores = torch.full((rows, count), -math.inf, dtype=like.dtype, device=like.device)
    return scores, torch.zeros((rows, count), dtype=torch.long, device=like.device)


def _merge_top(scores: torch.Tensor, candidates: torch.Tensor, tile: torch.Tensor, offset: int) -> None:
    """Merge one score tile into a running top-c state, in place.

    Only entries strictly above a row's current c-th best can enter, and after the
    first tiles few rows have any (one ``amax`` per row finds them): those rows'
    entries are pulled out sparsely (``nonzero``), padded per row and merged with one
    small ``topk``. An entry left out scores <= the row's c-th best at that time,
    hence <= its final smallest candidate (the invariant the safety check needs).

    Args:
        scores: (r, c) state, each row sorted descending (-inf: empty slot); a view
            is fine, it is written in place.
        candidates: (r, c) int64 rows of the state's scores.
        tile: (r, w) scores of the rows ``offset .. offset + w - 1`` (any strides).
        offset: the row index of the tile's first column.

    Cost: O(r w) for the row maxima, then O(a w + a (c + m)) for the a active rows
    holding m entries that enter.
    """
    active = (tile.amax(dim=1) > scores[:, -1]).nonzero().squeeze(1)  # shape: (a,)
    if not active.numel():
        return
    tile = tile[active]  # shape: (a, w)
    hit, column = (tile > scores[active, -1:]).nonzero(as_tuple=True)  # shape: (m,), (m,); sorted by hit
    sizes = torch.bincount(hit, minlength=active.numel())  # shape: (a,), each >= 1
    slot = torch.arange(hit.numel(), device=hit.device) - (sizes.cumsum(0) - sizes)[hit]  # shape: (m,)
    new_scores, new_rows = _empty_top(active.numel(), int(sizes.max()), tile)  # shape: (a, max size)
    new_scores[hit, slot] = tile[hit, column]
    new_rows[hit, slot] = column + offset
    merged = torch.cat([scores[active], new_scores], dim=1)  # shape: (a, c + max size)
    top, keep = merged.topk(scores.shape[1], dim=1)  # shape: (a, c)
    scores[active] = top
    candidates[active] = torch.cat([candidates[active], new_rows], dim=1).gather(1, keep)


def _exact_distances(unit: torch.Tensor, queries: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """The reference's cosine distances ``1 - clip(column-order dot)`` of query/candidate pairs.

    Args:
        unit: (D, N) float64 unit rows.
        queries: (p,) int64 rows.
        candidates: (p, c) int64 rows.

    Returns:
        (p, c) float64 distances. Works on chunks of about ``_PAIR_CHUNK`` pairs (per
        column: a gather, a multiply, an add), so memory stays O(D p' + _PAIR_CHUNK).
    """
    per_chunk = max(1, _PAIR_CHUNK // candidates.shape[1])
    parts = []
    for start in range(0, queries.numel(), per_chunk):
        others = candidates[start : start + per_chunk]  # shape: (p', c)
        flat = others.reshape(-1)  # shape: (p' c,)
        query = unit.index_select(1, queries[start : start + per_chunk])  # shape: (D, p')
        factors = (
            (left[:, None], column.index_select(0, flat).view(others.shape)) for left, column in zip(query, unit)
        )
        similarity = _column_order_sum(factors, others.shape, unit.device)  # shape: (p', c)
        parts.append(1.0 - similarity.clamp(-1.0, 1.0))
    return torch.cat(parts)


def _exclude_self(scores: torch.Tensor, queries: torch.Tensor, start: int, stop: int) -> None:
    """Set ``scores[i, queries[i] - start]`` to -inf where the query's own row is in the tile."""
    inside = ((queries >= start) & (queries < stop)).nonzero().squeeze(1)  # shape: (s,)
    scores[inside, queries[inside] - start] = -math.inf


def _pick_order(
    candidates: torch.Tensor, distance: torch.Tensor, rank: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Candidates sorted by (distance, chunk-ID rank): a rank sort, then a stable distance sort.

    (p, c) int64 and (p, c) float64 -> the same, reordered per row.
    """
    by_rank = rank[candidates].argsort(dim=1)  # shape: (p, c)
    candidates, distance = candidates.gather(1, by_rank), distance.gather(1, by_rank)
    by_distance = distance.argsort(dim=1, stable=True)  # shape: (p, c)
    return candidates.gather(1, by_distance), distance.gather(1, by_distance)


def _is_final(bound: torch.Tensor, kth_distance: torch.Tensor, tolerance: float) -> torch.Tensor:
    """Whether no non-candidate can reach or tie the k-th pick (module docstring, step 4).

    A non-candidate's exact similarity is <= ``bound + tolerance``, so its distance is
    >= ``1 - clip(bound + tolerance)`` (rounding is monotone); strictly above the k-th
    distance means the picks are final. (p,) float64 x2 -> (p,) bool.
    """
    outsider = 1.0 - (bound + tolerance).clamp(-1.0, 1.0)  # shape: (p,)
    return outsider > kth_distance


def _union_edges(
    neighbors: torch.Tensor, distances: torch.Tensor, minimum: float, maximum: float
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The undirected min-union of the picks: coalesced (2, E) int64 and (E,) float64.

    (N, k) picks and raw distances -> every pick ``i -> j`` with weight
    ``min(max(d, minimum), maximum)``, plus its reverse, duplicates reduced by min.
    """
    size, k = neighbors.shape
    source = torch.arange(size, device=neighbors.device).repeat_interleave(k)  # shape: (N k,)
    edge_index = torch.stack([source, neighbors.reshape(-1)])  # shape: (2, N k)
    edge_weight = distances.reshape(-1).clamp(min=minimum, max=maximum)  # shape: (N k,)
    from torch_geometric.utils import to_undirected  # slow to import: on first use (see _csr.build_csr)

    return to_undirected(edge_index, edge_weight, num_nodes=size, reduce="min")
