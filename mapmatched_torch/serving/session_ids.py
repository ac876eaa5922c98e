"""Session IDs of a server: what may be one, its key, and how it is saved.

A session ID is any hashable value the caller chooses (a string, an int, a UUID, a
numpy integer from pandas, a tuple of those); :func:`session_key` checks it and
normalizes numpy integers to ``int`` (so ``np.int64(3)`` and ``3`` are one session),
:func:`plain_id` / :func:`restored_id` write it to a saved state and read it back.
"""

from __future__ import annotations

import numbers
from typing import Any, Hashable

from ..core.checks import describe
from ..core.errors import MapMatchedTypeError

__all__ = ["SessionId", "session_key", "session_id_error", "plain_id", "restored_id"]

SessionId = Hashable

_SESSION_ID_TYPES = ("a str, an int (numpy integers are taken as ints), a float, None, or a tuple of them (what a "
                     "saved server state restores with torch.load(weights_only=True))")


def session_id_error(session_id: Any, part: Any, unhashable: bool = False) -> MapMatchedTypeError:
    """The MapMatchedTypeError of a refused session ID (``part``: the refused piece of it)."""
    inside = "" if part is session_id else f" inside {describe(session_id)}"
    why = ", which is unhashable" if unhashable else ""
    return MapMatchedTypeError(f"a session ID must be {_SESSION_ID_TYPES}; got {describe(part)}{inside}{why}")


def session_key(session_id: Any, whole: Any = None) -> SessionId:
    """``session_id`` as the server keeps it: numpy (and other ``numbers.Integral``)
    integers as ``int``, so ``np.int64(3)`` opens session ``3``; else it must be a str, an
    int, a float, None or a (nested) tuple of them: what ``torch.load(...,
    weights_only=True)`` restores. Anything else is a MapMatchedTypeError (a ValueError
    and a TypeError) naming what is accepted and what was given."""
    whole = session_id if whole is None else whole
    if isinstance(session_id, tuple):
        return tuple(session_key(part, whole) for part in session_id)
    if session_id is None or isinstance(session_id, (str, int, float)):
        return session_id
    if isinstance(session_id, numbers.Integral):
        return int(session_id)
    try:
        hash(session_id)
    except TypeError:
        raise session_id_error(whole, session_id, unhashable=True) from None
    raise session_id_error(whole, session_id)


def plain_id(session_id: SessionId) -> Any:
    """A session ID as saved: tuples as lists."""
    return [plain_id(part) for part in session_id] if isinstance(session_id, tuple) else session_id


def restored_id(saved: Any) -> SessionId:
    """:func:`plain_id` undone."""
    return tuple(restored_id(part) for part in saved) if isinstance(saved, list) else saved


#: Row failures that :func:`_raise_row_error` words from the whole row (step_indexed).
