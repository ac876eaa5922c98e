"""Docstring examples are executed as tests (STYLE: einops)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import mapmatched_torch

OPTIONAL = {"faiss"}


def _modules():
    for info in pkgutil.walk_packages(mapmatched_torch.__path__, "mapmatched_torch."):
        yield info.name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    tests = [test for test in finder.find(module) if test.examples]
    if not tests:
        pytest.skip("no examples")
    for test in tests:
        source = "".join(example.source for example in test.examples)
        for package in OPTIONAL:
            if f"import {package}" in source:
                pytest.importorskip(package)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0, f"{runner.failures} docstring example(s) failed in {name}"
