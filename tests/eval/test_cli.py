"""The ``mapmatched-torch eval`` command line, in-process and as a subprocess."""

from __future__ import annotations

import json
import re
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


# --------------------------------------------------------------------------- verdicts, warnings, inputs, outputs

FAST = ["--conversations", "24", "--turns", "4", "--candidates", "8", "--methods", "pointwise,map-matched",
        "--betas", "0,0.5", "--quiet"]


def test_bootstrap_0_verdicts_are_unjudged_in_markdown_and_json(tmp_path, capsys):
    assert main(["eval", *FAST, "--bootstrap", "0", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "PASS" not in out and "beyond tolerance" not in out
    assert "UNJUDGED: no intervals (--bootstrap 0)" in out
    methods = {m["key"]: m for m in json.loads((tmp_path / "r.json").read_text())["methods"]}
    judged = methods["map-matched lambda=1 beta=0.5 full"]
    assert judged["status"] == "UNJUDGED" and judged["verdict"]["passed"] is False
    assert judged["verdict"]["reason"].startswith("UNJUDGED: no intervals (--bootstrap 0)")


def test_a_single_conversation_warns_and_cannot_pass(tmp_path, capsys):
    assert main(["eval", *FAST, "--conversations", "1", "--bootstrap", "50", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr()
    assert "warning: only 1 conversation has labelled turns" in out.err  # printed even with --quiet
    assert "## Warnings" in out.out and "PASS" not in out.out
    data = json.loads((tmp_path / "r.json").read_text())
    assert any("only 1 conversation" in note for note in data["warnings"])
    assert {m["status"] for m in data["methods"]} == {"baseline", "UNJUDGED"}


def test_beta_0_is_marked_baseline(capsys):
    assert main(["eval", *FAST, "--bootstrap", "20"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| map-matched lambda=1 beta=0 ")]
    last = [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows]
    assert [cell for cell in last if not cell.isdigit()] == ["baseline", "baseline"]  # nDCG@3 and verdict tables
    assert not any("PASS" in row or "FAIL" in row for row in rows)


def test_no_labelled_turns_is_an_input_error(fixtures, tmp_path, capsys):
    folder = tmp_path / "unlabelled"
    folder.mkdir()
    rows = [json.loads(line) for line in (fixtures / "normalized" / "tiny.conversations.jsonl").read_text().splitlines()
            if line.strip()]
    for row in rows:
        for turn in row["turns"]:
            turn["qrels"] = {}
    (folder / "u.conversations.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "u.passages.jsonl").write_text((fixtures / "normalized" / "tiny.passages.jsonl").read_text())
    assert main(["eval", "--data", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"no labelled turns in {folder}" in err and '"qrels"' in err and "grade > 0" in err


def test_latin1_input_names_file_and_line_and_exits_2(fixtures, tmp_path, capsys):
    folder = tmp_path / "latin1"
    folder.mkdir()
    text = (fixtures / "normalized" / "tiny.conversations.jsonl").read_text()
    (folder / "l.conversations.jsonl").write_bytes(text.encode("utf-8") + '{"conversation_id": "é"}\n'.encode("latin-1"))
    (folder / "l.passages.jsonl").write_text((fixtures / "normalized" / "tiny.passages.jsonl").read_text())
    line = len(text.splitlines()) + 1
    assert main(["eval", "--data", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{folder / 'l.conversations.jsonl'}:{line}: not UTF-8 (byte 0xe9" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "option, target, message",
    [
        ("--json", "file/x.json", "is not a directory"),
        ("--markdown", "folder", "is a directory"),
        ("--plots", "file", "is an existing file"),
        ("--plots", "file/plots", "is not a directory"),
    ],
)
def test_unwritable_outputs_fail_before_any_work(tmp_path, capsys, monkeypatch, option, target, message):
    import mapmatched_torch.cli as cli

    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    monkeypatch.setattr(cli, "run_eval", lambda args: pytest.fail("the run started before the output check"))
    assert main(["eval", option, str(tmp_path / target)]) == 2
    err = capsys.readouterr().err
    assert f"{option} {tmp_path / target}: " in err and message in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc (a folder no one can write)")
def test_output_under_proc_fails_before_any_work(capsys, monkeypatch):
    import mapmatched_torch.cli as cli

    monkeypatch.setattr(cli, "run_eval", lambda args: pytest.fail("the run started before the output check"))
    assert main(["eval", "--json", "/proc/nope/x.json"]) == 2
    assert "--json /proc/nope/x.json: /proc/nope does not exist and cannot be created" in capsys.readouterr().err


def test_json_and_markdown_must_differ(tmp_path, capsys):
    assert main(["eval", "--json", str(tmp_path / "r"), "--markdown", str(tmp_path / "r")]) == 2
    assert "name the same file" in capsys.readouterr().err


def test_help_prints_each_default_once_as_typed(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: nothing wrapped
    assert main(["eval", "--help"]) == 0
    helps = {}  # option -> its help, continuation lines joined
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):
            option = line.split()[0]
            helps[option] = line
        elif line.startswith("   ") and helps:
            helps[option] += " " + line.strip()
    for option, line in helps.items():
        assert line.count("(default") <= 1, line
        assert "(None" not in line and "((" not in line and "(default: None)" not in line, line
        assert "default: False" not in line and "default: (" not in line, line
    assert helps["--betas"].endswith("(default: 0,0.25,0.5,1,2,4)")
    assert helps["--lags"].endswith("(default: full)") and helps["--lambdas"].endswith("(default: 1)")
    assert "(default: pointwise,map-matched,history-concatenation," in helps["--methods"]
    assert helps["--seed"].endswith("(default: 0)") and helps["--maximum-distance"].endswith("(default: 10)")
    assert helps["--graph"].endswith("(default: knn for data, the topic graph for the synthetic benchmark)")


def test_progress_lines_and_the_compile_notice(capsys, monkeypatch):
    import mapmatched_torch.eval.distances as distances

    monkeypatch.setattr(distances, "kernels_need_compiling", lambda device=None: True)
    assert main(["eval", *[a for a in FAST if a != "--quiet"], "--bootstrap", "10"]) == 0
    err = capsys.readouterr().err
    assert "building the topic graph" in err
    assert "compiling graph kernels (first run only; cached on disk)" in err


# --------------------------------------------------------------------------- fit

FIT = ["fit", "--conversations", "12", "--turns", "3", "--candidates", "6", "--quiet"]


def _unset_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_fit_writes_the_weights_of_fit_weights(tmp_path, capsys, monkeypatch):
    from mapmatched_torch.eval.methods import labelled_conversations
    from mapmatched_torch.eval.runner import inputs_from_synthetic
    from mapmatched_torch.eval.synthetic import make_synthetic
    from mapmatched_torch.fit import fit_weights

    _unset_torchrun(monkeypatch)
    out = tmp_path / "nested" / "weights.json"
    assert main([*FIT, "--validation-fraction", "0.25", "--seed", "3", "--output", str(out)]) == 0
    assert capsys.readouterr().err == ""  # --quiet
    written = json.loads(out.read_text())
    inputs = inputs_from_synthetic(make_synthetic(12, 3, 6, 3))
    expected = fit_weights(labelled_conversations(inputs), inputs.graph, validation_fraction=0.25, seed=3,
                           patience=10, progress=False)
    assert (written["lambda"], written["beta"]) == (expected.emission_weight, expected.transition_weight)
    assert written["n_conversations"] == 12 and written["stopped"] == expected.stopped
    assert written["world_size"] == 1 and written["options"]["seed"] == 3


def test_fit_that_keeps_its_starting_point_says_so_and_what_to_try(tmp_path, capsys, monkeypatch):
    import dataclasses

    import mapmatched_torch.fit as fit

    _unset_torchrun(monkeypatch)
    real = fit.fit_weights

    def stopped_at_once(*args, **kwargs):  # what a noisy validation split of a small set does
        result = real(*args, **kwargs)
        start = result.history[0]
        return dataclasses.replace(result, best_iteration=0, stopped="early_stopping",
                                   emission_weight=start.emission_weight, transition_weight=start.transition_weight)

    monkeypatch.setattr(fit, "fit_weights", stopped_at_once)
    out = tmp_path / "w.json"
    assert main([*FIT, "--validation-fraction", "0.25", "--output", str(out)]) == 0
    err = capsys.readouterr().err  # --quiet, and still the warning
    assert "warning: the fitted weights are the starting point (lambda=1, beta=1)" in err
    assert "--validation-fraction 0" in err and "--patience" in err
    written = json.loads(out.read_text())
    assert written["kept_starting_point"] is True and len(written["warnings"]) == 1
    assert main([*FIT[:-1], "--validation-fraction", "0.25", "--output", str(out)]) == 0
    assert "(the starting point: early stopping kept iteration 0)" in capsys.readouterr().err  # the summary line


def test_fit_defaults_suit_small_sets_and_name_each_gold_count(fixtures, tmp_path, monkeypatch):
    _unset_torchrun(monkeypatch)
    out = tmp_path / "w.json"
    assert main([*FIT, "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    # 12 conversations: no validation split by default (fitted to convergence), so no early stopping at iteration 0
    assert written["options"]["validation_fraction"] == 0.0 and written["n_validation_conversations"] == 0
    assert written["options"]["patience"] == 10 and written["kept_starting_point"] is False
    assert main(["fit", "--data", str(fixtures / "normalized"), "--embedder", "hash", "--k", "2", "--candidates", "1",
                 "--quiet", "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    assert "n_gold_missing" not in written  # it counted gold outside the candidates, not outside the corpus
    assert written["n_gold_not_in_corpus"] == written["info"]["gold_missing"]["labelled_turns_without_gold_in_corpus"]
    assert written["n_gold_not_among_candidates"] >= written["n_gold_not_in_corpus"]


def test_fit_takes_the_data_options_of_eval(fixtures, tmp_path, monkeypatch):
    _unset_torchrun(monkeypatch)
    out = tmp_path / "w.json"
    assert main(["fit", "--data", str(fixtures / "normalized"), "--embedder", "hash", "--k", "2", "--candidates", "3",
                 "--validation-fraction", "0", "--quiet", "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["info"]["graph"] == "knn" and written["lambda"] >= 0 and written["beta"] >= 0


@pytest.mark.parametrize(
    "arguments, message",
    [
        ([], "fit needs --json PATH (the fitted weights as JSON) or --out DIR (the model directory), or both"),
        (["--out", "m", "--method", "best"], "invalid choice: 'best'"),
        (["--output", "w.json", "--validation-fraction", "1"], "--validation-fraction must be in [0, 1)"),
        (["--output", "w.json", "--optimizer", "sgd"], "invalid choice"),
        (["--output", "w.json", "--bootstrap", "3"], "unrecognized arguments: --bootstrap"),
    ],
)
def test_fit_bad_options_exit_2_with_a_message(arguments, message, capsys):
    assert main(["fit", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_fit_output_that_is_a_directory_fails_before_any_work(tmp_path, capsys):
    assert main([*FIT, "--output", str(tmp_path)]) == 2
    assert "--json/--output" in capsys.readouterr().err
# (fit under torchrun: tests/fit/test_distributed_fit.py runs it with 2 gloo processes)


def _with_missing_gold(fixtures: Path, folder: Path) -> Path:
    """The tiny data set plus a conversation whose gold lies partly outside the corpus."""
    folder.mkdir()
    rows = (fixtures / "normalized" / "tiny.conversations.jsonl").read_text()
    extra = {"conversation_id": "c-gone", "turns": [
        {"turn": 0, "query": "Tea and cheese?", "qrels": {"Tea:1": 1, "Nowhere:1": 1}},
        {"turn": 1, "query": "What about the rest?", "qrels": {"Nowhere:2": 1}}]}
    (folder / "g.conversations.jsonl").write_text(rows.rstrip("\n") + "\n" + json.dumps(extra) + "\n")
    (folder / "g.passages.jsonl").write_text((fixtures / "normalized" / "tiny.passages.jsonl").read_text())
    return folder


@pytest.mark.parametrize("policy", ["all", "in-corpus"])
def test_missing_gold_is_counted_warned_and_droppable(fixtures, tmp_path, capsys, policy):
    folder = _with_missing_gold(fixtures, tmp_path / "data")
    rc = main(["eval", "--data", str(folder), "--embedder", "hash", "--k", "2", "--candidates", "3", "--bootstrap",
               "10", "--quiet", "--methods", "pointwise,map-matched", "--qrels", policy,
               "--json", str(tmp_path / "r.json")])
    assert rc == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["info"]["qrels"] == policy
    assert data["info"]["gold_missing"] == {"missing_ids": 2, "missing_judgements": 2,
                                            "labelled_turns_with_missing": 2,
                                            "labelled_turns_without_gold_in_corpus": 1}
    warning = next(note for note in data["warnings"] if "not in the corpus" in note)
    assert warning.startswith("2 gold judgements (2 passage IDs) of 2 labelled turns are not in the corpus")
    assert warning in capsys.readouterr().err
    # in-corpus: the turn whose only gold is missing is unjudged (it left the "all" slice)
    pointwise = next(m for m in data["methods"] if m["key"] == "pointwise")
    assert pointwise["slices"]["all"]["n_turns"] == (6 if policy == "all" else 5)
    assert ("--qrels in-corpus dropped them" in warning) == (policy == "in-corpus")


def test_stream_draws_the_synthetic_benchmark_chunk_by_chunk(fixtures, tmp_path, capsys):
    rc = main(["eval", *SMALL, "--stream", "--batch-size", "7", "--betas", "0,0.5", "--json", str(tmp_path / "s.json")])
    assert rc == 0
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["info"]["conversations"] == 24 and data["info"]["generator"]["stream"] is True
    keys = [m["key"] for m in data["methods"]]
    assert keys[0] == "pointwise" and "map-matched lambda=1 beta=0.5 full" in keys
    assert "fitted" in data["skipped"]  # it prepares on every conversation at once
    capsys.readouterr()
    assert main(["eval", "--data", str(fixtures / "normalized"), "--stream", "--quiet"]) == 2
    assert "--stream" in capsys.readouterr().err


@pytest.mark.parametrize("flag, bad, message", [
    ("--conversations", "x", "expected a positive integer, got 'x'"),
    ("--conversations", "0", "expected a positive integer, got 0"),
    ("--bootstrap", "-1", "expected an integer >= 0, got -1"),
    ("--maximal-marginal-relevance-lambda", "1.5", r"expected a number in \[0, 1\], got 1.5"),
    ("--mixing-l2", "inf", "expected a finite number >= 0, got inf"),
    ("--mixing-temperature", "0", "expected a finite number > 0, got 0.0"),  # refused before any data is read
    ("--mixing-temperature", "nan", "expected a finite number > 0, got nan"),
])
def test_number_options_are_refused_with_their_bounds(flag, bad, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", flag, bad])
    assert re.search(f"argument {flag}: {message}$", capsys.readouterr().err.strip())


def test_number_options_accept_their_bounds():
    args = build_parser().parse_args(["eval", "--bootstrap", "0", "--maximal-marginal-relevance-lambda", "1",
                                      "--mixing-l2", "0", "--mixing-temperature", "1e-3"])
    assert (args.bootstrap, args.relevance_weight, args.mixing_l2, args.mixing_temperature) == (
        0, 1.0, 0.0, 1e-3
    )


def test_an_interrupt_while_writing_leaves_the_old_reports_and_exits_130(tmp_path, capsys, monkeypatch):
    import mapmatched_torch.eval.plots as plots

    (tmp_path / "r.md").write_text("old markdown")
    (tmp_path / "r.json").write_text("old json")

    def interrupted(result, directory):
        raise KeyboardInterrupt  # Ctrl-C after the markdown and the JSON were written

    monkeypatch.setattr(plots, "write_plots", interrupted)
    assert main(["eval", *FAST, *_outputs(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err == "mapmatched-torch eval: interrupted\n"  # one line, no traceback
    assert (tmp_path / "r.md").read_text() == "old markdown" and (tmp_path / "r.json").read_text() == "old json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]  # no temporary file left


def test_fit_writes_its_output_through_a_rename(tmp_path, monkeypatch):
    import os

    _unset_torchrun(monkeypatch)
    out = tmp_path / "w.json"
    out.write_text("old")
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda source, target: (renamed.append(target), replace(source, target)))
    assert main([*FIT, "--output", str(out)]) == 0
    assert renamed == [str(out)] and json.loads(out.read_text())["world_size"] == 1


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_out_of_memory_while_loading_data_is_a_resource_failure(fixtures, capsys, monkeypatch, failure):
    import mapmatched_torch.eval.data as data

    def load_directory(path):
        raise failure

    monkeypatch.setattr(data, "load_directory", load_directory)
    assert main(["eval", "--data", str(fixtures / "normalized"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mapmatched-torch eval: error: out of memory") and "a resource failure" in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_other_runtime_errors_still_propagate(fixtures, monkeypatch):
    import mapmatched_torch.eval.data as data

    def load_directory(path):
        raise RuntimeError("a bug")

    monkeypatch.setattr(data, "load_directory", load_directory)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["eval", "--data", str(fixtures / "normalized"), "--quiet"])


def test_fit_writes_its_json_with_the_option_of_eval_and_keeps_output_as_an_alias(tmp_path, capsys, monkeypatch):
    _unset_torchrun(monkeypatch)
    assert main([*FIT, "--json", str(tmp_path / "new.json")]) == 0
    assert main([*FIT, "--output", str(tmp_path / "old.json")]) == 0
    assert (tmp_path / "new.json").read_text() == (tmp_path / "old.json").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "--help"])
    helps = " ".join(capsys.readouterr().out.split())
    assert "--json PATH, --output PATH write the fitted weights (JSON) here; --output is the old name" in helps


def test_the_selection_preference_and_margin_reach_the_report(tmp_path, capsys):
    args = build_parser().parse_args(["eval"])
    assert (args.selection_prefer, args.selection_margin) == ("mixed", 1.0)
    assert main(["eval", *FAST, "--selection-prefer", " fitted , ", "--selection-margin", "0.5",
                 "--json", str(tmp_path / "p.json")]) == 0
    config = json.loads((tmp_path / "p.json").read_text())["config"]
    assert (config["selection_preference"], config["selection_margin"]) == (["fitted"], 0.5)
    assert main(["eval", *FAST, "--selection-prefer", "", "--json", str(tmp_path / "q.json")]) == 0
    assert json.loads((tmp_path / "q.json").read_text())["config"]["selection_preference"] == []
    assert main(["eval", *FAST, "--selection-prefer", "nope"]) == 2
    assert "unknown methods ['nope']" in capsys.readouterr().err
