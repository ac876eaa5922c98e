"""The README's Python blocks run as written, and its set-up commands are what CI runs.

(The docs pages' blocks run the same way, through these helpers: ``tests/test_docs.py``.)

Every ```` ```python ```` block of README.md is a test of its own
(:func:`test_readme_block`, named after the heading above it): it is executed on its
own, in a fresh namespace and a temporary working directory, so each block must be
self-contained -- its small inputs defined inline, every name it uses imported, and
the ``mapmatched_torch`` names from the top level
(:func:`test_readme_imports_mapmatched_torch_names_from_the_top_level_only`). Blocks
are found generically, so a new block that does not run fails the suite.

A block that needs what a plain ``pip install -e ".[test]"`` on a CPU machine may lack
says so on its first line, and is skipped (with the reason) without it::

    # requires: cuda                  a GPU: skipped unless torch.cuda.is_available()
    # requires: langchain_core        a Python package (module name; dotted names such
                                      as llama_index.core work): skipped unless it imports
    # requires: cuda, qdrant_client   several, comma-separated

A block that needs a running service names the module that reaches it the same way
(``# requires: my_service_client``): skipped unless that module imports, which in CI it
never does.

What a block prints is part of what the README claims: :data:`EXPECTED_OUTPUT` holds
the first lines each printing block must print, and every block that prints must have
an entry there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List, NamedTuple, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


class Block(NamedTuple):
    """One ```python block: its test id, first line number in README.md, source, requirements."""

    name: str
    line: int
    code: str
    requires: Tuple[str, ...]


REQUIRES = re.compile(r"#\s*requires:\s*(.+)")


def readme_blocks(text: str) -> List[Block]:
    """Every ```python block of ``text``, named by the slug of the ``##``/``###``
    heading above it (``-2``, ``-3`` ... for further blocks under the same heading)."""
    blocks: List[Block] = []
    heading, fence, start, lines = "top", None, 0, []
    counts: dict = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is None:
            if line.startswith("```"):
                fence, start, lines = line[3:].strip(), number + 1, []
            elif re.match(r"#{2,3} ", line):
                heading = re.sub(r"[^a-z0-9]+", "-", line.lstrip("#").strip().lower()).strip("-")
        elif line.startswith("```"):
            if fence == "python":
                counts[heading] = counts.get(heading, 0) + 1
                name = heading if counts[heading] == 1 else f"{heading}-{counts[heading]}"
                first = REQUIRES.fullmatch(lines[0].strip()) if lines else None
                requires = tuple(part.strip() for part in first.group(1).split(",")) if first else ()
                blocks.append(Block(name, start, "\n".join(lines) + "\n", requires))
            fence = None
        else:
            lines.append(line)
    assert fence is None, "README.md ends inside a code fence"
    return blocks


BLOCKS = readme_blocks(README)

#: block name -> the first lines it prints (what the prose and its comments claim).
EXPECTED_OUTPUT = {
    "quickstart": ["gpu"],
}


def skip_unless_available(requires: Tuple[str, ...]) -> None:
    """Skip the running test unless every requirement of a block is met."""
    for requirement in requires:
        if requirement == "cuda":
            import torch

            if not torch.cuda.is_available():
                pytest.skip("the block needs a CUDA device (# requires: cuda)")
        else:
            pytest.importorskip(requirement, reason=f"the block needs {requirement} (# requires: {requirement})")


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_readme_block(block, tmp_path, monkeypatch, capsys):
    skip_unless_available(block.requires)
    monkeypatch.chdir(tmp_path)  # a block may write files (server.pt)
    # padded so that a traceback names the README's own line numbers
    code = compile("\n" * (block.line - 1) + block.code, str(ROOT / "README.md"), "exec")
    exec(code, {"__name__": "__readme__"})
    printed = capsys.readouterr().out.splitlines()
    expected = EXPECTED_OUTPUT.get(block.name, [])
    assert printed[: len(expected)] == expected


def test_readme_blocks_are_all_found_and_every_printing_block_is_checked():
    openings = re.findall(r"^```(\S*)", README, re.M)[::2]  # (every other fence closes one)
    assert openings.count("python") == len(BLOCKS)
    assert all(tag == "python" for tag in openings if tag.startswith("py")), "tag every Python block ```python"
    names = [block.name for block in BLOCKS]
    assert len(names) == len(set(names)) and len(names) >= 1
    printing = {block.name for block in BLOCKS if re.search(r"^\s*print\(", block.code, re.M)}
    assert printing == set(EXPECTED_OUTPUT), "give every printing block its expected output (and no other)"
    for block in BLOCKS:
        assert all(r == "cuda" or re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", r) for r in block.requires), block.name


def test_readme_blocks_parse_the_requires_line():
    text = "## A b\n\n```python\n# requires: cuda, some_pkg.sub\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\n```\n"
    assert readme_blocks(text) == [
        Block("a-b", 4, "# requires: cuda, some_pkg.sub\nx = 1\n", ("cuda", "some_pkg.sub")),
        Block("a-b-2", 12, "y = 2\n", ()),
    ]


def test_readme_imports_mapmatched_torch_names_from_the_top_level_only():
    """The README teaches the public surface, ``mapmatched_torch.__all__``: submodule
    paths are layout (they moved once already), so a block that imports from one
    teaches a path that may move. Every imported name must also resolve there."""
    import mapmatched_torch

    assert not re.search(r"\b(from|import) mapmatched_torch\.", README)
    names = set()
    for block in BLOCKS:
        for node in ast.walk(ast.parse(block.code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mapmatched_torch":
                assert node.module == "mapmatched_torch", f"{block.name}: from {node.module} import ..."
                names.update(alias.name for alias in node.names)
    assert names and sorted(names - set(mapmatched_torch.__all__)) == []
    assert all(getattr(mapmatched_torch, name) is not None for name in names)


def test_ci_runs_the_readme_test_command():
    command = next(line.strip() for line in README.splitlines() if "pytest" in line and line.startswith("    "))
    assert command in (ROOT / ".ci" / "run").read_text()


def test_ci_works_in_a_copy_and_leaves_the_checkouts_venv_alone():
    script = (ROOT / ".ci" / "run").read_text()
    assert "rm -rf .venv" not in script
    copy = script.index("mktemp -d")
    assert copy < script.index('cd "$work/repo"') < script.index("python3 -m venv .venv")


def test_readme_commands_run_from_a_clone():
    """A clone has no ``shared/`` beside it: the README's commands use the committed
    example data (``examples/data/tiny``), and commands on other data live in the docs."""
    assert "shared/data" not in "\n".join(line for line in README.splitlines() if line.startswith("    "))
    assert "../shared" not in README
    for folder in re.findall(r"--data (\S+)", README):
        assert folder.isupper() or (ROOT / folder).is_dir(), folder
