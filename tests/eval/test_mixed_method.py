"""The cross-fitted "mixed" and "mixed+gated" evaluation methods and the online retrieval they run on."""

from __future__ import annotations

import dataclasses
from typing import List

import pytest
import torch

from mapmatched_torch.eval.candidates import retrieve_candidates, retrieve_online
from mapmatched_torch.eval.methods import DEFAULT_METHODS, METHODS, MethodOptions, relevant_passages, settings_grid
from mapmatched_torch.eval.runner import EvalConfig, EvalInputs, evaluate, inputs_from_synthetic
from mapmatched_torch.eval.synthetic import make_synthetic
from mapmatched_torch.kernels.ranking_metrics import SparseQrels
from mapmatched_torch.providers import DenseProvider
from mapmatched_torch.providers.query_mixing import QueryMixing
from mapmatched_torch.standalone.graph import InMemoryCorpusGraph

PASSAGES, DIMENSION, CONVERSATIONS, WIDTH = 30, 8, 24, 6
LENGTHS = [5, 3, 4, 5, 2, 5, 3, 4, 5, 3, 4, 5] * 2


class _TableEmbedder:
    """Texts are ``"b t"``; their embeddings a fixed table (what an embedder would return)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def encode(self, texts: List[str]) -> torch.Tensor:
        return torch.stack([self.table[tuple(int(x) for x in text.split())] for text in texts])


def _world():
    """Topic walks over a ring of passages: each turn's gold is mostly the previous one's
    (else its ring neighbour), and the queries are noisy views of it."""
    generator = torch.Generator().manual_seed(0)
    passages = torch.nn.functional.normalize(torch.randn(PASSAGES, DIMENSION, generator=generator), dim=1)
    turns = max(LENGTHS)
    gold = torch.zeros(CONVERSATIONS, turns, dtype=torch.long)
    gold[:, 0] = torch.randint(PASSAGES, (CONVERSATIONS,), generator=generator)
    for t in range(1, turns):
        stay = torch.rand(CONVERSATIONS, generator=generator) < 0.75
        gold[:, t] = torch.where(stay, gold[:, t - 1], (gold[:, t - 1] + 1) % PASSAGES)
    noise = torch.randn(CONVERSATIONS, turns, DIMENSION, generator=generator)
    queries = torch.nn.functional.normalize(passages[gold] + 0.9 * noise, dim=-1)
    texts = [[f"{b} {t}" for t in range(length)] for b, length in enumerate(LENGTHS)]
    return passages, queries, gold, texts


@pytest.fixture(scope="module")
def world():
    return _world()


@pytest.fixture(scope="module")
def inputs(world) -> EvalInputs:
    return _inputs(*world)


def _inputs(passages: torch.Tensor, queries: torch.Tensor, gold: torch.Tensor, texts: List[List[str]]) -> EvalInputs:
    ids = tuple(f"p{i}" for i in range(PASSAGES))
    provider = DenseProvider(passages, ids, metric="inner_product")
    cands = retrieve_candidates(texts, _TableEmbedder(queries), provider, WIDTH)
    valid = cands.valid
    embedded = torch.where(valid.unsqueeze(-1), queries, 0.0)
    flat_gold = gold[valid].unsqueeze(1)
    graph = InMemoryCorpusGraph.from_edges([(ids[i], ids[(i + 1) % PASSAGES]) for i in range(PASSAGES)])
    return EvalInputs(
        name="ring", candidates=cands, qrels=SparseQrels(flat_gold, torch.ones(flat_gold.shape, dtype=torch.float64)),
        topic_switch=torch.full(valid.shape, -1, dtype=torch.int8), graph=graph, passage_ids=ids,
        conversation_ids=tuple(f"c{b}" for b in range(CONVERSATIONS)), passage_embeddings=passages,
        query_embeddings=embedded,
    )


def _options() -> MethodOptions:
    return MethodOptions(settings_grid((1.0,), (0.5,)), extra={"mixing_iterations": 30, "gated_iterations": 20})


def test_mixed_methods_are_registered_defaults_that_skip_themselves_without_embeddings():
    for name in ("mixed", "mixed+gated"):
        assert name in METHODS and name in DEFAULT_METHODS
        assert METHODS[name].prepare is not None


def test_relevant_passages_are_each_real_turns_positive_qrels():
    valid = torch.tensor([[True, True], [True, False]])
    qrels = SparseQrels(torch.tensor([[2, 0], [1, -1], [3, 1]]),
                        torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 1.0]], dtype=torch.float64))
    relevant = relevant_passages(valid, qrels, 4)
    assert relevant.tolist() == [[[False, False, True, False], [False, True, False, False]],
                                 [[False, True, False, True], [False, False, False, False]]]


def test_online_retrieval_with_a_zero_mix_is_the_raw_queries_retrieval_exactly(inputs):
    provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, metric="inner_product")
    calls = []

    def decoded(turn, prefix):
        calls.append(prefix.index.shape[1])
        return prefix.index[:, turn, 1]

    online = retrieve_online(inputs.query_embeddings, inputs.candidates.valid, provider, WIDTH, QueryMixing(0.0),
                             inputs.passage_embeddings, decoded)
    for mine, theirs in zip(online, inputs.candidates):
        assert torch.equal(mine, theirs)
    assert calls == [1, 2, 3, 4, 5]


def test_online_retrieval_mixes_each_query_with_the_passage_decoded_at_the_previous_turn(inputs):
    provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, metric="inner_product")
    mixing = QueryMixing(0.8, 1.0, 0.0)
    chosen: List[torch.Tensor] = []

    def decoded(turn, prefix):  # decode the second candidate: not what the pointwise answer would be
        chosen.append(prefix.index[:, turn, 1])
        return chosen[-1]

    valid = inputs.candidates.valid
    online = retrieve_online(inputs.query_embeddings, valid, provider, WIDTH, mixing, inputs.passage_embeddings,
                             decoded)
    assert torch.equal(online.index[:, 0], inputs.candidates.index[:, 0])
    for turn in (1, 2):
        rows = valid[:, turn]
        context = inputs.passage_embeddings[chosen[turn - 1][rows]]
        expected = provider.search_tensors(mixing.apply(inputs.query_embeddings[rows, turn], context), WIDTH)[1]
        assert torch.equal(online.index[rows, turn], expected)
        assert not torch.equal(online.index[rows, turn], inputs.candidates.index[rows, turn])


@pytest.mark.parametrize("name", ["mixed", "mixed+gated"])
def test_each_folds_parameters_are_fitted_only_on_the_other_folds(inputs, name):
    """Move the gold passages of fold 0's conversations after turn 0: the parameters that
    rank fold 0 (fitted on fold 1) stay the same bit for bit; fold 1's change."""
    prepare = METHODS[name].prepare
    state = prepare(inputs, _options())
    held = state.fold == 0
    later = torch.arange(inputs.candidates.shape[1]) > 0
    moved = (held[:, None] & later[None, :])[inputs.candidates.valid]
    ids = torch.where(moved[:, None], (inputs.qrels.ids + 7) % PASSAGES, inputs.qrels.ids)
    changed = dataclasses.replace(inputs, qrels=SparseQrels(ids, inputs.qrels.grades))
    again = prepare(changed, _options())
    assert again.params[0] == state.params[0]
    assert again.params[1] != state.params[1]
    assert torch.equal(again.passages[held], state.passages[held])
    mixing = state.params[0]["mixing"]
    assert {"mix_weight", "gate_bias", "gate_weight", "cosine_mean", "cosine_std", "temperature"} <= set(mixing)
    if name == "mixed+gated":
        assert {"lambda", "beta", "gate_bias", "gate_weight", "feature_mean"} <= set(state.params[0]["transitions"])
    else:
        assert set(state.params[0]) == {"mixing"}


