"""Offline evaluation: datasets, embedders, metrics, slices, bootstrap and a synthetic benchmark.

- :mod:`~mapmatched_torch.eval.data`: :class:`Dataset` (passages, conversations, turns);
  :mod:`~mapmatched_torch.eval.datasets`: its loaders, one module per format (normalized
  JSONL and the ``--data`` folder, INSCIT, TopiOCQA, TREC CAsT).
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
- :mod:`~mapmatched_torch.eval.runner`: the harness (:func:`evaluate`), with
  :mod:`~mapmatched_torch.eval.config` (:class:`EvalConfig`), :mod:`~mapmatched_torch.eval.inputs`
  (:class:`EvalInputs` and its builders) and :mod:`~mapmatched_torch.eval.summary` (the
  results: slice means, intervals, lifts, verdicts).
- :mod:`~mapmatched_torch.eval.distributed`: torchrun detection, the process group,
  sharding the conversations by rank and gathering to rank 0.
- :mod:`~mapmatched_torch.eval.report` and :mod:`~mapmatched_torch.eval.plots`:
  markdown, JSON and PNG reports.

Its public surface is the handful of names a user calls (``__all__``): the harness
(:func:`evaluate` and its inputs and result), loading a dataset, making an embedder,
registering a method and writing the reports. Every other name these modules define
(metrics, slices, bootstrap, methods, synthetic data, ...) is imported from its module,
e.g. ``from mapmatched_torch.eval.bootstrap import paired_bootstrap``.
"""

from __future__ import annotations

from .data import Dataset
from .datasets import load_directory
from .embedders import make_embedder
from .methods import register_method
from .plots import write_plots
from .report import to_markdown, write_json, write_markdown
from .config import EvalConfig
from .inputs import EvalInputs, inputs_from_dataset, inputs_from_synthetic
from .runner import evaluate
from .summary import EvalResult

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
