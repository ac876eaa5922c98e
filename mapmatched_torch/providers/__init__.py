"""Candidate providers: adapters from existing retrievers to ``ScoredCandidate`` lists.

Each provider implements the ``CandidateProvider`` protocol
(``retrieve(query, limit)``); optional dependencies are imported only when a provider
is constructed, and a missing one raises an ImportError naming the pip extra.
"""

from .faiss import FAISSProvider

__all__ = ["FAISSProvider"]
