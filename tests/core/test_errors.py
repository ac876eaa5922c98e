"""The error types and the shared checks' messages: one format per idea, naming what is
wrong and how to fix it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mapmatched_torch.core.checks import check_choice, check_sequence, check_trellis, describe
from mapmatched_torch.core.errors import (
    FAISSNotInstalledError,
    MapMatchedError,
    MapMatchedTypeError,
    MapMatchedValueError,
    MissingDependencyError,
)
from mapmatched_torch.core.models import DecoderCandidate, ScoredCandidate

PACKAGE = Path(__file__).resolve().parents[2] / "mapmatched_torch"


def test_the_type_error_is_also_a_value_error_and_a_project_error():
    error = MapMatchedTypeError("x")
    assert isinstance(error, TypeError) and isinstance(error, ValueError)
    assert isinstance(error, MapMatchedValueError) and isinstance(error, MapMatchedError)


# ------------------------------------------------------------------ check_choice

MODES = ("zscore", "center", "none")


@pytest.mark.parametrize(
    "value, choices, message",
    [
        ("minmax", MODES, "unsupported mode: minmax (expected one of 'zscore', 'center', 'none')"),
        ("zscor", MODES, "unsupported mode: zscor (expected one of 'zscore', 'center', 'none'; did you mean 'zscore'?)"),
        ("NONE", MODES, "unsupported mode: NONE (expected one of 'zscore', 'center', 'none'; did you mean 'none'?)"),
        (None, MODES, "unsupported mode: None (expected one of 'zscore', 'center', 'none')"),
        (1, MODES, "unsupported mode: 1 (expected one of 'zscore', 'center', 'none')"),
        (["zscore"], MODES, "unsupported mode: ['zscore'] (expected one of 'zscore', 'center', 'none')"),
        (100, (64, 128), "unsupported mode: 100 (expected one of 64, 128)"),
        ("64", (64, 128), "unsupported mode: '64' (expected one of 64, 128)"),
        (True, (1, 2), "unsupported mode: True (expected one of 1, 2)"),
    ],
)
def test_check_choice_names_the_value_and_every_choice(value, choices, message):
    with pytest.raises(MapMatchedValueError, match=f"^{re.escape(message)}$"):
        check_choice("mode", value, choices)


def test_check_choice_returns_the_choice():
    assert check_choice("mode", "center", MODES) == "center"
    assert check_choice("wordllama dim", 128, (64, 128)) == 128
    assert check_choice("mode", "b", iter(["a", "b"])) == "b"  # any iterable of choices


def test_every_expected_one_of_message_comes_from_check_choice():
    # one message format: no hand-written "expected one of" f-string outside core/checks.py
    hand_written = re.compile(r"""\bf["'].*expected one of""")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "checks.py" or path.parent.name != "core"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if hand_written.search(line)
    ]
    assert offenders == []


# --------------------------------------------------------------- sequences, trellises


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "turns must be a list of turns, got None"),
        (42, "turns must be a list of turns, got int 42"),
        ("ab", "turns must be a list of turns, got str 'ab'"),
        (b"ab", "turns must be a list of turns, got bytes b'ab'"),
        (3.5, "turns must be a list of turns, got float 3.5"),
    ],
)
def test_check_sequence_refuses_non_sequences_as_type_errors(value, message):
    with pytest.raises(MapMatchedTypeError, match=f"^{re.escape(message)}$"):
        check_sequence(value, "turns", "a list of turns")


def test_check_sequence_materializes_iterables_and_describe_cuts_long_values():
    assert check_sequence((x for x in "ab"), "turns", "x") == ("a", "b")
    assert check_sequence({"a": 1}, "turns", "x") == ("a",)
    assert describe("x" * 100).startswith("str 'xxx") and describe("x" * 100).endswith("...")
    assert len(describe("x" * 100)) == len("str ") + 60


@pytest.mark.parametrize(
    "trellis, error, message",
    [
        (None, MapMatchedTypeError, "trellis must be a sequence of turns (each a sequence of DecoderCandidate), got None"),
        ([None], MapMatchedTypeError, "trellis turn 0 must be a sequence of DecoderCandidate, got None"),
        ([[None]], MapMatchedTypeError,
         "trellis turn 0 candidate 0 must be a DecoderCandidate (chunk_id, raw_score, normalized_score), got None"),
        ([[("a", 1.0, 1.0)]], MapMatchedTypeError, "trellis turn 0 candidate 0 must be a DecoderCandidate"),
        ([[ScoredCandidate("a", 1.0)]], MapMatchedTypeError,
         "trellis turn 0 candidate 0 is a ScoredCandidate (chunk_id, score), but a trellis holds normalized "
         "DecoderCandidate (chunk_id, raw_score, normalized_score): convert each turn with "
         "normalize_candidates(turn, score_normalization) first"),
        ([[DecoderCandidate("a", 1.0, 0.0)], []], MapMatchedValueError, "trellis turn 1 must contain candidates"),
        ([], MapMatchedValueError, "trellis must contain at least one turn"),
    ],
)
def test_check_trellis_says_what_it_got_and_what_it_takes(trellis, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}") as caught:
        check_trellis(trellis)
    assert type(caught.value) is error


# ----------------------------------------------------------------- missing extras


def test_missing_extra_hints_are_quoted_and_name_the_clone_install():
    message = str(MissingDependencyError("networkx", "networkx", "graph export"))
    assert message == (
        "networkx is required for graph export; install it with `pip install 'mapmatched-torch[networkx]'`, "
        "or from a clone of the repository with `pip install -e '.[networkx]'`"
    )
    faiss = str(FAISSNotInstalledError())
    assert "`pip install 'mapmatched-torch[faiss]'`" in faiss and "`pip install -e '.[faiss]'`" in faiss
    assert "[faiss-gpu]" in faiss


@pytest.mark.parametrize("shapes", [[(3, 1), (1, 4)], [(2, 5, 1), (1, 5)], [(0, 1), (1, 3)], [(), (2,)], [(4,)], []])
def test_broadcast_shape_is_torchs(shapes):
    from mapmatched_torch.core.checks import broadcast_shape

    assert broadcast_shape(*shapes) == tuple(torch.broadcast_shapes(*shapes))


def test_broadcast_shape_refuses_what_does_not_broadcast():
    from mapmatched_torch.core.checks import broadcast_shape

    with pytest.raises(ValueError, match=r"\(2, 3\), \(4,\) do not broadcast"):
        broadcast_shape((2, 3), (4,))
    with pytest.raises(ValueError, match="do not broadcast"):
        broadcast_shape((0,), (3,))
