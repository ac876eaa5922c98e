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
- :mod:`~mapmatched_torch.eval.turn_values`: per-turn metrics held losslessly in about a
  byte per value (:class:`CodedValues`, :class:`PerTurnMetrics`) and their exact slice sums.
- :mod:`~mapmatched_torch.eval.synthetic`: the built-in deterministic benchmark.
- :mod:`~mapmatched_torch.eval.candidates`: each turn's retrieval candidates as
  (B, T, M) tensors (synthetic, or embedder + exact dense top-M) and their normalization.
- :mod:`~mapmatched_torch.eval.distances`: corpus graphs (kNN, section) and the
  distance tensors of a batch.
- :mod:`~mapmatched_torch.eval.methods`: the ranking methods (pointwise, map-matched
  grid, history concatenation, Maximal Marginal Relevance, resolved-query oracle,
  geodesic bound, cross-fitted weights) and their registry.
- :mod:`~mapmatched_torch.eval.runner`: the harness (:func:`evaluate`).
- :mod:`~mapmatched_torch.eval.distributed`: torchrun detection, the process group,
  sharding the conversations by rank and gathering to rank 0.
- :mod:`~mapmatched_torch.eval.report` and :mod:`~mapmatched_torch.eval.plots`:
  markdown, JSON and PNG reports.

Its public surface is the handful of names a user calls (``__all__``): the harness
(:func:`evaluate` and its inputs and result), loading a dataset, making an embedder,
registering a method and writing the reports. Every other name these modules define
(metrics, slices, bootstrap, methods, synthetic data, ...) is imported from its module,
e.g. ``from mapmatched_torch.eval.bootstrap import paired_bootstrap``; the names this
package used to re-export stay readable here too, imported on first access.
"""

from __future__ import annotations

from .._lazy import lazy_attributes
from .data import Dataset, load_directory
from .embedders import make_embedder
from .methods import register_method
from .plots import write_plots
from .report import to_markdown, write_json, write_markdown
from .runner import EvalConfig, EvalInputs, EvalResult, evaluate, inputs_from_dataset, inputs_from_synthetic

__all__ = [
    "evaluate",
    "EvalConfig",
    "EvalInputs",
    "EvalResult",
    "inputs_from_dataset",
    "inputs_from_synthetic",
    "Dataset",
    "load_directory",
    "make_embedder",
    "register_method",
    "to_markdown",
    "write_json",
    "write_markdown",
    "write_plots",
]

# Names this package re-exported before its surface was cut to __all__ (kept readable).
_LAZY = {
    "GAINS": "..kernels.ranking_metrics",
    "Qrels": "..kernels.ranking_metrics",
    "SparseQrels": "..kernels.ranking_metrics",
    "dcg_at_k": "..kernels.ranking_metrics",
    "dense_qrels": "..kernels.ranking_metrics",
    "labelled": "..kernels.ranking_metrics",
    "ndcg_at_k": "..kernels.ranking_metrics",
    "pack_qrels": "..kernels.ranking_metrics",
    "pack_rankings": "..kernels.ranking_metrics",
    "ranking_metrics": "..kernels.ranking_metrics",
    "recall_at_k": "..kernels.ranking_metrics",
    "reciprocal_rank": "..kernels.ranking_metrics",
    "WEIGHTINGS": ".bootstrap",
    "BootstrapResult": ".bootstrap",
    "Verdict": ".bootstrap",
    "bootstrap_mean": ".bootstrap",
    "paired_bootstrap": ".bootstrap",
    "verdict": ".bootstrap",
    "QUERY_MODES": ".candidates",
    "Candidates": ".candidates",
    "candidates_from_synthetic": ".candidates",
    "normalize_candidate_scores": ".candidates",
    "passage_embedding_text": ".candidates",
    "query_texts": ".candidates",
    "retrieve_candidates": ".candidates",
    "Conversation": ".data",
    "Passage": ".data",
    "Turn": ".data",
    "TurnTable": ".data",
    "load_inscit": ".data",
    "load_normalized": ".data",
    "load_topiocqa": ".data",
    "load_trec_cast": ".data",
    "read_passages": ".data",
    "GRAPH_KINDS": ".distances",
    "CorpusDistances": ".distances",
    "build_corpus_graph": ".distances",
    "synthetic_graph": ".distances",
    "EMBEDDERS": ".embedders",
    "Embedder": ".embedders",
    "HashEmbedder": ".embedders",
    "SentenceTransformerEmbedder": ".embedders",
    "WordLlamaEmbedder": ".embedders",
    "l2_normalize": ".embedders",
    "DEFAULT_METHODS": ".methods",
    "METHODS": ".methods",
    "MethodBatch": ".methods",
    "MethodOptions": ".methods",
    "MethodOutput": ".methods",
    "MethodSpec": ".methods",
    "MethodUnavailable": ".methods",
    "Setting": ".methods",
    "geodesic_online_order": ".methods",
    "history_concatenation_scores": ".methods",
    "map_matched_orders": ".methods",
    "maximal_marginal_relevance_order": ".methods",
    "online_forward_scores": ".methods",
    "rank_slots": ".methods",
    "settings_grid": ".methods",
    "plot_beta_sweep": ".plots",
    "plot_split": ".plots",
    "to_json": ".report",
    "to_json_dict": ".report",
    "PRIMARY_METRIC": ".runner",
    "SLICES": ".runner",
    "MethodResult": ".runner",
    "PathSplit": ".runner",
    "SliceResult": ".runner",
    "EntropySlices": ".slices",
    "TopicSlices": ".slices",
    "emission_entropy": ".slices",
    "entropy_slices": ".slices",
    "median": ".slices",
    "topic_slices": ".slices",
    "DRILL": ".synthetic",
    "FACETS": ".synthetic",
    "JUMP": ".synthetic",
    "MOVE_NAMES": ".synthetic",
    "START": ".synthetic",
    "SyntheticBenchmark": ".synthetic",
    "make_synthetic": ".synthetic",
}

__getattr__ = lazy_attributes(__name__, _LAZY, globals())
