"""Dataset types and loaders (normalized JSONL, INSCIT, TopiOCQA, TREC CAsT) on hand-written fixtures."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.data import (
    Conversation,
    Dataset,
    Passage,
    Turn,
    load_directory,
    load_inscit,
    load_normalized,
    load_topiocqa,
    load_trec_cast,
    read_passages,
)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --------------------------------------------------------------------------- types


def test_types_validate_and_copy():
    turn = Turn(0, "q", qrels={"a": 1, "b": 0})
    assert turn.qrels == {"a": 1.0, "b": 0.0} and isinstance(turn.qrels["a"], float)
    assert turn.labelled and turn.relevant_ids == ("a",)
    assert not Turn(1, "q", qrels={"a": 0.0}).labelled
    with pytest.raises(MapMatchedValueError, match="nonnegative int"):
        Turn(-1, "q")
    with pytest.raises(MapMatchedValueError, match="grade of 'a' must be finite"):
        Turn(0, "q", qrels={"a": float("nan")})
    with pytest.raises(MapMatchedValueError, match="topic_switch must be a bool"):
        Turn(0, "q", topic_switch=1)  # type: ignore[arg-type]
    with pytest.raises(MapMatchedValueError, match="strictly increase"):
        Conversation("c", (Turn(1, "a"), Turn(1, "b")))
    with pytest.raises(MapMatchedValueError, match="has no turns"):
        Conversation("c", ())
    with pytest.raises(MapMatchedValueError, match="non-empty"):
        Passage("", "text")
    assert Passage("p", "t", section_path=["a", "b"]).section_path == ("a", "b")


def test_dataset_helpers():
    conversations = (
        Conversation("c0", (Turn(0, "x", qrels={"p1": 1.0}), Turn(1, "y", topic_switch=True))),
        Conversation("c1", (Turn(0, "z", qrels={"p2": 2.0, "gone": 1.0}, topic_switch=False),)),
    )
    dataset = Dataset("d", conversations, (Passage("p1", "one"), Passage("p2", "two")))
    assert len(dataset) == 2 and dataset.num_turns == 3 and dataset.labelled_turn_count == 2
    assert dataset.passage_index == {"p1": 0, "p2": 1}
    assert dataset.passage("p2").text == "two"
    with pytest.raises(KeyError, match="'nope' is not in dataset 'd'"):
        dataset.passage("nope")
    assert dataset.missing_qrel_ids() == ("gone",)
    table = dataset.turn_table()
    assert table.conversation.tolist() == [0, 0, 1]
    assert table.position.tolist() == [0, 1, 0]
    assert table.labelled.tolist() == [True, False, True]
    assert table.topic_switch.tolist() == [-1, 1, 0] and table.topic_switch.dtype == torch.int8
    assert [list(q) for q in dataset.turn_qrels()] == [["p1"], [], ["p2", "gone"]]
    assert dataset.select([1]).conversations[0].conversation_id == "c1"
    assert dataset.summary() == {"name": "d", "conversations": 2, "turns": 3, "labelled_turns": 2, "passages": 2}
    with pytest.raises(MapMatchedValueError, match="duplicate passage id 'p1'"):
        Dataset("d", conversations, (Passage("p1", "a"), Passage("p1", "b")))
    with pytest.raises(MapMatchedValueError, match="duplicate conversation_id 'c0'"):
        Dataset("d", (conversations[0], conversations[0]))


# --------------------------------------------------------------------------- normalized


def test_load_directory_fixture(fixtures):
    dataset = load_directory(fixtures / "normalized")
    assert dataset.name == "tiny"
    assert [c.conversation_id for c in dataset.conversations] == ["c-cheese", "c-tea"]
    cheese, tea = dataset.conversations
    assert cheese.metadata == {"seed": {"title": "Cheese", "topic": "food", "level": 1}}
    assert cheese.turns[0].qrels == {"Cheese:1": 1.0, "Types of cheese:2": 1.0}
    assert cheese.turns[1].rewrite == "Can cheese be vegan?" and cheese.turns[1].qrels == {"Vegan cheese:1": 2.0}
    assert [t.topic_switch for t in cheese.turns] == [False, True, False]
    assert [t.topic_switch for t in tea.turns] == [None, False]
    assert dataset.num_turns == 5 and dataset.labelled_turn_count == 4
    assert len(dataset.passages) == 5 and dataset.missing_qrel_ids() == ()
    types = dataset.passage("Types of cheese:2")
    assert (types.doc_id, types.position, types.title, types.section_path) == (
        "Types of cheese", 2, "Types of cheese", ("Types of cheese", "Source of milk"))
    bare = dataset.passage("Tea:2")
    assert (bare.doc_id, bare.position, bare.title, bare.section_path) == (None, None, None, ())


def test_load_normalized_reads_gzip_and_names(fixtures, tmp_path):
    source = fixtures / "normalized" / "tiny.conversations.jsonl"
    target = tmp_path / "mine.conversations.jsonl.gz"
    with gzip.open(target, "wt", encoding="utf-8") as handle:
        handle.write(source.read_text(encoding="utf-8"))
    dataset = load_normalized(target)
    assert dataset.name == "mine" and dataset.passages == () and dataset.num_turns == 5
    assert load_normalized(source, name="other").name == "other"


@pytest.mark.parametrize(
    "lines, message",
    [
        ('{"conversation_id": "a", "turns": [{"query": "q"}]}\n{"conversation_id": "b", "turns": [}\n', r":2: invalid JSON"),
        ('{"conversation_id": "a", "turns": [{"turn": 0}]}\n', r":1: turn 0: missing field 'query'"),
        ('{"turns": []}\n', r":1: missing field 'conversation_id'"),
        ('{"conversation_id": "a", "turns": [{"query": "q", "qrels": {"p": "high"}}]}\n', r":1: turn 0: qrels grade of 'p'"),
        ('{"conversation_id": "a", "turns": [{"query": "q", "topic_switch": 1}]}\n', r":1: turn 0: topic_switch must be"),
        ('{"conversation_id": "a", "turns": [{"query": "q", "turn": 2}, {"query": "r", "turn": 1}]}\n', r":1: .*strictly increase"),
        ('{"conversation_id": "a", "turns": [{"query": "q"}]}\n{"conversation_id": "a", "turns": [{"query": "q"}]}\n',
         r":2: duplicate conversation_id 'a' \(first at .*:1\)"),
        ('{"conversation_id": "a", "turns": []}\n', r":1: conversation 'a' has no turns"),
        ('[1, 2]\n', r":1: expected a JSON object"),
    ],
)
def test_load_normalized_errors_name_file_and_line(tmp_path, lines, message):
    path = _write(tmp_path / "bad.conversations.jsonl", lines)
    with pytest.raises(MapMatchedValueError, match=message) as info:
        load_normalized(path)
    assert str(info.value).startswith(str(path))


def test_read_passages_errors(tmp_path):
    path = _write(tmp_path / "p.passages.jsonl", '{"id": "a", "text": "x"}\n\n{"id": "a", "text": "y"}\n')
    with pytest.raises(MapMatchedValueError, match=r":3: duplicate passage id 'a' \(first at .*:1\)"):
        read_passages(path)
    path = _write(tmp_path / "q.passages.jsonl", '{"id": "a", "text": "x", "position": "first"}\n')
    with pytest.raises(MapMatchedValueError, match=r"q.passages.jsonl:1: position must be an integer"):
        read_passages(path)
    path = _write(tmp_path / "r.passages.jsonl", '{"id": "a", "text": "x", "section_path": "A"}\n')
    with pytest.raises(MapMatchedValueError, match=r":1: section_path must be a list"):
        read_passages(path)
    with pytest.raises(MapMatchedValueError, match="no such file"):
        read_passages(tmp_path / "missing.jsonl")


def test_load_directory_needs_exactly_one_of_each(fixtures, tmp_path):
    with pytest.raises(MapMatchedValueError, match="not a directory"):
        load_directory(tmp_path / "nope")
    with pytest.raises(MapMatchedValueError, match=r"exactly one \*\.conversations\.jsonl file, found 0 \(none\)"):
        load_directory(tmp_path)
    for name in ("a.conversations.jsonl", "b.conversations.jsonl", "a.passages.jsonl"):
        shutil.copy(fixtures / "normalized" / ("tiny." + name.split(".", 1)[1]), tmp_path / name)
    with pytest.raises(MapMatchedValueError, match=r"found 2 \(a.conversations.jsonl, b.conversations.jsonl\)"):
        load_directory(tmp_path)
    (tmp_path / "b.conversations.jsonl").unlink()
    assert load_directory(tmp_path).name == "a"


# --------------------------------------------------------------------------- INSCIT


def test_load_inscit_fixture(fixtures):
    dataset = load_inscit(fixtures / "inscit_tiny.json")
    first, second = dataset.conversations
    assert first.conversation_id == "inscit-food_level1_dial1" and second.conversation_id == "inscit-top25_dial2"
    assert first.metadata == {"seed": {"title": "Cheese", "topic": "food", "level": 1}} and second.metadata == {}
    assert [t.turn for t in first.turns] == [0, 1, 2, 3, 4]
    assert [t.query for t in first.turns][:3] == [
        "Which milks are used for cheese?", "Can it be vegan?", "What is the weather like?"]
    assert [list(t.qrels) for t in first.turns] == [
        ["Types of cheese:2", "Cheese:1"], ["Vegan cheese:1", "Vegan cheese:0"], [], ["Vegan cheese:1"],
        ["Cheese:1", "Vegan cheese:1"]]
    assert all(grade == 1.0 for t in first.turns for grade in t.qrels.values())
    # articles disjoint from the latest labelled turn's -> switch; no evidence -> False
    assert [t.topic_switch for t in first.turns] == [False, True, False, False, False]
    assert [t.rewrite for t in first.turns] == [None] * 5
    assert dataset.passage_ids == ("Types of cheese:2", "Cheese:1", "Vegan cheese:1", "Vegan cheese:0", "Match:3")
    types = dataset.passage("Types of cheese:2")
    assert (types.doc_id, types.position, types.title, types.section_path) == (
        "Types of cheese", 2, "Types of cheese", ("Types of cheese", "Source of milk"))
    toc = dataset.passage("Vegan cheese:0")
    assert (toc.doc_id, toc.position, toc.title, toc.section_path) == ("Vegan cheese", 0, "Vegan cheese", ())
    assert dataset.labelled_turn_count == 5 and dataset.missing_qrel_ids() == ()


@pytest.mark.parametrize(
    "document, message",
    [
        ([], r"expected a JSON object of dialogue id -> dialogue"),
        ({"d": {}}, r"dialogue 'd': missing field 'turns'"),
        ({"d": {"turns": [{"context": []}]}}, r"dialogue 'd' turn 0: context must be a non-empty list"),
        ({"d": {"turns": [{"context": ["q"], "labels": [{"evidence": [{"passage_text": "x"}]}]}]}},
         r"dialogue 'd' turn 0 label 0 evidence 0: missing field 'passage_id'"),
        ({"d": {"turns": [{"context": ["q"], "labels": [{"evidence": "x"}]}]}}, r"turn 0 label 0: evidence must be a list"),
    ],
)
def test_load_inscit_errors(tmp_path, document, message):
    path = _write(tmp_path / "dev.json", json.dumps(document))
    with pytest.raises(MapMatchedValueError, match=message):
        load_inscit(path)
    with pytest.raises(MapMatchedValueError, match=r"bad.json:1: invalid JSON"):
        load_inscit(_write(tmp_path / "bad.json", "{"))


def test_load_inscit_reproduces_the_shared_normalized_form(inscit_dev, tmp_path):
    """Rebuild an INSCIT-structured file from the normalized data: the loader must give it back."""
    normalized = load_directory(inscit_dev)
    document = {}
    for conversation in normalized.conversations:
        turns = []
        for turn in conversation.turns:
            labels = [
                {"responseType": "directAnswer", "response": "r", "evidence": [{
                    "passage_id": pid, "passage_text": normalized.passage(pid).text,
                    "passage_titles": list(normalized.passage(pid).section_path)}]}
                for pid in turn.qrels
            ]
            turns.append({"context": ["earlier", "answer", turn.query], "prevEvidence": [], "labels": labels})
        key = conversation.conversation_id[len("inscit-"):]
        document[key] = {"seedArticle": conversation.metadata["seed"], "turns": turns}
    path = _write(tmp_path / "dev.json", json.dumps(document))
    loaded = load_inscit(path, name=normalized.name)
    assert loaded.conversations == normalized.conversations
    assert sorted(loaded.passages, key=lambda p: p.id) == sorted(normalized.passages, key=lambda p: p.id)


def test_shared_inscit_dev_smoke(inscit_dev):
    dataset = load_directory(inscit_dev)
    assert dataset.summary() == {
        "name": "inscit_dev", "conversations": 86, "turns": 502, "labelled_turns": 485, "passages": 996}
    assert dataset.missing_qrel_ids() == ()
    assert int(dataset.turn_table().topic_switch.eq(1).sum()) == 149


# --------------------------------------------------------------------------- TopiOCQA


@pytest.mark.parametrize("name", ["topiocqa_tiny.json", "topiocqa_tiny.jsonl"])
def test_load_topiocqa_fixture(fixtures, name):
    dataset = load_topiocqa(fixtures / name)
    assert [c.conversation_id for c in dataset.conversations] == ["7", "8"]
    seven = dataset.conversations[0]
    assert [t.turn for t in seven.turns] == [0, 1, 2, 3, 4]
    assert [t.query for t in seven.turns][:2] == ["who sang the song?", "when was it released?"]
    assert [t.qrels for t in seven.turns] == [
        {"wiki:101": 1.0}, {"wiki:102": 1.0}, {"201": 1.0}, {}, {"wiki:202": 1.0}]
    # the article part of the title decides; a turn without gold passage is unknown
    assert [t.topic_switch for t in seven.turns] == [False, False, True, None, False]
    assert dataset.conversations[1].turns[0].topic_switch is False
    release = dataset.passage("wiki:102")
    assert (release.doc_id, release.title, release.section_path, release.text) == (
        "Song", "Song [SEP] Release", ("Song", "Release"), "The song was released in 1999.")
    assert dataset.passage("201").section_path == ("Band",)
    assert dataset.labelled_turn_count == 5


@pytest.mark.parametrize(
    "row, message",
    [
        ({"Conversation_no": 1, "Turn_no": 0, "Question": "q"}, r":2: Turn_no must be >= 1"),
        ({"Conversation_no": 1, "Turn_no": 2}, r":2: missing field 'Question'"),
        ({"Conversation_no": 1, "Turn_no": 2, "Question": "q", "Additional_answers": {}}, r":2: Additional_answers must be a list"),
        ({"Conversation_no": 1, "Turn_no": 1, "Question": "q"}, r":2: duplicate Turn_no 1 in conversation 1"),
        ({"Conversation_no": 1, "Turn_no": 2, "Question": "q", "Gold_passage": {"title": "t"}}, r":2 Gold_passage: missing field 'id'"),
    ],
)
def test_load_topiocqa_errors(tmp_path, row, message):
    good = {"Conversation_no": 1, "Turn_no": 1, "Question": "q", "Gold_passage": {"id": 1, "title": "T", "text": "x"}}
    path = _write(tmp_path / "rows.jsonl", json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(MapMatchedValueError, match=message):
        load_topiocqa(path)


def test_load_topiocqa_array_errors_name_the_row(tmp_path):
    path = _write(tmp_path / "rows.json", json.dumps([{"Conversation_no": 1, "Turn_no": "x", "Question": "q"}]))
    with pytest.raises(MapMatchedValueError, match=r"rows.json: row 0: Turn_no must be an integer"):
        load_topiocqa(path)


# --------------------------------------------------------------------------- TREC CAsT


def test_load_trec_cast_fixture(fixtures):
    dataset = load_trec_cast(fixtures / "cast_topics.json", fixtures / "cast_qrels.txt", fixtures / "cast_passages.jsonl")
    assert [c.conversation_id for c in dataset.conversations] == ["31", "32"]
    topic = dataset.conversations[0]
    assert topic.metadata == {"title": "Head and neck cancer", "description": "A person is trying to compare treatments."}
    assert [t.turn for t in topic.turns] == [0, 1, 2]
    assert [t.query for t in topic.turns] == ["What is throat cancer?", "Is it treatable?", "Tell me about lung cancer."]
    assert [t.rewrite for t in topic.turns] == ["What is throat cancer?", "Is throat cancer treatable?", None]
    assert topic.turns[0].qrels == {"MARCO_1": 2.0, "CAR_aa": 0.0, "MARCO_2": 1.0}
    assert topic.turns[1].qrels == {"MARCO_3": 4.0}  # a repeated (qid, docid) keeps the last grade
    assert topic.turns[2].qrels == {}
    assert all(t.topic_switch is None for _, _, t in dataset.iter_turns())
    assert dataset.conversations[1].turns[0].qrels == {"CAR_bb": 1.0}  # qid 99_1 matched no topic: ignored
    assert dataset.labelled_turn_count == 3
    assert dataset.passage_ids == ("MARCO_1", "MARCO_2", "MARCO_3")
    assert dataset.missing_qrel_ids() == ("CAR_bb",)


def test_load_trec_cast_without_qrels_or_corpus(fixtures):
    dataset = load_trec_cast(fixtures / "cast_topics.json")
    assert dataset.passages == () and dataset.labelled_turn_count == 0
    passages = [Passage("MARCO_1", "x")]
    assert load_trec_cast(fixtures / "cast_topics.json", None, passages).passage_ids == ("MARCO_1",)
    with pytest.raises(MapMatchedValueError, match="must be Passage objects"):
        load_trec_cast(fixtures / "cast_topics.json", None, ["MARCO_1"])  # type: ignore[list-item]


def test_load_trec_cast_errors(fixtures, tmp_path):
    bad = _write(tmp_path / "qrels.txt", "31_1 Q0 MARCO_1 2\n31_2 Q0 MARCO_3\n")
    with pytest.raises(MapMatchedValueError, match=r"qrels.txt:2: expected 4 columns"):
        load_trec_cast(fixtures / "cast_topics.json", bad)
    bad = _write(tmp_path / "qrels2.txt", "31_1 Q0 MARCO_1 high\n")
    with pytest.raises(MapMatchedValueError, match=r"qrels2.txt:1: relevance must be a number"):
        load_trec_cast(fixtures / "cast_topics.json", bad)
    topics = _write(tmp_path / "topics.json", json.dumps([{"number": 1, "turn": [{"number": 1}]}]))
    with pytest.raises(MapMatchedValueError, match=r"topic 1 turn 0: missing field 'raw_utterance'"):
        load_trec_cast(topics)
    topics = _write(tmp_path / "topics2.json", json.dumps({"number": 1}))
    with pytest.raises(MapMatchedValueError, match=r"expected a JSON array of topics"):
        load_trec_cast(topics)


# --------------------------------------------------------------------------- encodings


_ROW = b'{"conversation_id": "c%d", "turns": [{"query": "what is a cat?", "qrels": {"p": 1}}]}\n'


@pytest.mark.parametrize("gzipped", [False, True])
def test_latin1_jsonl_names_file_and_line(tmp_path, gzipped):
    # 300 good lines (more than one decoding chunk) before the bad one: the line must be exact
    content = b"".join(_ROW % i for i in range(300)) + '{"conversation_id": "x", "turns": [{"query": "café"}]}\n'.encode("latin-1")
    path = tmp_path / ("bad.conversations.jsonl" + (".gz" if gzipped else ""))
    path.write_bytes(gzip.compress(content) if gzipped else content)
    with pytest.raises(MapMatchedValueError, match=r":301: not UTF-8 \(byte 0xe9 at byte 50 of the line") as info:
        load_normalized(path)
    assert str(info.value).startswith(str(path))


def test_latin1_json_documents_and_qrels_name_file_and_line(fixtures, tmp_path):
    inscit = tmp_path / "dev.json"
    inscit.write_bytes('{"d": {"turns": [\n  {"context": ["café"]}\n]}}\n'.encode("latin-1"))
    with pytest.raises(MapMatchedValueError, match=r"dev.json:2: not UTF-8 \(byte 0xe9"):
        load_inscit(inscit)
    rows = tmp_path / "rows.json"
    rows.write_bytes('[{"Question": "Qu\'est-ce qu\'un café ?"}]'.encode("latin-1"))
    with pytest.raises(MapMatchedValueError, match=r"rows.json:1: not UTF-8"):
        load_topiocqa(rows)
    qrels = tmp_path / "qrels.txt"
    qrels.write_bytes("31_1 Q0 MARCO_1 2\n31_2 Q0 caf\xe9 1\n".encode("latin-1"))
    with pytest.raises(MapMatchedValueError, match=r"qrels.txt:2: not UTF-8"):
        load_trec_cast(fixtures / "cast_topics.json", qrels)


def test_gold_missing_from_the_corpus_is_counted_and_can_be_dropped():
    from mapmatched_torch.eval.data import Conversation, Dataset, Passage, Turn

    passages = (Passage("a", "alpha"), Passage("b", "beta"))
    turns = (Turn(0, "q0", qrels={"a": 1, "gone": 2}),  # one gold in the corpus, one not
             Turn(1, "q1", qrels={"gone": 1, "lost": 1, "b": 0}),  # no gold in the corpus
             Turn(2, "q2", qrels={"b": 1}))
    dataset = Dataset("d", (Conversation("c", turns, {"m": 1}),), passages)
    assert dataset.gold_coverage() == {"missing_ids": 2, "missing_judgements": 3, "labelled_turns_with_missing": 2,
                                       "labelled_turns_without_gold_in_corpus": 1}
    kept = dataset.qrels_in_corpus()
    assert [t.qrels for t in kept.conversations[0].turns] == [{"a": 1.0}, {"b": 0.0}, {"b": 1.0}]
    assert kept.labelled_turn_count == 2 and dataset.labelled_turn_count == 3  # turn 1 is now unjudged
    assert kept.gold_coverage()["missing_judgements"] == 0 and kept.passages == passages
    assert kept.conversations[0].metadata == {"m": 1} and kept.conversations[0].turns[2] is turns[2]
