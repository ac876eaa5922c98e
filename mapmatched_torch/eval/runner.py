"""The evaluation harness: every method's per-turn metrics, slices, intervals and verdicts.

Data flow (one direction):

1. :class:`EvalInputs`: each turn's query candidates (B, T, M), the flat qrels of the
   real turns, topic-switch labels, the corpus graph, optional passage embeddings
   and alternative candidate sets (history-concatenation and resolved-query
   retrieval). :func:`inputs_from_synthetic` and :func:`inputs_from_dataset` build
   them (the latter embeds and retrieves: everything later is embedding-free).
2. :func:`evaluate` walks the conversations in chunks (a progress bar on long runs):
   normalizes the scores, fills the (B, T-1, M, M) distances ONCE per chunk, runs
   every method of :data:`~mapmatched_torch.eval.methods.METHODS` (the map-matched
   grid reuses the distances), and scores each ranking per turn (nDCG@{3,5,10},
   Recall@{3,5,10}, MRR) as tensors.
3. Slices over the labelled turns: ``all``; ``follow-up`` / ``standalone`` by
   emission entropy at lambda = ``slice_emission_weight`` (turn 0 standalone; median
   threshold over later labelled turns unless configured; the threshold is
   reported); ``topic-switch`` / ``same-topic`` where labelled.
4. Per method and slice: the mean of every metric, a bootstrap interval of the
   primary metric (nDCG@3), and the paired bootstrap interval of its lift over
   pointwise, resampling conversations (seeded). Per method, the verdict: follow-up
   lift interval above 0 and standalone change not below ``-tolerance`` (none for
   pointwise and beta = 0, the baseline). Degenerate data (one conversation, a slice
   with fewer than 2 conversations, a constant entropy) adds :attr:`EvalResult.warnings`.
5. For one conversation, the per-turn emission vs transition split of the decoded
   path of the primary map-matched setting (for the plot).

Choices where the issue was silent: the slices use the entropy of the query
candidates at ``slice_emission_weight`` (1.0), the same for every method; the
headline (primary) method is ``config.primary`` or else the cross-fitted selection
(:mod:`~mapmatched_torch.eval.selection`: per fold, the method best on the other
folds; ``selected_on_data`` false); the split plot's map-matched setting is
``config.primary`` or else the grid setting with the best nDCG@3 over all labelled
turns (chosen on the evaluated data: it only picks what to draw); with
``fold_repeats`` R > 1 the whole evaluation runs over R fold splits and reports the
cross-fitted rankings' mean and range (:attr:`EvalResult.repeats`); the split conversation is
``config.split_conversation`` or else the one where that setting gains most nDCG@3
over pointwise (ties: the first).

Example:
    >>> from mapmatched_torch.eval.synthetic import make_synthetic
    >>> bench = make_synthetic(8, 3, 4, topics=6, passages_per_topic=4)
    >>> config = EvalConfig(methods=("pointwise", "map-matched"), betas=(0.5,), n_bootstrap=10, progress=False)
    >>> result = evaluate(inputs_from_synthetic(bench), config)
    >>> [method.key for method in result.methods]
    ['pointwise', 'map-matched lambda=1 beta=0.5 full', 'cross-fitted primary (5-fold selection)']
    >>> result.primary, result.primary_selected_on_data
    ('cross-fitted primary (5-fold selection)', False)
    >>> result.per_turn["pointwise"]["ndcg@3"].shape
    torch.Size([24])

Modules: :mod:`.inputs` (step 1), this one (step 2 and the loop over chunks and ranks),
:mod:`.summary` (steps 3 to 5 and the result types), :mod:`.config` (:class:`EvalConfig`).
Their names are importable from here too.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..core.progress import progress_bar, progress_wanted
from ..kernels.ranking_metrics import SparseQrels, labelled, ranking_metrics
from .candidates import Candidates, normalize_candidate_scores
from .config import PRIMARY_METRIC, SLICES, EvalConfig, _phase, progress_enabled  # noqa: F401  (SLICES: as before the split)
from .distances import CorpusDistances
from .distributed import gather_to_all, gather_to_main, main_process, rank, shard, world_size
from .inputs import (  # noqa: F401  (as before the split)
    QRELS_POLICIES,
    EvalInputs,
    SyntheticInputStream,
    inputs_from_dataset,
    inputs_from_synthetic,
)
from .methods import (
    METHODS,
    MethodBatch,
    MethodOptions,
    MethodUnavailable,
    cross_fitting_folds,
    similarity_from_distances,
    similarity_from_embeddings,
)
from .selection import (
    SELECTION_KEY_FORMAT,
    SELECTION_METHOD,
    cross_fitted_selection,
    repeat_summaries,
    selection_candidates,
)
from .slices import emission_entropy
from .summary import (  # noqa: F401  (the result types: as before the split)
    EvalResult,
    MethodResult,
    PathSplit,
    SliceResult,
    _primary,
    _require_labelled,
    _slices,
    _split,
    _summaries,
    _warnings,
)
from .turn_values import CodedColumnWriter, CodedValues, PerTurnMetrics
from ._allocator import trim_heap

__all__ = ["evaluate"]


def _chunk_size(config: EvalConfig, shape: Tuple[int, int, int]) -> int:
    """Conversations per chunk: the stacked transitions of the largest lag group fit ``memory_budget``."""
    if config.batch_size is not None:
        return config.batch_size
    _, turns, width = shape
    groups: Dict[Optional[int], int] = {}
    for setting in config.settings:
        groups[setting.fixed_lag] = groups.get(setting.fixed_lag, 0) + 1
    # float64 stacked transitions plus two (B, T-1, M, M) temporaries per setting of the group
    per_conversation = max(groups.values(), default=1) * max(turns - 1, 1) * width * width * 8 * 3
    return max(1, config.memory_budget // per_conversation)


def _prepare_methods(inputs: EvalInputs, config: EvalConfig, options: MethodOptions, show: bool,
                     in_memory: bool = True):
    """The methods that can run (registry order), their prepared state, and the skipped ones with reasons.

    On an input stream (``in_memory`` False) a method with a ``prepare`` (it reads every
    conversation at once, e.g. cross-fitting) is skipped."""
    active, state, skipped = [], {}, {}
    for name in config.methods:
        spec = METHODS[name]
        if spec.prepare is not None and not in_memory:
            skipped[name] = ("it prepares on every conversation at once (cross-fitting), which an input stream "
                             "does not hold: evaluate in-memory EvalInputs to run it")
            continue
        if spec.prepare is not None:  # e.g. the cross-fitting of the fitted weights: long on large data
            _phase(show, f"preparing {spec.title} ({name})")
        try:
            state[name] = spec.prepare(inputs, options) if spec.prepare is not None else None
        except MethodUnavailable as reason:
            skipped[name] = str(reason)
            continue
        active.append(spec)
    return active, state, skipped


class _Scored(NamedTuple):
    """What the chunk loop produces."""

    metrics: PerTurnMetrics  # method key -> metric -> (N,), coded
    described: Dict[str, Tuple[str, Dict[str, Any]]]  # method key -> (method name, params)
    turns: Dict[str, Tensor]  # per real turn (N,): conversation, position, entropy, topic_switch, eligible
    clock: Dict[str, float]


def _score_chunks(inputs: EvalInputs, config: EvalConfig, options: MethodOptions, active: List[Any],
                  state: Dict[str, Any], lookup: CorpusDistances, device: torch.device, show: bool) -> _Scored:
    """Normalize, fill the distances once, run every method and score it, chunk by chunk.

    Each chunk is ``inputs.select(rows)`` (a slice of in-memory inputs, or drawn by a
    stream): only the chunk's (B_c, T, M) tensors and the (N,) per-turn results are
    held, so memory stays flat in the number of conversations. The per-turn metrics are
    coded chunk by chunk (:class:`~mapmatched_torch.eval.turn_values.CodedColumnWriter`,
    about a byte per value instead of eight) and, with the per-turn facts, written into
    buffers sized once for the shard (conversations x turns), so the chunks'
    temporaries are not interleaved with what is kept.
    """
    embeddings = None if inputs.passage_embeddings is None else inputs.passage_embeddings.to(device)
    needs_similarity = any(spec.needs_similarity for spec in active)
    needs_distances = any(spec.needs_distances for spec in active)
    # this rank's contiguous block of conversations (all of them without a process group)
    part = shard(inputs.num_conversations, rank(), world_size())
    step = _chunk_size(config, inputs.shape)
    # the most real turns this shard can have
    capacity = (part.stop - part.start) * inputs.shape[1]
    per_turn: Dict[str, Dict[str, CodedColumnWriter]] = {}
    described: Dict[str, Tuple[str, Dict[str, Any]]] = {}
    facts = {name: torch.empty(capacity, dtype=dtype, device=device) for name, dtype in _TURN_FACTS.items()}
    filled = 0
    clock = {"inputs": 0.0, "normalize": 0.0, "distances": 0.0, "methods": 0.0, "metrics": 0.0}
    cpu = time.process_time()
    bar = progress_bar(total=part.stop - part.start, unit="conv", desc=f"evaluating {inputs.name}",
                       show=progress_wanted(config.progress, main_process()), leave=False)
    for start in range(part.start, part.stop, step):
        rows = slice(start, min(start + step, part.stop))
        tick = time.perf_counter()
        piece = inputs.select(rows)  # a stream draws the chunk now
        chunk = piece.candidates.to(device)
        chunk_qrels = piece.qrels.to(device)
        clock["inputs"] += time.perf_counter() - tick
        tick = time.perf_counter()
        normalized = normalize_candidate_scores(chunk.scores, chunk.mask, config.score_normalization,
                                                exact=config.exact_normalization)
        chunk_facts = _turn_facts(piece, chunk, chunk_qrels, normalized, rows, config)
        real = chunk_facts["conversation"].numel()  # the chunk's real turns
        for name, values in chunk_facts.items():
            facts[name][filled:filled + real] = values
        filled += real
        tock = time.perf_counter()
        # shape: (B_c, T-1, M, M), ONCE for every setting and method of the chunk
        distances = lookup.consecutive(chunk.index) if needs_distances else None
        similarity = None
        if needs_similarity:
            similarity = (similarity_from_embeddings(chunk.index, embeddings) if embeddings is not None
                          else similarity_from_distances(lookup.within_turn(chunk.index), lookup.maximum_distance))
        clock["normalize"] += tock - tick
        clock["distances"] += time.perf_counter() - tock
        method_batch = MethodBatch(
            torch.arange(rows.start, rows.stop, device=device), chunk, normalized, distances, similarity,
            {name: other.to(device) for name, other in piece.alternatives.items()}, state,
        )
        for spec in active:
            tick = time.perf_counter()
            outputs = spec.run(method_batch, options)
            tock = time.perf_counter()
            for output in outputs:
                described.setdefault(output.key, (output.method, output.params))
                values = ranking_metrics(output.passages[chunk.valid], chunk_qrels, config.ks)
                for metric, tensor in values.items():
                    columns = per_turn.setdefault(output.key, {})
                    columns.setdefault(metric, CodedColumnWriter(capacity, device)).append(tensor)
            clock["methods"] += tock - tick
            clock["metrics"] += time.perf_counter() - tock
        bar.update(rows.stop - rows.start)
    bar.close()
    clock["cpu"] = time.process_time() - cpu  # this process's CPU seconds in the loop (a shared machine's wall is not)
    # shape: (N_r,) each, N_r = 0 on a rank without conversations; finished one metric at a
    # time, dropping its writer
    metrics = PerTurnMetrics({key: {m: writers.pop(m).finish() for m in list(writers)}
                              for key, writers in per_turn.items()})
    turns = {name: values if filled == capacity else values[:filled].clone() for name, values in facts.items()}
    return _Scored(metrics, described, turns, clock)


#: The per-turn facts the summary needs besides the metrics, with their dtypes.
_TURN_FACTS = {"conversation": torch.long, "position": torch.long, "entropy": torch.float64,
               "topic_switch": torch.int8, "eligible": torch.bool}


def _turn_facts(piece: "EvalInputs", chunk: Candidates, qrels: SparseQrels, normalized: Tensor, rows: slice,
                config: "EvalConfig") -> Dict[str, Tensor]:
    """(N_c,) facts of a chunk's real turns: conversation index, position, slicing entropy, topic label, labelled."""
    valid = chunk.valid
    batch, turns = valid.shape
    device = valid.device
    return {
        "conversation": torch.arange(rows.start, rows.start + batch, device=device).unsqueeze(1).expand(batch, turns)[valid],
        "position": torch.arange(turns, device=device).unsqueeze(0).expand(batch, turns)[valid],
        "entropy": emission_entropy(normalized, chunk.mask, config.slice_emission_weight)[valid],
        "topic_switch": piece.topic_switch.to(device=device, dtype=torch.int8)[valid],
        "eligible": labelled(qrels),
    }