def test_the_mixed_methods_run_in_the_harness_deterministically(inputs):
    config = EvalConfig(methods=("pointwise", "mixed", "mixed+gated"), betas=(0.5,), n_bootstrap=0, progress=False)
    first, second = evaluate(inputs, config), evaluate(inputs, config)
    for key, name in (("mixed (2-fold cross-fitted)", "mixed"), ("mixed+gated (2-fold cross-fitted)", "mixed+gated")):
        result = first.method(key)
        assert result.method == name and result.params["folds"] == 2
        assert second.method(key).params == result.params
        for metric, values in first.per_turn[key].items():
            assert torch.equal(values, second.per_turn[key][metric])
    # the gold mostly stays where the conversation was: the previous chunk helps
    mixed = first.method("mixed (2-fold cross-fitted)").slices["all"].means["ndcg@3"]
    assert mixed > first.method("pointwise").slices["all"].means["ndcg@3"]


def test_the_mixed_methods_are_skipped_without_embeddings():
    synthetic = inputs_from_synthetic(make_synthetic(n_conversations=6, turns=3, candidates=3, seed=1, topics=3,
                                                     passages_per_topic=3))
    result = evaluate(synthetic, EvalConfig(methods=("pointwise", "mixed"), betas=(0.5,), n_bootstrap=0,
                                            progress=False))
    assert "query and passage embeddings" in result.skipped["mixed"]


