"""The package layout holds: parts import only the parts before them (lazy imports
included), no two modules import each other (directly or through others, lazy imports
included), no private name crosses a part, the plain-Python parts stay free of torch,
and importing the package has no side effects."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

import mapmatched_torch

PACKAGE_DIR = Path(mapmatched_torch.__file__).resolve().parent
PACKAGE = "mapmatched_torch"

#: Each part imports only from parts of a lower or equal rank (docs/design.md, "Layout").
RANKS = {
    "_compat": 0,  # package plumbing (the upstream alias, lazy attributes): they import
    "_lazy": 0,  # nothing of the package at load time, and every part may use them
    "_version": 0,
    "core": 1,
    "standalone": 2,
    "kernels": 3,
    "testing": 3,  # test helpers on tensors, beside the kernels
    "graph": 4,
    "providers": 5,
    "retrieval": 6,
    "serving": 7,
    "integrations": 8,
    "fit": 9,
    "eval": 10,
    "cli": 11,
    "__main__": 12,
}
#: Root modules every part may import, private names or not.
PLUMBING = ("_compat", "_lazy", "_version")
#: Parts that are plain Python: no torch, numpy or scipy anywhere in them.
PLAIN_PYTHON = ("core", "standalone")
HEAVY = ("torch", "numpy", "scipy", "torch_geometric", "numba")
#: Parts that may import only from core (and themselves).
CORE_ONLY = ("providers",)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """'mapmatched_torch.kernels.decode' -> 'kernels'; the package root -> ''."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def type_checking_nodes(tree: ast.AST) -> set:
    """The ids of every node under an ``if TYPE_CHECKING:`` body (imports for annotations
    only: they never run, so they are no dependency, though they must keep the layout)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", "")
            if name == "TYPE_CHECKING":
                inside.update(id(child) for statement in node.body for child in ast.walk(statement))
    return inside


def imports(path: Path, module: str, *, runtime_only: bool = False) -> Iterator[Tuple[int, str, List[str]]]:
    """Every import of ``path`` as ``(line, absolute module, imported names)``, at any depth
    (``runtime_only``: without the imports under ``if TYPE_CHECKING:``)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    skipped = type_checking_nodes(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            if node.module is None:  # "from . import chain": the names are modules
                for name in names:
                    yield node.lineno, f"{target}.{name}", []
            else:
                yield node.lineno, target, names
        elif isinstance(node, ast.Call):
            # importlib.import_module("mapmatched_torch.x") / import_module(".x", __name__),
            # and the name -> module mappings handed to lazy_attributes
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if function == "import_module" and node.args:
                yield from lazy_targets(node.lineno, [node.args[0]], module)
            elif function == "lazy_attributes" and len(node.args) > 1:
                yield from lazy_targets(node.lineno, [node.args[1]], module)
        elif isinstance(node, ast.Assign) and any(getattr(target, "id", "") == "_LAZY" for target in node.targets):
            yield from lazy_targets(node.lineno, [node.value], module)


def lazy_targets(line: int, values: List[ast.AST], package: str) -> Iterator[Tuple[int, str, List[str]]]:
    """The modules named by string constants in ``values`` (a module name, or a
    ``_LAZY``-style dict of name -> module), resolved as ``importlib.import_module(name,
    package)`` resolves them; the names read from each are not known, so none are given."""
    for value in values:
        for node in ast.walk(value):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            name = node.value
            if name.startswith("."):
                level = len(name) - len(name.lstrip("."))
                base = package.split(".")
                base = base[: len(base) - (level - 1)]
                rest = name[level:]
                yield line, ".".join(base + ([rest] if rest else [])), []
            elif name.split(".")[0] == PACKAGE:
                yield line, name, []


def layout_problems(root: Path) -> List[str]:
    """Every rule the tree under ``root`` (a package folder) breaks, one line each."""
    problems = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        part = part_of(module)
        if part == "":  # the package's __init__: the public facade, free to re-export
            continue
        rank = RANKS.get(part)
        if rank is None:
            problems.append(f"{module}: part {part!r} has no place in the layout order")
            continue
        for line, target, names in imports(path, module):
            where = f"{module}:{line}"
            top = target.split(".")[0]
            if part in PLAIN_PYTHON and top in HEAVY:
                problems.append(f"{where}: plain-Python part {part!r} imports {target}")
            if top != root.name:
                continue
            other = part_of(target)
            if other == part:
                continue
            if other == "":
                problems.append(f"{where}: imports the package root ({target} {names})")
                continue
            if RANKS.get(other, 99) > rank:
                problems.append(f"{where}: {part} (rank {rank}) imports {target}, a later part")
            if part in CORE_ONLY and other != "core" and other not in PLUMBING:
                problems.append(f"{where}: {part} may import only core, imports {target}")
            private = [piece for piece in target.split(".")[1:] if is_private(piece) and piece not in PLUMBING]
            private += [name for name in names if is_private(name)]
            if private:
                problems.append(f"{where}: private {private} imported across parts from {target}")
    return problems


def module_imports(root: Path) -> Dict[str, Set[str]]:
    """Every module under ``root`` -> the modules of the same tree it imports at run time
    (at any depth, lazy and string imports included; an import of a name that is not a
    module counts as an import of its module)."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: Dict[str, Set[str]] = {module: set() for module in paths}
    for module, path in paths.items():
        for _, target, names in imports(path, module, runtime_only=True):
            submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in paths]
            pieces = target.split(".")
            while pieces and ".".join(pieces) not in paths:
                pieces.pop()
            found = submodules + ([".".join(pieces)] if pieces else [])
            graph[module].update(other for other in found if other != module)
    return graph


def import_cycles(root: Path) -> List[str]:
    """One line per group of modules that import each other, directly or through others
    (a strongly connected component of :func:`module_imports` with more than one module)."""
    graph = module_imports(root)
    order: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    groups: List[str] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph[module]):
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append("modules that import each other: " + ", ".join(sorted(group)))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return sorted(groups)


def test_the_package_follows_the_layout() -> None:
    assert layout_problems(PACKAGE_DIR) == []


def test_no_two_modules_import_each_other() -> None:
    assert import_cycles(PACKAGE_DIR) == []


def test_the_cycle_checker_sees_lazy_indirect_cycles_and_not_annotations(tmp_path: Path) -> None:
    root = tmp_path / PACKAGE
    (root / "kernels").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "kernels" / "__init__.py").write_text("")
    (root / "kernels" / "a.py").write_text("from .b import x\n")
    (root / "kernels" / "b.py").write_text("def f():\n    from . import c\n")  # lazy
    (root / "kernels" / "c.py").write_text('import importlib\nimportlib.import_module("mapmatched_torch.kernels.a")\n')
    (root / "kernels" / "d.py").write_text("from .e import y\n")
    (root / "kernels" / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import z\n")
    assert import_cycles(root) == [
        "modules that import each other: mapmatched_torch.kernels.a, mapmatched_torch.kernels.b, mapmatched_torch.kernels.c"
    ]


def test_the_checker_catches_each_kind_of_break(tmp_path: Path) -> None:
    root = tmp_path / PACKAGE
    for folder in ("core", "kernels", "graph", "providers", "misc"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("from .graph import x\n")  # the facade may
    (root / "core" / "a.py").write_text("import torch\nfrom ..kernels import decode\n")
    (root / "kernels" / "b.py").write_text("def f():\n    from ..graph.knn import knn_graph\n")
    (root / "graph" / "c.py").write_text("from ..kernels.decode import _prepare\nfrom ..kernels._hidden import y\n")
    (root / "providers" / "d.py").write_text("from ..kernels.decode import viterbi\n")
    (root / "misc" / "e.py").write_text("")
    (root / "kernels" / "__init__.py").write_text('_LAZY = {"x": "..graph.knn"}\n')
    (root / "kernels" / "f.py").write_text('import importlib\nimportlib.import_module("mapmatched_torch.providers.dense")\n')
    (root / "providers" / "__init__.py").write_text(
        'from .._lazy import lazy_attributes\n__getattr__ = lazy_attributes(__name__, {"y": "..graph.sections"}, globals())\n'
    )
    (root / "core" / "g.py").write_text("def __getattr__(name):\n    from ..graph import knn\n    return knn\n")
    found = "\n".join(layout_problems(root))
    for expected in (
        "mapmatched_torch.core.a:1: plain-Python part 'core' imports torch",
        "mapmatched_torch.core.a:2: core (rank 1) imports mapmatched_torch.kernels, a later part",
        "mapmatched_torch.kernels.b:2: kernels (rank 3) imports mapmatched_torch.graph.knn, a later part",
        "mapmatched_torch.graph.c:1: private ['_prepare'] imported across parts",
        "mapmatched_torch.graph.c:2: private ['_hidden'] imported across parts",
        "mapmatched_torch.providers.d:1: providers may import only core",
        "mapmatched_torch.misc.e: part 'misc' has no place in the layout order",
        "mapmatched_torch.kernels:1: kernels (rank 3) imports mapmatched_torch.graph.knn, a later part",
        "mapmatched_torch.kernels.f:2: kernels (rank 3) imports mapmatched_torch.providers.dense, a later part",
        "mapmatched_torch.providers:2: providers may import only core, imports mapmatched_torch.graph.sections",
        "mapmatched_torch.core.g:2: core (rank 1) imports mapmatched_torch.graph, a later part",
    ):
        assert expected in found
    assert "mapmatched_torch:" not in found  # the root facade is exempt


#: Import paths of the flat layout (never released), gone: no finder answers them.
REMOVED_PATHS = (
    "decode", "models", "errors", "scoring", "trace", "chain", "sampling", "streaming", "decoder", "model",
    "providers.langchain", "cmg", "knn", "adapters.faiss",
)  # fmt: skip


@pytest.mark.parametrize("old", REMOVED_PATHS)
def test_the_flat_layouts_paths_are_gone(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"{PACKAGE}.{old}")


def test_importing_the_package_has_no_side_effects() -> None:
    code = (
        "import sys, types\n"
        "finders, before = list(sys.meta_path), set(sys.modules)\n"
        "import mapmatched_torch\n"
        "assert sys.meta_path == finders, sys.meta_path\n"
        "assert type(mapmatched_torch) is types.ModuleType, type(mapmatched_torch)\n"
        "assert 'mapmatched' not in sys.modules\n"
        "new = {name.split('.')[0] for name in set(sys.modules) - before}\n"
        "assert new - set(sys.stdlib_module_names) == {'mapmatched_torch'}, new\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_one_path_per_name_outside_the_package_root() -> None:
    """A part's ``__init__`` re-exports only its own modules' names, and the adapters
    are found where they are defined, not under ``providers``."""
    import mapmatched_torch.integrations
    import mapmatched_torch.providers

    for name in ("LangChainProvider", "as_langchain_retriever", "LlamaIndexProvider", "as_llamaindex_retriever"):
        assert name in mapmatched_torch.integrations.__all__
        with pytest.raises(AttributeError):
            getattr(mapmatched_torch.providers, name)
    assert mapmatched_torch.LangChainProvider is mapmatched_torch.integrations.LangChainProvider  # the convenience path
    # graph/ re-exports two core names (left while graph/ is being reworked)
    known = {("graph", "implements"), ("graph", "CacheInfo")}
    for part in ("core", "standalone", "kernels", "graph", "providers", "retrieval", "serving", "integrations", "fit", "eval"):
        package = importlib.import_module(f"{PACKAGE}.{part}")
        for name in getattr(package, "__all__", ()):
            home = getattr(getattr(package, name), "__module__", None) or f"{PACKAGE}.{part}"
            if home.startswith(PACKAGE) and (part, name) not in known:  # not a typing alias
                assert part_of(home) == part, f"{PACKAGE}.{part}.{name} is re-exported from {home}"


def test_the_plain_python_parts_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "import mapmatched_torch\n"
        "from mapmatched_torch import MapMatchedRetriever, StandaloneDecoder, KNNGraph, render_trace\n"
        "import mapmatched_torch.core.embeddings, mapmatched_torch.core.graph_types\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_eval_surface_is_the_handful_a_user_calls():
    import mapmatched_torch.eval as evaluation

    assert len(evaluation.__all__) <= 16 and "evaluate" in evaluation.__all__
    for name in evaluation.__all__:
        assert getattr(evaluation, name) is not None
    assert not hasattr(evaluation, "_LAZY")
    with pytest.raises(AttributeError):
        evaluation.paired_bootstrap  # noqa: B018  (its path is mapmatched_torch.eval.bootstrap)
