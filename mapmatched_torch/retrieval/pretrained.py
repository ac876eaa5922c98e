"""Loading a fitted model directory for sessions, the server and the integrations.

:func:`load_model` reads a model directory (checked by
:func:`mapmatched_torch.core.model_artifacts.read_artifact`; the weights with
``torch.load(..., weights_only=True)``). :func:`pretrained_options` turns it into the
keyword arguments of :class:`~mapmatched_torch.MapMatchedRetriever` and
:class:`~mapmatched_torch.MapMatchedServer` (their ``from_pretrained`` classmethods
share it), so that a session applies what the evaluation's method applied:

- ``map-matched``: the fitted lambda and beta (``settings``), full decoding;
- ``mixed``: beta = 0 (ranked pointwise, as the evaluation's ``mixed`` method ranks)
  and the provider wrapped in a
  :class:`~mapmatched_torch.providers.query_mixing.QueryMixingProvider` with the fitted
  gates, so each query takes in the chunk decoded at the previous turn (and the
  previous query);
- ``gated`` and ``mixed+gated``: the fitted
  :class:`~mapmatched_torch.kernels.transitions.GatedTransitions`, passed as
  ``transitions=`` (a class without that keyword raises NotImplementedError), with the
  gate feature it was fitted on: the query-source cosine needs the caller's
  ``passage_embeddings=`` (and ``passage_ids=``), the score-level feature refuses them.

The writer is :func:`mapmatched_torch.fit.artifacts.save_model`.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union

import torch

from ..core.checks import check_choice
from ..core.errors import MapMatchedTypeError, MapMatchedValueError
from ..core.model_artifacts import check_fingerprints, read_artifact
from ..core.settings import DecodeSettings
from ..kernels.gate_features import GATE_FEATURE_NAMES

__all__ = ["MODEL_METHODS", "LoadedModel", "load_model", "transition_model", "pretrained_options"]

#: The methods a model directory may hold (``fit --method``'s choices but ``auto``).
MODEL_METHODS = ("map-matched", "gated", "mixed", "mixed+gated")
_SETTINGS = ("emission_weight", "transition_weight", "fixed_lag", "score_normalization")


class LoadedModel(NamedTuple):
    """What :func:`load_model` returns.

    Attributes:
        method: the fitted method (one of :data:`MODEL_METHODS`). settings: the decode
        settings. state_dict: the weights (tensors, on the CPU). mixing: the query-mixing
        values (``QueryMixing(**mixing)``) or None. fingerprint: the recorded
        fingerprints. metrics: validation metrics. config: the whole ``config.json``
        (``transitions``, ``candidate_limit``, ``selection``, ...).
    """

    method: str
    settings: DecodeSettings
    state_dict: Dict[str, torch.Tensor]
    mixing: Optional[Dict[str, Any]]
    fingerprint: Dict[str, Any]
    metrics: Dict[str, Any]
    config: Dict[str, Any]


def load_model(
    path: Union[str, "os.PathLike[str]"], *, graph: Any = None, embedder: Any = None, strict: bool = True
) -> LoadedModel:
    """Read a model directory written by :func:`~mapmatched_torch.fit.artifacts.save_model`.

    Args:
        path: the directory.
        graph: when given, it must have the recorded graph fingerprint (node IDs,
            maximum distance).
        embedder: when given (an object with ``encode(texts) -> (N, D)``), it must
            have the recorded embedder fingerprint.
        strict: False: a graph or embedder that differs is warned about
            (:class:`~mapmatched_torch.core.model_artifacts.ModelMismatchWarning`), not refused.

    Raises:
        MapMatchedValueError: a damaged artifact (missing file, checksum mismatch,
            unreadable file, unknown format or method) or, with ``strict``, a graph /
            embedder that differs from the one it was fitted over (naming the fields).
    """
    files = read_artifact(path)
    check_fingerprints(files, graph=graph, embedder=embedder, strict=strict)
    config = files.config
    method = config["method"]
    try:
        check_choice("model method", method, MODEL_METHODS)
    except MapMatchedValueError as error:
        raise MapMatchedValueError(f"damaged model artifact {files.folder}: {error}") from None
    try:
        settings = DecodeSettings(**{name: config["settings"][name] for name in _SETTINGS})
        state = torch.load(files.folder / "weights.pt", map_location="cpu", weights_only=True)
    except (KeyError, TypeError, RuntimeError) as error:
        raise MapMatchedValueError(f"damaged model artifact {files.folder}: {error}") from None
    return LoadedModel(method, settings, state, config.get("mixing"), files.fingerprint, files.metrics, config)


def transition_model(model: LoadedModel) -> Optional[torch.nn.Module]:
    """The fitted :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` of a
    ``gated`` or ``mixed+gated`` model (its config and its ``transition_model.*``
    weights), or None for the fixed model ``-(beta * d)``."""
    spec = model.config.get("transitions")
    if spec is None:
        return None
    from ..kernels.transitions import GatedTransitions

    if spec.get("kind") != "gated":
        raise MapMatchedValueError(f"model artifact: unknown transition model {spec.get('kind')!r} (expected gated)")
    prefix = "transition_model."
    weights = {key[len(prefix):]: value for key, value in model.state_dict.items() if key.startswith(prefix)}
    gate = GatedTransitions(float(model.settings.transition_weight), num_features=int(spec["num_features"]),
                            calibrate=bool(spec["calibrate"]), cap=float(spec["cap"]))
    try:
        gate.load_state_dict(weights)
    except RuntimeError as error:
        raise MapMatchedValueError(f"model artifact: the transition weights do not fit its config ({error})") from None
    return gate.requires_grad_(False)


def _mixing_provider(model: LoadedModel, provider: Any) -> Any:
    """``provider`` wrapped in a QueryMixingProvider with the model's gates."""
    from ..providers.query_mixing import QueryMixing, QueryMixingProvider

    if provider is None:
        raise MapMatchedValueError(f"a {model.method!r} model mixes the previous decoded chunk into each query: "
                                   "from_pretrained needs provider= (a vector-search provider over the corpus it was "
                                   "fitted on, e.g. a DenseProvider with embed_query)")
    if isinstance(provider, QueryMixingProvider):
        raise MapMatchedTypeError("from_pretrained wraps the provider in the model's QueryMixingProvider: pass the "
                                  "plain vector-search provider")
    return QueryMixingProvider(provider, QueryMixing(**model.mixing))


def pretrained_options(
    cls: type,
    path: Union[str, "os.PathLike[str]"],
    *,
    graph: Any,
    provider: Any = None,
    embedder: Any = None,
    strict: bool = True,
    options: Optional[Dict[str, Any]] = None,
) -> Tuple[LoadedModel, Dict[str, Any]]:
    """The model at ``path`` as keyword arguments of ``cls`` (a retriever or server class).

    Args:
        cls: the class to construct (its signature says whether it takes ``transitions=``).
        path, graph, embedder, strict: as :func:`load_model` (the graph is always checked).
        provider: the candidate provider (wrapped for the mixed methods).
        options: the caller's other keyword arguments (``candidate_limit``,
            ``context_radius``, ...); ``settings``, ``emission_weight``,
            ``transition_weight``, ``fixed_lag`` and ``score_normalization`` are refused
            (the model fixes them), ``candidate_limit`` defaults to the fit's M.

    Returns:
        ``(model, keyword arguments)``: ``cls(graph, **keyword arguments)`` builds it.

    Raises:
        MapMatchedValueError: as :func:`load_model`; a mixed model without a provider.
        MapMatchedTypeError: an option the model fixes.
        NotImplementedError: a gated model for a class without ``transitions=``.
    """
    model = load_model(path, graph=graph, embedder=embedder, strict=strict)
    kwargs = dict(options or {})
    fixed = sorted(set(kwargs) & {"settings", *_SETTINGS, "transitions"})
    if fixed:
        raise MapMatchedTypeError(f"from_pretrained takes {', '.join(fixed)} from the model ({model.method}): "
                                  "leave them out")
    limit = model.config.get("candidate_limit")
    if limit is not None:
        kwargs.setdefault("candidate_limit", int(limit))
    kwargs["settings"] = model.settings
    kwargs["provider"] = _mixing_provider(model, provider) if model.mixing is not None else provider
    gate = transition_model(model)
    if gate is not None:
        if "transitions" not in inspect.signature(cls).parameters:
            raise NotImplementedError(
                f"{cls.__name__} does not take transitions= (learned transition models in sessions and the server, "
                f"issue 33 item 2), so the {model.method!r} model at {path} cannot be applied as fitted")
        _check_gate_feature(model, kwargs)
        kwargs["transitions"] = gate
    return model, kwargs


def _check_gate_feature(model: LoadedModel, kwargs: Dict[str, Any]) -> None:
    """The gate must read the feature it was fitted on: the query-source cosine needs the
    caller's ``passage_embeddings=`` (the sessions' and the server's cosine), the
    score-level feature must not get them (they would switch the feature)."""
    feature = (model.config.get("transitions") or {}).get("feature")
    given = kwargs.get("passage_embeddings") is not None
    if feature == GATE_FEATURE_NAMES[0] and not given:
        raise MapMatchedValueError(
            f"the {model.method!r} model's gate was fitted on the {feature} (the new query's cosine to the previous "
            "turn's passages): pass passage_embeddings= (N, D), the embeddings of the fit, and passage_ids= unless "
            "the rows follow the graph's node order")
    if feature == GATE_FEATURE_NAMES[1] and given:
        raise MapMatchedValueError(
            f"the {model.method!r} model's gate was fitted on the {feature}: leave passage_embeddings= out "
            "(with them the gate would read the query-source cosine instead)")