def _gather_scored(scored: _Scored, device: torch.device) -> Optional[_Scored]:
    """Every rank's shard on rank 0, concatenated in rank order (= conversation order); None elsewhere.

    Without a process group (or with one process) ``scored`` itself. The coded
    per-turn metrics travel through the CPU (pickled by ``gather_object``) one method
    at a time, so rank 0 holds the gathered metrics plus one method's shards, not a
    second copy of everything; joined, their codes are those of a one-process run. The
    clock is rank 0's (its own shard) plus the ``gather`` wait.
    """
    if world_size() == 1:
        return scored
    tick = time.perf_counter()
    # every rank learns every key (a rank without conversations has none), in rank order
    described: Dict[str, Tuple[str, Dict[str, Any]]] = {}
    for shard_described in gather_to_all(scored.described):
        for key, value in shard_described.items():
            described.setdefault(key, value)
    metrics = PerTurnMetrics()
    for key in described:
        mine = scored.metrics.columns(key) if key in scored.metrics else None
        parts = gather_to_main(None if mine is None else {m: v.to(torch.device("cpu")) for m, v in mine.items()})
        if parts is not None:
            held = [part for part in parts if part is not None]
            metrics.put(key, {m: CodedValues.concat([part[m] for part in held]).to(device) for m in held[0]})
        trim_heap()  # the key's pickled and joined temporaries
    facts = gather_to_main({name: v.cpu() for name, v in scored.turns.items()})
    if facts is None:
        return None
    turns = {name: torch.cat([part[name] for part in facts]).to(device) for name in _TURN_FACTS}
    clock = dict(scored.clock, gather=time.perf_counter() - tick)
    return _Scored(metrics, described, turns, clock)


