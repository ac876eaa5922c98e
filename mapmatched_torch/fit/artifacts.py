"""A fitted model as one directory: weights, settings, fingerprints of graph and embedder, metrics.

Layout of a model directory (every file named in ``manifest.json`` with its SHA-256):

- ``weights.pt``: the model's ``state_dict`` (tensors only; ``torch.load(...,
  weights_only=True)`` loads it);
- ``config.json``: ``{"method", "settings"`` (:class:`~mapmatched_torch.core.settings.DecodeSettings`
  fields), ``"mixing"`` (query-mixing options, or null)``}``;
- ``fingerprint.json``: ``{"graph": {"nodes", "node_ids_sha256", "maximum_distance"},
  "embedder": {"name", "dimension", "probe_sha256"} or null}``;
- ``metrics.json``: validation metrics of the fit (free-form numbers);
- ``manifest.json``: ``{"format": 1, "files": {name: sha256}}``.

:func:`save_model` writes one; :func:`load_model` reads it back and refuses a damaged
directory (a missing file, a checksum that does not match, unreadable JSON) or one
fitted over another graph or embedder than the ones passed, with an error naming what
differs.

Example:
    >>> import tempfile
    >>> from mapmatched_torch.core.settings import DecodeSettings
    >>> from mapmatched_torch.fit.model import MapMatchedModel
    >>> from mapmatched_torch.standalone.graph import InMemoryCorpusGraph
    >>> graph = InMemoryCorpusGraph([("a", "b", 1.0)], maximum_distance=3.0)
    >>> folder = tempfile.mkdtemp() + "/model"
    >>> _ = save_model(folder, MapMatchedModel(1.5, 0.5), DecodeSettings(1.5, 0.5), graph=graph)
    >>> load_model(folder, graph=graph).settings.transition_weight
    0.5
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from ..core.errors import MapMatchedValueError
from ..core.settings import DecodeSettings

__all__ = ["ARTIFACT_FORMAT", "PROBE_TEXTS", "LoadedModel", "graph_fingerprint", "embedder_fingerprint",
           "save_model", "load_model"]

#: The format number written to (and required in) ``manifest.json``.
ARTIFACT_FORMAT = 1
#: The fixed texts whose embeddings fingerprint an embedder.
PROBE_TEXTS = ("map-matched retrieval", "What happened next?", "the history of the river Thames")
_FILES = ("weights.pt", "config.json", "fingerprint.json", "metrics.json")
_SETTINGS = ("emission_weight", "transition_weight", "fixed_lag", "score_normalization")


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns.

    Attributes:
        method: the fitted method (``"map-matched"``, ...). settings: the decode
        settings. state_dict: the weights (tensors). mixing: query-mixing options or
        None. fingerprint: the recorded fingerprints. metrics: validation metrics.
    """

    method: str
    settings: DecodeSettings
    state_dict: Dict[str, torch.Tensor]
    mixing: Optional[Dict[str, Any]]
    fingerprint: Dict[str, Any]
    metrics: Dict[str, Any]


def _node_ids(graph: Any) -> Sequence[str]:
    vocabulary = getattr(graph, "vocabulary", None)
    if vocabulary is not None:
        return tuple(vocabulary.chunk_ids)
    for name in ("chunk_ids", "node_ids", "nodes"):
        ids = getattr(graph, name, None)
        if ids is not None:
            return tuple(sorted(map(str, ids() if callable(ids) else ids)))
    raise MapMatchedValueError(f"cannot fingerprint a {type(graph).__name__}: it exposes no node IDs "
                               "(a vocabulary, chunk_ids or nodes)")


def graph_fingerprint(graph: Any) -> Dict[str, Any]:
    """``{"nodes", "node_ids_sha256", "maximum_distance"}`` of a corpus graph."""
    ids = _node_ids(graph)
    digest = hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()
    return {"nodes": len(ids), "node_ids_sha256": digest, "maximum_distance": float(graph.maximum_distance)}


def embedder_fingerprint(embedder: Any) -> Dict[str, Any]:
    """``{"name", "dimension", "probe_sha256"}``: the embedder's repr, its dimension and a hash of
    :data:`PROBE_TEXTS`' embeddings rounded to 4 decimals (float32 noise across machines stays out)."""
    vectors = embedder.encode(list(PROBE_TEXTS)).detach().to("cpu", torch.float64)
    rounded = [f"{value:.4f}" for value in vectors.flatten().tolist()]
    return {"name": repr(embedder), "dimension": int(vectors.shape[-1]),
            "probe_sha256": hashlib.sha256(",".join(rounded).encode("ascii")).hexdigest()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, sort_keys=True, indent=2, allow_nan=False) + "\n")


