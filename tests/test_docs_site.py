"""The documentation site builds: ``mkdocs build --strict`` over mkdocs.yml and docs/
(a broken link, a page missing from the navigation or an API reference that does not
resolve fails the build). mkdocs comes with the ``[test]`` extra (and ``[docs]``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs site needs mkdocs (the [docs] or [test] extra)")
    pytest.importorskip("mkdocstrings", reason="the API reference needs mkdocstrings[python]")
    pytest.importorskip("material", reason="the theme is mkdocs-material")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert (site / "index.html").is_file() and (site / "api" / "serving" / "index.html").is_file()
    assert "MapMatchedServer" in (site / "api" / "serving" / "index.html").read_text()
