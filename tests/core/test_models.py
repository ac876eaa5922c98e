"""Validation of the frozen value types."""

from __future__ import annotations

import dataclasses
import math

import pytest

from mapmatched_torch.core.models import (
    CandidateScore,
    DecodedPath,
    DecodedStep,
    DecoderCandidate,
    RetrievalTrace,
    ScoredCandidate,
    TraceStep,
)


def step(**overrides):
    fields = dict(
        turn_index=0,
        chunk_id="a",
        raw_emission_score=1.0,
        normalized_emission_score=0.5,
        weighted_emission_score=0.5,
        graph_distance=0.0,
        weighted_transition_cost=0.0,
        cumulative_score=0.5,
    )
    fields.update(overrides)
    return DecodedStep(**fields)


@pytest.mark.parametrize(
    "factory, message",
    [
        (lambda: ScoredCandidate("", 1.0), "^candidate chunk_id must not be empty$"),
        (lambda: ScoredCandidate(3, 1.0), "must be a string"),
        (lambda: ScoredCandidate("a", math.nan), r"^candidate score must be finite, got nan \(candidate 'a'\)$"),
        (lambda: ScoredCandidate("a", math.inf), "^candidate score must be finite"),
        (lambda: ScoredCandidate("a", "1.0"), "^candidate score must be finite.*a real number is required"),
        (lambda: ScoredCandidate("a", True), "^candidate score must be finite.*a real number is required"),
        (lambda: DecoderCandidate("", 1.0, 0.0), "^decoder candidate chunk_id must not be empty$"),
        (lambda: DecoderCandidate("a", math.nan, 0.0), "^raw score must be finite, got nan"),
        (lambda: DecoderCandidate("a", 1.0, math.nan), "^normalized score must be finite, got nan"),
        (lambda: CandidateScore("a", -math.inf), "finite"),
        (lambda: step(graph_distance=-1.0), "nonnegative"),
        (lambda: step(cumulative_score=math.nan), "cumulative_score"),
        (lambda: step(turn_index=-1), "turn_index"),
        (lambda: DecodedPath(steps=(), chunk_ids=(), total_score=0.0), "^decoded path must contain at least one step"),
        (lambda: DecodedPath((step(),), ("b",), 0.0), "^decoded path chunk_ids must match its steps"),
        (lambda: DecodedPath((step(),), 0.0, 0.0), "^decoded path chunk_ids must match its steps"),
        (lambda: DecodedPath((step(),), ("a",), math.nan), "^decoded path total score must be finite"),
        (lambda: RetrievalTrace(steps=(), path_chunk_ids=("a",)), "1 entries for 0 steps"),
    ],
)
def test_invalid_values_raise_value_error(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


@pytest.mark.parametrize("score", ["1.0", None, True])
def test_a_score_that_is_not_a_number_is_a_type_error_too(score):
    # mapmatched 0.1.0's math.isfinite raised a TypeError there: both excepts keep working
    for build in (lambda: ScoredCandidate("a", score), lambda: DecoderCandidate("a", 1.0, score)):
        with pytest.raises(TypeError):
            build()
        with pytest.raises(ValueError):
            build()


def test_frozen_and_slotted():
    candidate = ScoredCandidate("a", 1)
    assert candidate.score == 1.0 and isinstance(candidate.score, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        candidate.score = 2.0
    assert not hasattr(candidate, "__dict__")


def test_trace_step_move_is_validated():
    fields = {f.name: getattr(step(), f.name) for f in dataclasses.fields(DecodedStep)}
    with pytest.raises(ValueError, match="unsupported move: teleport"):
        TraceStep(**fields, emission_entropy=0.0, normalized_emission_margin=0.0, move="teleport")


def test_decoded_path_chunk_ids_and_len():
    path = DecodedPath(steps=[step(), step(turn_index=1, chunk_id="b")], chunk_ids=["a", "b"], total_score=0.5)
    assert path.chunk_ids == ("a", "b")
    assert path == DecodedPath(path.steps, ("a", "b"), 0.5)  # mapmatched's positional order
    assert len(path) == 2
    assert isinstance(path.steps, tuple)


def test_trusted_constructors_build_what_the_checked_types_build() -> None:
    import random

    from mapmatched_torch.core.models import CandidateScore, DecoderCandidate, trusted_constructor

    rng = random.Random(0)
    for cls, values in (
        (DecoderCandidate, lambda: (f"c{rng.randrange(99)}", rng.gauss(0, 1), rng.choice([0.0, -0.0, rng.random()]))),
        (CandidateScore, lambda: (rng.choice(["a", "é", "x" * 40]), rng.gauss(0, 1e300))),
    ):
        build = trusted_constructor(cls)
        for _ in range(50):
            fields = values()
            built, checked = build(*fields), cls(*fields)
            assert built == checked and hash(built) == hash(checked) and repr(built) == repr(checked)
            assert type(built) is cls
        with pytest.raises(Exception):
            build(*fields).chunk_id = "other"  # still frozen


def test_trusted_constructors_need_slotted_dataclasses() -> None:
    from mapmatched_torch.core.models import trusted_constructor

    @dataclasses.dataclass(frozen=True)
    class Plain:
        value: float

    with pytest.raises(TypeError, match="slotted dataclass"):
        trusted_constructor(Plain)