def evaluate(inputs: EvalInputs, config: Optional[EvalConfig] = None) -> Optional[EvalResult]:
    """Run every method on every conversation and summarize (see the module docstring).

    Under an initialized ``torch.distributed`` group of W > 1 processes (e.g.
    torchrun, :func:`~mapmatched_torch.eval.distributed.init_from_environment`),
    every rank must call this with the same inputs and config: each decodes and
    scores its :func:`~mapmatched_torch.eval.distributed.shard` of the
    conversations, rank 0 gathers the per-turn metrics and alone summarizes.

    Streaming: ``inputs`` may also be an input stream (e.g.
    :func:`inputs_from_synthetic` of a
    :class:`~mapmatched_torch.eval.synthetic.SyntheticStream`): anything with
    :class:`EvalInputs`'s ``name``, ``graph``, ``passage_ids``,
    ``passage_embeddings`` and ``info``, plus ``shape``, ``num_conversations``,
    ``device`` and ``select(rows) -> EvalInputs``. The conversations are then
    drawn chunk by chunk (each rank only its shard) and never held at once; the
    result equals the evaluation of the same conversations in memory. Methods that
    prepare on every conversation (the cross-fitted ones) need in-memory inputs and
    are skipped on a stream, with the reason.

    Args:
        inputs: the candidates, qrels, labels and graph (in memory, or a stream).
        config: the options (default :class:`EvalConfig`).

    Returns:
        The :class:`EvalResult` (equal to a one-process run's except ``timings``
        and ``world_size``); None on ranks other than 0 of a distributed run.

    Raises:
        MapMatchedValueError: bad options or inputs (naming them), e.g. no labelled
            turn (nothing to score).
    """
    config = (config or EvalConfig()).check()
    in_memory = isinstance(inputs, EvalInputs)
    if in_memory:  # a stream is checked once its turns are scored
        _require_labelled(inputs.name, labelled(inputs.qrels))
    if config.fold_repeats > 1:
        return _repeated(inputs, config)
    device = torch.device(config.device) if config.device is not None else inputs.device
    show = progress_enabled(config.progress)
    started = time.perf_counter()
    lookup = CorpusDistances(inputs.graph, inputs.passage_ids)
    options = MethodOptions(config.settings, config.relevance_weight, config.score_normalization, config.seed,
                            config.fit_folds, dict(config.method_options))
    active, state, skipped = _prepare_methods(inputs, config, options, show, in_memory)
    timings = {"prepare": time.perf_counter() - started}
    scored = _gather_scored(_score_chunks(inputs, config, options, active, state, lookup, device, show), device)
    if scored is None:  # a worker rank: rank 0 summarizes
        return None
    timings.update(scored.clock)

    tick = time.perf_counter()
    batch = inputs.num_conversations
    _require_labelled(inputs.name, scored.turns["eligible"])
    # shape: (N,) conversation of each real turn
    conversation = scored.turns["conversation"]
    masks, slicing, split_note = _slices(scored.turns, config)
    headline = _select_headline(scored, masks["all"], conversation, batch, config)
    trim_heap()
    results = _summaries(scored.metrics, scored.described, masks, conversation, config, show)
    timings["bootstrap"] = time.perf_counter() - tick

    primary, selected = _primary(results, config)  # the split plot's map-matched setting
    notes = _warnings(masks, conversation, split_note)
    if headline is None and config.primary is None and primary is not None:
        notes += (f"fewer conversations ({batch}) than cross-fitting folds ({config.fit_folds}): the headline "
                  "setting was chosen on the evaluated data (selected_on_data: true)",)
    split = None if primary is None else _split(inputs, lookup, scored.metrics, conversation, primary, config, device)
    timings["total"] = time.perf_counter() - started
    return EvalResult(
        name=inputs.name,
        info=dict(inputs.info),
        config=config.to_dict(),
        threshold=slicing.threshold,
        threshold_configured=slicing.configured,
        methods=tuple(results),
        skipped=skipped,
        primary=headline if headline is not None else (None if primary is None else primary[0]),
        primary_selected_on_data=headline is None and selected,
        split=split,
        timings=timings,
        per_turn=scored.metrics,
        slice_masks=masks,
        conversation=conversation,
        warnings=notes,
        world_size=world_size(),
    )


