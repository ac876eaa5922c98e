"""The harness's inputs: :class:`EvalInputs` (every tensor :func:`~mapmatched_torch.eval.runner.evaluate`
needs; no text, no embedder), built from the synthetic benchmark (:func:`inputs_from_synthetic`,
:class:`SyntheticInputStream`) or a dataset and an embedder (:func:`inputs_from_dataset`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core.checks import check_choice, check_positive_int
from ..core.errors import MapMatchedValueError
from ..core.protocols import CorpusGraph
from ..kernels.ranking_metrics import SparseQrels, pack_qrels
from .candidates import (
    Candidates,
    candidates_from_synthetic,
    embed_turns,
    passage_embedding_text,
    query_texts,
    retrieve_candidates,
)
from .config import Device, _phase, progress_enabled
from .data import Dataset
from .distances import build_corpus_graph, synthetic_graph
from .synthetic import SyntheticStream

__all__ = ["QRELS_POLICIES", "EvalInputs", "inputs_from_synthetic", "SyntheticInputStream", "inputs_from_dataset"]

#: What :func:`inputs_from_dataset` does with gold passages missing from the corpus.
QRELS_POLICIES = ("all", "in-corpus")


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
