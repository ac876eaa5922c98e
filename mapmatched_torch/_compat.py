"""Upstream ``mapmatched``'s module paths, answered only once asked for.

Code written for the pure-Python ``mapmatched`` runs on this package through
:func:`install_mapmatched_alias`, which makes ``import mapmatched`` give a view of
``mapmatched_torch`` whose submodules are upstream's: ``mapmatched.decoder``, ``.graph``,
``.knn``, ``.retrieval``, ``.adapters`` and ``.adapters.faiss`` hold upstream's names
(:data:`UPSTREAM_VIEWS`: the same objects as ours, re-exported), ``mapmatched.cmg``,
``.models``, ``.scoring`` and ``.trace`` are our modules themselves
(:data:`UPSTREAM_PATHS`), and any other ``mapmatched.X`` is ``mapmatched_torch.X``. No
module file is loaded twice.

Nothing here runs when the package is imported: ``import mapmatched_torch`` leaves
``sys.meta_path`` and ``sys.modules["mapmatched"]`` alone, and the finder that answers
``mapmatched.<path>`` is put on ``sys.meta_path`` by :func:`install_mapmatched_alias`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any, Dict, Optional, Sequence

__all__ = ["UPSTREAM", "UPSTREAM_MODULES", "UPSTREAM_PATHS", "UPSTREAM_VIEWS", "install_mapmatched_alias", "is_upstream_view"]

_PACKAGE = __name__.rsplit(".", 1)[0]

#: The name of upstream's package, which :func:`install_mapmatched_alias` maps onto ours.
UPSTREAM = "mapmatched"

#: Upstream module path (relative to ``mapmatched``) -> upstream's names in it -> the
#: module of ours that defines each (relative to this package). The view modules hold
#: these names (the same objects as ours) and nothing else, plus ``importlib`` for code
#: that patches it through the module. They exist only as ``mapmatched.<path>``; a
#: path listed neither here nor in :data:`UPSTREAM_PATHS` is ``mapmatched_torch.<path>``
#: (see :func:`_target`).
UPSTREAM_VIEWS: Dict[str, Dict[str, str]] = {
    "decoder": {"Decoder": "core.protocols", "Trellis": "core.protocols", "StandaloneDecoder": "standalone.decoder"},
    "graph": {"CorpusGraph": "core.protocols", "GraphEdge": "core.graph_types", "InMemoryCorpusGraph": "standalone.graph"},
    "knn": {"KNNGraph": "standalone.knn", "GraphDependencyUnavailableError": "core.errors"},
    "retrieval": {
        "CandidateProvider": "core.protocols",
        "MapMatchedRetriever": "retrieval.session",
        "MapMatchedSession": "retrieval.session",
    },
    **{
        path: {
            name: "providers.faiss"
            for name in ("FAISSDependencyUnavailableError", "FAISSIndex", "FAISSProvider", "FAISSScoreMode", "QueryEmbedder")
        }
        for path in ("adapters", "adapters.faiss")
    },
}

#: View modules that are packages (they have submodules).
_VIEW_PACKAGES = ("adapters",)

#: Upstream module path (relative to ``mapmatched``) -> the module of ours it is (the
#: same object), where the two paths differ.
UPSTREAM_PATHS: Dict[str, str] = {
    "cmg": "standalone.cmg",
    "models": "core.models",
    "scoring": "core.scoring",
    "trace": "core.trace",
}

#: Upstream's top-level modules: attributes of the ``mapmatched`` view package.
UPSTREAM_MODULES = ("adapters", "cmg", "decoder", "eval", "graph", "knn", "models", "retrieval", "scoring", "trace")


def _load_scipy_sparse() -> None:
    """Upstream's ``mapmatched.knn`` switches to SciPy when this returns its modules; our
    KNNGraph is pure Python (docs/spec.md section 4) and never uses SciPy, so the view
    keeps the hook, for code that patches it, and it returns None."""
    return None


#: Extra attributes of a view module, beside its names.
_VIEW_EXTRAS: Dict[str, Dict[str, Any]] = {"knn": {"_load_scipy_sparse": _load_scipy_sparse}}


class _AliasLoader(importlib.abc.Loader):
    """Loads ``mapmatched.<path>`` as the module of ours it names."""

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


def is_upstream_view(value: Any) -> bool:
    """Whether ``value`` is one of the view modules of :data:`UPSTREAM_VIEWS`."""
    return isinstance(value, ModuleType) and getattr(value, "__mapmatched_view__", False) is True


class _ViewLoader(importlib.abc.Loader):
    """Builds the view module of one :data:`UPSTREAM_VIEWS` path."""

    def __init__(self, path: str) -> None:
        self._path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a plain new module

    def exec_module(self, module: ModuleType) -> None:
        names = UPSTREAM_VIEWS[self._path]
        module.__doc__ = f"Upstream mapmatched's ``{UPSTREAM}.{self._path}``: its names, from mapmatched_torch."
        for name, home in names.items():
            setattr(module, name, getattr(importlib.import_module(f"{_PACKAGE}.{home}"), name))
        for name, value in _VIEW_EXTRAS.get(self._path, {}).items():
            setattr(module, name, value)
        module.importlib = importlib
        module.__all__ = list(names)
        module.__mapmatched_view__ = True


def _view_spec(fullname: str, relative: str) -> importlib.machinery.ModuleSpec:
    return importlib.machinery.ModuleSpec(fullname, _ViewLoader(relative), is_package=relative in _VIEW_PACKAGES)


def _aliased() -> bool:
    """Whether ``sys.modules[UPSTREAM]`` is the view :func:`install_mapmatched_alias` made."""
    return isinstance(sys.modules.get(UPSTREAM), _UpstreamPackage)


def _target(path: str) -> Optional[str]:
    """The module of ours that ``mapmatched.<path>`` is when it is not a view, if any."""
    name = f"{_PACKAGE}.{UPSTREAM_PATHS.get(path, path)}"
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # its parent is no package, or is missing
        return None
    return name if found is not None else None


class _UpstreamFinder(importlib.abc.MetaPathFinder):
    """Finds ``mapmatched.<path>`` while ``mapmatched`` is the alias: a view of
    :data:`UPSTREAM_VIEWS`, else our module of that path (the same object)."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(UPSTREAM + ".") or not _aliased():
            return None
        relative = fullname[len(UPSTREAM) + 1 :]
        if relative in UPSTREAM_VIEWS:
            return _view_spec(fullname, relative)
        target_name = _target(relative)
        if target_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(target_name))


