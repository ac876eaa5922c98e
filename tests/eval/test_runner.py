"""The evaluation harness: inputs, per-turn metrics, slices, intervals, verdicts, distance reuse."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
import torch

from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval.candidates import Candidates, normalize_candidate_scores
from mapmatched_torch.eval.data import load_directory
from mapmatched_torch.eval.embedders import HashEmbedder
from mapmatched_torch.eval.methods import Setting, gather_passages, map_matched_orders
from mapmatched_torch.eval.runner import EvalConfig, evaluate, inputs_from_dataset, inputs_from_synthetic
from mapmatched_torch.eval.slices import median
from mapmatched_torch.eval.synthetic import make_synthetic
from mapmatched_torch.kernels.ranking_metrics import ndcg_at_k, recall_at_k, reciprocal_rank

FAST = ("pointwise", "map-matched", "history-concatenation", "maximal-marginal-relevance", "geodesic")


@pytest.fixture(scope="module")
def small_inputs():
    return inputs_from_synthetic(make_synthetic(n_conversations=24, turns=5, candidates=8, seed=3, topics=16,
                                                passages_per_topic=6))


def _config(**options) -> EvalConfig:
    defaults = dict(methods=FAST, betas=(0.0, 0.5, 2.0), n_bootstrap=50, progress=False)
    defaults.update(options)
    return EvalConfig(**defaults)


class CountingGraph:
    """A tensor graph proxy counting the batched distance calls."""

    def __init__(self, graph):
        self._graph = graph
        self.batches = []  # conversations per trellis_distances call

    def __getattr__(self, name):
        return getattr(self._graph, name)

    def trellis_distances(self, chunk_index, **kwargs):
        self.batches.append(chunk_index.shape[0])
        return self._graph.trellis_distances(chunk_index, **kwargs)


def test_distances_are_computed_once_per_chunk_for_the_whole_grid(small_inputs):
    counting = CountingGraph(small_inputs.graph)
    inputs = type(small_inputs)(**{**small_inputs.__dict__, "graph": counting})
    evaluate(inputs, _config(methods=("pointwise", "map-matched", "geodesic"), betas=(0.25, 0.5, 1.0, 2.0),
                             lags=(None, 0, 1), batch_size=1000))
    # 12 settings and the geodesic bound: one call for all 24 conversations (+ one for the split plot's)
    assert counting.batches == [24, 1]
    counting.batches.clear()
    evaluate(inputs, _config(methods=("pointwise", "map-matched"), betas=(0.5,), batch_size=10))
    assert counting.batches == [10, 10, 4, 1]


def test_chunking_does_not_change_results(small_inputs):
    whole = evaluate(small_inputs, _config(batch_size=1000))
    chunked = evaluate(small_inputs, _config(batch_size=7))
    for key, metrics in whole.per_turn.items():
        for name, values in metrics.items():
            assert torch.equal(values, chunked.per_turn[key][name]), (key, name)


def test_result_structure_slices_and_threshold(small_inputs):
    result = evaluate(small_inputs, _config())
    keys = [m.key for m in result.methods]
    assert keys[0] == "pointwise"
    assert "map-matched lambda=1 beta=0.5 full" in keys and "geodesic bound" in keys
    assert "Maximal Marginal Relevance lambda=0.7" in keys and "history concatenation" in keys
    assert set(result.skipped) == set()  # fitted and the oracle were not asked for
    turns = int(small_inputs.candidates.valid.sum())
    assert all(v.shape == (turns,) for m in result.per_turn.values() for v in m.values())
    masks = result.slice_masks
    assert set(masks) == {"all", "follow-up", "standalone", "topic-switch", "same-topic"}
    assert torch.equal(masks["follow-up"] | masks["standalone"], masks["all"])
    assert not bool((masks["follow-up"] & masks["standalone"]).any())
    # the threshold is the median entropy of the later labelled turns (first turns are standalone)
    position = torch.arange(5).repeat(24)
    assert not bool((masks["follow-up"] & (position == 0)).any())
    assert result.threshold_configured is False and math.isfinite(result.threshold)
    pointwise = result.method("pointwise")
    assert pointwise.verdict is None and pointwise.slices["all"].lift is None
    beta0 = result.method("map-matched lambda=1 beta=0 full")
    assert beta0.slices["all"].means == pointwise.slices["all"].means
    assert beta0.slices["all"].lift.mean == 0.0
    # the headline is the cross-fitted selection, not a setting chosen on the data
    assert result.primary == keys[-1] == "cross-fitted primary (5-fold selection)"
    assert not result.primary_selected_on_data
    assert result.split is not None and len(result.split.chunk_ids) == 5


def test_configured_threshold_and_verdict_tolerance(small_inputs):
    result = evaluate(small_inputs, _config(entropy_threshold=0.0, tolerance=1.0))
    assert result.threshold == 0.0 and result.threshold_configured
    later = result.slice_masks["follow-up"]
    assert int(later.sum()) > 0
    best = result.method(result.primary)
    assert best.verdict.standalone_ok  # a tolerance of 1 nDCG point allows anything


def test_metrics_are_those_of_the_map_matched_ranking(small_inputs):
    result = evaluate(small_inputs, _config(betas=(0.5,), methods=("pointwise", "map-matched")))
    cands = small_inputs.candidates
    normalized = normalize_candidate_scores(cands.scores, cands.mask)
    distances = small_inputs.graph.trellis_distances(cands.index)
    order = map_matched_orders(normalized, distances, cands.mask, [Setting(1.0, 0.5)])[0]
    ranked = gather_passages(cands.index, order)[cands.valid]
    got = result.per_turn["map-matched lambda=1 beta=0.5 full"]
    assert set(got) == {"ndcg@3", "ndcg@5", "ndcg@10", "recall@3", "recall@5", "recall@10", "mrr"}
    for k in (3, 5, 10):
        assert torch.equal(got[f"ndcg@{k}"], ndcg_at_k(ranked, small_inputs.qrels, k))
        assert torch.equal(got[f"recall@{k}"], recall_at_k(ranked, small_inputs.qrels, k))
    assert torch.equal(got["mrr"], reciprocal_rank(ranked, small_inputs.qrels))


def test_bootstrap_is_seeded(small_inputs):
    first = evaluate(small_inputs, _config(seed=5))
    second = evaluate(small_inputs, _config(seed=5))
    assert first.methods == second.methods


def test_fitted_method_is_cross_fitted(small_inputs):
    result = evaluate(small_inputs, _config(methods=("pointwise", "fitted"), n_bootstrap=10))
    fitted = result.method("fitted (2-fold cross-fitted)")
    weights = fitted.params["weights"]
    assert fitted.params["folds"] == 2 and len(weights) == 2
    assert all(w["lambda"] >= 0 and w["beta"] >= 0 and w["lag"] is None for w in weights)


def test_dataset_inputs_retrieve_query_history_and_rewrites(fixtures):
    dataset = load_directory(fixtures / "normalized")
    inputs = inputs_from_dataset(dataset, HashEmbedder(dim=64), graph="knn", k=2, candidates=3)
    assert inputs.candidates.shape == (2, 3, 3)
    assert set(inputs.alternatives) == {"history", "rewrite"}  # the fixture has one rewrite
    assert inputs.topic_switch.tolist() == [[0, 1, 0], [-1, 0, -1]]
    result = evaluate(inputs, EvalConfig(n_bootstrap=20, progress=False, methods=(
        "pointwise", "map-matched", "history-concatenation", "maximal-marginal-relevance", "resolved-query-oracle",
        "geodesic")))
    keys = [m.key for m in result.methods]
    assert "resolved-query oracle" in keys and "history concatenation" in keys
    assert result.method("history concatenation").params == {"level": "query text"}
    # turn 1 of c-cheese is the only rewritten turn: the oracle retrieves with "Can cheese be vegan?"
    oracle = result.per_turn["resolved-query oracle"]["mrr"]
    assert oracle.shape == (5,)


def test_oracle_is_skipped_without_rewrites(small_inputs):
    result = evaluate(small_inputs, _config(methods=("pointwise", "resolved-query-oracle")))
    assert "rewrites" in result.skipped["resolved-query-oracle"]
    assert [m.key for m in result.methods] == ["pointwise", "cross-fitted primary (5-fold selection)"]


def test_bad_config_is_rejected(small_inputs):
    with pytest.raises(MapMatchedValueError, match="unknown method"):
        evaluate(small_inputs, EvalConfig(methods=("pointwise", "nope")))
    with pytest.raises(MapMatchedValueError, match="pointwise"):
        evaluate(small_inputs, EvalConfig(methods=("map-matched",)))
    with pytest.raises(MapMatchedValueError, match="transition_weight"):
        evaluate(small_inputs, EvalConfig(betas=(-1.0,)))
    with pytest.raises(MapMatchedValueError, match="primary"):
        evaluate(small_inputs, _config(primary=Setting(1.0, 9.0, None)))


def test_median_threshold_matches_slices_helper(small_inputs):
    result = evaluate(small_inputs, _config(methods=("pointwise",), n_bootstrap=0))
    assert result.method("pointwise").slices["all"].interval.n_resamples == 0
    assert math.isnan(result.method("pointwise").slices["all"].interval.low)
    assert isinstance(median(torch.tensor([1.0, 3.0])), float)


def test_any_corpus_graph_gives_the_tensor_graphs_results():
    from mapmatched_torch import InMemoryCorpusGraph

    bench = make_synthetic(n_conversations=6, turns=4, candidates=5, seed=8, topics=8, passages_per_topic=4)
    tensor = evaluate(inputs_from_synthetic(bench), _config())
    reference = evaluate(inputs_from_synthetic(bench, graph=InMemoryCorpusGraph(bench.edges)), _config())
    for key, metrics in tensor.per_turn.items():
        for name, values in metrics.items():
            assert torch.equal(values, reference.per_turn[key][name]), (key, name)


def test_single_turn_conversations():
    bench = make_synthetic(n_conversations=5, turns=1, candidates=4, seed=1, topics=6, passages_per_topic=4)
    result = evaluate(inputs_from_synthetic(bench), _config(n_bootstrap=10))
    # one turn: no follow-ups, every method is pointwise
    assert int(result.slice_masks["follow-up"].sum()) == 0
    assert all(torch.equal(m["ndcg@3"], result.per_turn["pointwise"]["ndcg@3"])
               for k, m in result.per_turn.items() if k != "Maximal Marginal Relevance lambda=0.7")


# --------------------------------------------------------------------------- baselines, degenerate data, progress


def test_beta_0_is_a_baseline_without_verdict(small_inputs):
    result = evaluate(small_inputs, _config())
    assert result.method("map-matched lambda=1 beta=0 full").verdict is None
    assert result.method("map-matched lambda=1 beta=0.5 full").verdict is not None
    assert result.warnings == ()  # 24 conversations: nothing degenerate


def test_a_single_conversation_warns():
    bench = make_synthetic(n_conversations=1, turns=4, candidates=5, seed=2, topics=6, passages_per_topic=4)
    result = evaluate(inputs_from_synthetic(bench), _config(methods=("pointwise", "map-matched")))
    assert len(result.warnings) == 2 and result.warnings[0].startswith("only 1 conversation has labelled turns")
    # too few conversations to cross-fit the headline: chosen on the data, and said so
    assert result.warnings[1].startswith("fewer conversations (1) than cross-fitting folds (2)")
    assert result.primary == "map-matched lambda=1 beta=0.5 full" and result.primary_selected_on_data


def test_identical_turns_and_thin_slices_warn(small_inputs):
    cands = small_inputs.candidates
    # every turn gets the same scores: the same entropy, so the median split puts no turn in follow-up
    same = torch.linspace(1.0, 0.0, cands.shape[2], dtype=torch.float64).expand(cands.shape).clone()
    inputs = replace(small_inputs, candidates=Candidates(cands.index, torch.where(cands.mask, same, 0.0), cands.mask))
    result = evaluate(inputs, _config(methods=("pointwise", "map-matched")))
    assert any("have the same emission entropy" in note for note in result.warnings)
    assert any(note.startswith("the follow-up slice is empty") for note in result.warnings)


def test_no_labelled_turns_is_refused(small_inputs):
    qrels = small_inputs.qrels
    unlabelled = replace(small_inputs, qrels=qrels._replace(grades=torch.zeros_like(qrels.grades)))
    with pytest.raises(MapMatchedValueError, match="no labelled turns"):
        evaluate(unlabelled, _config())


def test_progress_lines_name_the_slow_phases(fixtures, small_inputs, capsys):
    dataset = load_directory(fixtures / "normalized")
    inputs_from_dataset(dataset, HashEmbedder(dim=64), graph="knn", k=2, candidates=3, progress=True)
    evaluate(small_inputs, _config(methods=("pointwise", "resolved-query-oracle"), progress=True))
    err = capsys.readouterr().err
    for phase in ("eval: embedding 5 passages", "eval: embedding and retrieving the top 3 passages of 5 turns (query)",
                  "eval: building the knn graph", "eval: preparing resolved-query oracle"):
        assert phase in err
    evaluate(small_inputs, _config(methods=("pointwise", "resolved-query-oracle"), progress=False))
    assert capsys.readouterr().err == ""
    texts = ["the cat sat", "a dog", ""]
    import mapmatched_torch.core.progress as progress

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(progress, "_terminal", lambda: True)  # a bar (off a terminal: a line every 10 s)
        assert torch.equal(HashEmbedder(dim=64, progress=True).encode(texts), HashEmbedder(dim=64).encode(texts))
    assert "embedding" in capsys.readouterr().err  # the hash embedder's bar


def test_progress_is_off_on_other_ranks(monkeypatch):
    from mapmatched_torch.eval.runner import main_process, progress_enabled

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main_process() and progress_enabled(None)
    monkeypatch.setenv("RANK", "1")
    assert not main_process() and not progress_enabled(None) and progress_enabled(True)


def test_kernel_compilation_is_announced_only_before_it_happens(small_inputs):
    from mapmatched_torch.eval.distances import kernels_need_compiling

    small_inputs.graph.trellis_distances(small_inputs.candidates.index)  # any search: the kernels are loaded now
    assert kernels_need_compiling("cpu") is False
    assert kernels_need_compiling("meta") is False  # not the compiled engine's device


# --------------------------------------------------------------------------- streaming


def _without_timings(result):
    from mapmatched_torch.eval.report import to_json_dict

    report = to_json_dict(result)
    report.pop("timings")
    return report


class RecordingStream:
    """An input stream proxy recording the conversations each select draws."""

    def __init__(self, stream):
        self._stream = stream
        self.drawn = []

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def select(self, rows):
        self.drawn.append((rows.start, rows.stop))
        return self._stream.select(rows)


@pytest.fixture(scope="module")
def streamed():
    from mapmatched_torch.eval.synthetic import synthetic_stream

    return inputs_from_synthetic(synthetic_stream(37, 4, 6, seed=4, block_size=8, topics=16, passages_per_topic=6))


def test_a_stream_gives_the_in_memory_report_in_bounded_chunks(streamed):
    methods = ("pointwise", "map-matched", "history-concatenation", "maximal-marginal-relevance", "geodesic")
    config = _config(methods=methods, betas=(0.0, 0.5, 2.0), lags=(None, 1))
    in_memory = evaluate(streamed.materialize(), replace(config, batch_size=1000))
    recording = RecordingStream(streamed)
    streaming = evaluate(recording, replace(config, batch_size=5))
    assert _without_timings(streaming) == _without_timings(in_memory)
    for key, metrics in in_memory.per_turn.items():
        for name, values in metrics.items():
            assert torch.equal(values, streaming.per_turn[key][name]), (key, name)
    # chunks of at most 5 conversations, each drawn once, then the split plot's conversation
    chunks = recording.drawn[:-1]
    assert chunks == [(start, min(start + 5, 37)) for start in range(0, 37, 5)]
    assert recording.drawn[-1][1] - recording.drawn[-1][0] == 1


def test_in_memory_select_is_the_inputs_of_those_conversations(small_inputs):
    piece = small_inputs.select(slice(5, 9))
    assert piece.num_conversations == 4 and piece.conversation_ids == small_inputs.conversation_ids[5:9]
    assert torch.equal(piece.candidates.scores, small_inputs.candidates.scores[5:9])
    turns = small_inputs.candidates.valid.sum(dim=1)
    first = int(turns[:5].sum())
    assert torch.equal(piece.qrels.ids, small_inputs.qrels.ids[first:first + int(turns[5:9].sum())])


def test_a_stream_skips_the_methods_that_prepare_on_every_conversation(streamed):
    result = evaluate(streamed, _config(methods=("pointwise", "map-matched", "fitted"), betas=(0.5,)))
    assert "fitted" in result.skipped and "input stream" in result.skipped["fitted"]
    assert [m.method for m in result.methods if m.method != "map-matched"][0] == "pointwise"


def test_each_rank_draws_only_its_shard(streamed, monkeypatch):
    from mapmatched_torch.eval import runner

    monkeypatch.setattr(runner, "world_size", lambda: 2)
    monkeypatch.setattr(runner, "rank", lambda: 1)
    monkeypatch.setattr(runner, "gather_to_main", lambda value: None)  # a worker rank: rank 0 summarizes
    recording = RecordingStream(streamed)
    assert evaluate(recording, _config(methods=("pointwise", "map-matched"), betas=(0.5,), batch_size=6)) is None
    assert recording.drawn == [(18, 24), (24, 30), (30, 36), (36, 37)]  # shard(37, 1, 2) = [18, 37)


def test_report_does_not_depend_on_the_number_of_torch_threads():
    """torchrun runs one thread per process, a plain run all cores: the report must not move.

    36,000 turns: long enough that a float64 ``tensor.sum()`` over a slice is split across
    threads (its last bits then depend on the thread count; the harness sums exactly).
    """
    inputs = inputs_from_synthetic(make_synthetic(n_conversations=4500, turns=8, candidates=4, seed=3, topics=16,
                                                  passages_per_topic=6, with_conversations=False))
    config = _config(methods=("pointwise", "map-matched"), betas=(0.5,), lags=(None,), n_bootstrap=20)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(evaluate(inputs, config))
    finally:
        torch.set_num_threads(threads)
    one, two = results
    assert [m.slices for m in one.methods] == [m.slices for m in two.methods]
    assert one.primary == two.primary and one.split == two.split
    # the per-turn metrics are held coded: about a byte per value, not eight
    values = sum(len(metrics) for metrics in one.per_turn.values()) * one.conversation.numel()
    assert one.per_turn.nbytes < 1.5 * values
    mean = one.method("pointwise").slices["all"].means["ndcg@3"]
    assert mean == math.fsum(one.per_turn["pointwise"]["ndcg@3"].tolist()) / one.conversation.numel()
