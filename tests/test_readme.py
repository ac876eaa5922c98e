"""The README's Python snippets run, and its set-up commands are what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quickstart_runs_and_says_what_it_claims(capsys):
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", README, re.S).group(1)
    exec(compile(block, "README quickstart", "exec"), {})
    assert capsys.readouterr().out.splitlines()[0] == "gpu"


def test_ci_runs_the_readme_test_command():
    command = next(line.strip() for line in README.splitlines() if "pytest" in line and line.startswith("    "))
    assert command in (ROOT / ".ci" / "run").read_text()


def test_ci_works_in_a_copy_and_leaves_the_checkouts_venv_alone():
    script = (ROOT / ".ci" / "run").read_text()
    assert "rm -rf .venv" not in script
    copy = script.index("mktemp -d")
    assert copy < script.index('cd "$work/repo"') < script.index("python3 -m venv .venv")


def test_qdrant_snippet_runs_and_prints_its_claim(capsys):
    import pytest

    pytest.importorskip("qdrant_client")
    block = re.search(r"```python\n(from qdrant_client import.*?)```", README, re.S).group(1)
    exec(compile(block, "README qdrant", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1] == "('setup', 'gpu')"