# --------------------------------------------------------------------------- posterior ranking (issue 15 item 3)


def test_filtering_scores_are_the_log_total_weight_of_the_prefix_paths_ending_at_each_candidate():
    import itertools

    from mapmatched_torch.eval.methods import online_filtering_scores

    generator = torch.Generator().manual_seed(5)
    emissions = torch.randn(1, 3, 3, generator=generator, dtype=torch.float64)
    transitions = torch.randn(1, 2, 3, 3, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[[True, True, True], [True, True, False], [True, True, True]]])
    scores = online_filtering_scores(emissions, transitions, mask)
    for turn in range(3):
        for end in range(3):
            if not mask[0, turn, end]:
                assert scores[0, turn, end] == float("-inf")
                continue
            totals = []
            for path in itertools.product(range(3), repeat=turn):
                states = (*path, end)
                if all(mask[0, t, s] for t, s in enumerate(states)):
                    totals.append(sum(float(emissions[0, t, s]) for t, s in enumerate(states))
                                  + sum(float(transitions[0, t, states[t], states[t + 1]]) for t in range(turn)))
            expected = float(torch.logsumexp(torch.tensor(totals, dtype=torch.float64), dim=0))
            assert float(scores[0, turn, end]) == pytest.approx(expected, rel=1e-12)
    from mapmatched_torch.testing import fused_kernels_off

    with fused_kernels_off():  # the torch path agrees with the fused kernel
        torch.testing.assert_close(online_filtering_scores(emissions, transitions, mask), scores, rtol=1e-14, atol=0)
    # with a gradient asked for, the kernel leaves the scores to the torch path (differentiable)
    assert online_filtering_scores(emissions.clone().requires_grad_(True), transitions, mask).requires_grad


def test_the_options_run_in_the_methods_and_a_bad_ranking_is_named(inputs):
    base = {"mixing_iterations": 10, "gated_iterations": 10}
    forward = METHODS["mixed+gated"].prepare(inputs, MethodOptions(settings_grid((1.0,), (0.5,)), extra=base))
    options = MethodOptions(settings_grid((1.0,), (0.5,)), extra={**base, "gated_ranking": "posterior"})
    posterior = METHODS["mixed+gated"].prepare(inputs, options)
    assert posterior.params == forward.params  # the same fits; only the ranking differs
    assert posterior.passages.shape == inputs.candidates.shape
    assert not torch.equal(posterior.passages, forward.passages)
    bad = MethodOptions(settings_grid((1.0,), (0.5,)), extra={"mixing_iterations": 5, "gated_iterations": 5,
                                                               "gated_ranking": "marginal"})
    with pytest.raises(ValueError, match="gated_ranking"):
        METHODS["mixed+gated"].prepare(inputs, bad)


def test_a_held_mixing_temperature_is_every_folds_temperature_and_a_bad_one_is_named(inputs):
    base = {"mixing_iterations": 10}
    fitted = METHODS["mixed"].prepare(inputs, MethodOptions(settings_grid((1.0,), (0.5,)), extra=base))
    held = METHODS["mixed"].prepare(inputs, MethodOptions(settings_grid((1.0,), (0.5,)),
                                                          extra={**base, "mixing_temperature": 0.03}))
    assert [fold["mixing"]["temperature"] for fold in held.params] == [0.03, 0.03]
    assert all(fold["mixing"]["temperature"] != 0.03 for fold in fitted.params)
    assert held.params[0]["mixing"]["gate_weight"] != fitted.params[0]["mixing"]["gate_weight"]
    bad = MethodOptions(settings_grid((1.0,), (0.5,)), extra={**base, "mixing_temperature": -1.0})
    with pytest.raises(ValueError, match="mixing_temperature"):
        METHODS["mixed"].prepare(inputs, bad)


