"""Import paths of the flat layout (before the package was grouped by part), kept working.

Until 0.1.x the package root held every module side by side (``mapmatched_torch.decode``,
``mapmatched_torch.models``, ...). Those paths still import, as aliases: importing an
old path returns the module at its new home (the *same* module object, so
``mapmatched_torch.decode is mapmatched_torch.kernels.decode`` and patching either
patches both). Only public modules are aliased; the old private ones
(``_validation``, ``_packing``, ...) are not.

Names that moved out of a package that still exists (the LangChain and LlamaIndex
adapters, once under ``providers``) are lazy attributes of that package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Dict, Optional, Sequence

__all__ = ["MOVED_MODULES", "install"]

_PACKAGE = __name__.rsplit(".", 1)[0]

#: Old module path (relative to the package) -> its new home.
MOVED_MODULES: Dict[str, str] = {
    "errors": "core.errors",
    "models": "core.models",
    "scoring": "core.scoring",
    "trace": "core.trace",
    "reporting": "core.path_reports",
    "protocols": "core.protocols",
    "semiring": "kernels.semiring",
    "chain": "kernels.chain",
    "decode": "kernels.decode",
    "batch_scoring": "kernels.normalization",
    "sampling": "fit.sampling",
    "eval.metrics": "kernels.ranking_metrics",
    "trellis": "retrieval.trellis",
    "decoder": "retrieval.torch_decoder",
    "streaming": "retrieval.streaming",
    "step_results": "serving.step_results",
    "model": "fit.model",
    "providers.langchain": "integrations.langchain",
    "providers.llamaindex": "integrations.llamaindex",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new home."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias's spec on the module: give it its own back
        module.__spec__ = self._spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED_MODULES`, and nothing else."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(_PACKAGE + "."):
            return None
        new = MOVED_MODULES.get(fullname[len(_PACKAGE) + 1 :])
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(f"{_PACKAGE}.{new}"))


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once; the package's ``__init__`` calls it)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
