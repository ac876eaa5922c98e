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
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core.progress import progress_bar, progress_wanted
from ..core.checks import check_choice, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.protocols import CorpusGraph
from ..kernels.ranking_metrics import SparseQrels, labelled, pack_qrels, ranking_metrics
from .bootstrap import BootstrapResult, Verdict, bootstrap_means, paired_difference, verdict
from .candidates import (
    Candidates,
    candidates_from_synthetic,
    embed_turns,
    normalize_candidate_scores,
    passage_embedding_text,
    query_texts,
    retrieve_candidates,
)
from .data import Dataset
from .distances import CorpusDistances, build_corpus_graph, synthetic_graph
from .distributed import gather_to_all, gather_to_main, rank, shard, world_size
from .methods import (
    DEFAULT_METHODS,
    METHODS,
    MethodBatch,
    MethodOptions,
    MethodUnavailable,
    Setting,
    cross_fitting_folds,
    decode_setting,
    settings_grid,
    similarity_from_distances,
    similarity_from_embeddings,
)
from .selection import (
    SELECTION_KEY_FORMAT,
    SELECTION_METHOD,
    SELECTION_TITLE,
    cross_fitted_selection,
    repeat_summaries,
    selection_candidates,
)
from .slices import emission_entropy, entropy_slices, topic_slices
from .synthetic import SyntheticStream
from .turn_values import CodedColumnWriter, CodedValues, PerTurnMetrics
from ._allocator import trim_heap

__all__ = [
    "SLICES",
    "PRIMARY_METRIC",
    "QRELS_POLICIES",
    "EvalInputs",
    "EvalConfig",
    "SliceResult",
    "MethodResult",
    "PathSplit",
    "EvalResult",
    "inputs_from_synthetic",
    "SyntheticInputStream",
    "inputs_from_dataset",
    "evaluate",
    "progress_enabled",
    "main_process",
]

#: Slice names, in report order.
SLICES = ("all", "follow-up", "standalone", "topic-switch", "same-topic")
#: The metric with intervals, lifts and verdicts.
PRIMARY_METRIC = "ndcg@3"
#: What :func:`inputs_from_dataset` does with gold passages missing from the corpus.
QRELS_POLICIES = ("all", "in-corpus")

