"""The methods' registry and the types a method is run with.

A method is a :class:`MethodSpec` in :data:`METHODS` (:func:`register_method`): a
``run`` on :class:`MethodBatch` es with :class:`MethodOptions` (its map-matching
settings: :class:`Setting`, :func:`settings_grid`), returning :class:`MethodOutput`
rankings, and an optional one-off ``prepare`` that may raise :class:`MethodUnavailable`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple

from torch import Tensor

from ...core.errors import MapMatchedValueError
from ...core.settings import DecodeSettings
from ..candidates import Candidates

__all__ = [
    "Setting",
    "settings_grid",
    "MethodOptions",
    "MethodBatch",
    "MethodOutput",
    "MethodSpec",
    "MethodUnavailable",
    "METHODS",
    "register_method",
    "gather_passages",
]


@dataclass(frozen=True, slots=True)
class Setting(DecodeSettings):
    """One map-matching setting of an evaluation: a
    :class:`~mapmatched_torch.core.settings.DecodeSettings` (validated on construction,
    frozen, hashable) with the evaluation's label and record.

    Attributes:
        emission_weight: lambda (finite, >= 0).
        transition_weight: beta (finite, >= 0); 0 is pointwise.
        fixed_lag: None (full decoding) or L >= 0.
        score_normalization: not read by the evaluation, which normalizes every method's
            candidates alike (``EvalConfig.score_normalization``).
    """

    @property
    def label(self) -> str:
        """``"lambda=1 beta=0.5 full"`` / ``"... lag=2"``."""
        lag = "full" if self.fixed_lag is None else f"lag={self.fixed_lag}"
        return f"lambda={self.emission_weight:g} beta={self.transition_weight:g} {lag}"

    def to_dict(self) -> Dict[str, Any]:
        """``{"lambda", "beta", "lag"}`` (lag None = full decoding)."""
        return {"lambda": self.emission_weight, "beta": self.transition_weight, "lag": self.fixed_lag}


def settings_grid(
    lambdas: Iterable[float], betas: Iterable[float], lags: Iterable[Optional[int]] = (None,)
) -> Tuple[Setting, ...]:
    """Every (lambda, beta, lag) combination, validated, duplicates dropped, in product order.

    Raises:
        MapMatchedValueError: an empty axis or a value the decoders reject (the
            decoders' messages: weights finite and >= 0, lag >= 0).
    """
    axes = [tuple(lambdas), tuple(betas), tuple(lags)]
    for name, axis in zip(("lambdas", "betas", "lags"), axes):
        if not axis:
            raise MapMatchedValueError(f"the grid needs at least one value in {name}")
    settings = [Setting(*values) for values in itertools.product(*axes)]
    return tuple(dict.fromkeys(settings))


def gather_passages(index: Tensor, order: Tensor) -> Tensor:
    """(B, T, M) ranked passage indices: ``index`` (-1 padding) permuted by ``order``."""
    return index.gather(-1, order)


@dataclass(frozen=True)
class MethodOptions:
    """What the methods are run with.

    Attributes:
        settings: the map-matching grid.
        relevance_weight: the Maximal Marginal Relevance lambda.
        score_normalization: the normalization the fitted method fits with.
        seed: seeds the fitted method's folds and fits.
        fit_folds: cross-fitting folds of the fitted method (>= 2).
        extra: free-form options of registered methods (e.g. a fitting budget).
        memo: work the methods' prepare steps share, by name (e.g. the mixing fits of
            ``mixed`` and ``mixed+gated``: :func:`_mixing_folds`). :func:`evaluate`
            builds one MethodOptions per evaluation, so nothing in it outlives the run.
    """

    settings: Tuple[Setting, ...]
    relevance_weight: float = 0.7
    score_normalization: str = "zscore"
    seed: int = 0
    fit_folds: int = 2
    extra: Mapping[str, Any] = field(default_factory=dict)
    memo: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


class MethodBatch(NamedTuple):
    """What a method sees for one chunk of conversations.

    Attributes:
        rows: (B,) long, the conversations' indices in the whole evaluation.
        candidates: the query candidates (B, T, M).
        normalized: (B, T, M) float64 normalized scores.
        distances: (B, T-1, M, M) float64 graph distances, computed once per chunk.
        similarity: (B, T, M, M) within-turn passage similarity, or None when no
            method asked for it.
        alternatives: other candidate sets of the same conversations by name
            (``"history"``: history-concatenation retrieval, ``"rewrite"``: the
            resolved queries).
        state: per-method state from :attr:`MethodSpec.prepare`, by method name.
    """

    rows: Tensor
    candidates: Candidates
    normalized: Tensor
    distances: Optional[Tensor]
    similarity: Optional[Tensor]
    alternatives: Mapping[str, Candidates]
    state: Mapping[str, Any]


class MethodOutput(NamedTuple):
    """One ranking of a batch.

    Attributes:
        key: unique name in reports (e.g. ``"map-matched lambda=1 beta=0.5 full"``).
        method: the method's registry name.
        params: its parameters (JSON-friendly).
        passages: (B, T, K) long ranked passage indices, -1 padding.
    """

    key: str
    method: str
    params: Dict[str, Any]
    passages: Tensor


class MethodUnavailable(Exception):
    """Raised by :attr:`MethodSpec.prepare` when a method cannot run on these inputs (the message says why)."""


@dataclass(frozen=True)
class MethodSpec:
    """A registered method.

    Attributes:
        name: registry name (``"pointwise"``, ``"map-matched"``, ...).
        title: human-readable name for reports.
        run: ``run(batch, options) -> list of MethodOutput``.
        prepare: optional ``prepare(inputs, options) -> state`` run once before the
            batches (e.g. fitting); it raises :class:`MethodUnavailable` to skip the
            method. ``inputs`` is the runner's :class:`~mapmatched_torch.eval.inputs.EvalInputs`.
        needs_distances: the runner fills :attr:`MethodBatch.distances`.
        needs_similarity: the runner computes :attr:`MethodBatch.similarity`.
    """

    name: str
    title: str
    run: Callable[[MethodBatch, MethodOptions], List[MethodOutput]]
    prepare: Optional[Callable[[Any, MethodOptions], Any]] = None
    needs_distances: bool = False
    needs_similarity: bool = False


#: The registry of methods, by name (the runner runs them in this order).
METHODS: Dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add a method to :data:`METHODS` (``replace=True`` to override one)."""
    if not isinstance(spec, MethodSpec):
        raise MapMatchedValueError(f"register_method needs a MethodSpec, got {type(spec).__name__}")
    if spec.name in METHODS and not replace:
        raise MapMatchedValueError(f"method {spec.name!r} is already registered (pass replace=True)")
    METHODS[spec.name] = spec
    return spec


def _ranked(batch: MethodBatch, order: Tensor) -> Tensor:
    return gather_passages(batch.candidates.index, order)
