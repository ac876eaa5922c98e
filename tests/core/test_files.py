"""Atomic output files: a temporary file beside the target, renamed over it."""

from __future__ import annotations

import os
import signal

import pytest

from mapmatched_torch.core.files import atomic_path, output_group, write_text_atomic


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as temporary:
            with open(temporary, "w") as stream:
                stream.write("half of the new")
            raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["report.json"]


def test_write_text_atomic_creates_parents_and_replaces(tmp_path):
    target = tmp_path / "a" / "b" / "w.json"
    assert write_text_atomic(target, "one") == target
    write_text_atomic(target, "two")
    assert target.read_text() == "two" and os.listdir(target.parent) == ["w.json"]


def test_a_group_renames_nothing_until_it_ends_and_nothing_on_an_error(tmp_path):
    first, second = tmp_path / "r.md", tmp_path / "r.json"
    first.write_text("old md")
    second.write_text("old json")
    with pytest.raises(KeyboardInterrupt):
        with output_group():
            write_text_atomic(first, "new md")
            assert first.read_text() == "old md"
            raise KeyboardInterrupt  # before the JSON is written
    assert (first.read_text(), second.read_text()) == ("old md", "old json")
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r.md"]
    with output_group():
        write_text_atomic(first, "new md")
        write_text_atomic(second, "new json")
    assert (first.read_text(), second.read_text()) == ("new md", "new json")


def test_sigint_during_the_renames_is_delivered_after_the_last_one(tmp_path, monkeypatch, python_sigint):
    targets = [tmp_path / f"{name}.txt" for name in "abc"]
    replace = os.replace

    def replace_then_interrupt(source, target):
        replace(source, target)
        if target.endswith("a.txt"):
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with output_group():
            for target in targets:
                write_text_atomic(target, "new")
    assert [target.read_text() for target in targets] == ["new"] * 3
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