Device = Union[str, torch.device, None]


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class EvalInputs:
    """Everything :func:`evaluate` needs; no text, no embedder.

    B conversations, T turns, M candidates, N real turns, P passages.

    Attributes:
        name: dataset name for reports.
        candidates: the query candidates (B, T, M).
        qrels: flat qrels of the N real turns in (conversation, position) order.
        topic_switch: (B, T) int8, 1 switch / 0 same topic / -1 unknown.
        graph: the corpus graph (any ``CorpusGraph``; nodes may be in any order).
        passage_ids: the P corpus IDs in corpus order.
        conversation_ids: B conversation IDs.
        passage_embeddings: (P, D) unit rows, or None (synthetic).
        query_embeddings: (B, T, D) the raw queries' embeddings (0.0 at padding), or
            None (synthetic); the gated method's feature.
        alternatives: other candidate sets of the same turns by name (``"history"``,
            ``"rewrite"``), each (B, T, M').
        info: free-form facts for the report (dataset counts, embedder, graph).
    """

    name: str
    candidates: Candidates
    qrels: SparseQrels
    topic_switch: Tensor
    graph: CorpusGraph
    passage_ids: Tuple[str, ...]
    conversation_ids: Tuple[str, ...]
    passage_embeddings: Optional[Tensor] = None
    query_embeddings: Optional[Tensor] = None
    alternatives: Mapping[str, Candidates] = field(default_factory=dict)
    info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        batch, turns, _ = self.candidates.check(len(self.passage_ids)).shape
        real = int(self.candidates.valid.sum())
        if self.qrels.ids.shape[0] != real:
            raise MapMatchedValueError(f"qrels has {self.qrels.ids.shape[0]} turns but the candidates have {real}")
        if tuple(self.topic_switch.shape) != (batch, turns):
            raise MapMatchedValueError(f"topic_switch must be (B, T) = {(batch, turns)}, got {tuple(self.topic_switch.shape)}")
        if len(self.conversation_ids) != batch:
            raise MapMatchedValueError(f"{len(self.conversation_ids)} conversation IDs for {batch} conversations")
        for name, other in self.alternatives.items():
            if other.check(len(self.passage_ids)).shape[:2] != (batch, turns) or not bool(
                (other.valid == self.candidates.valid).all()
            ):
                raise MapMatchedValueError(f"alternative candidates {name!r} must cover the same (B, T) turns")

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(B, T, M) of the query candidates."""
        return tuple(self.candidates.shape)  # type: ignore[return-value]

    @property
    def num_conversations(self) -> int:
        """B."""
        return self.candidates.shape[0]

    @property
    def device(self) -> torch.device:
        """Where the candidates live."""
        return self.candidates.mask.device

    @cached_property
    def _turn_offsets(self) -> List[int]:
        """(B + 1,) flat index of each conversation's first real turn (and the total)."""
        counts = self.candidates.valid.sum(dim=1)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).tolist()

    def select(self, rows: slice) -> "EvalInputs":
        """Conversations ``rows`` (a step-1 slice) as inputs of their own: the unit that
        :func:`evaluate` works on (an input stream's :meth:`select` gives the same).

        The corpus, graph and ``info`` are shared; candidates, qrels, labels, IDs,
        query embeddings and alternatives are the rows'.
        """
        start, stop, _ = rows.indices(self.num_conversations)
        offsets = self._turn_offsets
        return replace(
            self,
            candidates=self.candidates.select(slice(start, stop)),
            qrels=self.qrels.select(slice(offsets[start], offsets[stop])),
            topic_switch=self.topic_switch[start:stop],
            conversation_ids=self.conversation_ids[start:stop],
            query_embeddings=None if self.query_embeddings is None else self.query_embeddings[start:stop],
            alternatives={name: other.select(slice(start, stop)) for name, other in self.alternatives.items()},
        )


def inputs_from_synthetic(
    bench: Any, *, graph: Optional[CorpusGraph] = None, device: Device = None, maximum_distance: float = 10.0
) -> Union[EvalInputs, "SyntheticInputStream"]:
    """:class:`EvalInputs` of a :class:`~mapmatched_torch.eval.synthetic.SyntheticBenchmark`, or the
    :class:`SyntheticInputStream` of a :class:`~mapmatched_torch.eval.synthetic.SyntheticStream`.

    The graph defaults to the benchmark's topic graph (:func:`synthetic_graph`, dense
    table precomputed). History concatenation is score-level; the resolved-query
    oracle is not available (the candidates are simulated, not retrieved).
    """
    if isinstance(bench, SyntheticStream):
        return SyntheticInputStream(bench, graph=graph, device=device, maximum_distance=maximum_distance)
    batch = bench.candidate_index.shape[0]
    conversations = bench.dataset.conversations
    ids = tuple(c.conversation_id for c in conversations) if conversations else tuple(
        f"{bench.dataset.name}-{b}" for b in range(batch)
    )
    if graph is None:
        graph = synthetic_graph(bench, maximum_distance=maximum_distance, device=device)
    return _synthetic_inputs(bench, graph, device, ids, _synthetic_info(bench, bench.config, batch))


def _synthetic_info(bench: Any, config: Mapping[str, Any], batch: int) -> Dict[str, Any]:
    """The report facts of ``batch`` synthetic conversations (every turn real)."""
    turns, width = bench.candidate_index.shape[1:]
    return {"source": "synthetic", "generator": dict(config), "conversations": batch, "turns": batch * turns,
            "passages": len(bench.dataset.passages), "candidates_per_turn": width, "graph": "synthetic topic graph"}


