"""Optional dependencies, probed once.

Each optional package is imported at most once per process; the outcome (the module,
or the fact that it is missing) is cached, so a hot path can ask again for free. A
missing package raises :class:`~mapmatched_torch.core.errors.MissingDependencyError` (an
``ImportError``) whose message names the ``mapmatched-torch`` extra to install.

Nothing here imports an optional package at module import time.

Example:
    >>> from mapmatched_torch.core.optional import has_module, import_optional
    >>> has_module("math")
    True
    >>> import_optional("math", "none", "an example").sqrt(4.0)
    2.0
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, Optional

from .errors import FAISSNotInstalledError, MissingDependencyError

__all__ = ["has_module", "import_optional", "require_faiss", "clear_cache"]

# module name -> the module, or the ImportError its import raised.
_PROBED: Dict[str, "ModuleType | ImportError"] = {}


def _probe(module_name: str) -> "ModuleType | ImportError":
    """Import ``module_name`` once; cache and return the module or the ImportError."""
    try:
        return _PROBED[module_name]
    except KeyError:
        pass
    try:
        outcome: "ModuleType | ImportError" = importlib.import_module(module_name)
    except ImportError as exc:  # missing, or present but broken (e.g. a bad native lib)
        outcome = exc
    _PROBED[module_name] = outcome
    return outcome


def has_module(name: str) -> bool:
    """Whether the optional module ``name`` can be imported (probed once, then cached).

    Args:
        name: an importable module name, e.g. ``"faiss"``.

    Returns:
        True when ``import name`` succeeds.
    """
    return not isinstance(_probe(name), ImportError)


def import_optional(module_name: str, extra: str, feature: str = "") -> ModuleType:
    """Import an optional dependency, or fail with the extra that installs it.

    Args:
        module_name: the module to import, e.g. ``"networkx"``.
        extra: the ``mapmatched-torch`` extra that installs it, e.g. ``"networkx"``.
        feature: what needs it, for the error message.

    Returns:
        The imported module.

    Raises:
        MissingDependencyError: (an ``ImportError``) when the import fails; the
            original ImportError is chained as ``__cause__``.
    """
    outcome = _probe(module_name)
    if isinstance(outcome, ImportError):
        raise MissingDependencyError(module_name, extra, feature) from outcome
    return outcome


def require_faiss(feature: str = "FAISSProvider") -> ModuleType:
    """Return the ``faiss`` module, or raise :class:`FAISSNotInstalledError`.

    Args:
        feature: what needs faiss, for the error message.

    Raises:
        FAISSNotInstalledError: (an ``ImportError``) naming the ``[faiss]`` extra
            (``[faiss-gpu]`` for GPU indexes; the two extras exclude each other).
    """
    try:
        return import_optional("faiss", "faiss", feature)
    except MissingDependencyError as exc:
        raise FAISSNotInstalledError(feature) from exc.__cause__


def clear_cache(module_name: Optional[str] = None) -> None:
    """Forget probe results (all of them, or one module's), e.g. after an install or in tests."""
    if module_name is None:
        _PROBED.clear()
    else:
        _PROBED.pop(module_name, None)