def save_model(
    path: Union[str, os.PathLike],
    model: torch.nn.Module,
    settings: DecodeSettings,
    *,
    graph: Any,
    embedder: Any = None,
    method: str = "map-matched",
    mixing: Optional[Mapping[str, Any]] = None,
    metrics: Optional[Mapping[str, Any]] = None,
) -> Path:
    """Write a model directory (see the module docstring); returns its path.

    The files are written into ``path`` + ``".partial"`` and the folder renamed at the
    end, so an interrupted save leaves no half-written model under ``path``.

    Raises:
        MapMatchedValueError: ``path`` exists already.
    """
    target = Path(path)
    if target.exists():
        raise MapMatchedValueError(f"{target} exists: give a new directory for the model")
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    state = {name: value.detach().to("cpu").clone() for name, value in model.state_dict().items()}
    torch.save(state, partial / "weights.pt")
    _write_json(partial / "config.json", {"method": method, "settings": {k: getattr(settings, k) for k in _SETTINGS},
                                          "mixing": None if mixing is None else dict(mixing)})
    _write_json(partial / "fingerprint.json", {
        "graph": graph_fingerprint(graph),
        "embedder": None if embedder is None else embedder_fingerprint(embedder),
    })
    _write_json(partial / "metrics.json", dict(metrics or {}))
    _write_json(partial / "manifest.json", {"format": ARTIFACT_FORMAT,
                                            "files": {name: _sha256(partial / name) for name in _FILES}})
    partial.rename(target)
    return target


def _read_json(folder: Path, name: str) -> Any:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError) as error:
        raise MapMatchedValueError(f"damaged model artifact {folder}: cannot read {name} ({error})") from None


def _differences(recorded: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    return ", ".join(f"{key} {recorded.get(key)!r} (artifact) vs {actual.get(key)!r} (given)"
                     for key in sorted(set(recorded) | set(actual)) if recorded.get(key) != actual.get(key))


def load_model(path: Union[str, os.PathLike], *, graph: Any = None, embedder: Any = None) -> LoadedModel:
    """Read a model directory written by :func:`save_model`.

    Args:
        path: the directory.
        graph: when given, it must have the recorded graph fingerprint.
        embedder: when given, it must have the recorded embedder fingerprint.

    Raises:
        MapMatchedValueError: a damaged artifact (missing file, checksum mismatch,
            unreadable file, unknown format) or a graph / embedder that differs
            from the one it was fitted over (naming the differing fields).
    """
    folder = Path(path)
    if not folder.is_dir():
        raise MapMatchedValueError(f"{folder} is not a model directory")
    manifest = _read_json(folder, "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("format") != ARTIFACT_FORMAT:
        raise MapMatchedValueError(f"damaged model artifact {folder}: manifest.json has format "
                                   f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                                   f"expected {ARTIFACT_FORMAT}")
    files = manifest.get("files") or {}
    for name in _FILES:
        if not (folder / name).is_file():
            raise MapMatchedValueError(f"damaged model artifact {folder}: {name} is missing")
        if files.get(name) != _sha256(folder / name):
            raise MapMatchedValueError(f"damaged model artifact {folder}: {name} does not match its checksum "
                                       "in manifest.json")
    config = _read_json(folder, "config.json")
    fingerprint = _read_json(folder, "fingerprint.json")
    if graph is not None:
        differs = _differences(fingerprint["graph"], graph_fingerprint(graph))
        if differs:
            raise MapMatchedValueError(f"model {folder} was fitted over another graph: {differs}")
    if embedder is not None:
        recorded = fingerprint.get("embedder")
        if recorded is None:
            raise MapMatchedValueError(f"model {folder} records no embedder, but one was given")
        differs = _differences(recorded, embedder_fingerprint(embedder))
        if differs:
            raise MapMatchedValueError(f"model {folder} was fitted with another embedder: {differs}")
    state = torch.load(folder / "weights.pt", map_location="cpu", weights_only=True)
    return LoadedModel(config["method"], DecodeSettings(**config["settings"]), state, config.get("mixing"),
                       fingerprint, _read_json(folder, "metrics.json"))
