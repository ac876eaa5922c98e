"""Reading a fitted model directory, in plain Python: manifest, checksums, JSON, fingerprints.

A model directory (written by :func:`mapmatched_torch.fit.artifacts.save_model`) holds
five files, each named in ``manifest.json`` with its SHA-256:

- ``weights.pt``: the model's ``state_dict`` (tensors only; read by
  :func:`mapmatched_torch.retrieval.pretrained.load_model`, ``torch.load(...,
  weights_only=True)``);
- ``config.json``: ``{"method", "settings"`` (the
  :class:`~mapmatched_torch.core.settings.DecodeSettings` fields), ``"mixing"`` (the
  :class:`~mapmatched_torch.providers.query_mixing.QueryMixing` values, or null),
  ``"transitions"`` (the transition model: ``{"kind": "gated", "num_features",
  "calibrate", "cap", "feature"}``, or null for ``-(beta * d)``), ``"candidate_limit"``
  (M of the fit, or null), ``"selection"`` (``fit --method auto``'s choice and why, or
  null)``}``;
- ``fingerprint.json``: ``{"graph": {"nodes", "node_ids_sha256", "maximum_distance"},
  "embedder": {"name", "dimension", "probe_sha256"} or null}``;
- ``metrics.json``: the fit's validation metrics (free-form numbers);
- ``manifest.json``: ``{"format": 1, "files": {name: sha256}}``.

This module (no torch: :mod:`mapmatched_torch.core` is plain Python) checks a directory
(:func:`read_artifact`: a missing file, a checksum that does not match, unreadable
JSON, an unknown format are refused) and compares fingerprints (:func:`check_fingerprints`:
an artifact fitted over another graph or embedder is refused naming what differs, or
warned about with ``strict=False``). Sessions, the server and the integrations load
through :mod:`mapmatched_torch.retrieval.pretrained`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Sequence, Union

from .errors import MapMatchedValueError

__all__ = [
    "ARTIFACT_FORMAT",
    "ARTIFACT_FILES",
    "PROBE_TEXTS",
    "ModelMismatchWarning",
    "ArtifactFiles",
    "graph_fingerprint",
    "embedder_fingerprint",
    "file_sha256",
    "is_model_artifact",
    "read_artifact",
    "check_fingerprints",
]

#: The format number written to (and required in) ``manifest.json``.
ARTIFACT_FORMAT = 1
#: The fixed texts whose embeddings fingerprint an embedder.
PROBE_TEXTS = ("map-matched retrieval", "What happened next?", "the history of the river Thames")
#: The files every model directory holds besides ``manifest.json``.
ARTIFACT_FILES = ("weights.pt", "config.json", "fingerprint.json", "metrics.json")

PathLike = Union[str, "os.PathLike[str]"]


class ModelMismatchWarning(UserWarning):
    """A model artifact loaded with ``strict=False`` over another graph or embedder than its fit's."""


class ArtifactFiles(NamedTuple):
    """What :func:`read_artifact` returns: the checked directory and its JSON files.

    Attributes:
        folder: the directory. config: ``config.json``. fingerprint:
        ``fingerprint.json``. metrics: ``metrics.json``.
    """

    folder: Path
    config: Dict[str, Any]
    fingerprint: Dict[str, Any]
    metrics: Dict[str, Any]


def _node_ids(graph: Any) -> Sequence[str]:
    vocabulary = getattr(graph, "vocabulary", None)
    if vocabulary is not None:
        return tuple(sorted(vocabulary.chunk_ids))
    for name in ("chunk_ids", "node_ids", "nodes"):
        ids = getattr(graph, name, None)
        if ids is not None:
            return tuple(sorted(map(str, ids() if callable(ids) else ids)))
    raise MapMatchedValueError(f"cannot fingerprint a {type(graph).__name__}: it exposes no node IDs "
                               "(a vocabulary, chunk_ids or nodes)")


def graph_fingerprint(graph: Any) -> Dict[str, Any]:
    """``{"nodes", "node_ids_sha256", "maximum_distance"}`` of a corpus graph (its node IDs sorted:
    the same corpus in another node order has the same fingerprint, since a model's weights do not
    depend on the order)."""
    ids = _node_ids(graph)
    digest = hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()
    return {"nodes": len(ids), "node_ids_sha256": digest, "maximum_distance": float(graph.maximum_distance)}


