"""LangChain drop-in: an existing retrieval setup, changed by one line.

The setup: a LangChain ``InMemoryVectorStore`` over a small handbook with two
sections that share words -- Python the language and python the snake -- and the
usual ``store.as_retriever(search_kwargs={"k": 4})``. The embedder is a tiny
bag-of-words hash (offline and deterministic; any LangChain ``Embeddings`` works).

The change: the retriever line. ``as_langchain_retriever`` returns a real LangChain
``BaseRetriever`` over one conversation; each ``invoke`` decodes one turn against the
corpus graph (here: consecutive passages of a section are linked), so a terse
follow-up ("and how do I install it?") is read in the light of the conversation so
far. Everything downstream of ``retriever.invoke`` is unchanged. Each document's
``metadata["map_matched"]`` tells why it is there, and the trace explains every turn.

Run: python examples/03_langchain_drop_in.py (needs the ``[langchain]`` extra:
``pip install 'mapmatched-torch[langchain]'``)
"""

from __future__ import annotations

#: Optional packages this example imports: tests/test_examples.py skips it without them.
REQUIRES = ("langchain_core",)

import re
import sys
import zlib
from typing import List

from mapmatched_torch.core.errors import MissingDependencyError
from mapmatched_torch.core.optional import import_optional

try:  # without the extra: one line naming the pip install, not a ModuleNotFoundError traceback
    import_optional("langchain_core", "langchain", "examples/03_langchain_drop_in.py")
except MissingDependencyError as missing:
    sys.exit(f"error: {missing}")

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import InMemoryVectorStore

from mapmatched_torch import InMemoryCorpusGraph, MapMatchedRetriever
from mapmatched_torch.integrations import LangChainProvider, as_langchain_retriever

HANDBOOK = {
    "language": [
        "Python is a programming language; install Python from python.org or with your package manager.",
        "Create a virtual environment for each project and install packages into it with pip.",
        "Pin the versions of the packages a project needs in a requirements or lock file.",
        "Wheels are built packages: pip installs a wheel without compiling anything.",
        "Read tracebacks from the bottom: the last line names the error, the lines above where it happened.",
    ],
    "snake": [
        "Ball pythons are calm snakes that stay under five feet long and live for thirty years.",
        "A python enclosure needs a warm side, a cool side, hides and a water bowl; install the heat lamp outside the reach of the snake.",
        "Feed a young python a thawed mouse every week; adults eat a rat every two or three weeks.",
        "A python sheds its skin in one piece when the humidity in the enclosure is right.",
        "Handle the snake gently, supporting its body, and never right after it has eaten.",
    ],
}
CONVERSATION = [
    "what enclosure does a pet python need",
    "how do I install the heat lamp",
    "what do they eat and how often",
    "and how do I install it",  # terse and ambiguous: install Python, or install the lamp?
    "is it safe to handle after eating",
]
WORDS = re.compile(r"[a-z]+")
STOP = {"a", "an", "and", "the", "of", "to", "do", "i", "it", "is", "how", "what", "does", "with", "for", "in", "or"}


class HashEmbeddings(Embeddings):
    """Bag of words hashed into 512 buckets, L2-normalized."""

    size = 512

    def _embed(self, text: str) -> List[float]:
        vector = [0.0] * self.size
        for word in WORDS.findall(text.lower()):
            if word not in STOP:
                vector[zlib.crc32(word.rstrip("s").encode()) % self.size] += 1.0
        norm = sum(value * value for value in vector) ** 0.5 or 1.0
        return [value / norm for value in vector]

    def embed_documents(self, texts: List[str]) -> List[List[float]]:
        return [self._embed(text) for text in texts]

    def embed_query(self, text: str) -> List[float]:
        return self._embed(text)


def main() -> int:
    documents = [
        Document(text, metadata={"chunk_id": f"{section}:{i}", "section": section})
        for section, passages in HANDBOOK.items()
        for i, text in enumerate(passages)
    ]
    store = InMemoryVectorStore(HashEmbeddings())
    store.add_documents(documents)
    # The corpus graph: consecutive passages of a section are neighbours, and every
    # passage links to its section's first one; the two sections are not connected.
    edges = [(f"{s}:{i}", f"{s}:{i + 1}") for s, passages in HANDBOOK.items() for i in range(len(passages) - 1)]
    edges += [(f"{s}:0", f"{s}:{i}") for s, passages in HANDBOOK.items() for i in range(2, len(passages))]
    graph = InMemoryCorpusGraph.from_edges(edges, maximum_distance=4.0)

    baseline = store.as_retriever(search_kwargs={"k": 4})  # the existing setup
    # The one-line change: the same retriever, map-matched over the conversation.
    retriever = as_langchain_retriever(MapMatchedRetriever(graph, provider=LangChainProvider(baseline, score_mode="similarity"), candidate_limit=4))

    live = []  # the decoded chunk each turn returned first, as the user saw it
    for turn, query in enumerate(CONVERSATION):
        plain_top = baseline.invoke(query)[0].metadata["chunk_id"]
        context = retriever.invoke(query)  # unchanged downstream: a list of Documents
        decoded = context[0].metadata["map_matched"]
        live.append(decoded["chunk_id"])
        print(f"turn {turn}: {query!r}")
        print(f"  plain top hit:  {plain_top}")
        print(f"  map-matched:    {decoded['chunk_id']} ({decoded['trace_step']['move']}, "
              f"entropy {decoded['trace_step']['emission_entropy']:.3f})")
        revised = retriever.last_result.trace.revised_prior_indices
        if revised:
            print(f"  revised turns:  {', '.join(map(str, revised))} -> path {' -> '.join(retriever.session.path.chunk_ids)}")
        print("  context:        " + ", ".join(
            f"{d.metadata['map_matched']['chunk_id']} [{d.metadata['map_matched']['role']}]" for d in context))
    print()
    print(retriever.trace.render())

    # Turn 0 is ambiguous on its own ("python"); from turn 1 on, every answer and the
    # final path stay with the snake, although the plain top hit of turn 3 does not.
    path = retriever.trace.path_chunk_ids
    if not all(chunk.startswith("snake:") for chunk in [*live[1:], *path]):
        print(f"FAIL: the conversation about the snake left its section: live {live}, path {path}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
