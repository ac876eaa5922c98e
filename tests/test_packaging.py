"""The package's metadata: license, typing marker, one version."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import mapmatched_torch

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_file_is_the_declared_license() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text and "END OF TERMS AND CONDITIONS" in text
    assert importlib.metadata.metadata("mapmatched-torch")["License"] == "Apache-2.0"


def test_the_package_is_marked_typed() -> None:
    assert (Path(mapmatched_torch.__file__).parent / "py.typed").is_file()


def test_one_version_for_the_metadata_and_the_package() -> None:
    assert importlib.metadata.version("mapmatched-torch") == mapmatched_torch.__version__
