"""Docstring examples are executed as tests (STYLE: einops)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import mapmatched_torch

#: Optional packages: a module or an example that needs a missing one is skipped.
OPTIONAL = {"faiss", "numba", "langchain_core", "llama_index", "qdrant_client", "chromadb", "networkx", "matplotlib"}


def _modules():
    for info in pkgutil.walk_packages(mapmatched_torch.__path__, "mapmatched_torch."):
        yield info.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in OPTIONAL:
            raise
        pytest.skip(f"needs {exc.name}")
    finder = doctest.DocTestFinder()
    tests = [test for test in finder.find(module) if test.examples]
    if not tests:
        pytest.skip("no examples")
    for test in tests:
        source = "".join(example.source for example in test.examples)
        for package in OPTIONAL:
            if f"import {package}" in source or f"from {package}" in source:
                pytest.importorskip(package)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {name}"