def _select_headline(scored: _Scored, eligible: Tensor, conversation: Tensor, batch: int,
                     config: EvalConfig) -> Optional[str]:
    """Add the cross-fitted selection's per-turn metrics to ``scored`` (mutated); its report key.

    None (nothing added) when a primary setting is configured or there are fewer
    conversations than folds (:mod:`~mapmatched_torch.eval.selection`).
    """
    if config.primary is not None or batch < config.fit_folds:
        return None
    folds = min(config.selection_folds, batch)
    fold = cross_fitting_folds(batch, folds, config.seed).to(conversation.device)
    candidates = selection_candidates(scored.described)
    # the preferred methods' report keys, in the order of preference
    preferred = [key for name in config.selection_preference for key in candidates
                 if scored.described[key][0] == name]
    chosen = cross_fitted_selection(scored.metrics, candidates, conversation, eligible, fold, PRIMARY_METRIC,
                                    preferred, float(config.selection_margin))
    key = SELECTION_KEY_FORMAT.format(folds=folds)
    scored.metrics.add(key, chosen.metrics)
    scored.described[key] = (SELECTION_METHOD, chosen.params(PRIMARY_METRIC))
    return key


def _repeated(inputs: EvalInputs, config: EvalConfig) -> Optional[EvalResult]:
    """:func:`evaluate` over ``config.fold_repeats`` fold splits (seeds ``seed + r``): the first
    split's full result, with :attr:`EvalResult.repeats` (the other splits skip the bootstrap)."""
    single = replace(config, fold_repeats=1)
    main = evaluate(inputs, single)
    others = [evaluate(inputs, replace(single, seed=config.seed + r, n_bootstrap=0))
              for r in range(1, config.fold_repeats)]
    if main is None:  # a worker rank of a distributed run
        return None
    runs = [main] + others

    def means(result: EvalResult) -> Dict[str, Tuple[Dict[str, Any], Dict[str, float]]]:
        return {m.key: (m.params, {name: piece.means[PRIMARY_METRIC] for name, piece in m.slices.items()})
                for m in result.methods}

    def choices(result: EvalResult) -> Optional[List[str]]:
        row = next((m for m in result.methods if m.method == SELECTION_METHOD), None)
        return None if row is None else [choice["method"] for choice in row.params["choices"]]

    repeats = {
        "seeds": [config.seed + r for r in range(config.fold_repeats)],
        "primary_choices": [choices(result) for result in runs],
        "methods": repeat_summaries([means(result) for result in runs]),
    }
    timings = dict(main.timings, repeats=sum(result.timings.get("total", 0.0) for result in others))
    return replace(main, config=config.to_dict(), repeats=repeats, timings=timings)
