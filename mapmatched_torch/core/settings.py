"""The decoding settings: lambda, beta, the lag and the normalization, as one value.

:class:`DecodeSettings` is validated once, where a user hands the options in
(``MapMatchedRetriever``, ``MapMatchedServer``, a decoder's keywords, an evaluation
grid), and is then passed down whole: the retriever, its sessions, the server, its
session store and slot decoder, the decoders, fitting and evaluation hold one.

:class:`DecodingMode` is the one choice "beta = 0 -> pointwise, a lag -> fixed lag, else
full Viterbi" (:attr:`DecodeSettings.mode`; the tensor-side
:func:`~mapmatched_torch.kernels.transitions.decoding_mode` makes the same choice for a
tensor beta or a learned transition model).

Plain Python: no torch here.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Dict, Optional

from .checks import check_decode_options
from .errors import MapMatchedValueError
from .scoring import check_score_normalization

__all__ = ["DecodeSettings", "DecodingMode"]


class DecodingMode(enum.Enum):
    """Which decoder a (beta, lag) setting runs (:attr:`DecodeSettings.mode`).

    - ``POINTWISE``: beta = 0, every transition is 0: each turn's first best candidate
      (:func:`~mapmatched_torch.kernels.decode.pointwise_decode`, as the reference does;
      the max-plus recursion could see rounding ties the emissions do not have).
    - ``VITERBI``: full decoding (:func:`~mapmatched_torch.kernels.decode.viterbi`).
    - ``FIXED_LAG``: fixed-lag decoding
      (:func:`~mapmatched_torch.kernels.decode.fixed_lag_viterbi`).
    """

    POINTWISE = "pointwise"
    VITERBI = "viterbi"
    FIXED_LAG = "fixed_lag"

    @property
    def uses_distances(self) -> bool:
        """Whether this mode reads the distances (not in ``POINTWISE``: the graph need
        not be asked)."""
        return self is not DecodingMode.POINTWISE

    @classmethod
    def choose(cls, transitions_are_zero: bool, fixed_lag: Optional[int]) -> "DecodingMode":
        """``POINTWISE`` when every transition is zero (the lag then only decides which
        turns count as committed), else ``VITERBI`` without a lag and ``FIXED_LAG`` with one."""
        if transitions_are_zero:
            return cls.POINTWISE
        return cls.VITERBI if fixed_lag is None else cls.FIXED_LAG


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeSettings:
    """How to decode: lambda, beta, the lag and the per-turn score normalization.

    Validated once, on construction, with the messages of docs/spec.md section 8 (in
    this order: ``emission_weight``, ``transition_weight``, ``fixed_lag``, then
    ``score_normalization``); the values are stored normalized (weights as ``float``,
    the lag as ``int``). Frozen, so it can be shared, compared and hashed (a grid of
    settings is a set of them).

    Args:
        emission_weight: lambda, finite and >= 0 (default 1.0).
        transition_weight: beta, finite and >= 0 (default 1.0); 0 decodes pointwise.
        fixed_lag: None (full decoding, every turn may be revised) or L >= 0.
        score_normalization: ``"zscore"`` (default), ``"center"`` or ``"none"``.

    The transition model is the fixed one of docs/spec.md section 1, ``-beta * d``;
    a learned model (:class:`~mapmatched_torch.kernels.transitions.GatedTransitions`)
    is a module with parameters and lives with its owner (``MapMatchedModel``).

    Raises:
        MapMatchedValueError: (a ``ValueError``) an option out of range, e.g.
            ``"transition_weight must be finite and nonnegative, got -1.0"``.

    Examples:
        >>> settings = DecodeSettings(transition_weight=0.5, fixed_lag=2)
        >>> settings
        DecodeSettings(emission_weight=1.0, transition_weight=0.5, fixed_lag=2, score_normalization='zscore')
        >>> settings.mode
        <DecodingMode.FIXED_LAG: 'fixed_lag'>
        >>> DecodeSettings(transition_weight=0).mode.uses_distances
        False
        >>> settings.transition_cost(3.0)
        1.5
        >>> DecodeSettings(emission_weight=-1)
        Traceback (most recent call last):
        ...
        mapmatched_torch.core.errors.MapMatchedValueError: emission_weight must be finite and nonnegative, got -1.0
    """

    emission_weight: float = 1.0
    transition_weight: float = 1.0
    fixed_lag: Optional[int] = None
    score_normalization: str = "zscore"

    def __post_init__(self) -> None:
        lam, beta, lag = check_decode_options(self.emission_weight, self.transition_weight, self.fixed_lag)
        method = check_score_normalization(self.score_normalization)
        object.__setattr__(self, "emission_weight", lam)
        object.__setattr__(self, "transition_weight", beta)
        object.__setattr__(self, "fixed_lag", lag)
        object.__setattr__(self, "score_normalization", method)

    @classmethod
    def resolve(cls, settings: Optional["DecodeSettings"] = None, **options: Any) -> "DecodeSettings":
        """The settings of an entry point that takes either ``settings=`` or the loose
        keyword options (``emission_weight=``, ``transition_weight=``, ``fixed_lag=``,
        ``score_normalization=``, with this class's defaults).

        Args:
            settings: a :class:`DecodeSettings`, or None to build one from ``options``.
            options: the entry point's loose keyword options, as the caller passed them.

        Returns:
            ``settings`` itself, or ``DecodeSettings(**options)`` (validated).

        Raises:
            MapMatchedValueError: ``settings`` is not a :class:`DecodeSettings`, or it is
                given together with a loose option that differs from its default (which
                of the two should win is not clear).
        """
        if settings is None:
            return cls(**options)
        if not isinstance(settings, DecodeSettings):
            raise MapMatchedValueError(f"settings must be a DecodeSettings, got {type(settings).__name__}")
        defaults = {field.name: field.default for field in dataclasses.fields(cls)}
        given = sorted(name for name, value in options.items() if value is not defaults[name] and value != defaults[name])
        if given:
            raise MapMatchedValueError(
                f"pass either settings= or {', '.join(given)}=, not both (settings already holds them)"
            )
        return settings

    @property
    def mode(self) -> DecodingMode:
        """The :class:`DecodingMode` these settings run: ``POINTWISE`` when beta == 0,
        ``FIXED_LAG`` with a lag, else ``VITERBI``."""
        return DecodingMode.choose(self.transition_weight == 0.0, self.fixed_lag)

    @property
    def decoder_options(self) -> Dict[str, Any]:
        """``{"emission_weight", "transition_weight", "fixed_lag"}``: the keywords of the
        ``Decoder`` protocol (upstream mapmatched's ``decode(trellis, graph, ...)``)."""
        return {
            "emission_weight": self.emission_weight,
            "transition_weight": self.transition_weight,
            "fixed_lag": self.fixed_lag,
        }

    def transition_cost(self, distance: Any) -> Any:
        """The weighted transition cost ``beta * distance`` (docs/spec.md section 5's
        ``weighted_transition_cost``) of a float, or of a tensor of distances.

        The one product of beta and a distance in plain Python (the reference decoder,
        the reported paths) and in the reports of the tensor paths; the decoders' moves
        are its negation, made by
        :func:`~mapmatched_torch.kernels.transitions.weighted_transitions` bit for bit.
        """
        return self.transition_weight * distance


class HoldsSettings:
    """The options of a held :class:`DecodeSettings` (``self.settings``) as read-only
    attributes: what the retriever, the slot decoder and the server expose, so that
    ``retriever.transition_weight`` keeps working and the value lives in one place."""

    settings: DecodeSettings

    @property
    def emission_weight(self) -> float:
        """lambda (of :attr:`settings`)."""
        return self.settings.emission_weight

    @property
    def transition_weight(self) -> float:
        """beta (of :attr:`settings`)."""
        return self.settings.transition_weight

    @property
    def fixed_lag(self) -> Optional[int]:
        """None (full decoding) or the lag L >= 0 (of :attr:`settings`)."""
        return self.settings.fixed_lag

    @property
    def score_normalization(self) -> str:
        """``"zscore"``, ``"center"`` or ``"none"`` (of :attr:`settings`)."""
        return self.settings.score_normalization
