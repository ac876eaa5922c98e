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


# --------------------------------------------------------------------------- the docs site's pages

import ast  # noqa: E402
import importlib.util  # noqa: E402

import pytest  # noqa: E402


def _readme_tests():
    """tests/test_readme.py's block parser and requirement check (one definition of how
    a page's blocks are found, named and skipped)."""
    spec = importlib.util.spec_from_file_location("_readme_blocks", Path(__file__).with_name("test_readme.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_README_TESTS = _readme_tests()
PAGES = sorted((ROOT / "docs").rglob("*.md"))
#: (page, block): every ```python block of every docs page, named "page/heading-slug"
PAGE_BLOCKS = [
    (page, block._replace(name=f"{page.relative_to(ROOT / 'docs').with_suffix('').as_posix()}/{block.name}"))
    for page in PAGES
    for block in _README_TESTS.readme_blocks(page.read_text())
]

#: block name -> the first lines it prints (what the page's prose and comments claim).
PAGE_EXPECTED_OUTPUT = {
    "index/quickstart": ["gpu"],
    "concepts/tensor-api": ["tensor([[0, 0, 0]])"],
    "serving/serving-many-conversations": ["{'alice': 'gpu'} MapMatchedValueError"],
    "serving/serving-many-conversations-2": ["{'alice': 'gpu', 'bob': 'billing'}"],
    "serving/serving-many-conversations-3": ["[0, 0] ['gpu', 'billing']", "[[1, 2], [3, 4]] torch.Size([2, 3])"],
    "serving/serving-a-learned-transition-model": ["('intro', 'setup', 'gpu') [0.0, 1.0294, 0.7233]",
                                                   "score-level query-source match"],
    "adapters/drop-in-adapters-langchain-llamaindex-qdrant-chroma": ["decoded start"],
    "adapters/drop-in-adapters-langchain-llamaindex-qdrant-chroma-2": ["[('setup', False), ('gpu', True), ('intro', True), ('faq', False)]"],
    "adapters/drop-in-adapters-langchain-llamaindex-qdrant-chroma-3": ["('setup', 'gpu')"],
}


@pytest.mark.parametrize("page, block", PAGE_BLOCKS, ids=[block.name for _, block in PAGE_BLOCKS])
def test_docs_page_block(page, block, tmp_path, monkeypatch, capsys):
    """Each block runs on its own, as the README's do (tests/test_readme.py): a fresh
    namespace, a temporary working directory, ``# requires: ...`` skips."""
    _README_TESTS.skip_unless_available(block.requires)
    monkeypatch.chdir(tmp_path)
    code = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
    exec(code, {"__name__": "__docs__"})
    printed = capsys.readouterr().out.splitlines()
    expected = PAGE_EXPECTED_OUTPUT.get(block.name, [])
    assert printed[: len(expected)] == expected


def test_docs_blocks_are_all_found_and_every_printing_block_is_checked() -> None:
    import mapmatched_torch

    names = [block.name for _, block in PAGE_BLOCKS]
    assert len(names) == len(set(names)) and len(names) >= 8
    for page in PAGES:
        text = page.read_text()
        openings = re.findall(r"^```(\S*)", text, re.M)[::2]
        assert openings.count("python") == sum(1 for p, _ in PAGE_BLOCKS if p == page), page
        assert all(tag == "python" for tag in openings if tag.startswith("py")), f"{page}: tag Python blocks ```python"
    printing = {block.name for _, block in PAGE_BLOCKS if re.search(r"^\s*print\(", block.code, re.M)}
    assert printing == set(PAGE_EXPECTED_OUTPUT), "give every printing block its expected output (and no other)"
    for _, block in PAGE_BLOCKS:  # the public surface only, as in the README
        for node in ast.walk(ast.parse(block.code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mapmatched_torch":
                assert node.module == "mapmatched_torch", f"{block.name}: from {node.module} import ..."
                assert all(alias.name in mapmatched_torch.__all__ for alias in node.names), block.name


def test_the_tiny_example_dataset_loads() -> None:
    """The README's "your data in five minutes" folder: 5 conversations, every turn labelled."""
    from mapmatched_torch.eval.data import load_directory

    dataset = load_directory(ROOT / "examples" / "data" / "tiny")
    assert len(dataset.conversations) == 5 and dataset.num_turns == dataset.labelled_turn_count
    passages = {passage.id for passage in dataset.passages}
    assert all(set(turn.qrels) <= passages for conversation in dataset.conversations for turn in conversation.turns)
