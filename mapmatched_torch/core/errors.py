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
    "MapMatchedBackendError",
    "MapMatchedResourceError",
    "MissingDependencyError",
    "FAISSNotInstalledError",
    "FAISSDependencyUnavailableError",
    "GraphDependencyUnavailableError",
    "CMGBackendUnavailableError",
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


class MapMatchedBackendError(MapMatchedValueError, RuntimeError):
    """An external backend answered something invalid, or changed under the library: a
    FAISS index returned a bad label or score, or grew after its provider was built; the
    composable-model-graph decoder returned a path that does not fit the trellis.

    Both a ``ValueError`` (docs/spec.md calls an invalid store result bad input) and a
    ``RuntimeError`` (what the pure-Python ``mapmatched`` raises there, so ``except
    RuntimeError`` written against it keeps working).
    """


class MapMatchedResourceError(MapMatchedError, MemoryError):
    """Not enough memory for the operation (e.g. loading a saved server state): a resource
    failure, not a sign that the input is malformed.

    A ``MemoryError``, so ``except MemoryError`` keeps catching it; the original error
    (a ``MemoryError`` or torch's allocation failure) is chained as ``__cause__``.
    """


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure: a ``MemoryError``, torch's
    ``OutOfMemoryError`` (CUDA), or the ``RuntimeError`` of torch's CPU allocator."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        words in text for words in ("out of memory", "not enough memory", "can't allocate memory")
    )


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
    """faiss (or numpy, which FAISS searches need) is missing: install the ``[faiss]``
    (CPU) or ``[faiss-gpu]`` extra.

    Upstream ``mapmatched`` calls this error :data:`FAISSDependencyUnavailableError`;
    the two names are one class.

    Args:
        feature: what needed it, for the message.
        extra: the extra to name first (``"faiss"`` or ``"faiss-gpu"``).
        package: the module that failed to import (``"faiss"``, or ``"numpy"`` when a
            search could not load it).
    """

    def __init__(self, feature: str = "FAISSProvider", extra: str = "faiss", package: str = "faiss") -> None:
        super().__init__(
            package,
            extra,
            feature,
            hint="or `[faiss-gpu]` for GPU indexes; the two extras overwrite each other, so install only one",
        )


#: Upstream ``mapmatched``'s name (``mapmatched.adapters.faiss``) for
#: :class:`FAISSNotInstalledError`: the same class, so ``except`` clauses written with
#: either name catch it.
FAISSDependencyUnavailableError = FAISSNotInstalledError


class GraphDependencyUnavailableError(MissingDependencyError):
    """A graph builder's optional dependency is missing: install the ``[graph]`` extra.

    Upstream ``mapmatched``'s ``KNNGraph.from_embeddings`` needs numpy and raises this
    when it is missing. Ours is pure Python and never needs numpy, so the library never
    raises it; the class exists so that code catching it keeps importing and working.

    Args:
        feature: what needed it, for the message.
        package: the module that failed to import.
    """

    def __init__(self, feature: str = "KNNGraph", package: str = "numpy") -> None:
        super().__init__(package, "graph", feature)


#: How to install composable-model-graph, which is not on PyPI.
CMG_INSTALL = "pip install 'composable-model-graph @ git+https://github.com/operatorstack/composable-model-graph#subdirectory=python'"


class CMGBackendUnavailableError(MissingDependencyError):
    """:class:`~mapmatched_torch.standalone.cmg.CMGDecoder` could not import a
    compatible ``composable_model_graph`` (one exporting ``CandidateState``,
    ``decode_path`` and ``decode_path_fixed_lag``).

    The message starts with upstream ``mapmatched``'s text and says how to install the
    package, which is not on PyPI and which no extra installs.

    Args:
        feature: what needed it, for the message.
    """

    def __init__(self, feature: str = "CMGDecoder") -> None:
        ImportError.__init__(
            self,
            f"{feature} requires a compatible composable-model-graph installation; no unstable Git dependency "
            f"is installed by mapmatched_torch: install it yourself with `{CMG_INSTALL}` "
            "(it must export CandidateState, decode_path and decode_path_fixed_lag), or decode with StandaloneDecoder",
        )
        self.package = "composable_model_graph"
        self.extra = None


class NetworkXNotInstalledError(MissingDependencyError):
    """networkx is missing: install the ``[networkx]`` extra."""

    def __init__(self, feature: str = "networkx interop") -> None:
        super().__init__("networkx", "networkx", feature)
