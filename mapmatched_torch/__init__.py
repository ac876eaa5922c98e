"""mapmatched_torch: map-matched retrieval on tensors.

Conversational retrieval as trajectory estimation: each turn's retrieval candidates
are the states of a trellis, the corpus graph's bounded shortest-path distance is the
transition cost, and decoding returns the best path of chunks (HMM map matching,
carried over from GPS tracks to retrieval).

The upstream-compatible names (``MapMatchedRetriever``, ``StandaloneDecoder``,
``InMemoryCorpusGraph``, ...) behave exactly like the pure-Python ``mapmatched``
package: code written for it runs by changing only the import. The tensor API
(batched decoding, the nn.Module, the tensor graph) is imported lazily, so
``import mapmatched_torch`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    FAISSNotInstalledError,
    MapMatchedError,
    MapMatchedRuntimeError,
    MapMatchedValueError,
    MissingDependencyError,
    NetworkXNotInstalledError,
)
from .models import (
    CandidateScore,
    DecodedPath,
    DecodedStep,
    DecoderCandidate,
    RetrievalResult,
    RetrievalTrace,
    ScoredCandidate,
    TraceStep,
)
from .protocols import CandidateProvider, CorpusGraph, Decoder
from .retrieval import MapMatchedRetriever, MapMatchedSession
from .scoring import normalize_candidates, normalize_scores, softmax_entropy
from .standalone import GraphEdge, InMemoryCorpusGraph, KNNGraph, StandaloneDecoder
from .trace import render_trace

__version__ = "0.1.0"

# name -> module, imported on first access (these pull in torch, faiss, ...).
_LAZY = {
    # tensor decoding (functional)
    **{
        name: ".decode"
        for name in (
            "viterbi",
            "fixed_lag_viterbi",
            "pointwise_decode",
            "geodesic_viterbi",
            "forward_scores",
            "log_partition",
            "marginals",
            "log_likelihood",
            "path_score",
            "ViterbiState",
            "FixedLagState",
        )
    },
    "MapMatchedModel": ".model",
    "use_compiled_kernels": ".chain",
    "TorchDecoder": ".decoder",
    "pack_trellises": ".trellis",
    "SlotDecoder": ".streaming",
    "DecodingStream": ".streaming",
    "MapMatchedServer": ".serving",
    "StepResults": ".step_results",
    # fitting and sampling
    "fit_weights": ".fit",
    "FitResult": ".fit",
    "set_log_likelihood": ".fit",
    "sample_paths": ".sampling",
    "sample_conversations": ".sampling",
    # providers
    "FAISSProvider": ".providers.faiss",
    "DenseProvider": ".providers.dense",
    "FusionProvider": ".providers.fusion",
    "LangChainProvider": ".providers.langchain",
    "as_langchain_retriever": ".providers.langchain",
    "LlamaIndexProvider": ".providers.llamaindex",
    "as_llamaindex_retriever": ".providers.llamaindex",
    "QdrantProvider": ".providers.qdrant",
    "ChromaProvider": ".providers.chroma",
}

__all__ = [
    "__version__",
    # errors
    "MapMatchedError",
    "MapMatchedValueError",
    "MapMatchedRuntimeError",
    "MissingDependencyError",
    "FAISSNotInstalledError",
    "NetworkXNotInstalledError",
    # models
    "ScoredCandidate",
    "DecoderCandidate",
    "CandidateScore",
    "DecodedStep",
    "DecodedPath",
    "TraceStep",
    "RetrievalTrace",
    "RetrievalResult",
    # protocols
    "CorpusGraph",
    "Decoder",
    "CandidateProvider",
    # scoring and traces
    "normalize_candidates",
    "normalize_scores",
    "softmax_entropy",
    "render_trace",
    # reference graph and decoder
    "GraphEdge",
    "InMemoryCorpusGraph",
    "KNNGraph",
    "StandaloneDecoder",
    # sessions
    "MapMatchedRetriever",
    "MapMatchedSession",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mapmatched_torch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
