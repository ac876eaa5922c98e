"""Exception types of mapmatched_torch.

Every error the library raises on purpose derives from :class:`MapMatchedError` *and*
from the builtin type the behaviour spec names (``ValueError`` for bad input,
``RuntimeError`` for broken invariants, ``ImportError`` for missing extras), so code
written for the pure-Python ``mapmatched`` keeps catching what it caught before.
"""

from __future__ import annotations

__all__ = [
    "MapMatchedError",
    "MapMatchedValueError",
    "MapMatchedTypeError",
    "MapMatchedRuntimeError",
    "MissingDependencyError",
    "FAISSNotInstalledError",
    "NetworkXNotInstalledError",
]


class MapMatchedError(Exception):
    """Base class of every exception raised by mapmatched_torch."""


class MapMatchedValueError(MapMatchedError, ValueError):
    """Invalid input: bad shapes, non-finite scores, bad options, unknown enum values."""


class MapMatchedTypeError(MapMatchedValueError, TypeError):
    """Invalid input of the wrong type: None, a number or a string where a candidate, a
    list of candidates, a trellis or a mapping belongs.

    Both a ``ValueError`` (the spec's class for bad input, so ``except ValueError`` keeps
    working) and a ``TypeError`` (what Python raised there before, so ``except
    TypeError`` keeps working too).
    """


class MapMatchedRuntimeError(MapMatchedError, RuntimeError):
    """A broken invariant at run time (e.g. a decoder revised a committed turn)."""


class MissingDependencyError(MapMatchedError, ImportError):
    """An optional dependency is missing; the message names the pip extra to install,
    quoted for every shell (zsh expands unquoted brackets), from PyPI and from a clone.

    Args:
        package: the importable package that is missing (e.g. ``"faiss"``).
        extra: the extra of ``mapmatched-torch`` that installs it (e.g. ``"faiss"``).
        feature: what needed it, for the message.
        hint: an optional remark appended to the message.
    """

    def __init__(self, package: str, extra: str, feature: str = "", hint: str = "") -> None:
        what = f" for {feature}" if feature else ""
        more = f" ({hint})" if hint else ""
        super().__init__(
            f"{package} is required{what}; install it with `pip install 'mapmatched-torch[{extra}]'`, "
            f"or from a clone of the repository with `pip install -e '.[{extra}]'`{more}"
        )
        self.package = package
        self.extra = extra


class FAISSNotInstalledError(MissingDependencyError):
    """faiss is missing: install the ``[faiss]`` (CPU) or ``[faiss-gpu]`` extra."""

    def __init__(self, feature: str = "FAISSProvider", extra: str = "faiss") -> None:
        super().__init__(
            "faiss",
            extra,
            feature,
            hint="or `[faiss-gpu]` for GPU indexes; the two extras overwrite each other, so install only one",
        )


class NetworkXNotInstalledError(MissingDependencyError):
    """networkx is missing: install the ``[networkx]`` extra."""

    def __init__(self, feature: str = "networkx interop") -> None:
        super().__init__("networkx", "networkx", feature)
