"""Graph artifacts: a saved corpus graph as a directory that loads memory-mapped.

Layout (format ``mapmatched-torch-graph``, version 1)::

    manifest.json        what the directory holds, the graph's fingerprint, every
                         file's size and SHA-256 (written last: no manifest, no artifact)
    vocabulary.json      the N chunk IDs in node order (a JSON array)
    csr_indptr.npy       (N + 1,) int64   \\
    csr_indices.npy      (E,) int64        } the CSR arcs (an undirected graph: both directions)
    csr_weights.npy      (E,) float64     /
    ball_indptr.npy, ball_neighbors.npy, ball_distances.npy
                         the optional bounded-ball table (:mod:`.balls`)
    context_indptr.npy, context_nodes.npy
                         the optional context neighbourhoods (:mod:`.neighborhood_table`)

Arrays are plain ``.npy`` files (little-endian, a fixed header, read with
``allow_pickle=False``: loading executes nothing) so they can be written in pieces
while a table is built and memory-mapped on load without a copy.

:func:`load_graph` refuses, with a :class:`~mapmatched_torch.core.errors.MapMatchedValueError`
naming the file and what is wrong, a directory without a manifest, another format or
version, a missing file, a file of another size, a checksum that differs (files up to
``FULL_CHECK_BYTES`` are hashed whole; larger ones by a sampled digest of their size
and 64 spread blocks unless ``verify="full"``), a ball table built for another graph
(fingerprint) or a smaller bound, a context table built for another graph or (when the
caller names one) another radius, and chunk IDs other than the caller expects.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np
import torch

from ..core.checks import check_choice, check_positive_finite
from ..core.errors import MapMatchedValueError
from . import _memory
from ._csr import CSRAdjacency, csr_fingerprint
from .balls import FILES as BALL_FILES
from .balls import BallTable, ball_size_summary
from .neighborhood_table import CONTEXT_FILES, NeighborhoodTable
from .tensor_graph import TensorCorpusGraph
from .vocabulary import ChunkVocabulary

__all__ = ["FORMAT", "VERSION", "save_graph", "load_graph", "graph_fingerprint", "read_manifest"]

PathLike = Union[str, "os.PathLike[str]"]

FORMAT = "mapmatched-torch-graph"
VERSION = 1
MANIFEST = "manifest.json"
VOCABULARY = "vocabulary.json"
CSR_FILES = {"indptr": "csr_indptr.npy", "indices": "csr_indices.npy", "weights": "csr_weights.npy"}
#: Files up to this size are checked by a full SHA-256 on load (``verify="auto"``).
FULL_CHECK_BYTES = 256 << 20
_BLOCK = 1 << 16
_SAMPLES = 64
VERIFY_MODES = ("auto", "full", "size")


def graph_fingerprint(graph: TensorCorpusGraph) -> str:
    """A SHA-256 of the graph's structure: N, direction and the CSR arcs (not the bound,
    not the IDs). A ball table records the fingerprint of the graph it was built from."""
    return csr_fingerprint(graph.num_nodes, graph.directed, graph.indptr, graph.indices, graph.weights)


def _file_digests(path: Path) -> Dict[str, Any]:
    """``{"bytes", "sha256", "sampled_sha256"}`` of a file."""
    full = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            full.update(block)
    return {"bytes": path.stat().st_size, "sha256": full.hexdigest(), "sampled_sha256": _sampled_digest(path)}


def _sampled_digest(path: Path) -> str:
    """A SHA-256 of the size and of 64 evenly spread 64 KiB blocks (first and last included)."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        last = max(size - _BLOCK, 0)
        for offset in sorted({int(last * i / (_SAMPLES - 1)) for i in range(_SAMPLES)}):
            handle.seek(offset)
            digest.update(handle.read(_BLOCK))
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _save_array(path: Path, array: torch.Tensor) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "wb") as handle:
        np.save(handle, np.ascontiguousarray(array.cpu().numpy()), allow_pickle=False)
    os.replace(temporary, path)


