"""mapmatched_torch: map-matched retrieval on tensors.

Conversational retrieval as trajectory estimation: each turn's retrieval candidates
are the states of a trellis, the corpus graph's bounded shortest-path distance is the
transition cost, and decoding returns the best path of chunks (HMM map matching,
carried over from GPS tracks to retrieval).

The upstream-compatible names (``MapMatchedRetriever``, ``StandaloneDecoder``,
``InMemoryCorpusGraph``, ...) behave exactly like the pure-Python ``mapmatched``
package: code written for it runs by changing only the import (or unchanged, after
:func:`install_mapmatched_alias`). The tensor API (batched decoding, the nn.Module, the
tensor graph) is imported lazily, so ``import mapmatched_torch`` stays cheap; importing
it has no side effects (nothing is added to ``sys.meta_path`` or ``sys.modules`` beyond
its own modules).

The lazily imported names (``_LAZY``) are a convenience path to the tensor API; each
is documented in the part that defines it (``mapmatched_torch.integrations``,
``mapmatched_torch.kernels.decode``, ...), and no other part re-exports it.
"""

from __future__ import annotations

from ._compat import install_mapmatched_alias
from ._lazy import lazy_attributes
from ._version import __version__
from .core.errors import (
    CMGBackendUnavailableError,
    FAISSDependencyUnavailableError,
    FAISSNotInstalledError,
    GraphDependencyUnavailableError,
    MapMatchedBackendError,
    MapMatchedError,
    MapMatchedResourceError,
    MapMatchedRuntimeError,
    MapMatchedTypeError,
    MapMatchedValueError,
    MissingDependencyError,
    NetworkXNotInstalledError,
)
from .core.models import (
    CandidateScore,
    DecodedPath,
    DecodedStep,
    DecoderCandidate,
    RetrievalResult,
    RetrievalTrace,
    ScoredCandidate,
    TraceStep,
)
from .core.protocols import CandidateProvider, CorpusGraph, Decoder
from .core.scoring import ScoreNormalization, normalize_candidates, normalize_scores, softmax_entropy
from .core.settings import DecodeSettings
from .core.trace import render_trace
from .retrieval.session import MapMatchedRetriever, MapMatchedSession
from .core.graph_types import GraphEdge
from .standalone import InMemoryCorpusGraph, KNNGraph, StandaloneDecoder
from .standalone.cmg import CMGDecoder

# name -> module, imported on first access (these pull in torch, faiss, ...).
_LAZY = {
    # tensor decoding (functional)
    **{
        name: ".kernels.decode"
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
        )
    },
    "ViterbiState": ".kernels.states",
    "FixedLagState": ".kernels.states",
    "MapMatchedModel": ".fit.model",
    "use_compiled_kernels": ".kernels.chain",
    "use_fused_kernels": ".kernels.fused",
    "GatedTransitions": ".kernels.transitions",
    "query_source_cosine": ".kernels.transitions",
    "TorchDecoder": ".retrieval.torch_decoder",
    "pack_trellises": ".retrieval.trellis",
    "SlotDecoder": ".kernels.slot_decoder",
    "DecodingStream": ".retrieval.streaming",
    "MapMatchedServer": ".serving.server",
    "StepResults": ".serving.step_results",
    # tensor corpus graph
    "TensorCorpusGraph": ".graph.tensor_graph",
    "knn_graph": ".graph.knn",
    "section_graph": ".graph.sections",
    # fitting and sampling
    "fit_weights": ".fit.fitting",
    "FitResult": ".fit.fitting",
    "set_log_likelihood": ".fit.loss",
    "sample_paths": ".kernels.sampling",
    "sample_conversations": ".fit.sampling",
    # fitted model directories (``mapmatched-torch fit --out``)
    "save_model": ".fit.artifacts",
    "load_model": ".retrieval.pretrained",
    # providers
    "FAISSProvider": ".providers.faiss",
    "FAISSIndex": ".providers.faiss",
    "FAISSScoreMode": ".providers.faiss",
    "QueryEmbedder": ".providers.base",
    "DenseProvider": ".providers.dense",
    "FusionProvider": ".providers.fusion",
    "LangChainProvider": ".integrations.langchain",
    "as_langchain_retriever": ".integrations.langchain",
    "LlamaIndexProvider": ".integrations.llamaindex",
    "as_llamaindex_retriever": ".integrations.llamaindex",
    "QdrantProvider": ".providers.qdrant",
    "ChromaProvider": ".providers.chroma",
}

__all__ = [
    "__version__",
    # errors
    "MapMatchedError",
    "MapMatchedValueError",
    "MapMatchedTypeError",
    "MapMatchedRuntimeError",
    "MapMatchedBackendError",
    "MapMatchedResourceError",
    "MissingDependencyError",
    "FAISSNotInstalledError",
    "FAISSDependencyUnavailableError",
    "GraphDependencyUnavailableError",
    "CMGBackendUnavailableError",
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
    "ScoreNormalization",
    "normalize_candidates",
    "normalize_scores",
    "softmax_entropy",
    "render_trace",
    # reference graph and decoder
    "GraphEdge",
    "InMemoryCorpusGraph",
    "KNNGraph",
    "StandaloneDecoder",
    "CMGDecoder",
    # sessions
    "DecodeSettings",
    "MapMatchedRetriever",
    "MapMatchedSession",
    # running code written for the pure-Python mapmatched (``import mapmatched``)
    "install_mapmatched_alias",
    *_LAZY,
]


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
