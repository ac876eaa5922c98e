"""Writing a fitted model as one directory: weights, settings, fingerprints of graph and embedder, metrics.

The directory's layout and its checks are :mod:`mapmatched_torch.core.model_artifacts`'
(plain Python); :func:`save_model` writes one, :func:`load_model` (from
:mod:`mapmatched_torch.retrieval.pretrained`, where sessions and the server load it)
reads it back and refuses a damaged directory (a missing file, a checksum that does
not match, unreadable JSON) or one fitted over another graph or embedder than the ones
passed, with an error naming what differs. ``mapmatched-torch fit --output DIR`` writes
one per fitted method; ``MapMatchedRetriever.from_pretrained(DIR, graph=...)`` serves it.

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

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import torch

from ..core.checks import check_choice
from ..core.errors import MapMatchedValueError
from ..core.model_artifacts import (
    ARTIFACT_FILES,
    ARTIFACT_FORMAT,
    PROBE_TEXTS,
    embedder_fingerprint,
    file_sha256,
    graph_fingerprint,
    is_model_artifact,
)
from ..core.settings import DecodeSettings
from ..core.signals import deferred_sigint
from ..retrieval.pretrained import MODEL_METHODS, LoadedModel, load_model

__all__ = ["ARTIFACT_FORMAT", "PROBE_TEXTS", "LoadedModel", "graph_fingerprint", "embedder_fingerprint",
           "transitions_config", "save_model", "load_model"]

_SETTINGS = ("emission_weight", "transition_weight", "fixed_lag", "score_normalization")


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, sort_keys=True, indent=2, allow_nan=False) + "\n")


def transitions_config(model: torch.nn.Module, feature: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """``config.json``'s ``"transitions"`` of a :class:`~mapmatched_torch.fit.model.MapMatchedModel`:
    ``{"kind": "gated", "num_features", "calibrate", "cap", "feature"}`` for a
    :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` (``feature``: what
    its per-move feature is, e.g. ``"query-source cosine"``), None for ``-(beta * d)``."""
    gate = getattr(model, "transition_model", None)
    if gate is None:
        return None
    cap = float(torch.nn.functional.softplus(gate.cap_parameter.detach())) if gate.calibrate else 10.0
    return {"kind": "gated", "num_features": int(gate.num_features), "calibrate": bool(gate.calibrate),
            "cap": cap, "feature": feature}


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
    feature: Optional[str] = None,
    candidate_limit: Optional[int] = None,
    selection: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
) -> Path:
    """Write a model directory (see :mod:`mapmatched_torch.core.model_artifacts`); returns its path.

    Args:
        path: the directory to write.
        model: the fitted module (its ``state_dict`` is saved; a
            :class:`~mapmatched_torch.fit.model.MapMatchedModel` with a
            ``transition_model`` also records that model's config).
        settings: the decode settings a session applies.
        graph: the corpus graph it was fitted over (fingerprinted).
        embedder: the text embedder (fingerprinted), or None (no text: synthetic data).
        method: one of ``map-matched``, ``gated``, ``mixed``, ``mixed+gated``.
        mixing: the query-mixing values (``QueryMixing.to_dict()``) of the mixed methods.
        metrics: validation metrics (JSON numbers).
        feature: the gate's per-move feature, by name. candidate_limit: M of the fit.
        selection: ``fit --method auto``'s choice and why.
        overwrite: replace ``path`` when it is a model directory already (a directory
            that is not one is always refused).

    The files are written into ``path`` + ``".partial"`` and the folder renamed at the
    end, so an interrupted save leaves no half-written model under ``path``.

    Raises:
        MapMatchedValueError: ``path`` exists (and is not a model directory to
            overwrite), or an unknown method.
    """
    check_choice("model method", method, MODEL_METHODS)
    target = Path(path)
    if target.exists() and not (overwrite and target.is_dir() and is_model_artifact(target)):
        why = "give a new directory for the model" if not overwrite else "it is not a model directory, refusing to replace it"
        raise MapMatchedValueError(f"{target} exists: {why}")
    partial = target.with_name(target.name + ".partial")
    if partial.exists():  # a save interrupted before its rename
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    state = {name: value.detach().to("cpu").clone() for name, value in model.state_dict().items()}
    torch.save(state, partial / "weights.pt")
    _write_json(partial / "config.json", {
        "method": method, "settings": {k: getattr(settings, k) for k in _SETTINGS},
        "mixing": None if mixing is None else dict(mixing), "transitions": transitions_config(model, feature),
        "candidate_limit": candidate_limit, "selection": None if selection is None else dict(selection),
    })
    _write_json(partial / "fingerprint.json", {
        "graph": graph_fingerprint(graph),
        "embedder": None if embedder is None else embedder_fingerprint(embedder),
    })
    _write_json(partial / "metrics.json", dict(metrics or {}))
    _write_json(partial / "manifest.json", {"format": ARTIFACT_FORMAT,
                                            "files": {name: file_sha256(partial / name) for name in ARTIFACT_FILES}})
    with deferred_sigint():  # Ctrl-C waits for the renames: the old model or the new one, never neither
        if target.exists():  # an old model directory: moved aside, replaced, removed
            old = target.with_name(target.name + ".old")
            if old.exists():
                shutil.rmtree(old)
            target.rename(old)
            partial.rename(target)
            shutil.rmtree(old)
        else:
            partial.rename(target)
    return target
