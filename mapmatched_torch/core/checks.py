"""Argument checks shared by every public entry point (docs/spec.md section 8).

Each check raises :class:`~mapmatched_torch.core.errors.MapMatchedValueError` (a
``ValueError``) with the offending name and value in the message, and returns the
value normalized to its Python type.
"""

from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Iterable, Optional, TypeVar

from .errors import MapMatchedTypeError, MapMatchedValueError

__all__ = [
    "broadcast_shape",
    "check_choice",
    "check_chunk_id",
    "check_finite",
    "check_weight",
    "check_positive_int",
    "check_nonnegative_int",
    "check_optional_lag",
    "check_radius",
    "check_trellis",
    "check_turn",
    "check_decode_options",
    "empty_turn_error",
    "duplicate_ids_error",
    "check_positive_finite",
    "check_not_a_string",
    "check_sequence",
    "describe",
]

_Choice = TypeVar("_Choice")


def broadcast_shape(*shapes: Iterable[int]) -> tuple:
    """The broadcast of ``shapes`` (numpy's rule), as ``torch.broadcast_shapes`` gives it,
    without its first-call cost: torch's version imports its symbolic-shape machinery
    (sympy) on first use, about half a second, which a server's first step must not pay.

    Raises:
        MapMatchedValueError: shapes that do not broadcast.
    """
    shapes = [tuple(int(size) for size in shape) for shape in shapes]
    rank = max((len(shape) for shape in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for axis, size in enumerate(shape, start=rank - len(shape)):
            if size != 1:
                if out[axis] not in (1, size):
                    raise MapMatchedValueError(f"shapes {', '.join(str(s) for s in shapes)} do not broadcast")
                out[axis] = size
    return tuple(out)


def check_choice(name: str, value: Any, choices: Iterable[_Choice]) -> _Choice:
    """``value`` must equal one of ``choices`` (an option naming a mode, engine, metric ...).

    The one message of every such check: ``unsupported {name}: {value} (expected one
    of 'a', 'b')`` (a plain word unquoted, as mapmatched 0.1.0 words it; anything else
    as its repr), plus ``; did you mean 'a'?`` when a string value is close to a
    string choice (a typo). A value matches a choice only when it is an instance of the
    choice's type (so ``1`` is not ``"1"``, and ``True`` is not ``1``).

    Args:
        name: what the option is, as the message should call it, e.g. ``"metric"`` or
            ``"Chroma space of collection 'docs'"``.
        value: the caller's value (any object; unhashable ones are fine).
        choices: the accepted values, in the order the message lists them.

    Returns:
        The matching choice.

    Raises:
        MapMatchedValueError: (a ``ValueError``) ``value`` is not one of ``choices``.
    """
    choices = tuple(choices)
    for choice in choices:
        if (
            isinstance(value, type(choice))
            and (isinstance(choice, bool) or not isinstance(value, bool))
            and value == choice
        ):
            return choice
    hint = ""
    if isinstance(value, str):
        words = [choice for choice in choices if isinstance(choice, str)]
        close = difflib.get_close_matches(value, words, n=1) or [
            word for word in words if word.lower() == value.lower()
        ]
        if close:
            hint = f"; did you mean {close[0]!r}?"
    expected = ", ".join(map(repr, choices))
    # a plain word is shown as upstream mapmatched shows it ("unsupported score
    # normalization: minmax"), so code matching upstream's message still matches
    plain = isinstance(value, str) and value and value.isprintable() and value.strip() == value
    shown = value if plain and all(isinstance(choice, str) for choice in choices) else repr(value)
    raise MapMatchedValueError(f"unsupported {name}: {shown} (expected one of {expected}{hint})")


def check_chunk_id(value: Any, what: str = "chunk ID") -> str:
    """A chunk ID must be a non-empty ``str``."""
    if not isinstance(value, str):
        raise MapMatchedValueError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise MapMatchedValueError(f"{what} must be non-empty")
    return value


def check_finite(value: Any, what: str) -> float:
    """A real, finite number (bools are rejected); returned as ``float``."""
    if type(value) is float:  # the common case, without the slow ABC check below
        if math.isfinite(value):
            return value
        raise MapMatchedValueError(f"{what} must be finite, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MapMatchedValueError(f"{what} must be a finite number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise MapMatchedValueError(f"{what} must be finite, got {value!r}")
    return value


def check_weight(value: Any, name: str) -> float:
    """A finite number >= 0 (``emission_weight``, ``transition_weight``, ``context_radius``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MapMatchedValueError(f"{name} must be finite and nonnegative, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise MapMatchedValueError(f"{name} must be finite and nonnegative, got {value!r}")
    return value


def _check_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MapMatchedValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def check_positive_int(value: Any, name: str) -> int:
    """An ``int`` > 0 (bools rejected); the message is mapmatched 0.1.0's wording
    (``"{name} must be greater than zero"``) followed by the value."""
    value = _check_int(value, name)
    if value <= 0:
        raise MapMatchedValueError(f"{name} must be greater than zero, got {value}")
    return value


def check_nonnegative_int(value: Any, name: str) -> int:
    """An ``int`` >= 0 (bools rejected)."""
    value = _check_int(value, name)
    if value < 0:
        raise MapMatchedValueError(f"{name} must be nonnegative, got {value}")
    return value


def check_optional_lag(value: Optional[Any]) -> Optional[int]:
    """``fixed_lag``: None (full decoding) or an ``int`` >= 0."""
    if value is None:
        return None
    return check_nonnegative_int(value, "fixed_lag")


def check_radius(value: Any, name: str = "radius") -> float:
    """A search radius: a number >= 0 (``inf`` allowed, NaN and negatives rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MapMatchedValueError(f"{name} must be a nonnegative number, got {value!r}")
    value = float(value)
    if math.isnan(value) or value < 0.0:
        raise MapMatchedValueError(f"{name} must be a nonnegative number, got {value!r}")
    return value


def check_trellis(trellis: Any) -> tuple:
    """Validate a Python trellis (docs/spec.md section 5) and return it as a tuple of tuples.

    A trellis is a non-empty sequence of turns; each turn a non-empty sequence of
    candidates with ``chunk_id`` (non-empty str, unique within the turn),
    ``raw_score`` and ``normalized_score`` (finite). Raises ValueError before any work
    (:class:`~mapmatched_torch.core.errors.MapMatchedTypeError`, also a TypeError, for
    a trellis, turn or candidate of the wrong type).
    """
    turns = check_sequence(trellis, "trellis", "a sequence of turns (each a sequence of DecoderCandidate)")
    if not turns:
        raise MapMatchedValueError("trellis must contain at least one turn")
    return tuple(check_turn(turn, turn_index) for turn_index, turn in enumerate(turns))


def empty_turn_error(turn_index: int) -> MapMatchedValueError:
    """SPEC's error for a turn without candidates (raised by every path that checks one)."""
    return MapMatchedValueError(f"trellis turn {turn_index} must contain candidates")


def duplicate_ids_error(where: str, chunk_id: str) -> MapMatchedValueError:
    """The error for a turn listing ``chunk_id`` twice (``where``: e.g. "trellis turn 3")."""
    return MapMatchedValueError(f"{where} contains duplicate chunk IDs ({chunk_id!r})")


def check_turn(turn: Any, turn_index: int) -> tuple:
    """Validate one trellis turn (see :func:`check_trellis`); ``turn_index`` names it."""
    turn = check_sequence(turn, f"trellis turn {turn_index}", "a sequence of DecoderCandidate")
    if not turn:
        raise empty_turn_error(turn_index)
    seen = set()
    for candidate_index, candidate in enumerate(turn):
        chunk_id = getattr(candidate, "chunk_id", _MISSING)
        if chunk_id is _MISSING:
            raise _not_a_decoder_candidate(candidate, turn_index, candidate_index)
        check_chunk_id(chunk_id, f"trellis turn {turn_index} candidate {candidate_index} chunk ID")
        if chunk_id in seen:
            raise duplicate_ids_error(f"trellis turn {turn_index}", chunk_id)
        seen.add(chunk_id)
        for name in ("raw_score", "normalized_score"):
            value = getattr(candidate, name, _MISSING)
            if value is _MISSING:
                raise _not_a_decoder_candidate(candidate, turn_index, candidate_index)
            check_finite(value, f"trellis turn {turn_index} candidate {chunk_id!r} {name}")
    return turn


_MISSING = object()


def _not_a_decoder_candidate(candidate: Any, turn_index: int, candidate_index: int) -> MapMatchedTypeError:
    """The error for a trellis entry without ``chunk_id``, ``raw_score`` and ``normalized_score``."""
    where = f"trellis turn {turn_index} candidate {candidate_index}"
    if hasattr(candidate, "chunk_id") and hasattr(candidate, "score"):  # a provider's ScoredCandidate
        return MapMatchedTypeError(
            f"{where} is a {type(candidate).__name__} (chunk_id, score), but a trellis holds normalized "
            "DecoderCandidate (chunk_id, raw_score, normalized_score): convert each turn with "
            "normalize_candidates(turn, score_normalization) first, or hand raw candidates to "
            "MapMatchedSession.retrieve_candidates / MapMatchedServer.step, which normalize them"
        )
    return MapMatchedTypeError(
        f"{where} must be a DecoderCandidate (chunk_id, raw_score, normalized_score), got {describe(candidate)}"
    )


def check_decode_options(emission_weight: Any, transition_weight: Any, fixed_lag: Any) -> tuple:
    """Validate the decoder options; returns ``(lambda, beta, lag)`` normalized."""
    return (
        check_weight(emission_weight, "emission_weight"),
        check_weight(transition_weight, "transition_weight"),
        check_optional_lag(fixed_lag),
    )


def check_positive_finite(value: Any, what: str) -> float:
    """A real number that is finite and > 0 (bools rejected); returned as ``float``.

    The message is mapmatched 0.1.0's wording (``"{what} must be finite and greater than
    zero"``) followed by the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MapMatchedValueError(f"{what} must be finite and greater than zero, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number > 0.0):
        raise MapMatchedValueError(f"{what} must be finite and greater than zero, got {number!r}")
    return number


def describe(value: Any, width: int = 60) -> str:
    """``value`` for an error message: its type and a ``repr`` cut at ``width`` characters
    (``"None"``, ``"int 42"``, ``"str 'a'"``)."""
    text = repr(value)
    if len(text) > width:
        text = text[: width - 3] + "..."
    return text if value is None else f"{type(value).__name__} {text}"


def check_sequence(values: Any, what: str, expected: str) -> tuple:
    """A non-string iterable argument (list, tuple, generator ...), returned as a tuple.

    Args:
        values: the caller's value.
        what: what it is, for the message (e.g. ``"trellis turn 3"``).
        expected: what it should be (e.g. ``"a sequence of DecoderCandidate"``).

    Returns:
        ``tuple(values)``.

    Raises:
        MapMatchedTypeError: (a ValueError and a TypeError) ``values`` is a ``str`` or
            ``bytes`` (it would split into characters) or is not iterable (None, a
            number): ``"{what} must be {expected}, got {describe(values)}"``.
    """
    if type(values) is tuple:  # the common case
        return values
    if isinstance(values, (str, bytes)):
        raise MapMatchedTypeError(f"{what} must be {expected}, got {describe(values)}")
    try:
        iterator = iter(values)
    except TypeError:
        raise MapMatchedTypeError(f"{what} must be {expected}, got {describe(values)}") from None
    return tuple(iterator)


def check_not_a_string(values: Any, name: str) -> Any:
    """Reject a bare string where an iterable of items is expected (it would split into characters)."""
    if isinstance(values, (str, bytes)):
        raise MapMatchedValueError(f"{name} must be an iterable, not a string: {values!r}")
    return values