def embedder_fingerprint(embedder: Any) -> Dict[str, Any]:
    """``{"name", "dimension", "probe_sha256"}``: the embedder's repr, its dimension and a hash of
    :data:`PROBE_TEXTS`' embeddings (``embedder.encode``, a (3, D) tensor) rounded to 4 decimals
    (float32 noise across machines stays out)."""
    vectors = embedder.encode(list(PROBE_TEXTS)).detach().cpu().double()
    rounded = [f"{value:.4f}" for value in vectors.flatten().tolist()]
    return {"name": repr(embedder), "dimension": int(vectors.shape[-1]),
            "probe_sha256": hashlib.sha256(",".join(rounded).encode("ascii")).hexdigest()}


def file_sha256(path: PathLike) -> str:
    """The SHA-256 hex digest of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _read_json(folder: Path, name: str) -> Any:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError) as error:
        raise MapMatchedValueError(f"damaged model artifact {folder}: cannot read {name} ({error})") from None


def is_model_artifact(path: PathLike) -> bool:
    """Whether ``path`` is a directory whose ``manifest.json`` names this format (damaged or not
    otherwise): what ``fit --output`` may replace."""
    folder = Path(path)
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == ARTIFACT_FORMAT


def read_artifact(path: PathLike) -> ArtifactFiles:
    """Check a model directory (manifest, every file present and matching its checksum) and read its JSON.

    Raises:
        MapMatchedValueError: not a directory; a damaged artifact (missing file,
            checksum mismatch, unreadable JSON, unknown format), naming the file.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise MapMatchedValueError(f"{folder} is not a model directory (mapmatched-torch fit --output DIR writes one)")
    manifest = _read_json(folder, "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("format") != ARTIFACT_FORMAT:
        raise MapMatchedValueError(f"damaged model artifact {folder}: manifest.json has format "
                                   f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                                   f"expected {ARTIFACT_FORMAT}")
    files = manifest.get("files") or {}
    for name in ARTIFACT_FILES:
        if not (folder / name).is_file():
            raise MapMatchedValueError(f"damaged model artifact {folder}: {name} is missing")
        if files.get(name) != file_sha256(folder / name):
            raise MapMatchedValueError(f"damaged model artifact {folder}: {name} does not match its checksum "
                                       "in manifest.json")
    parts = [_read_json(folder, name) for name in ("config.json", "fingerprint.json", "metrics.json")]
    for name, part in zip(("config.json", "fingerprint.json", "metrics.json"), parts):
        if not isinstance(part, dict):
            raise MapMatchedValueError(f"damaged model artifact {folder}: {name} is not a JSON object")
    if "method" not in parts[0] or "settings" not in parts[0] or "graph" not in parts[1]:
        raise MapMatchedValueError(f"damaged model artifact {folder}: config.json needs method and settings, "
                                   "fingerprint.json a graph")
    return ArtifactFiles(folder, *parts)


def _differences(recorded: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} {recorded.get(key)!r} (artifact) vs {actual.get(key)!r} (given)"
                     for key in sorted(set(recorded) | set(actual)) if recorded.get(key) != actual.get(key))


def check_fingerprints(files: ArtifactFiles, *, graph: Any = None, embedder: Any = None, strict: bool = True) -> None:
    """Compare the recorded fingerprints with the graph and embedder given (None: not compared).

    Raises:
        MapMatchedValueError: (``strict``) the graph or the embedder differs, naming each
            differing field with both values; with ``strict=False`` a
            :class:`ModelMismatchWarning` says the same and the load goes on.
    """
    problems = []
    if graph is not None:
        differs = _differences(files.fingerprint["graph"], graph_fingerprint(graph))
        if differs:
            problems.append(f"model {files.folder} was fitted over another graph: {differs}")
    if embedder is not None:
        recorded = files.fingerprint.get("embedder")
        if recorded is None:
            problems.append(f"model {files.folder} records no embedder, but one was given")
        else:
            differs = _differences(recorded, embedder_fingerprint(embedder))
            if differs:
                problems.append(f"model {files.folder} was fitted with another embedder: {differs}")
    if not problems:
        return
    if strict:
        raise MapMatchedValueError("; ".join(problems) + " (strict=False loads it anyway, with a warning)")
    for problem in problems:
        warnings.warn(problem, ModelMismatchWarning, stacklevel=3)