def save_graph(
    graph: TensorCorpusGraph, directory: PathLike, *, metadata: Optional[Dict[str, Any]] = None
) -> Path:
    """Write ``graph`` (vocabulary, CSR, its ball table and its neighbourhood table if
    attached) as an artifact directory.

    Args:
        graph: the graph. A ball table already stored in ``directory`` (built there by
            :meth:`~.TensorCorpusGraph.precompute_balls`) is kept as it is.
        directory: created if needed; an older artifact there is replaced (its
            manifest goes first, so a half-written directory never loads).
        metadata: JSON-serializable notes kept in the manifest (e.g. how it was built).

    Returns:
        The directory's path.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / MANIFEST
    if manifest_path.exists():
        manifest_path.unlink()
    _write_atomic(folder / VOCABULARY, json.dumps(list(graph.nodes), ensure_ascii=False).encode("utf-8"))
    for key, name in CSR_FILES.items():
        _save_array(folder / name, getattr(graph, key))
    fingerprint = graph_fingerprint(graph)
    names = [VOCABULARY, *CSR_FILES.values()]
    balls = None
    table = graph.ball_table
    if table is not None:
        stored = all((folder / name).exists() for name in BALL_FILES.values()) and _same_storage(table, folder)
        if not stored:
            table.save(folder)
        names.extend(BALL_FILES.values())
        balls = {"bound": table.bound, "graph_fingerprint": fingerprint, "entries": int(table.neighbors.numel()),
                 "sizes": ball_size_summary(table.ball_sizes())}
    else:
        _remove(folder, BALL_FILES.values())  # never leave another graph's table beside this one
    contexts = None
    neighborhoods = graph.neighborhood_table
    if neighborhoods is not None:
        for key, name in CONTEXT_FILES.items():
            _save_array(folder / name, getattr(neighborhoods, key))
        names.extend(CONTEXT_FILES.values())
        contexts = {"radius": neighborhoods.radius, "limit": neighborhoods.limit, "graph_fingerprint": fingerprint,
                    "entries": int(neighborhoods.nodes.numel())}
    else:
        _remove(folder, CONTEXT_FILES.values())
    manifest = {
        "format": FORMAT, "version": VERSION, "num_nodes": graph.num_nodes, "arcs": graph.edge_count,
        "directed": graph.directed, "maximum_distance": graph.maximum_distance,
        "graph_fingerprint": fingerprint, "balls": balls, "contexts": contexts, "metadata": metadata or {},
        "files": {name: _file_digests(folder / name) for name in names},
    }
    _write_atomic(manifest_path, (json.dumps(manifest, sort_keys=True, indent=2, allow_nan=False) + "\n").encode())
    return folder


def _remove(folder: Path, names: Any) -> None:
    for name in names:
        if (folder / name).exists():
            (folder / name).unlink()


def _same_storage(table: BallTable, folder: Path) -> bool:
    """Whether the table's arrays are the memory maps of ``folder``'s ball files."""
    return table.directory is not None and table.directory == folder.resolve()


def read_manifest(directory: PathLike) -> Dict[str, Any]:
    """The artifact's manifest, checked for format and version.

    Raises:
        ValueError: no manifest, unreadable JSON, another format or version.
    """
    folder = Path(directory)
    path = folder / MANIFEST
    if not path.is_file():
        raise MapMatchedValueError(f"{folder} is not a graph artifact: {MANIFEST} is missing (incomplete or not one)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise MapMatchedValueError(f"graph artifact {folder}: {MANIFEST} is damaged ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise MapMatchedValueError(f"graph artifact {folder}: {MANIFEST} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise MapMatchedValueError(
            f"graph artifact {folder} has format version {manifest.get('version')!r}; this version reads {VERSION}"
        )
    return manifest


def _verify_file(folder: Path, name: str, record: Dict[str, Any], verify: str) -> None:
    path = folder / name
    if not path.is_file():
        raise MapMatchedValueError(f"graph artifact {folder}: {name} is missing")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise MapMatchedValueError(
            f"graph artifact {folder}: {name} has {size} bytes, the manifest says {record['bytes']} (damaged or replaced)"
        )
    if verify == "size":
        return
    if verify == "full" or size <= FULL_CHECK_BYTES:
        actual, expected = _file_digests(path)["sha256"], record["sha256"]
    else:
        actual, expected = _sampled_digest(path), record["sampled_sha256"]
    if actual != expected:
        raise MapMatchedValueError(f"graph artifact {folder}: {name} fails its checksum (damaged or replaced)")


def _load_array(path: Path, mmap: bool, dtype: Any) -> torch.Tensor:
    return _memory.load_vector(path, mmap, [dtype], "graph artifact")


def load_graph(
    directory: PathLike,
    *,
    chunk_ids: Optional[Sequence[str]] = None,
    maximum_distance: Optional[float] = None,
    device: Union[torch.device, str, None] = None,
    verify: str = "auto",
    mmap: bool = True,
    prefault: Union[bool, str] = "auto",
    context_radius: Optional[float] = None,
    **options: Any,
) -> TensorCorpusGraph:
    """The :class:`~.TensorCorpusGraph` saved in ``directory``, its ball table and its
    neighbourhood table (context rows) attached.

    Args:
        directory: an artifact written by :func:`save_graph`.
        chunk_ids: the IDs the caller's corpus has, in order: refused unless equal to
            the artifact's vocabulary (the message names the first difference).
        maximum_distance: the bound to use (default the saved one; a ball table must
            have been built for at least it).
        device: where the graph goes (default CPU; the ball table stays on the CPU).
        verify: ``"auto"`` (full SHA-256 of files up to 256 MiB, a sampled digest of
            larger ones), ``"full"`` or ``"size"`` (sizes only).
        mmap: memory-map the arrays (default) instead of reading them.
        prefault: with ``mmap``, read every page of the arrays now (about 0.25 s for the
            1M-node artifact's 1.95 GB from the page cache), so the first queries do not
            pay the OS's page mapping (the first serving step at 1M: 107-132 ms without,
            49 ms with). ``"auto"`` (default): when the arrays take at most half the
            memory the OS reports available, so a larger-than-memory artifact stays
            lazily paged; True or False to choose.
        context_radius: the context radius the caller serves with: the artifact must
            hold a neighbourhood table of this radius (None: any table is attached).
        **options: ``distance_cache_size``, ``distance_cache_entries``, ``memory_budget``.

    Raises:
        ValueError: a damaged, incomplete or mismatched artifact (module docstring).
    """
    check_choice("verify mode", verify, VERIFY_MODES)
    if not isinstance(prefault, bool) and prefault != "auto":
        raise MapMatchedValueError(f"prefault must be True, False or 'auto', got {prefault!r}")
    folder = Path(directory)
    manifest = read_manifest(folder)
    files = manifest.get("files") or {}
    for name in [VOCABULARY, *CSR_FILES.values()]:
        if name not in files:
            raise MapMatchedValueError(f"graph artifact {folder}: the manifest lists no {name}")
    for name, record in files.items():
        _verify_file(folder, name, record, verify)
    try:
        ids = json.loads((folder / VOCABULARY).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise MapMatchedValueError(f"graph artifact {folder}: {VOCABULARY} is damaged ({error})") from None
    if not isinstance(ids, list) or len(ids) != manifest["num_nodes"]:
        raise MapMatchedValueError(f"graph artifact {folder}: {VOCABULARY} does not hold {manifest['num_nodes']} IDs")
    if chunk_ids is not None:
        _check_same_ids(folder, ids, list(chunk_ids))
    indptr = _load_array(folder / CSR_FILES["indptr"], mmap, np.int64)
    indices = _load_array(folder / CSR_FILES["indices"], mmap, np.int64)
    weights = _load_array(folder / CSR_FILES["weights"], mmap, np.float64)
    if indptr.numel() != len(ids) + 1 or indices.numel() != weights.numel() or int(indptr[-1]) != indices.numel():
        raise MapMatchedValueError(f"graph artifact {folder}: the CSR arrays do not fit together")
    bound = manifest["maximum_distance"] if maximum_distance is None else maximum_distance
    bound = check_positive_finite(bound, "maximum_distance")
    adjacency = CSRAdjacency(indptr, indices, weights, len(ids))
    graph = TensorCorpusGraph(adjacency, ChunkVocabulary(ids), maximum_distance=bound,
                              directed=bool(manifest["directed"]), **options)
    balls = manifest.get("balls")
    if balls is not None:
        if balls.get("graph_fingerprint") != manifest.get("graph_fingerprint"):
            raise MapMatchedValueError(f"graph artifact {folder}: its ball table was built for another graph")
        if not math.isfinite(balls["bound"]) or balls["bound"] < bound:
            raise MapMatchedValueError(
                f"graph artifact {folder}: its ball table's bound {balls['bound']!r} is below maximum_distance {bound!r}"
            )
        table = BallTable.load(folder, balls["bound"], mmap=mmap)
        graph.attach_balls(table)
    _attach_contexts(graph, folder, manifest, mmap, context_radius)
    if mmap:
        arrays = _mapped_arrays(graph)
        if _should_prefault(prefault, arrays):
            _memory.prefault(arrays)
    return graph if device is None else graph.to(device)


def _mapped_arrays(graph: TensorCorpusGraph) -> list:
    """The loaded graph's arrays: its CSR, its ball table's, its context table's."""
    adjacency = graph.adjacency
    arrays = [adjacency.indptr, adjacency.indices, adjacency.weights]
    if graph.ball_table is not None:
        arrays += [graph.ball_table.indptr, graph.ball_table.neighbors, graph.ball_table.distances]
    if graph.neighborhood_table is not None:
        arrays += [graph.neighborhood_table.indptr, graph.neighborhood_table.nodes]
    return arrays