def test_the_mixing_flags_reach_the_methods_options():
    from mapmatched_torch.cli import build_parser
    from mapmatched_torch.cli.run import _method_options

    parser = build_parser()
    assert _method_options(parser.parse_args(["eval"])) == {}
    args = parser.parse_args(["eval", "--mixing-temperature", "0.03", "--mixing-l2", "0", "--gated-calibrate",
                              "--mixing-context", "chunk"])
    assert _method_options(args) == {"gated_calibrate": True, "mixing_l2": 0.0, "mixing_temperature": 0.03,
                                     "mixing_context": "chunk"}


def test_the_previous_query_is_a_second_context_source_by_default_and_the_chunk_alone_is_an_option(inputs):
    base = {"mixing_iterations": 10}
    both = METHODS["mixed"].prepare(inputs, MethodOptions(settings_grid((1.0,), (0.5,)), extra=base))
    chunk = METHODS["mixed"].prepare(inputs, MethodOptions(settings_grid((1.0,), (0.5,)),
                                                           extra={**base, "mixing_context": "chunk"}))
    assert all(fold["mixing"]["query_mix_weight"] > 0 for fold in both.params)
    assert all(fold["mixing"]["query_mix_weight"] == 0 for fold in chunk.params)
    assert both.params[0]["mixing"]["gate_weight"] != chunk.params[0]["mixing"]["gate_weight"]
    bad = MethodOptions(settings_grid((1.0,), (0.5,)), extra={**base, "mixing_context": "query"})
    with pytest.raises(ValueError, match="mixing_context"):
        METHODS["mixed"].prepare(inputs, bad)


def test_online_retrieval_mixes_in_the_previous_raw_query_when_the_mix_has_that_source(inputs):
    provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, metric="inner_product")
    mixing = QueryMixing(0.0, query_mix_weight=0.5)  # the previous query alone, a_t = 0, c_t = 0.25
    first = lambda turn, prefix: prefix.index[:, turn, 0]  # noqa: E731
    online = retrieve_online(inputs.query_embeddings, inputs.candidates.valid, provider, 5, mixing,
                             inputs.passage_embeddings, first)
    queries, valid = inputs.query_embeddings, inputs.candidates.valid
    rows = valid[:, 2]
    mixed = mixing.apply(queries[rows, 2], inputs.passage_embeddings[online.index[rows, 1, 0]],
                         previous_queries=queries[rows, 1])
    _, found = provider.search_tensors(mixed, 5)
    assert torch.equal(online.index[rows, 2], found)
    unit = torch.nn.functional.normalize
    by_hand = unit(0.75 * unit(queries[rows, 2], dim=-1) + 0.25 * unit(queries[rows, 1], dim=-1), dim=-1)
    assert torch.allclose(mixed.double(), by_hand.double(), atol=1e-6)


def test_mixed_and_mixed_gated_share_one_mixing_fit_per_evaluation(inputs, monkeypatch):
    import mapmatched_torch.fit.query_mixing as query_mixing

    calls = []
    fit = query_mixing.fit_query_mixing
    monkeypatch.setattr(query_mixing, "fit_query_mixing", lambda *a, **k: calls.append(1) or fit(*a, **k))
    options = _options()  # what one evaluation hands every prepare step
    mixed = METHODS["mixed"].prepare(inputs, options)
    assert len(calls) == 2 * 2  # two folds, two rounds
    both = METHODS["mixed+gated"].prepare(inputs, options)
    assert len(calls) == 4  # the same gates: no new fit
    assert [p["mixing"] for p in both.params] == [p["mixing"] for p in mixed.params]
    # the shared fit is the one mixed+gated makes alone, bit for bit
    alone = METHODS["mixed+gated"].prepare(inputs, _options())
    assert len(calls) == 8 and alone.params == both.params and torch.equal(alone.passages, both.passages)
    # another evaluation's options, or other inputs, fit again
    METHODS["mixed"].prepare(inputs, MethodOptions(options.settings, extra={**options.extra, "mixing_rounds": 1}))
    assert len(calls) == 10
    METHODS["mixed"].prepare(dataclasses.replace(inputs), options)
    assert len(calls) == 14


def test_a_failed_mixing_fit_is_reported_by_both_mixed_methods(inputs):
    import mapmatched_torch.eval.methods as methods

    # no positive grade left: neither fit has a turn to learn from
    unlabelled = dataclasses.replace(inputs, qrels=SparseQrels(inputs.qrels.ids, torch.zeros_like(inputs.qrels.grades)))
    options = _options()
    for name in ("mixed", "mixed+gated"):
        with pytest.raises(methods.MethodUnavailable, match="needs at least one turn with a relevant passage"):
            METHODS[name].prepare(unlabelled, options)


