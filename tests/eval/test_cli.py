"""The ``mapmatched-torch eval`` command line, in-process and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mapmatched_torch.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--conversations", "24", "--turns", "4", "--candidates", "8", "--bootstrap", "50", "--quiet"]


def _outputs(tmp_path: Path):
    return ["--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"), "--plots", str(tmp_path / "plots")]


def test_synthetic_default_writes_all_three_report_kinds(tmp_path, capsys):
    assert main(["eval", *SMALL, "--betas", "0,0.5,1", "--lags", "full,1", *_outputs(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("# Map-matched retrieval evaluation: synthetic")
    assert out.err == ""  # --quiet: no status lines, no progress bars
    data = json.loads((tmp_path / "r.json").read_text())
    keys = [m["key"] for m in data["methods"]]
    assert keys[0] == "pointwise" and "map-matched lambda=1 beta=0.5 lag=1" in keys
    assert "fitted (2-fold cross-fitted)" in keys
    assert (tmp_path / "r.md").read_text() == out.out
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["emission_transition_split.png",
                                                                    "ndcg_vs_beta.png"]


def test_data_directory_with_hash_embedder(fixtures, tmp_path, capsys):
    rc = main(["eval", "--data", str(fixtures / "normalized"), "--embedder", "hash", "--graph", "knn", "--k", "2",
               "--candidates", "3", "--bootstrap", "20", "--quiet", "--methods",
               "pointwise,map-matched,history-concatenation,maximal-marginal-relevance,resolved-query-oracle",
               "--json", str(tmp_path / "t.json")])
    assert rc == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["info"]["conversations"] == 2 and data["info"]["graph"] == "knn"
    assert "resolved-query oracle" in [m["key"] for m in data["methods"]]
    assert "tiny" in capsys.readouterr().out


def test_subprocess_module_entry_point(tmp_path):
    command = [sys.executable, "-m", "mapmatched_torch", "eval", *SMALL, "--methods", "pointwise,map-matched,geodesic",
               *_outputs(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| pointwise |" in done.stdout
    assert (tmp_path / "r.json").is_file() and (tmp_path / "plots" / "ndcg_vs_beta.png").is_file()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--betas", "0,x"], "not a number"),
        (["--betas", "-1"], "nonnegative"),
        (["--lags", "full,-1"], "a lag is 'full' or an int"),
        (["--methods", "pointwise,mmr"], "unknown method(s): mmr"),
        (["--methods", "map-matched"], "must include pointwise"),
        (["--embedder", "nope"], "invalid choice"),
        (["--candidates", "0"], "positive integer"),
        (["--cast-qrels", "q.txt"], "need --cast-topics"),
        (["--embedder", "sentence-transformers"], "needs --model"),
        (["--data", "a", "--inscit", "b"], "not allowed with argument"),
        (["--maximal-marginal-relevance-lambda", "2"], "[0, 1]"),
    ],
)
def test_bad_options_exit_2_with_a_message(arguments, message, capsys):
    assert main(["eval", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_bad_inputs_exit_2_with_a_message(tmp_path, capsys):
    assert main(["eval", "--data", str(tmp_path / "missing"), "--quiet"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["eval", "--device", "no-such-device", "--quiet"]) == 2
    assert "--device" in capsys.readouterr().err


def test_command_is_required_and_help_exits_0(capsys):
    assert main([]) == 2
    assert main(["eval", "--help"]) == 0
    assert "--maximal-marginal-relevance-lambda" in capsys.readouterr().out
    assert build_parser().prog == "mapmatched-torch"


def test_version_prints_the_package_version(capsys):
    import mapmatched_torch

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mapmatched-torch {mapmatched_torch.__version__}"
