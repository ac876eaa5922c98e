"""Every numbered example runs to completion (exit code 0).

An example that needs an optional package says so in a module-level
``REQUIRES = ("package", ...)`` (importable module names, read here without running
the example); it is skipped, with the reason, when one of them is missing, so a plain
``pip install -e .`` runs the suite without the extras. Run without them, such an
example must exit with one line naming the ``pip install 'mapmatched-torch[...]'``
that provides them (``core.optional.import_optional``), not with a traceback.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("[0-9][0-9]_*.py"))


def requirements(path: Path) -> Tuple[str, ...]:
    """The example's ``REQUIRES`` tuple of module names (empty when it has none)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REQUIRES" for t in node.targets):
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple) and all(isinstance(name, str) for name in value), path.name
            return value
    return ()


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package, or a module blocked in sys.modules
        return False


def missing(path: Path) -> List[str]:
    """The example's required modules that cannot be imported here."""
    return [name for name in requirements(path) if not _importable(name)]


def test_examples_exist():
    assert EXAMPLES, "no numbered examples found"


def test_examples_declare_their_optional_packages(tmp_path):
    assert requirements(next(p for p in EXAMPLES if p.name.startswith("03_"))) == ("langchain_core",)
    example = tmp_path / "99_needs_extras.py"
    example.write_text('"""Doc."""\nREQUIRES = ("json", "no_such_module_for_this_test", "no_such_package_for_this_test.sub")\nimport no_such_module_for_this_test\n')
    assert missing(example) == ["no_such_module_for_this_test", "no_such_package_for_this_test.sub"]
    (tmp_path / "98_plain.py").write_text("print('hello')\n")
    assert requirements(tmp_path / "98_plain.py") == ()


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    absent = missing(path)
    if absent:
        pytest.skip(f"{path.name} needs {', '.join(absent)} (an optional extra), which is not installed")
    completed = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]


NEEDS_EXTRAS = [p for p in EXAMPLES if requirements(p)]

#: Runs an example with the named modules made unimportable (``sys.modules[name] = None``).
_BLOCKED = "import runpy, sys\nfor name in sys.argv[2:]:\n    sys.modules[name] = None\n" \
           "sys.argv = sys.argv[1:2]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"


@pytest.mark.parametrize("path", NEEDS_EXTRAS, ids=[p.name for p in NEEDS_EXTRAS])
def test_an_example_without_its_extra_names_the_pip_install(path):
    modules = [name.split(".")[0] for name in requirements(path)]
    completed = subprocess.run([sys.executable, "-c", _BLOCKED, str(path), *modules], capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 1, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert "Traceback" not in completed.stderr and completed.stderr.count("\n") == 1, completed.stderr
    assert "pip install 'mapmatched-torch[" in completed.stderr
