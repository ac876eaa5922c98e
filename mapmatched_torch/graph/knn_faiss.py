"""Approximate kNN picks through FAISS for corpora of millions of chunks (``backend="faiss"``).

:func:`~mapmatched_torch.graph.knn_graph` is exact by default (docs/spec.md section 4);
its O(N^2 D) search stops paying at a few hundred thousand rows on a CPU. With
``backend="faiss"`` the *candidates* come from a FAISS index instead, and everything
after them follows the reference rules:

1. **Chunked normalization.** Rows are read ``chunk_rows`` at a time (so the
   embeddings may be a memory-mapped ``.npy`` of float16 or float32; nothing of size
   N x D is ever held in float64), normalized exactly like the reference (a
   column-order float64 sum of squares, a correctly rounded ``sqrt``, ``x / norm``)
   and validated with the reference's messages; their float32 copies go into the index.
2. **Candidates.** Each row asks the index for ``k + margin`` neighbours by inner
   product: ``"flat"`` (exact float32 brute force), ``"ivf"`` (IVF with float16
   vectors, a k-means coarse quantizer of ``4 sqrt(N)`` lists trained with a fixed
   seed on a fixed sample of 40 rows per list) or ``"hnsw"``.
   ``"auto"``: flat up to 50,000 rows, IVF beyond; flat on a GPU when faiss has one.
3. **Exact re-scoring.** The candidates' distances are recomputed in float64 with
   the reference formula (``1 - clip(column-order dot)``) and ordered by
   (distance, chunk ID); the first k are the picks. A row left with fewer than k
   candidates (IVF lists too small) is searched again over every list.

So the picks' distances and tie order are the reference's, and the only difference
from the exact backend is which rows are found: a true neighbour the index misses
is replaced by the next candidate. :func:`knn_recall` measures that on a sample.
:class:`FAISSCorpusIndex` keeps the same index for outside query vectors (the top rows
of each query, re-scored the same way; ``benchmarks/scale.py``'s eval phase searches
with it).
Runs are deterministic: fixed seeds, a fixed training sample, and FAISS searches
are per query.

Cost (IVF, N rows, nlist lists, nprobe probed): training ``O(train * nlist * D *
iterations)``, adding ``O(N nlist D)``, searching ``O(N nprobe (N / nlist) D)``;
memory: the index (N D float16 for IVF), ``(N,)`` norms and ``(N, k)`` results, plus one
chunk of rows at a time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

from ..core.checks import check_choice, check_positive_int
from ..core.embeddings import (
    check_embedding_ids,
    dimension_error,
    nonfinite_value_error,
    norm_overflow_error,
    row_count_error,
    zero_vector_error,
)
from ..core.errors import FAISSNotInstalledError, MapMatchedValueError
from ..core.progress import progress_bar
from .vocabulary import ChunkVocabulary

__all__ = ["FAISS_INDEXES", "FAISSCorpusIndex", "faiss_knn_neighbors", "knn_recall", "read_rows"]

#: The ``index=`` choices of :func:`faiss_knn_neighbors`.
FAISS_INDEXES = ("auto", "flat", "ivf", "hnsw")
#: ``index="auto"`` uses exact flat search up to this many rows.
FLAT_UP_TO = 50_000
#: Query rows re-scored at once (bounds the gathered float64 candidate rows).
_RESCORE_ROWS = 2048
#: ``progress=None`` shows progress from this many rows on.
PROGRESS_THRESHOLD = 50_000


def _faiss() -> Any:
    try:
        import faiss  # noqa: PLC0415
    except ImportError as error:
        raise FAISSNotInstalledError("knn_graph(backend='faiss')") from error
    return faiss


def read_rows(embeddings: Any) -> Tuple[Any, int, int]:
    """``(rows, N, D)``: an object whose ``rows[a:b]`` slices give real rows (numpy
    arrays, memory maps and CPU tensors are sliced lazily; anything else becomes an array)."""
    if isinstance(embeddings, torch.Tensor):
        embeddings = embeddings.detach().cpu().numpy() if embeddings.dtype != torch.bfloat16 else (
            embeddings.detach().cpu().double().numpy()
        )
    if not isinstance(embeddings, np.ndarray):
        try:
            embeddings = np.asarray(embeddings, dtype=np.float64)
        except (TypeError, ValueError) as error:
            raise MapMatchedValueError(f"embeddings must be a 2-D matrix of numbers: {error}") from None
    if embeddings.ndim != 2 or embeddings.dtype.kind not in "iuf":
        raise MapMatchedValueError(
            f"embeddings must be a 2-D real matrix, got shape {embeddings.shape} of {embeddings.dtype}"
        )
    return embeddings, int(embeddings.shape[0]), int(embeddings.shape[1])


def _unit_chunk(rows: Any, start: int, stop: int, ids: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """Rows ``start:stop`` as reference unit rows: ``(unit (b, D) float64, norms (b,))``."""
    return _normalize(np.asarray(rows[start:stop], dtype=np.float64), np.arange(start, stop), ids)


def _normalize(block: np.ndarray, positions: np.ndarray, ids: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
    """(b, D) float64 rows (the rows ``positions`` of the matrix) as reference unit rows.

    The norm is the column-order float64 sum of squares (one multiply and one add per
    column, no fused multiply-add), correctly rounded ``sqrt``; the reference's errors
    for the first bad row.
    """
    total = np.zeros(block.shape[0])
    for column in block.T:
        total += column * column
    norms = np.sqrt(total)  # shape: (b,)
    finite = np.isfinite(block).all(axis=1)
    bad = ~finite | (norms == 0.0) | ~np.isfinite(norms)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        position = int(positions[row])
        label = f"embeddings row {position} (chunk {ids[position]!r})"
        if not finite[row]:
            column = int(np.flatnonzero(~np.isfinite(block[row]))[0])
            raise nonfinite_value_error(label, column, float(block[row, column]))
        if norms[row] == 0.0:
            raise zero_vector_error(label)
        raise norm_overflow_error(label)
    return block / norms[:, None], norms


def _exact_distances(rows: Any, norms: np.ndarray, query: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """The reference's ``1 - clip(column-order dot)`` of query rows and their candidates.

    query: (b, D) float64 unit rows; candidates: (b, c) int64 rows (``-1``: none,
    distance ``inf``). Returns (b, c) float64.
    """
    valid = candidates >= 0
    flat = np.where(valid, candidates, 0).reshape(-1)
    order = np.argsort(flat, kind="stable")  # sorted reads from a memory map
    gathered = np.empty((flat.size, query.shape[1]), dtype=np.float64)
    gathered[order] = np.asarray(rows[flat[order]], dtype=np.float64)
    gathered /= norms[flat][:, None]
    # shape: (D, b, c)
    columns = gathered.T.reshape(query.shape[1], *candidates.shape)
    total = np.zeros(candidates.shape)
    for left, right in zip(query.T, columns):
        total += left[:, None] * right
    distance = 1.0 - np.clip(total, -1.0, 1.0)
    distance[~valid] = np.inf
    return distance


def _make_index(faiss: Any, kind: str, size: int, dimension: int, nlist: Optional[int], seed: int) -> Any:
    """An empty inner-product index of ``kind`` (``"flat"``, ``"ivf"`` or ``"hnsw"``)."""
    if kind == "flat":
        return faiss.IndexFlatIP(dimension)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dimension, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        return index
    lists = nlist or max(1, min(size // 39, int(4 * math.sqrt(size))))
    quantizer = faiss.IndexFlatIP(dimension)
    # float16 vectors: half the memory and scan time of float32; the picks are re-scored exactly anyway
    index = faiss.IndexIVFScalarQuantizer(
        quantizer, dimension, lists, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT
    )
    index.cp.seed = seed
    index.cp.niter = 10
    index.cp.max_points_per_centroid = 40
    return index


def _filled_index(
    faiss: Any, rows: Any, ids: Sequence[str], kind: str, nlist: Optional[int], probes: int, ef_search: int,
    seed: int, chunk: int, show: bool, seconds: dict,
) -> Tuple[Any, Any, np.ndarray]:
    """An index of ``kind`` trained (IVF) and holding every row as a float32 unit row.

    Returns ``(built, search_index, norms)``: the index, the one to search (a GPU copy
    of a flat index when faiss has a GPU, else ``built``) and the (N,) float64 row
    norms; ``seconds`` receives ``train`` (IVF) and ``add``.
    """
    size, dimension = len(ids), int(rows.shape[1])
    gpu = getattr(faiss, "get_num_gpus", lambda: 0)() > 0
    clock = time.perf_counter()
    norms = np.empty(size, dtype=np.float64)
    built = _make_index(faiss, kind, size, dimension, nlist, seed)
    if kind == "ivf":
        generator = np.random.default_rng(seed)
        train = built.nlist * 40  # faiss asks for at least 39 points per centroid
        sample = np.arange(size) if train >= size else np.sort(generator.choice(size, train, replace=False))
        vectors = np.empty((sample.size, dimension), dtype=np.float32)
        for start in range(0, sample.size, chunk):
            part = sample[start:start + chunk]
            vectors[start:start + part.size] = _normalize(np.asarray(rows[part], dtype=np.float64), part, ids)[0]
        built.train(vectors)
        del vectors
        built.nprobe = min(probes, built.nlist)
        seconds["train"] = time.perf_counter() - clock
    if kind == "hnsw":
        built.hnsw.efSearch = ef_search
    search_index = faiss.index_cpu_to_all_gpus(built) if gpu and kind == "flat" else built
    clock = time.perf_counter()
    with progress_bar(total=size, unit="row", desc="kNN faiss add", show=show) as bar:
        for start in range(0, size, chunk):
            stop = min(start + chunk, size)
            unit, norms[start:stop] = _unit_chunk(rows, start, stop, ids)
            search_index.add(np.ascontiguousarray(unit, dtype=np.float32))
            bar.update(stop - start)
    seconds["add"] = time.perf_counter() - clock
    return built, search_index, norms


def faiss_knn_neighbors(
    embeddings: Any,
    chunk_ids: Sequence[str],
    k: int = 10,
    *,
    index: str = "auto",
    nlist: Optional[int] = None,
    nprobe: Optional[int] = None,
    ef_search: Optional[int] = None,
    seed: int = 0,
    chunk_rows: int = 1 << 15,
    progress: Optional[bool] = None,
    info: Optional[dict] = None,
    recall_sample: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every chunk's (approximately) k nearest neighbours through FAISS (module docstring).

    Args:
        embeddings: (N, D) real matrix: a numpy array or memory map (e.g.
            ``np.load(path, mmap_mode="r")`` of float16/float32), a CPU tensor, or lists.
        chunk_ids: N unique, non-empty chunk IDs (ties go to the smaller ID).
        k: neighbours per chunk, an ``int`` > 0 (capped at N - 1).
        index: ``"auto"``, ``"flat"``, ``"ivf"`` or ``"hnsw"`` (see the module docstring).
        nlist: IVF lists (default ``4 sqrt(N)``, at least 39 rows per list).
        nprobe: IVF lists probed per query (default 16).
        ef_search: HNSW search depth (default ``max(64, 2 (k + margin))``).
        seed: the training sample's and k-means' seed.
        chunk_rows: rows read, normalized and searched at a time (bounds memory).
        progress: progress lines (None: from 50,000 rows on).
        info: a dict that receives what was built (index kind, lists, seconds per phase,
            and ``recall_at_k`` when measured).
        recall_sample: > 0: measure recall@k on that many rows (:func:`knn_recall`)
            into ``info["recall_at_k"]``.

    Returns:
        ``(neighbors, distances)``: (N, k') int64 rows and (N, k') float64 raw cosine
        distances (k' = min(k, N - 1)), in pick order (distance, chunk ID), on the CPU:
        the shapes and meaning of :func:`~mapmatched_torch.graph.knn_neighbors_tensor`.

    Raises:
        FAISSNotInstalledError: faiss is missing (the ``[faiss]`` extra).
        ValueError: as :func:`~mapmatched_torch.graph.knn_neighbors_tensor`, or a bad option.
    """
    faiss = _faiss()
    count = check_positive_int(k, "k")
    check_choice("faiss index", index, FAISS_INDEXES)
    chunk = check_positive_int(chunk_rows, "chunk_rows")
    probes = 16 if nprobe is None else check_positive_int(nprobe, "nprobe")
    ids = check_embedding_ids(chunk_ids)
    rows, size, dimension = read_rows(embeddings)
    if size != len(ids):
        raise row_count_error(size, len(ids))
    if dimension == 0:
        raise dimension_error()
    picks = min(count, size - 1)
    if picks == 0:
        return torch.empty((size, 0), dtype=torch.long), torch.empty((size, 0), dtype=torch.float64)
    gpu = getattr(faiss, "get_num_gpus", lambda: 0)() > 0
    kind = index if index != "auto" else ("flat" if gpu or size <= FLAT_UP_TO else "ivf")
    show = size >= PROGRESS_THRESHOLD if progress is None else bool(progress)
    wanted = min(size, picks + max(4, picks // 2) + 1)  # + 1: the row itself
    seconds: dict = {}
    depth = ef_search or max(64, 2 * wanted)
    built, search_index, norms = _filled_index(faiss, rows, ids, kind, nlist, probes, depth, seed, chunk, show, seconds)

    rank = ChunkVocabulary(ids).rank().numpy()
    neighbors = np.empty((size, picks), dtype=np.int64)
    distances = np.empty((size, picks), dtype=np.float64)
    widened = 0
    clock = time.perf_counter()
    with progress_bar(total=size, unit="row", desc="kNN faiss search", show=show) as bar:
        for start in range(0, size, chunk):
            stop = min(start + chunk, size)
            unit, _ = _unit_chunk(rows, start, stop, ids)
            _, found = search_index.search(np.ascontiguousarray(unit, dtype=np.float32), wanted)
            found = np.where(found == np.arange(start, stop)[:, None], -1, found)  # never the row itself
            short = np.flatnonzero((found >= 0).sum(axis=1) < picks)
            if short.size and kind == "ivf":  # too few rows in the probed lists: probe them all
                widened += int(short.size)
                built.nprobe = built.nlist
                _, again = built.search(np.ascontiguousarray(unit[short], dtype=np.float32), wanted)
                built.nprobe = min(probes, built.nlist)
                found[short] = np.where(again == (start + short)[:, None], -1, again)
            distance = np.concatenate([
                _exact_distances(rows, norms, unit[part:part + _RESCORE_ROWS], found[part:part + _RESCORE_ROWS])
                for part in range(0, stop - start, _RESCORE_ROWS)
            ])
            # pick order: distance, then chunk-ID rank (missing candidates last)
            order = np.lexsort((np.where(found >= 0, rank[np.maximum(found, 0)], size), distance), axis=1)
            found = np.take_along_axis(found, order, axis=1)[:, :picks]
            distance = np.take_along_axis(distance, order, axis=1)[:, :picks]
            if (found < 0).any():
                row = start + int(np.flatnonzero((found < 0).any(axis=1))[0])
                raise MapMatchedValueError(f"the {kind} index found fewer than {picks} neighbours for row {row}")
            neighbors[start:stop], distances[start:stop] = found, distance
            bar.update(stop - start)
    seconds["search"] = time.perf_counter() - clock
    if info is not None:
        info.update({"backend": "faiss", "index": kind, "gpu": bool(gpu and kind == "flat"), "k": picks,
                     "candidates": wanted - 1, "widened_rows": widened, "seconds": seconds})
        if kind == "ivf":
            info.update({"nlist": int(built.nlist), "nprobe": int(built.nprobe)})
        if recall_sample > 0:
            clock = time.perf_counter()
            info["recall_at_k"] = knn_recall(embeddings, neighbors, sample=recall_sample, seed=seed)
            info["recall_sample"] = min(recall_sample, size)
            seconds["recall"] = time.perf_counter() - clock
    return torch.from_numpy(neighbors), torch.from_numpy(distances)


class FAISSCorpusIndex:
    """The corpus rows in a FAISS index, searched by outside query vectors with exact re-scoring.

    The index and its normalization are those of :func:`faiss_knn_neighbors` (module
    docstring, steps 1-3): ``limit + margin`` candidates per query from the index, their
    cosine similarities recomputed in float64 with the reference formula, ordered by
    (similarity decreasing, chunk ID), the first ``limit`` returned.

    Args:
        embeddings: (N, D) real matrix (a memory-mapped ``.npy`` is read in chunks).
        chunk_ids: N unique chunk IDs (ties go to the smaller ID).
        index, nlist, nprobe, seed, chunk_rows, progress: as for :func:`faiss_knn_neighbors`.

    Attributes:
        kind: the index built (``"flat"``, ``"ivf"`` or ``"hnsw"``).
        seconds: ``{"train"?: s, "add": s}``.

    Example:
        >>> import numpy as np
        >>> corpus = FAISSCorpusIndex(np.eye(3), ["a", "b", "c"])
        >>> scores, rows = corpus.search(np.array([[0.0, 1.0, 0.1]]), 2)
        >>> rows.tolist(), [round(value, 3) for value in scores[0].tolist()]
        ([[1, 2]], [0.995, 0.1])
    """

    def __init__(
        self,
        embeddings: Any,
        chunk_ids: Sequence[str],
        *,
        index: str = "auto",
        nlist: Optional[int] = None,
        nprobe: Optional[int] = None,
        seed: int = 0,
        chunk_rows: int = 1 << 15,
        progress: Optional[bool] = None,
    ) -> None:
        self._faiss = _faiss()
        check_choice("faiss index", index, FAISS_INDEXES)
        chunk = check_positive_int(chunk_rows, "chunk_rows")
        probes = 16 if nprobe is None else check_positive_int(nprobe, "nprobe")
        self._ids = check_embedding_ids(chunk_ids)
        self._rows, size, dimension = read_rows(embeddings)
        if size != len(self._ids):
            raise row_count_error(size, len(self._ids))
        if dimension == 0:
            raise dimension_error()
        gpu = getattr(self._faiss, "get_num_gpus", lambda: 0)() > 0
        self.kind = index if index != "auto" else ("flat" if gpu or size <= FLAT_UP_TO else "ivf")
        show = size >= PROGRESS_THRESHOLD if progress is None else bool(progress)
        self.seconds: dict = {}
        self._built, self._search_index, self._norms = _filled_index(
            self._faiss, self._rows, self._ids, self.kind, nlist, probes, 64, seed, chunk, show, self.seconds
        )
        self._rank = ChunkVocabulary(self._ids).rank().numpy()
        self.widened = 0  # queries searched again over every IVF list

    def search(self, queries: Any, limit: int) -> Tuple[np.ndarray, np.ndarray]:
        """The ``limit`` corpus rows most similar to each query.

        Args:
            queries: (Q, D) real query vectors (any norm but 0).
            limit: rows per query (at most N).

        Returns:
            ``(scores, rows)``: (Q, limit) float64 cosine similarities, decreasing, and
            (Q, limit) int64 corpus rows.

        Raises:
            MapMatchedValueError: a bad limit, a query of another dimension, a zero or
                non-finite query.
        """
        size = len(self._ids)
        limit = check_positive_int(limit, "limit")
        if limit > size:
            raise MapMatchedValueError(f"limit {limit} is larger than the corpus ({size} rows)")
        block = np.asarray(queries, dtype=np.float64)
        if block.ndim != 2 or block.shape[1] != self._rows.shape[1]:
            raise MapMatchedValueError(f"queries must be (Q, {self._rows.shape[1]}), got shape {block.shape}")
        unit, _ = _normalize(block, np.arange(block.shape[0]), _RowNames())
        wanted = min(size, limit + max(4, limit // 2))
        _, found = self._search_index.search(np.ascontiguousarray(unit, dtype=np.float32), wanted)
        short = np.flatnonzero((found >= 0).sum(axis=1) < limit)
        if short.size and self.kind == "ivf":  # too few rows in the probed lists: probe them all
            self.widened += int(short.size)
            probes, self._built.nprobe = self._built.nprobe, self._built.nlist
            _, found[short] = self._built.search(np.ascontiguousarray(unit[short], dtype=np.float32), wanted)
            self._built.nprobe = probes
        distance = np.concatenate([
            _exact_distances(self._rows, self._norms, unit[part:part + _RESCORE_ROWS], found[part:part + _RESCORE_ROWS])
            for part in range(0, unit.shape[0], _RESCORE_ROWS)
        ]) if unit.shape[0] else np.empty((0, wanted))
        order = np.lexsort((np.where(found >= 0, self._rank[np.maximum(found, 0)], size), distance), axis=1)
        found = np.take_along_axis(found, order, axis=1)[:, :limit]
        distance = np.take_along_axis(distance, order, axis=1)[:, :limit]
        if (found < 0).any():
            raise MapMatchedValueError(f"the {self.kind} index found fewer than {limit} rows for a query")
        return 1.0 - distance, found


class _RowNames:
    """Row numbers as labels (for error messages of :func:`knn_recall`, which has no IDs)."""

    def __getitem__(self, row: int) -> str:
        return str(row)


def knn_recall(
    embeddings: Any,
    neighbors: Any,
    *,
    sample: int = 1000,
    seed: int = 0,
    chunk_rows: int = 1 << 15,
) -> float:
    """recall@k of kNN picks against exact search, on a sample of rows.

    For each sampled row the exact k-th largest cosine similarity is found by a
    float32 brute-force scan of every row (chunk by chunk); a pick counts when its
    similarity reaches it (within 1e-5, so equal-distance ties are not counted as
    misses). recall@k = counted picks / (sample * k).

    Args:
        embeddings: the (N, D) matrix the picks were made from (as for
            :func:`faiss_knn_neighbors`).
        neighbors: (N, k) int64 picks (tensor or array).
        sample: rows checked (default 1000; all rows when N is smaller).
        seed: which rows.
        chunk_rows: rows scanned at a time.

    Returns:
        The recall in [0, 1].

    Cost: O(sample N D) float32 flops, one chunk of rows in memory at a time.
    """
    rows, size, dimension = read_rows(embeddings)
    picks = np.asarray(neighbors.cpu() if isinstance(neighbors, torch.Tensor) else neighbors, dtype=np.int64)
    k = picks.shape[1]
    if k == 0:
        return 1.0
    chosen = np.sort(np.random.default_rng(seed).choice(size, min(sample, size), replace=False))
    names = _RowNames()
    queries = _normalize(np.asarray(rows[chosen], dtype=np.float64), chosen, names)[0].astype(np.float32)
    best = np.full((chosen.size, k), -np.inf, dtype=np.float32)
    for start in range(0, size, chunk_rows):
        stop = min(start + chunk_rows, size)
        unit = _unit_chunk(rows, start, stop, names)[0].astype(np.float32)
        scores = queries @ unit.T  # shape: (s, b)
        inside = (chosen >= start) & (chosen < stop)
        scores[np.flatnonzero(inside), chosen[inside] - start] = -np.inf
        merged = np.concatenate([best, scores], axis=1)
        best = -np.sort(-np.partition(merged, merged.shape[1] - k, axis=1)[:, -k:], axis=1)
    threshold = best[:, k - 1]  # shape: (s,)
    chosen_picks = picks[chosen]  # shape: (s, k)
    distinct, places = np.unique(chosen_picks, return_inverse=True)  # sorted reads
    unit = _normalize(np.asarray(rows[distinct], dtype=np.float64), distinct, names)[0].astype(np.float32)
    places = places.reshape(chosen_picks.shape)
    similarity = np.einsum("sd,skd->sk", queries, unit[places])
    return float((similarity >= threshold[:, None] - 1e-5).mean())