def _synthetic_inputs(bench: Any, graph: CorpusGraph, device: Device, ids: Tuple[str, ...],
                      info: Mapping[str, Any]) -> EvalInputs:
    """:class:`EvalInputs` of a benchmark's conversations with the given graph, IDs and facts."""
    candidates = candidates_from_synthetic(bench).to(device)
    return EvalInputs(
        name=bench.dataset.name,
        candidates=candidates,
        qrels=bench.qrels().to(candidates.mask.device),
        topic_switch=bench.topic_switch.to(device=candidates.mask.device, dtype=torch.int8),
        graph=graph,
        passage_ids=bench.dataset.passage_ids,
        conversation_ids=ids,
        info=info,
    )


class SyntheticInputStream:
    """The evaluation inputs of a :class:`~mapmatched_torch.eval.synthetic.SyntheticStream`, drawn
    chunk by chunk: what :func:`evaluate` streams (see its docstring for the protocol).

    Holds the corpus and graph only; :meth:`select` draws conversations ``rows`` and
    returns them as :class:`EvalInputs` (IDs ``"<name>-<b>"`` by global index b), so
    a distributed run's rank draws only its own shard. :meth:`materialize` gives all
    conversations in memory (the same inputs, for small runs and tests).
    """

    def __init__(self, stream: SyntheticStream, *, graph: Optional[CorpusGraph] = None, device: Device = None,
                 maximum_distance: float = 10.0) -> None:
        self.stream = stream
        probe = stream.select(0, 1)  # the world's edges and passages, one conversation
        self.graph = graph if graph is not None else synthetic_graph(probe, maximum_distance=maximum_distance,
                                                                     device=device)
        self.name = stream.dataset.name
        self.passage_ids = stream.dataset.passage_ids
        self.passage_embeddings: Optional[Tensor] = None
        self.info = _synthetic_info(probe, stream.config, stream.n_conversations)
        self._device = device

    @property
    def shape(self) -> Tuple[int, int, int]:
        """(B, T, M)."""
        return self.stream.shape

    @property
    def num_conversations(self) -> int:
        """B."""
        return self.stream.n_conversations

    @property
    def device(self) -> torch.device:
        """Where the drawn chunks live."""
        return torch.device(self._device) if self._device is not None else torch.device("cpu")

    def select(self, rows: slice) -> EvalInputs:
        """Conversations ``rows`` (a step-1 slice), drawn now."""
        start, stop, _ = rows.indices(self.num_conversations)
        ids = tuple(f"{self.name}-{b}" for b in range(start, stop))
        return _synthetic_inputs(self.stream.select(start, stop), self.graph, self._device, ids, self.info)

    def materialize(self) -> EvalInputs:
        """Every conversation in memory (equal to concatenating any chunks of :meth:`select`)."""
        return self.select(slice(0, self.num_conversations))