class _UpstreamPackage(ModuleType):
    """``mapmatched`` as :func:`install_mapmatched_alias` installs it: every name of
    ``mapmatched_torch``, and upstream's submodules as attributes (``mapmatched.graph``
    is the view, ``mapmatched_torch.graph`` stays ours)."""

    def __getattr__(self, name: str) -> Any:
        if name in UPSTREAM_MODULES:
            return importlib.import_module(f"{UPSTREAM}.{name}")
        return getattr(sys.modules[_PACKAGE], name)

    def __dir__(self) -> list:
        return sorted(set(dir(sys.modules[_PACKAGE])) | set(UPSTREAM_MODULES))


def _install_finder() -> None:
    """Put the ``mapmatched`` finder first on ``sys.meta_path`` (once), before the path
    finder would load a second copy of a module file under the ``mapmatched.`` name."""
    if not any(isinstance(finder, _UpstreamFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _UpstreamFinder())


def install_mapmatched_alias() -> ModuleType:
    """Make ``import mapmatched`` (upstream's pure-Python package) give this package,
    so code written for ``mapmatched`` 0.1.0 runs on mapmatched_torch unchanged.

    Installs ``sys.modules["mapmatched"]``: a view with every name of
    ``mapmatched_torch`` whose submodules are upstream's (``mapmatched.decoder``,
    ``.graph``, ``.knn``, ``.cmg``, ``.models``, ``.scoring``, ``.trace``,
    ``.retrieval``, ``.adapters``, ``.adapters.faiss``; see the module docstring), and
    the finder that answers those paths. Importing ``mapmatched_torch`` does neither:
    this call is the only way in (setting ``sys.modules["mapmatched"]`` by hand is not
    supported). Calling it again is a no-op.

    Returns:
        The ``mapmatched`` module.

    Raises:
        ImportError: another ``mapmatched`` (upstream's own package) is already
            imported in this process; the alias would hide it.

    Example:
        >>> import sys
        >>> import mapmatched_torch
        >>> mapmatched = mapmatched_torch.install_mapmatched_alias()
        >>> from mapmatched.graph import InMemoryCorpusGraph
        >>> InMemoryCorpusGraph is mapmatched_torch.InMemoryCorpusGraph
        True
        >>> del sys.modules["mapmatched"], sys.modules["mapmatched.graph"]  # undone, for this example only
    """
    current = sys.modules.get(UPSTREAM)
    if current is not None:
        if _aliased():
            return current
        raise ImportError(
            f"another {UPSTREAM!r} module ({getattr(current, '__file__', current)!r}) is already imported; "
            f"install_mapmatched_alias() would hide it: call it before anything imports {UPSTREAM}, "
            f"or uninstall the pure-Python package"
        )
    ours = sys.modules[_PACKAGE]
    package = _UpstreamPackage(UPSTREAM, ours.__doc__)
    package.__path__ = []  # a package: its submodules come from the finder above
    package.__all__ = list(ours.__all__)
    package.__version__ = ours.__version__
    _install_finder()
    sys.modules[UPSTREAM] = package
    return package
