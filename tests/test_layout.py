"""The package layout holds: parts import only the parts before them, no private name
crosses a part, the plain-Python parts stay free of torch, and the flat layout's
import paths still work."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

import mapmatched_torch
from mapmatched_torch import _compat

PACKAGE_DIR = Path(mapmatched_torch.__file__).resolve().parent
PACKAGE = "mapmatched_torch"

#: Each part imports only from parts of a lower or equal rank (docs/design.md, "Layout").
RANKS = {
    "_compat": 0,  # package plumbing (the flat layout's paths, lazy attributes):
    "_lazy": 0,  # they import nothing of the package, and every part may use them
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


def imports(path: Path, module: str) -> Iterator[Tuple[int, str, List[str]]]:
    """Every import of ``path`` as ``(line, absolute module, imported names)``, at any depth."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def test_the_package_follows_the_layout() -> None:
    assert layout_problems(PACKAGE_DIR) == []


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
    found = "\n".join(layout_problems(root))
    for expected in (
        "mapmatched_torch.core.a:1: plain-Python part 'core' imports torch",
        "mapmatched_torch.core.a:2: core (rank 1) imports mapmatched_torch.kernels, a later part",
        "mapmatched_torch.kernels.b:2: kernels (rank 3) imports mapmatched_torch.graph.knn, a later part",
        "mapmatched_torch.graph.c:1: private ['_prepare'] imported across parts",
        "mapmatched_torch.graph.c:2: private ['_hidden'] imported across parts",
        "mapmatched_torch.providers.d:1: providers may import only core",
        "mapmatched_torch.misc.e: part 'misc' has no place in the layout order",
    ):
        assert expected in found
    assert "mapmatched_torch:" not in found  # the root facade is exempt


@pytest.mark.parametrize("old", sorted(_compat.MOVED_MODULES))
def test_old_module_paths_import_the_moved_module(old: str) -> None:
    new = _compat.MOVED_MODULES[old]
    try:
        moved = importlib.import_module(f"{PACKAGE}.{new}")
    except ModuleNotFoundError as exc:  # an adapter whose framework is not installed
        pytest.skip(f"needs {exc.name}")
    aliased = importlib.import_module(f"{PACKAGE}.{old}")
    assert aliased is moved
    assert moved.__spec__.name == f"{PACKAGE}.{new}"  # the alias does not rename the module
    assert sys.modules[f"{PACKAGE}.{old}"] is moved


def test_old_names_keep_importing() -> None:
    from mapmatched_torch.decode import ViterbiState, viterbi
    from mapmatched_torch.sampling import random_graph, sample_conversations, sample_paths
    from mapmatched_torch.streaming import DecodingStream, SlotDecoder

    from mapmatched_torch.integrations import LangChainProvider as provider
    from mapmatched_torch.kernels.decode import ViterbiState as state
    from mapmatched_torch.kernels.decode import viterbi as function
    from mapmatched_torch.kernels.slot_decoder import SlotDecoder as slots
    from mapmatched_torch.providers import LangChainProvider
    from mapmatched_torch.retrieval import MapMatchedSession, TorchDecoder, context_chunk_ids

    assert (ViterbiState, viterbi, LangChainProvider, SlotDecoder) == (state, function, provider, slots)
    assert callable(random_graph) and callable(sample_conversations) and callable(sample_paths)
    assert MapMatchedSession and TorchDecoder and context_chunk_ids and DecodingStream
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mapmatched_torch.providers.Nope
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mapmatched_torch._validation")  # private old paths are not kept


def test_the_plain_python_parts_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "import mapmatched_torch\n"
        "from mapmatched_torch import MapMatchedRetriever, StandaloneDecoder, KNNGraph, render_trace\n"
        "import mapmatched_torch.core.embeddings, mapmatched_torch.core.graph_types\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_eval_surface_is_the_handful_a_user_calls_and_former_names_still_resolve():
    import mapmatched_torch.eval as evaluation

    assert len(evaluation.__all__) <= 16 and "evaluate" in evaluation.__all__
    for name in evaluation.__all__:
        assert getattr(evaluation, name) is not None
    for name, module in evaluation._LAZY.items():
        assert name not in evaluation.__all__
        assert getattr(evaluation, name) is getattr(importlib.import_module(module, "mapmatched_torch.eval"), name)
