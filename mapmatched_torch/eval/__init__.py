"""Offline evaluation: datasets, embedders, metrics, slices, bootstrap and a synthetic benchmark.

- :mod:`~mapmatched_torch.eval.data`: :class:`Dataset` and loaders (normalized JSONL,
  INSCIT, TopiOCQA, TREC CAsT).
- :mod:`~mapmatched_torch.eval.embedders`: :class:`HashEmbedder` (no dependencies),
  :class:`WordLlamaEmbedder` and :class:`SentenceTransformerEmbedder` (optional extras).
- :mod:`~mapmatched_torch.kernels.ranking_metrics`: nDCG@k, Recall@k, reciprocal rank on tensors.
- :mod:`~mapmatched_torch.eval.slices`: follow-up vs standalone by emission entropy,
  topic switch vs same topic.
- :mod:`~mapmatched_torch.eval.bootstrap`: paired bootstrap intervals over
  conversations and the pass/fail :func:`verdict`.
- :mod:`~mapmatched_torch.eval.synthetic`: the built-in deterministic benchmark.
- :mod:`~mapmatched_torch.eval.candidates`: each turn's retrieval candidates as
  (B, T, M) tensors (synthetic, or embedder + exact dense top-M) and their normalization.
- :mod:`~mapmatched_torch.eval.distances`: corpus graphs (kNN, section) and the
  distance tensors of a batch.
- :mod:`~mapmatched_torch.eval.methods`: the ranking methods (pointwise, map-matched
  grid, history concatenation, Maximal Marginal Relevance, resolved-query oracle,
  geodesic bound, cross-fitted weights) and their registry.
- :mod:`~mapmatched_torch.eval.runner`: the harness (:func:`evaluate`).
- :mod:`~mapmatched_torch.eval.report` and :mod:`~mapmatched_torch.eval.plots`:
  markdown, JSON and PNG reports.
"""

from __future__ import annotations

from ..kernels.ranking_metrics import (
    GAINS,
    Qrels,
    SparseQrels,
    dcg_at_k,
    dense_qrels,
    labelled,
    ndcg_at_k,
    pack_qrels,
    pack_rankings,
    ranking_metrics,
    recall_at_k,
    reciprocal_rank,
)
from .bootstrap import WEIGHTINGS, BootstrapResult, Verdict, bootstrap_mean, paired_bootstrap, verdict
from .candidates import (
    QUERY_MODES,
    Candidates,
    candidates_from_synthetic,
    normalize_candidate_scores,
    passage_embedding_text,
    query_texts,
    retrieve_candidates,
)
from .data import (
    Conversation,
    Dataset,
    Passage,
    Turn,
    TurnTable,
    load_directory,
    load_inscit,
    load_normalized,
    load_topiocqa,
    load_trec_cast,
    read_passages,
)
from .distances import GRAPH_KINDS, CorpusDistances, build_corpus_graph, synthetic_graph
from .embedders import (
    EMBEDDERS,
    Embedder,
    HashEmbedder,
    SentenceTransformerEmbedder,
    WordLlamaEmbedder,
    l2_normalize,
    make_embedder,
)
from .methods import (
    DEFAULT_METHODS,
    METHODS,
    MethodBatch,
    MethodOptions,
    MethodOutput,
    MethodSpec,
    MethodUnavailable,
    Setting,
    geodesic_online_order,
    history_concatenation_scores,
    map_matched_orders,
    maximal_marginal_relevance_order,
    online_forward_scores,
    rank_slots,
    register_method,
    settings_grid,
)
from .plots import plot_beta_sweep, plot_split, write_plots
from .report import to_json, to_json_dict, to_markdown, write_json, write_markdown
from .runner import (
    PRIMARY_METRIC,
    SLICES,
    EvalConfig,
    EvalInputs,
    EvalResult,
    MethodResult,
    PathSplit,
    SliceResult,
    evaluate,
    inputs_from_dataset,
    inputs_from_synthetic,
)
from .slices import EntropySlices, TopicSlices, emission_entropy, entropy_slices, median, topic_slices
from .synthetic import DRILL, FACETS, JUMP, MOVE_NAMES, START, SyntheticBenchmark, make_synthetic

__all__ = [
    # data
    "Passage",
    "Turn",
    "Conversation",
    "Dataset",
    "TurnTable",
    "load_normalized",
    "load_directory",
    "load_inscit",
    "load_topiocqa",
    "load_trec_cast",
    "read_passages",
    # embedders
    "Embedder",
    "HashEmbedder",
    "WordLlamaEmbedder",
    "SentenceTransformerEmbedder",
    "EMBEDDERS",
    "make_embedder",
    "l2_normalize",
    # metrics
    "SparseQrels",
    "Qrels",
    "GAINS",
    "pack_qrels",
    "pack_rankings",
    "dense_qrels",
    "labelled",
    "dcg_at_k",
    "ndcg_at_k",
    "recall_at_k",
    "reciprocal_rank",
    "ranking_metrics",
    # slices
    "EntropySlices",
    "TopicSlices",
    "emission_entropy",
    "median",
    "entropy_slices",
    "topic_slices",
    # bootstrap
    "WEIGHTINGS",
    "BootstrapResult",
    "Verdict",
    "bootstrap_mean",
    "paired_bootstrap",
    "verdict",
    # synthetic
    "SyntheticBenchmark",
    "make_synthetic",
    "FACETS",
    "MOVE_NAMES",
    "START",
    "DRILL",
    "JUMP",
    # candidates
    "QUERY_MODES",
    "Candidates",
    "candidates_from_synthetic",
    "query_texts",
    "retrieve_candidates",
    "normalize_candidate_scores",
    "passage_embedding_text",
    # graphs and distances
    "GRAPH_KINDS",
    "build_corpus_graph",
    "synthetic_graph",
    "CorpusDistances",
    # methods
    "Setting",
    "settings_grid",
    "MethodOptions",
    "MethodBatch",
    "MethodOutput",
    "MethodSpec",
    "MethodUnavailable",
    "METHODS",
    "DEFAULT_METHODS",
    "register_method",
    "rank_slots",
    "online_forward_scores",
    "map_matched_orders",
    "history_concatenation_scores",
    "maximal_marginal_relevance_order",
    "geodesic_online_order",
    # harness
    "SLICES",
    "PRIMARY_METRIC",
    "EvalInputs",
    "EvalConfig",
    "SliceResult",
    "MethodResult",
    "PathSplit",
    "EvalResult",
    "inputs_from_synthetic",
    "inputs_from_dataset",
    "evaluate",
    # reports
    "to_markdown",
    "write_markdown",
    "to_json",
    "to_json_dict",
    "write_json",
    "plot_beta_sweep",
    "plot_split",
    "write_plots",
]
