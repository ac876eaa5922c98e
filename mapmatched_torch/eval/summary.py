"""The harness's results and how they are summarized: slice means, bootstrap intervals,
lifts and verdicts (:class:`EvalResult`, :class:`MethodResult`, :class:`SliceResult`), the
degenerate-data warnings, the primary setting and the emission vs transition split of one
decoded path (:class:`PathSplit`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ..core.errors import MapMatchedValueError
from ..core.progress import progress_bar, progress_wanted
from .bootstrap import BootstrapResult, Verdict, bootstrap_means, paired_difference, verdict
from .candidates import Candidates, normalize_candidate_scores
from .config import PRIMARY_METRIC, EvalConfig
from .distances import CorpusDistances
from .distributed import main_process
from .inputs import EvalInputs
from .methods import METHODS, Setting, decode_setting
from .selection import SELECTION_METHOD, SELECTION_TITLE
from .slices import entropy_slices, topic_slices
from .turn_values import PerTurnMetrics
from ._allocator import trim_heap

__all__ = ["SliceResult", "MethodResult", "PathSplit", "EvalResult"]


@dataclass(frozen=True)
class SliceResult:
    """One method on one slice.

    Attributes:
        n_turns: labelled turns in the slice. n_conversations: conversations with one.
        means: every metric's mean over the slice's turns (NaN when empty).
        interval: bootstrap interval of the primary metric's mean.
        lift: paired bootstrap interval of the primary metric minus pointwise's (None
            for pointwise itself).
    """

    n_turns: int
    n_conversations: int
    means: Dict[str, float]
    interval: BootstrapResult
    lift: Optional[BootstrapResult]


@dataclass(frozen=True)
class MethodResult:
    """One ranking method (one grid setting for map-matched) on every slice.

    Attributes:
        key: unique report name. method: registry name. title: the method's title.
        params: its parameters. slices: slice name -> :class:`SliceResult`.
        verdict: follow-up lift vs standalone tolerance (None for the baselines:
            pointwise and map-matching at beta = 0, which ranks as pointwise). Whether
            the intervals can back it (bootstrap on, enough conversations) is the
            report's :func:`~mapmatched_torch.eval.report.judge`.
    """

    key: str
    method: str
    title: str
    params: Dict[str, Any]
    slices: Dict[str, SliceResult]
    verdict: Optional[Verdict]


@dataclass(frozen=True)
class PathSplit:
    """Per-turn emission vs transition split of one decoded conversation.

    Attributes:
        conversation_id: the conversation. setting: the map-matched setting.
        chunk_ids: the decoded chunk of each turn. relevant: whether it is relevant.
        weighted_emission: lambda * s of each step. distance: d to the previous step
            (0 at turn 0). weighted_transition: beta * d. cumulative: the running
            score (emission minus transition), as in the session's trace.
        pointwise_chunk_ids: the pointwise choice of each turn, for comparison.
    """

    conversation_id: str
    setting: Setting
    chunk_ids: Tuple[str, ...]
    relevant: Tuple[bool, ...]
    weighted_emission: Tuple[float, ...]
    distance: Tuple[float, ...]
    weighted_transition: Tuple[float, ...]
    cumulative: Tuple[float, ...]
    pointwise_chunk_ids: Tuple[str, ...]


@dataclass(frozen=True)
class EvalResult:
    """The outcome of :func:`evaluate` (turn it into reports with :mod:`~mapmatched_torch.eval.report`).

    Attributes:
        name: dataset name. info: facts about the inputs. config: the options used.
        threshold: the follow-up entropy threshold (nats; NaN when there was no later
            turn). threshold_configured: whether it was given rather than the median.
        methods: one :class:`MethodResult` per ranking, pointwise first.
        skipped: methods that could not run, with the reason.
        primary: key of the headline method: the cross-fitted selection
            (:mod:`~mapmatched_torch.eval.selection`; its row's params name each
            fold's choice), or the configured map-matched setting, or (fewer
            conversations than folds) the grid's best on the data; None without one.
            primary_selected_on_data: whether it was chosen on the evaluated data.
        split: the per-turn split of one conversation (None without map-matching).
        timings: seconds per phase.
        per_turn: method key -> metric -> (N,) float64 per-turn values (not in JSON), a
            :class:`~mapmatched_torch.eval.turn_values.PerTurnMetrics` that holds them
            coded (about a byte per value) and decodes a column when it is read.
        slice_masks: slice name -> (N,) bool (not in JSON).
        conversation: (N,) long conversation index of each turn (not in JSON).
        warnings: degenerate data that weakens the intervals or the slices (a single
            conversation, a slice with fewer than 2 conversations, a follow-up split
            that cannot separate the turns), one sentence each.
        world_size: processes that decoded and scored the conversations (1 without
            ``torch.distributed``; see :mod:`~mapmatched_torch.eval.distributed`).
        repeats: with ``fold_repeats`` R > 1: ``{"seeds": [...], "primary_choices":
            [[key per fold] per split], "methods": key -> {"mean"/"lift": slice ->
            RepeatRange}}`` of the cross-fitted rankings
            (:func:`~mapmatched_torch.eval.selection.repeat_summaries`); else None.
    """

    name: str
    info: Dict[str, Any]
    config: Dict[str, Any]
    threshold: float
    threshold_configured: bool
    methods: Tuple[MethodResult, ...]
    skipped: Dict[str, str]
    primary: Optional[str]
    primary_selected_on_data: bool
    split: Optional[PathSplit]
    timings: Dict[str, float]
    per_turn: PerTurnMetrics = field(repr=False, default_factory=PerTurnMetrics)
    slice_masks: Dict[str, Tensor] = field(repr=False, default_factory=dict)
    conversation: Optional[Tensor] = field(repr=False, default=None)
    warnings: Tuple[str, ...] = ()
    world_size: int = 1
    repeats: Optional[Dict[str, Any]] = None

    def method(self, key: str) -> MethodResult:
        """The result of one method key (KeyError naming the keys otherwise)."""
        for result in self.methods:
            if result.key == key:
                return result
        raise KeyError(f"no method {key!r}; have {[m.key for m in self.methods]}")


def _require_labelled(name: str, eligible: Tensor) -> None:
    """Raise unless some turn is labelled (``eligible``: (N,) bool)."""
    if not bool(eligible.any()):
        raise MapMatchedValueError(
            f"{name}: no labelled turns: every metric needs a turn with a qrel grade > 0 (a relevant passage)"
        )


def _slices(turn_facts: Dict[str, Tensor], config: EvalConfig) -> Tuple[Dict[str, Tensor], Any, Optional[str]]:
    """(N,) masks of every slice over the labelled turns, the entropy slicing (its threshold), and a
    warning when every later labelled turn has the same entropy (no split can separate them).

    ``turn_facts``: the (N,) per-turn facts of :func:`_turn_facts`, every chunk's concatenated.
    """
    # shape: (N,)
    entropy, position, eligible = turn_facts["entropy"], turn_facts["position"], turn_facts["eligible"]
    by_entropy = entropy_slices(entropy, position, config.entropy_threshold, eligible)
    by_topic = topic_slices(turn_facts["topic_switch"], position, eligible)
    masks = {"all": eligible, "follow-up": by_entropy.followup, "standalone": by_entropy.standalone}
    if bool(by_topic.switch.any() | by_topic.same.any()):
        masks.update({"topic-switch": by_topic.switch, "same-topic": by_topic.same})
    later = entropy[eligible & (position > 0)]
    note = None
    if later.numel() >= 2 and bool((later == later[0]).all()):
        note = (f"all {later.numel()} later labelled turns have the same emission entropy ({float(later[0]):.3f} "
                "nats; identical turns or candidate scores?): the follow-up / standalone split cannot separate them")
    return masks, by_entropy, note


def _warnings(masks: Dict[str, Tensor], conversation: Tensor, split_note: Optional[str]) -> Tuple[str, ...]:
    """Degenerate data: fewer than 2 labelled conversations overall or in a slice; a constant entropy."""
    counts = {name: int(torch.unique(conversation[mask]).numel()) for name, mask in masks.items()}
    notes = []
    if counts["all"] < 2:
        notes.append(f"only {counts['all']} conversation has labelled turns: the bootstrap resamples conversations, "
                     "so every interval is zero-width and no verdict can be judged; evaluate more conversations")
    else:
        for name, count in counts.items():
            if count == 0:
                notes.append(f"the {name} slice is empty (no labelled turn): it has no interval, and verdicts "
                             "that need it cannot be judged")
            elif count < 2:
                notes.append(f"the {name} slice has labelled turns in only {count} conversation: its intervals are "
                             "zero-width, and verdicts that need it cannot be judged")
    if split_note is not None:
        notes.append(split_note)
    return tuple(notes)


def _summaries(metrics: PerTurnMetrics, described: Dict[str, Tuple[str, Dict[str, Any]]],
               masks: Dict[str, Tensor], conversation: Tensor, config: EvalConfig, show: bool) -> List[MethodResult]:
    """Every ranking's slice means (exact sums of the coded metrics), intervals and lifts.

    The bootstrap runs per slice for every ranking at once (:func:`bootstrap_means`:
    one grouping and one set of resamples; each result equals its own
    ``bootstrap_mean``), decoding each ranking's primary metric once per slice for its
    interval and its lift.
    """
    resamples = max(config.n_bootstrap, 1)
    options = dict(n_resamples=resamples, confidence=config.confidence, seed=config.seed)
    keys = list(metrics)
    turns = {name: int(mask.sum()) for name, mask in masks.items()}
    # key -> slice -> metric -> mean
    means = {key: {name: {metric: column.masked_sum(mask) / turns[name] if turns[name] else math.nan
                          for metric, column in metrics.columns(key).items()}
                   for name, mask in masks.items()}
             for key in keys}
    baseline = metrics["pointwise"][PRIMARY_METRIC]

    def kinds(key: str) -> Tuple[str, ...]:
        """What is bootstrapped of a key: its metric, and (but for pointwise) its lift."""
        return ("interval",) if key == "pointwise" else ("interval", "lift")

    order = [(key, kind) for key in keys for kind in kinds(key)]

    def columns() -> Iterator[Tensor]:  # in ``order``, each key's metric decoded once
        for key in keys:
            values = metrics[key][PRIMARY_METRIC]
            for kind in kinds(key):
                yield values if kind == "interval" else paired_difference(values, baseline)

    found: Dict[Tuple[str, str], Dict[str, BootstrapResult]] = {entry: {} for entry in order}
    for name, mask in progress_bar(masks.items(), desc="bootstrap", unit="slice",
                                   show=progress_wanted(config.progress, main_process()), leave=False):
        for entry, result in zip(order, bootstrap_means(columns(), conversation, mask, **options)):
            found[entry][name] = result
        trim_heap()  # the slice's decoded columns
    results: List[MethodResult] = []
    for key in keys:
        method, params = described[key]
        slices: Dict[str, SliceResult] = {}
        for name in masks:
            interval = found[key, "interval"][name]
            lift = found[key, "lift"][name] if key != "pointwise" else None
            if config.n_bootstrap == 0:
                interval = _without_interval(interval)
                lift = None if lift is None else _without_interval(lift)
            slices[name] = SliceResult(turns[name], interval.n, means[key][name], interval, lift)
        judged = None
        if not _is_baseline(method, params):
            judged = verdict(slices["follow-up"].lift, slices["standalone"].lift, config.tolerance)
        title = SELECTION_TITLE if method == SELECTION_METHOD else METHODS[method].title
        results.append(MethodResult(key, method, title, dict(params), slices, judged))
    return results


def _is_baseline(method: str, params: Mapping[str, Any]) -> bool:
    """Pointwise, and map-matching at beta = 0 (which ranks exactly as pointwise): no verdict."""
    return method == "pointwise" or (method == "map-matched" and params.get("beta") == 0)


def _without_interval(result: BootstrapResult) -> BootstrapResult:
    return BootstrapResult(result.mean, math.nan, math.nan, result.n, result.n_turns, result.confidence, 0,
                           result.weighting, result.seed)


def _primary(results: List[MethodResult], config: EvalConfig) -> Tuple[Optional[Tuple[str, Setting]], bool]:
    """((key, setting) of the primary map-matched method or None, whether it was chosen on the data)."""
    grid = {r.key: Setting(r.params["lambda"], r.params["beta"], r.params["lag"])
            for r in results if r.method == "map-matched" and r.params["beta"] > 0}
    if not grid:
        return None, False
    if config.primary is not None:
        for key, setting in grid.items():
            if setting == config.primary:
                return (key, setting), False
        raise MapMatchedValueError(f"the primary setting {config.primary.label} is not a beta > 0 setting of the grid")

    def score(key: str) -> float:
        value = next(r for r in results if r.key == key).slices["all"].means[PRIMARY_METRIC]
        return -math.inf if math.isnan(value) else value

    best = max(grid, key=score)  # the first of equals (max keeps the first maximum)
    return (best, grid[best]), True


def _split_conversation(metrics: PerTurnMetrics, conversation: Tensor, key: str, batch: int,
                        config: EvalConfig) -> int:
    """The configured conversation, else the one whose summed nDCG@3 gain over pointwise is largest (first of equals)."""
    if config.split_conversation is not None:
        index = int(config.split_conversation)
        if not 0 <= index < batch:
            raise MapMatchedValueError(f"split_conversation must be in [0, {batch - 1}], got {index}")
        return index
    gain = metrics[key][PRIMARY_METRIC] - metrics["pointwise"][PRIMARY_METRIC]
    per_conversation = torch.zeros(batch, dtype=torch.float64, device=gain.device).index_add_(0, conversation, gain)
    return int(per_conversation.argmax())


def _split(inputs: EvalInputs, lookup: CorpusDistances, metrics: PerTurnMetrics, conversation: Tensor,
           primary: Tuple[str, Setting], config: EvalConfig, device: torch.device) -> PathSplit:
    """The per-turn emission vs transition split of one conversation's decoded path (whole conversation).

    The conversation is selected again from ``inputs`` (a stream draws it again) and its
    scores normalized as in the chunk loop (per turn, so the same numbers)."""
    key, setting = primary
    b = _split_conversation(metrics, conversation, key, inputs.num_conversations, config)
    piece = inputs.select(slice(b, b + 1))
    candidates = piece.candidates.to(device)
    length = int(candidates.lengths[0])
    # shape: (1, T_b, M) and (1, T_b - 1, M, M)
    one = Candidates(*(tensor[:, :length] for tensor in candidates))
    scores = normalize_candidate_scores(one.scores, one.mask, config.score_normalization,
                                        exact=config.exact_normalization)
    distances = lookup.consecutive(one.index)
    path = decode_setting(scores, distances, one.mask, setting)[0].tolist()
    pointwise = decode_setting(scores, None, one.mask, Setting(1.0, 0.0))[0].tolist()
    ids, index = inputs.passage_ids, one.index[0].tolist()
    qrels = piece.qrels
    relevant = [{i for i, g in zip(row_ids, row_grades) if g > 0}
                for row_ids, row_grades in zip(qrels.ids.tolist(), qrels.grades.tolist())]
    emissions, gaps, costs, cumulative = [], [], [], []
    for t, slot in enumerate(path):
        emissions.append(setting.emission_weight * float(scores[0, t, slot]))
        gaps.append(float(distances[0, t - 1, path[t - 1], slot]) if t else 0.0)
        costs.append(setting.transition_cost(gaps[-1]))
        # the trace's running score: (cumulative - transition) + emission
        cumulative.append(emissions[-1] if t == 0 else (cumulative[-1] - costs[-1]) + emissions[-1])
    return PathSplit(
        conversation_id=piece.conversation_ids[0],
        setting=setting,
        chunk_ids=tuple(ids[index[t][slot]] for t, slot in enumerate(path)),
        relevant=tuple(index[t][slot] in relevant[t] for t, slot in enumerate(path)),
        weighted_emission=tuple(emissions),
        distance=tuple(gaps),
        weighted_transition=tuple(costs),
        cumulative=tuple(cumulative),
        pointwise_chunk_ids=tuple(ids[index[t][slot]] for t, slot in enumerate(pointwise)),
    )
