"""ChunkVocabulary: chunk IDs <-> node indices, unknown codes, rank order."""

from __future__ import annotations

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.graph import PADDING_INDEX, ChunkVocabulary


def test_lookups_both_ways() -> None:
    vocabulary = ChunkVocabulary(["b", "a", "c"])
    assert len(vocabulary) == 3 and list(vocabulary) == ["b", "a", "c"]
    assert "a" in vocabulary and "z" not in vocabulary and 1 not in vocabulary
    assert vocabulary[0] == "b" and vocabulary.chunk_ids == ("b", "a", "c")
    index = vocabulary.index(["c", "zzz", "b"])
    assert index.dtype == torch.long and index.tolist() == [2, PADDING_INDEX, 0]
    assert vocabulary.index_of("a") == 1 and vocabulary.index_of("q") == -1
    assert vocabulary.indices_of(["c", "zzz", "b"]) == [2, PADDING_INDEX, 0] and vocabulary.indices_of(("a",)) == [1]
    assert vocabulary.indices_of([]) == []
    with pytest.raises(MapMatchedValueError, match="not a string"):
        vocabulary.indices_of("abc")
    assert vocabulary.ids(torch.tensor([1, 2])) == ["a", "c"] and vocabulary.ids([0]) == ["b"]
    assert vocabulary.index([]).shape == (0,)
    assert vocabulary == ChunkVocabulary(["b", "a", "c"]) and vocabulary != ChunkVocabulary(["a", "b", "c"])
    assert "size=3" in repr(vocabulary)


def test_distinct_unknown_codes_share_one_code_per_id() -> None:
    vocabulary = ChunkVocabulary(["a"])
    assert vocabulary.index(["x", "a", "y", "x", "y"], distinct_unknown=True).tolist() == [-2, 0, -3, -2, -3]


def test_index_goes_to_the_device(device) -> None:
    assert ChunkVocabulary(["a"]).index(["a"], device=device).device.type == device.type


def test_rank_sorts_like_python_strings() -> None:
    ids = ["b10", "b2", "A", "a", "é", "b1"]
    rank = ChunkVocabulary(ids).rank()
    assert [ids[i] for i in torch.argsort(rank).tolist()] == sorted(ids)


@pytest.mark.parametrize(
    ("ids", "words"),
    [(["a", "a"], "duplicate chunk ID 'a' at positions 0 and 1"), (["a", ""], "chunk ID 1 must be non-empty"),
     (["a", 3], "chunk ID 1 must be a string"), ("abc", "not a string")],
)
def test_bad_ids_are_value_errors(ids, words) -> None:
    with pytest.raises(MapMatchedValueError, match=words):
        ChunkVocabulary(ids)


@pytest.mark.parametrize("bad", [[-1], [3], [True], [1.0]])
def test_ids_rejects_indices_without_an_id(bad) -> None:
    with pytest.raises(ValueError, match="is not in \\[0, 3\\)"):
        ChunkVocabulary(["a", "b", "c"]).ids(bad)


def test_index_rejects_a_bare_string() -> None:
    with pytest.raises(ValueError, match="not a string"):
        ChunkVocabulary(["a"]).index("a")
