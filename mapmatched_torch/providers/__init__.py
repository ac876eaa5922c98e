"""Candidate providers: adapters from existing retrievers to ``ScoredCandidate`` lists.

Dense (exact top-k on tensors), FAISS, reciprocal-rank fusion, Qdrant and Chroma, and
gated query mixing over any of them that searches by vector (:mod:`.query_mixing`); the
LangChain and LlamaIndex adapters are in :mod:`mapmatched_torch.integrations`.

Each provider implements the ``CandidateProvider`` protocol
(``candidates(query, limit)``, mapmatched 0.1.0's name, which is the provider's
``retrieve(query, limit)``) plus a batched ``retrieve_batch(queries, limit)``;
optional dependencies are imported only when a provider is constructed, and a missing
one raises an ImportError naming the pip extra.
"""

from .chroma import ChromaProvider
from .dense import DenseProvider, exact_top_k
from .faiss import FAISSProvider
from .fusion import FusionProvider, reciprocal_rank_fusion
from .qdrant import QdrantProvider
from .query_mixing import ContextualProvider, QueryMixing, QueryMixingProvider, VectorSearchProvider

__all__ = [
    "ChromaProvider", "DenseProvider", "FAISSProvider", "FusionProvider", "QdrantProvider", "exact_top_k",
    "reciprocal_rank_fusion", "QueryMixing", "QueryMixingProvider", "VectorSearchProvider", "ContextualProvider",
]