def inputs_from_dataset(
    dataset: Dataset,
    embedder: Any,
    *,
    graph: Union[str, Any] = "knn",
    k: int = 10,
    candidates: int = 20,
    maximum_distance: float = 10.0,
    device: Device = None,
    progress: Optional[bool] = None,
    qrels: str = "all",
) -> EvalInputs:
    """Embed a dataset's corpus and queries, retrieve the candidates, build the graph.

    Passages are embedded with their headings (:func:`~mapmatched_torch.eval.candidates.passage_embedding_text`).
    Retrieval is exact inner-product top-``candidates`` over the unit passage
    embeddings (:class:`~mapmatched_torch.providers.dense.DenseProvider`), for the raw
    queries, the history concatenation, and (when any turn has one) the rewrites.

    Args:
        dataset: conversations and a non-empty corpus.
        embedder: an :class:`~mapmatched_torch.eval.embedders.Embedder`.
        graph: ``"knn"`` (default, over the passage embeddings, ``k`` neighbours),
            ``"section"``, or a ready ``CorpusGraph`` over the passage IDs.
        k: kNN neighbours. candidates: M per turn.
        maximum_distance: the graph bound. device: where tensors live.
        progress: progress lines of the phases (embedding, retrieval, graph) and
            the graph build's bars (None: lines only on a terminal, see
            :func:`progress_enabled`; the kNN bars on large corpora).
        qrels: gold passages missing from the corpus: ``"all"`` (default: kept, a
            turn can never retrieve them, so they lower its recall and nDCG as in
            trec_eval) or ``"in-corpus"`` (dropped, :meth:`~mapmatched_torch.eval.data.Dataset.qrels_in_corpus`;
            a turn left without gold is unjudged). Either way ``info["gold_missing"]``
            counts them (:meth:`~mapmatched_torch.eval.data.Dataset.gold_coverage`)
            and the report warns when there are any.
    """
    from ..providers.dense import DenseProvider

    if not dataset.passages:
        raise MapMatchedValueError(f"dataset {dataset.name!r} has no passages: give the corpus to retrieve from")
    if not dataset.conversations:
        raise MapMatchedValueError(f"dataset {dataset.name!r} has no conversations")
    candidates = check_positive_int(candidates, "candidates")
    check_choice("qrels policy", qrels, QRELS_POLICIES)
    coverage = dataset.gold_coverage()
    if qrels == "in-corpus":
        dataset = dataset.qrels_in_corpus()
        if dataset.labelled_turn_count == 0:
            raise MapMatchedValueError(f"dataset {dataset.name!r}: no labelled turn has a gold passage in the corpus "
                                       "(--qrels in-corpus leaves nothing to score): give the corpus the gold is in")
    device = torch.device(device) if device is not None else torch.device("cpu")
    show = progress_enabled(progress)
    _phase(show, f"embedding {len(dataset.passages)} passages with {embedder!r}")
    # shape: (P, D)
    embeddings = embedder.encode([passage_embedding_text(p) for p in dataset.passages]).to(device)
    provider = DenseProvider(embeddings, dataset.passage_ids, metric="inner_product", device=device)

    def retrieve(mode: str) -> Candidates:
        _phase(show, f"embedding and retrieving the top {candidates} passages of {dataset.num_turns} turns ({mode})")
        return retrieve_candidates(query_texts(dataset, mode), embedder, provider, candidates, device=device)

    query = retrieve("query")
    alternatives = {"history": retrieve("history")}
    if any(turn.rewrite is not None for _, _, turn in dataset.iter_turns()):
        alternatives["rewrite"] = retrieve("rewrite")
    graph_name = graph if isinstance(graph, str) else type(graph).__name__
    if isinstance(graph, str):
        _phase(show, f"building the {graph} graph of {len(dataset.passages)} passages")
        graph = build_corpus_graph(graph, dataset.passages, embeddings, k=k, maximum_distance=maximum_distance,
                                   device=device, progress=progress)
    table = dataset.turn_table()
    switch = torch.full(query.valid.shape, -1, dtype=torch.int8)
    switch[table.conversation, table.position] = table.topic_switch
    info = dict(dataset.summary())
    info.update({"source": "dataset", "embedder": repr(embedder), "graph": graph_name, "k": k,
                 "candidates_per_turn": query.shape[2], "rewrites": "rewrite" in alternatives,
                 "qrels": qrels, "gold_missing": coverage})
    return EvalInputs(
        name=dataset.name,
        candidates=query,
        qrels=pack_qrels(dataset.turn_qrels(), dataset.passage_index, device=device),
        topic_switch=switch.to(device),
        graph=graph,
        passage_ids=dataset.passage_ids,
        conversation_ids=tuple(c.conversation_id for c in dataset.conversations),
        passage_embeddings=embeddings,
        query_embeddings=embed_turns(query_texts(dataset, "query"), embedder, device=device),
        alternatives=alternatives,
        info=info,
    )


# --------------------------------------------------------------------------- config and results