def _should_prefault(prefault: Union[bool, str], arrays: list) -> bool:
    if prefault == "auto":
        available = _memory.available_bytes()
        size = sum(array.numel() * array.element_size() for array in arrays)
        return available is not None and size <= available // 2
    return bool(prefault)


def _attach_contexts(graph: TensorCorpusGraph, folder: Path, manifest: Dict[str, Any], mmap: bool,
                     radius: Optional[float]) -> None:
    """Attach the artifact's neighbourhood table, refused when built for another graph,
    another limit (another bound), or another radius than ``radius`` (when given)."""
    contexts = manifest.get("contexts")
    if contexts is None:
        if radius is not None:
            raise MapMatchedValueError(f"graph artifact {folder} holds no context table (radius {radius!r} asked)")
        return
    if contexts.get("graph_fingerprint") != manifest.get("graph_fingerprint"):
        raise MapMatchedValueError(f"graph artifact {folder}: its context table was built for another graph")
    if radius is not None and float(radius) != contexts["radius"]:
        raise MapMatchedValueError(
            f"graph artifact {folder}: its context table has radius {contexts['radius']!r}, not {float(radius)!r}"
        )
    if min(contexts["radius"], graph.maximum_distance) != contexts["limit"]:
        raise MapMatchedValueError(
            f"graph artifact {folder}: its context table holds neighbourhoods within {contexts['limit']!r}, but "
            f"maximum_distance {graph.maximum_distance!r} bounds radius {contexts['radius']!r} at "
            f"{min(contexts['radius'], graph.maximum_distance)!r}"
        )
    indptr = _load_array(folder / CONTEXT_FILES["indptr"], mmap, np.int64)
    nodes = _memory.load_vector(folder / CONTEXT_FILES["nodes"], mmap, [np.int32, np.int64], "graph artifact")
    if indptr.numel() != graph.num_nodes + 1 or int(indptr[-1]) != nodes.numel():
        raise MapMatchedValueError(f"graph artifact {folder}: the context table's arrays do not fit the graph")
    graph.attach_neighborhoods(NeighborhoodTable(indptr, nodes, contexts["radius"], contexts["limit"]))


def _check_same_ids(folder: Path, saved: list, expected: list) -> None:
    if saved == expected:
        return
    if len(saved) != len(expected):
        raise MapMatchedValueError(
            f"graph artifact {folder} has {len(saved)} chunk IDs but the corpus has {len(expected)}: "
            "it was built for another corpus"
        )
    position = next(i for i, (a, b) in enumerate(zip(saved, expected)) if a != b)
    raise MapMatchedValueError(
        f"graph artifact {folder} was built for another corpus: node {position} is {saved[position]!r} there but "
        f"{expected[position]!r} here"
    )