def test_the_recurrent_mix_searches_with_the_vector_the_previous_turn_searched(inputs):
    """``chunk+searched``: the second source of turn t is the vector turn t-1 searched
    (its mixed query), not its raw query; the first rounds differ only from turn 2 on."""
    provider = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, metric="inner_product")
    raw = QueryMixing(0.3, 0.0, 0.0, query_mix_weight=0.5)
    recurrent = dataclasses.replace(raw, recurrent=True)
    first = lambda turn, prefix: prefix.index[:, turn, 0]  # noqa: E731
    queries, valid = inputs.query_embeddings, inputs.candidates.valid
    searched = torch.zeros_like(queries)
    online = retrieve_online(queries, valid, provider, 5, recurrent, inputs.passage_embeddings, first, searched)
    plain = retrieve_online(queries, valid, provider, 5, raw, inputs.passage_embeddings, first)
    assert torch.equal(online.index[:, :2], plain.index[:, :2])
    assert torch.equal(searched[:, 0], queries[:, 0])  # turn 0 has no context: its raw query
    for turn in (1, 2, 3):
        rows = valid[:, turn]
        mixed = recurrent.apply(queries[rows, turn], inputs.passage_embeddings[online.index[rows, turn - 1, 0]],
                                previous_queries=searched[rows, turn - 1])
        assert torch.equal(searched[rows, turn], mixed)
        assert torch.equal(online.index[rows, turn], provider.search_tensors(mixed, 5)[1])
    assert not torch.equal(online.index[:, 2:], plain.index[:, 2:])


def test_recurrent_mixed_rankings_equal_a_sessions_and_the_servers_turn_by_turn(inputs):
    """Issue 33 item 5: for fold 0's fitted recurrent gate, the eval's ``mixed`` rankings
    of fold 0's conversations are what sessions over a QueryMixingProvider retrieve turn
    by turn, and what the server returns (restored from its saved state halfway)."""
    from mapmatched_torch import MapMatchedRetriever
    from mapmatched_torch.providers.query_mixing import QueryMixingProvider, SearchedQuery
    from mapmatched_torch.serving import MapMatchedServer

    options = MethodOptions(_options().settings, extra={**_options().extra, "mixing_context": "chunk+searched"})
    state = METHODS["mixed"].prepare(inputs, options)
    fitted = {key: value for key, value in state.params[0]["mixing"].items() if key in QueryMixing.__dataclass_fields__}
    mixing = QueryMixing(**fitted)
    assert mixing.recurrent and mixing.uses_previous_query and mixing.mix_weight > 0
    table = {f"{b} {t}": inputs.query_embeddings[b, t] for b, length in enumerate(LENGTHS) for t in range(length)}
    dense = DenseProvider(inputs.passage_embeddings, inputs.passage_ids, table.__getitem__, metric="inner_product")
    provider = QueryMixingProvider(dense, mixing)
    held = state.fold.eq(0).nonzero().flatten().tolist()
    sessions = {b: MapMatchedRetriever(inputs.graph, provider=provider, candidate_limit=WIDTH,
                                       transition_weight=0.0).session() for b in held}
    server = MapMatchedServer(inputs.graph, provider=provider, candidate_limit=WIDTH, transition_weight=0.0)
    for b in held:
        server.open(b)
    for turn in range(max(LENGTHS)):
        asked = {b: f"{b} {turn}" for b in held if turn < LENGTHS[b]}
        if turn == 2:  # the searched vectors survive a save and restore
            saved = server.state_dict()
            assert any(len(entry) == 3 for entry in saved["previous_queries"])
            server = MapMatchedServer(inputs.graph, provider=provider, candidate_limit=WIDTH, transition_weight=0.0)
            server.load_state_dict(saved)
        results, errors = server.step(asked)
        assert not errors
        for b, query in asked.items():
            expected = [inputs.passage_ids[i] for i in state.passages[b, turn].tolist()]
            result = sessions[b].retrieve(query)
            assert [c.chunk_id for c in result.candidates] == expected, (b, turn)
            assert result.chunk_id == expected[0]
            assert isinstance(sessions[b].previous_query, SearchedQuery)
            assert results[b] == result