@dataclass(frozen=True)
class EvalConfig:
    """Options of :func:`evaluate`.

    Attributes:
        lambdas, betas, lags: the map-matching grid (lag None = full decoding).
        methods: registry names to run, in report order (default: all).
        relevance_weight: the Maximal Marginal Relevance lambda (1 = pure relevance).
        ks: cut-offs of nDCG@k and Recall@k.
        n_bootstrap: bootstrap resamples (0 skips the intervals: NaN bounds).
        confidence: interval coverage. seed: bootstrap seed.
        tolerance: the verdict's standalone tolerance (nDCG@3 units).
        entropy_threshold: a fixed follow-up threshold in nats (None: the median).
        slice_emission_weight: lambda of the slicing entropy.
        score_normalization: ``"zscore"``, ``"center"`` or ``"none"``.
        exact_normalization: bit-exact (Python) normalization, else tensor sums.
        fit_folds: cross-fitting folds of the fitted method (>= 2).
        selection_folds: folds of the headline's cross-fitted selection (>= 2,
            default 5; at most one per conversation): each is ranked by the method
            best on the other selection folds. More folds than ``fit_folds`` make each
            choice on most of the data, so the folds agree on small sets
            (:mod:`~mapmatched_torch.eval.selection`).
        fold_repeats: R >= 1 fold splits (seeds ``seed .. seed + R - 1``): with R > 1
            the cross-fitted rankings' slice means are also reported as a mean and
            range over R splits (:attr:`EvalResult.repeats`; the extra runs skip the bootstrap).
        method_options: free-form options of registered methods
            (:attr:`~mapmatched_torch.eval.methods.MethodOptions.extra`, e.g.
            ``{"gated_calibrate": True}``).
        primary: a map-matched setting as the headline verdict and the split plot
            (None: the headline is the cross-fitted selection,
            :mod:`~mapmatched_torch.eval.selection`; the split plot takes the grid's
            best setting on the data).
        split_conversation: conversation index of the split plot (None: automatic).
        batch_size: conversations per chunk (None: from ``memory_budget``).
        memory_budget: bytes of stacked transitions per chunk (default 256 MiB).
        device: where the work runs (None: where the inputs are).
        progress: progress bars (None: only on a terminal).
    """

    lambdas: Tuple[float, ...] = (1.0,)
    betas: Tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
    lags: Tuple[Optional[int], ...] = (None,)
    methods: Tuple[str, ...] = DEFAULT_METHODS
    relevance_weight: float = 0.7
    ks: Tuple[int, ...] = (3, 5, 10)
    n_bootstrap: int = 1000
    confidence: float = 0.95
    seed: int = 0
    tolerance: float = 0.01
    entropy_threshold: Optional[float] = None
    slice_emission_weight: float = 1.0
    score_normalization: str = "zscore"
    exact_normalization: bool = True
    fit_folds: int = 2
    selection_folds: int = 5
    fold_repeats: int = 1
    method_options: Mapping[str, Any] = field(default_factory=dict)
    primary: Optional[Setting] = None
    split_conversation: Optional[int] = None
    batch_size: Optional[int] = None
    memory_budget: int = 256 << 20
    device: Device = None
    progress: Optional[bool] = None

    @property
    def settings(self) -> Tuple[Setting, ...]:
        """The validated grid."""
        return settings_grid(self.lambdas, self.betas, self.lags)

    def check(self) -> "EvalConfig":
        """Validate every option; returns ``self``.

        Raises:
            MapMatchedValueError: naming the bad option.
        """
        self.settings  # noqa: B018 (validates the grid)
        unknown = [name for name in self.methods if name not in METHODS]
        if unknown:
            raise MapMatchedValueError(f"unknown method(s) {unknown} (registered: {', '.join(METHODS)})")
        if "pointwise" not in self.methods:
            raise MapMatchedValueError("the methods must include pointwise (the baseline of every lift)")
        for k in self.ks:
            check_positive_int(k, "k")
        if PRIMARY_METRIC.split("@")[1] not in {str(k) for k in self.ks}:
            raise MapMatchedValueError(f"ks must include {PRIMARY_METRIC.split('@')[1]} (the primary metric)")
        if isinstance(self.n_bootstrap, bool) or not isinstance(self.n_bootstrap, int) or self.n_bootstrap < 0:
            raise MapMatchedValueError(f"n_bootstrap must be an int >= 0, got {self.n_bootstrap!r}")
        if not 0.0 < float(self.confidence) < 1.0:
            raise MapMatchedValueError(f"confidence must be in (0, 1), got {self.confidence!r}")
        if not math.isfinite(float(self.tolerance)) or self.tolerance < 0:
            raise MapMatchedValueError(f"tolerance must be finite and nonnegative, got {self.tolerance!r}")
        if not 0.0 <= float(self.relevance_weight) <= 1.0:
            raise MapMatchedValueError(f"the Maximal Marginal Relevance lambda must be in [0, 1], got {self.relevance_weight!r}")
        if self.batch_size is not None:
            check_positive_int(self.batch_size, "batch_size")
        check_positive_int(self.memory_budget, "memory_budget")
        if isinstance(self.fit_folds, bool) or not isinstance(self.fit_folds, int) or self.fit_folds < 2:
            raise MapMatchedValueError(f"fit_folds must be an int >= 2, got {self.fit_folds!r}")
        if isinstance(self.selection_folds, bool) or not isinstance(self.selection_folds, int) \
                or self.selection_folds < 2:
            raise MapMatchedValueError(f"selection_folds must be an int >= 2, got {self.selection_folds!r}")
        if isinstance(self.fold_repeats, bool) or not isinstance(self.fold_repeats, int) or self.fold_repeats < 1:
            raise MapMatchedValueError(f"fold_repeats must be an int >= 1 (1 = one fold split), got {self.fold_repeats!r}")
        return self

    def to_dict(self) -> Dict[str, Any]:
        """The options as plain JSON-friendly values."""
        return {
            "lambdas": list(self.lambdas), "betas": list(self.betas), "lags": list(self.lags),
            "methods": list(self.methods), "maximal_marginal_relevance_lambda": self.relevance_weight,
            "ks": list(self.ks), "n_bootstrap": self.n_bootstrap, "confidence": self.confidence,
            "seed": self.seed, "tolerance": self.tolerance, "entropy_threshold": self.entropy_threshold,
            "slice_emission_weight": self.slice_emission_weight, "score_normalization": self.score_normalization,
            "exact_normalization": self.exact_normalization, "fit_folds": self.fit_folds,
            "selection_folds": self.selection_folds, "fold_repeats": self.fold_repeats, "method_options": dict(self.method_options),
            "primary": None if self.primary is None else self.primary.to_dict(),
            "device": None if self.device is None else str(self.device),
        }


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




# --------------------------------------------------------------------------- evaluate


def main_process() -> bool:
    """Whether this process should print: not a worker of a distributed job (rank 0,
    by ``torch.distributed`` when initialized, else by the ``RANK`` / ``LOCAL_RANK``
    environment variables that launchers such as torchrun set)."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank() == 0
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in ("RANK", "LOCAL_RANK"))


def progress_enabled(progress: Optional[bool]) -> bool:
    """Whether to show the phase lines (``eval: embedding ...``) on stderr.

    The loops' progress (``mapmatched_torch.core.progress``) shows with None on the main
    process wherever stderr goes: a bar on a terminal, else a plain line every 10 s.

    Args:
        progress: True or False decide; None: only when stderr is a terminal and
            this is the :func:`main_process`.
    """
    if progress is not None:
        return bool(progress)
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) and main_process()


def _phase(show: bool, message: str) -> None:
    """One progress line on stderr (a phase without a bar of its own)."""
    if show:
        print(f"eval: {message}", file=sys.stderr, flush=True)


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
    chosen = cross_fitted_selection(scored.metrics, selection_candidates(scored.described), conversation, eligible,
                                    fold, PRIMARY_METRIC)
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
