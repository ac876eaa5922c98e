"""A griffe extension for the API pages: the package's docstrings title their doctests
``Example:``, which Google-style parsing in griffe reads only as ``Examples:``. Renaming
the section for the site renders the doctests as code (and keeps ``[...]`` in their
output from being read as Markdown links); the sources stay as they are."""

from __future__ import annotations

import re

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs) -> None:  # noqa: D102 (griffe's hook)
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
