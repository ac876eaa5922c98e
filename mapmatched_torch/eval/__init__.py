"""Offline evaluation: datasets, embedders, metrics, slices, bootstrap and a synthetic benchmark.

- :mod:`~mapmatched_torch.eval.data`: :class:`Dataset` and loaders (normalized JSONL,
  INSCIT, TopiOCQA, TREC CAsT).
- :mod:`~mapmatched_torch.eval.embedders`: :class:`HashEmbedder` (no dependencies),
  :class:`WordLlamaEmbedder` and :class:`SentenceTransformerEmbedder` (optional extras).
- :mod:`~mapmatched_torch.eval.metrics`: nDCG@k, Recall@k, reciprocal rank on tensors.
- :mod:`~mapmatched_torch.eval.slices`: follow-up vs standalone by emission entropy,
  topic switch vs same topic.
- :mod:`~mapmatched_torch.eval.bootstrap`: paired bootstrap intervals over
  conversations and the pass/fail :func:`verdict`.
- :mod:`~mapmatched_torch.eval.synthetic`: the built-in deterministic benchmark.
"""

from __future__ import annotations

from .bootstrap import WEIGHTINGS, BootstrapResult, Verdict, bootstrap_mean, paired_bootstrap, verdict
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
from .embedders import (
    EMBEDDERS,
    Embedder,
    HashEmbedder,
    SentenceTransformerEmbedder,
    WordLlamaEmbedder,
    l2_normalize,
    make_embedder,
)
from .metrics import (
    GAINS,
    Qrels,
    SparseQrels,
    dcg_at_k,
    dense_qrels,
    labelled,
    ndcg_at_k,
    pack_qrels,
    pack_rankings,
    recall_at_k,
    reciprocal_rank,
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
]
