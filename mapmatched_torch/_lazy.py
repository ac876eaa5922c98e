"""Names of a package imported on first access (PEP 562), so importing it stays cheap."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, MutableMapping

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, names: Dict[str, str], namespace: MutableMapping[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each of ``names`` when first read.

    Args:
        package: the ``__name__`` of the package whose attributes these are.
        names: attribute -> the module that defines it, relative to ``package``
            (``".kernels.decode"``, ``"..integrations.langchain"``).
        namespace: the package's ``globals()``: a name read once is stored there, so
            later reads skip this hook.

    Returns:
        The ``__getattr__`` to assign in the package; an unknown name is an
        ``AttributeError`` as usual.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    return __getattr__
