"""Progress of long loops: a tqdm bar on a terminal, plain periodic lines elsewhere."""

from __future__ import annotations

import pytest

import mapmatched_torch.core.progress as progress
from mapmatched_torch.core.progress import progress_bar, progress_wanted


class _Clock:
    """A clock that moves ``step`` seconds each time it is read."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_off_a_terminal_a_long_loop_prints_plain_lines_with_rate_and_eta(capsys, monkeypatch):
    monkeypatch.setattr(progress, "_terminal", lambda: False)
    monkeypatch.setattr(progress, "_clock", _Clock(4.0))
    with progress_bar(total=10, desc="evaluating x", unit="conv", show=True) as bar:
        for _ in range(10):
            bar.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert "\r" not in "".join(lines) and len(lines) == 4  # at most every 10 s, then the last line
    assert lines[0] == "evaluating x: 3/10 conv (30%), 0.25 conv/s, ETA 28 s"
    assert lines[-1].startswith("evaluating x: 10/10 conv (100%), done in 44 s")


def test_a_short_loop_prints_nothing_and_iteration_works(capsys, monkeypatch):
    monkeypatch.setattr(progress, "_terminal", lambda: False)
    assert list(progress_bar(range(5), desc="embedding", unit="text", show=True)) == [0, 1, 2, 3, 4]
    assert capsys.readouterr().err == ""


def test_on_a_terminal_it_is_tqdm_and_disabled_it_prints_nothing(capsys, monkeypatch):
    from tqdm.auto import tqdm

    monkeypatch.setattr(progress, "_terminal", lambda: True)
    bar = progress_bar(total=3, desc="d", unit="u", show=True)
    assert isinstance(bar, tqdm)
    bar.close()
    capsys.readouterr()
    monkeypatch.setattr(progress, "_terminal", lambda: False)
    monkeypatch.setattr(progress, "_clock", _Clock(60.0))
    with progress_bar(total=3, desc="d", unit="u", show=False) as bar:
        bar.update(3)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("given, main, wanted", [(None, True, True), (None, False, False), (True, False, True),
                                                 (False, True, False)])
def test_progress_wanted(given, main, wanted):
    assert progress_wanted(given, main) is wanted


def test_eval_logs_progress_lines_when_stderr_is_a_file(capsys, monkeypatch):
    """The CLI without --quiet, stderr not a terminal: the loops used to print nothing."""
    from mapmatched_torch.cli import main

    monkeypatch.setattr(progress, "_clock", _Clock(11.0))
    assert main(["eval", "--conversations", "24", "--turns", "4", "--candidates", "8", "--methods",
                 "pointwise,map-matched", "--betas", "0,0.5", "--bootstrap", "10", "--batch-size", "8"]) == 0
    err = capsys.readouterr().err
    assert "evaluating synthetic" in err and "conv/s" in err and "bootstrap:" in err
    assert "\r" not in err
