"""The project's own docs: what the docstrings and the README point to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "mapmatched_torch").rglob("*.py")) + [ROOT / "README.md"]


def test_the_pointers_name_the_projects_own_docs() -> None:
    stale = [str(path.relative_to(ROOT)) for path in SOURCES if re.search(r"(?<!docs/)\b(SPEC|DESIGN)\.md", path.read_text())]
    assert stale == []  # the steering files are not part of the project
    named = {name for path in SOURCES for name in re.findall(r"docs/([a-z_]+\.md)", path.read_text())}
    assert named and all((ROOT / "docs" / name).is_file() for name in named)


def test_every_cited_spec_section_exists() -> None:
    headings = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "spec.md").read_text(), re.M))
    cited = set()
    for path in SOURCES:
        for first, last in re.findall(r"docs/spec\.md,? sections? (\d+)(?:\s*-\s*(\d+))?", path.read_text()):
            cited.update(str(n) for n in range(int(first), int(last or first) + 1))
    assert cited and cited <= headings
