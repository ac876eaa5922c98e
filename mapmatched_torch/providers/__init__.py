"""Candidate providers: adapters from existing retrievers to ``ScoredCandidate`` lists.

Each provider implements the ``CandidateProvider`` protocol
(``retrieve(query, limit)``) plus a batched ``retrieve_batch(queries, limit)``;
optional dependencies are imported only when a provider is constructed, and a missing
one raises an ImportError naming the pip extra.
"""

from .chroma import ChromaProvider
from .dense import DenseProvider, exact_top_k
from .faiss import FAISSProvider
from .fusion import FusionProvider, reciprocal_rank_fusion
from .langchain import LangChainProvider, as_langchain_retriever
from .llamaindex import LlamaIndexProvider, as_llamaindex_retriever
from .qdrant import QdrantProvider

__all__ = ["ChromaProvider", "DenseProvider", "FAISSProvider", "FusionProvider", "LangChainProvider", "LlamaIndexProvider", "QdrantProvider", "exact_top_k", "reciprocal_rank_fusion", "as_langchain_retriever", "as_llamaindex_retriever"]
