"""Integrations with LangChain and LlamaIndex, both ways.

Each framework's vector stores and retrievers become candidate providers
(``LangChainProvider``, ``LlamaIndexProvider``), and a map-matched session or server
becomes one of the framework's retrievers (``as_langchain_retriever``,
``as_llamaindex_retriever``). The frameworks are optional: each is imported when an
adapter is built, and a missing one raises an ImportError naming its extra.
"""

from .langchain import LangChainProvider, as_langchain_retriever
from .llamaindex import LlamaIndexProvider, as_llamaindex_retriever

__all__ = ["LangChainProvider", "as_langchain_retriever", "LlamaIndexProvider", "as_llamaindex_retriever"]
