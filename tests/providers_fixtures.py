"""Data and helpers shared by the provider tests (``from .providers_fixtures import ...``).

Two corpora:

- the conversation corpus of the framework adapters (LangChain, LlamaIndex): ten
  chunks ``c0..c9`` on a chain graph, unit vectors of dimension 6, and six queries that
  are noisy views of a walk through them;
- the vector-store corpus (Qdrant, Chroma): twelve chunks with unsorted IDs (so ties
  must follow the store's rank), random vectors of dimension 6, eight query vectors.

Nothing here imports an optional package.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np
import pytest

from mapmatched_torch import _optional
from mapmatched_torch.errors import MissingDependencyError
from mapmatched_torch.models import ScoredCandidate
from mapmatched_torch.retrieval import MapMatchedRetriever
from mapmatched_torch.serving import MapMatchedServer
from mapmatched_torch.standalone import InMemoryCorpusGraph, KNNGraph

# --------------------------------------------------------------------------- the conversation corpus

N, D, LIMIT = 10, 6, 4
IDS = [f"c{i}" for i in range(N)]
WALK = [2, 3, 3, 4, 8, 5]  # the chunks the user reads; queries are noisy views of them


def _corpus() -> Tuple[np.ndarray, List[np.ndarray]]:
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((N, D))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    queries = [vectors[i] + 0.8 * rng.standard_normal(D) for i in WALK]
    return vectors, queries


VECTORS, QUERY_VECTORS = _corpus()
QUERIES = [f"question {t}" for t in range(len(WALK))]
TEXTS = {chunk: f"passage about {chunk}" for chunk in IDS}
#: text -> vector for every passage and query: what the tests' embedders look up.
TABLE = {TEXTS[chunk]: VECTORS[i].tolist() for i, chunk in enumerate(IDS)}
TABLE.update({q: v.tolist() for q, v in zip(QUERIES, QUERY_VECTORS)})


def chain_graph() -> InMemoryCorpusGraph:
    """c0 - c1 - ... - c9."""
    return InMemoryCorpusGraph.from_edges([(IDS[i], IDS[i + 1]) for i in range(N - 1)], maximum_distance=4.0)


def session_options(**overrides: Any) -> Dict[str, Any]:
    """The MapMatchedRetriever options of the framework tests."""
    return {"candidate_limit": LIMIT, "context_radius": 1.0, **overrides}


def score_pairs(candidates: Sequence[ScoredCandidate]) -> List[Tuple[str, float]]:
    return [(c.chunk_id, c.score) for c in candidates]


def check_decoded_chunk_without_text(
    build: Callable[[str], Any], ask: Callable[[Any], List[Tuple[str, Dict[str, Any]]]]
) -> List[Any]:
    """An adapter whose chunks have no known text returns the decoded chunk anyway.

    ``build(missing_text)`` makes an adapter; ``ask(adapter)`` takes one turn
    (``QUERIES[0]``) and returns ``(text, report)`` per returned item. With
    ``missing_text="skip"`` only the decoded chunk comes back, with ``"empty"`` the
    whole context; either way first the decoded chunk, empty and ``text_known=False``.
    The adapters are returned for further checks.
    """
    adapters = []
    for missing_text in ("skip", "empty"):
        adapter = build(missing_text)
        items = ask(adapter)
        result = adapter.last_result
        context = list(result.context_chunk_ids)
        assert [report["chunk_id"] for _, report in items] == (context[:1] if missing_text == "skip" else context)
        text, report = items[0]
        assert text == "" and report["chunk_id"] == adapter.session.current_chunk_id and report["role"] == "decoded"
        assert report["raw_score"] == result.candidates[report["provider_rank"]].raw_score
        assert not any(report["text_known"] for _, report in items)
        adapters.append(adapter)
    return adapters


# --------------------------------------------------------------------------- the vector-store corpus

STORE_IDS = tuple(f"chunk-{letter}" for letter in "kbhadjlfcegi")  # not sorted: ties must follow the store's rank
STORE_DIMENSION = 6
STORE_VECTORS = np.random.default_rng(0).standard_normal((len(STORE_IDS), STORE_DIMENSION)).astype(np.float32)
STORE_QUERIES = {
    f"q{i}": row
    for i, row in enumerate(np.random.default_rng(1).standard_normal((8, STORE_DIMENSION)).astype(np.float32))
}
STORE_CONVERSATION = ["q0", "q1", "q1", "q4", "q2", "q7"]

_SCORES: Dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "cosine": lambda x, q: x @ q / np.linalg.norm(x, axis=1) / np.linalg.norm(q),
    "dot": lambda x, q: x @ q,
    "euclid": lambda x, q: -np.linalg.norm(x - q, axis=1),
    "manhattan": lambda x, q: -np.abs(x - q).sum(axis=1),
    "squared_l2": lambda x, q: -((x - q) ** 2).sum(axis=1),
}
#: Qdrant's distance names and Chroma's spaces, as _SCORES keys.
_METRICS = {"Cosine": "cosine", "Dot": "dot", "Euclid": "euclid", "Manhattan": "manhattan",
            "l2": "squared_l2", "cosine": "cosine", "ip": "dot"}


def brute_force(metric: str, query: np.ndarray, vectors: np.ndarray = STORE_VECTORS) -> np.ndarray:
    """Higher-is-better scores in float64 from the stored float32 vectors, for a Qdrant
    distance (``"Cosine"``, ``"Dot"``, ``"Euclid"``, ``"Manhattan"``) or a Chroma space
    (``"l2"``: squared distance, ``"cosine"``, ``"ip"``)."""
    return _SCORES[_METRICS[metric]](vectors.astype(np.float64), query.astype(np.float64))


def store_graph() -> KNNGraph:
    return KNNGraph.from_embeddings(STORE_IDS, STORE_VECTORS, neighbor_count=3, maximum_distance=3.0)


def qdrant_provider(distance: str = "Dot") -> Any:
    """A QdrantProvider over the vector-store corpus in a fresh local (``:memory:``)
    Qdrant collection; chunk IDs in the payload key ``"chunk"``. Skips the test without
    qdrant-client."""
    qdrant_client = pytest.importorskip("qdrant_client", reason="qdrant-client is not installed (the [qdrant] extra)")
    from mapmatched_torch.providers.qdrant import QdrantProvider

    models = qdrant_client.models
    client = qdrant_client.QdrantClient(":memory:")
    client.create_collection(
        "docs", vectors_config=models.VectorParams(size=STORE_DIMENSION, distance=models.Distance(distance))
    )
    client.upsert("docs", [models.PointStruct(id=i, vector=vector.tolist(), payload={"chunk": chunk})
                           for i, (chunk, vector) in enumerate(zip(STORE_IDS, STORE_VECTORS))])
    return QdrantProvider(client, "docs", STORE_QUERIES.__getitem__, chunk_id_field="chunk")


def check_server_parity(session_provider: Any, server_provider: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server stepping three sessions (``server_provider``, which must answer with
    ``retrieve_batch``) equals three sessions over ``session_provider``, turn by turn."""

    def no_single_queries(query: str, limit: int) -> Any:
        raise AssertionError("the server should use retrieve_batch")

    graph = store_graph()
    monkeypatch.setattr(server_provider, "retrieve", no_single_queries)
    server = MapMatchedServer(graph, provider=server_provider, candidate_limit=5, fixed_lag=1)
    sessions = {key: MapMatchedRetriever(graph, provider=session_provider, candidate_limit=5, fixed_lag=1).session()
                for key in "abc"}
    for key in sessions:
        server.open(key)
    for turn in range(4):
        asked = {"a": f"q{turn}", "b": f"q{7 - turn}", "c": f"q{(3 * turn) % 8}"}
        results, errors = server.step(asked)
        assert not errors
        for key, query in asked.items():
            expected = sessions[key].retrieve(query)
            assert results[key] == expected
            assert results[key].trace.to_dict() == expected.trace.to_dict()


# --------------------------------------------------------------------------- optional dependencies


def missing_extra_errors(module: str, extra: str, *builds: Callable[[], Any]) -> List[MissingDependencyError]:
    """Run each build with ``module`` (and its submodules) unimportable; each must raise
    a MissingDependencyError (an ImportError) naming ``pip install mapmatched-torch[extra]``.
    The errors are returned for further checks."""
    errors = []
    _optional.clear_cache()
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name in [name for name in sys.modules if name.startswith(module + ".")]:
                patch.setitem(sys.modules, name, None)
            patch.setitem(sys.modules, module, None)
            for build in builds:
                with pytest.raises(MissingDependencyError) as caught:
                    build()
                assert isinstance(caught.value, ImportError)
                assert f"`pip install mapmatched-torch[{extra}]`" in str(caught.value)
                assert caught.value.extra == extra
                errors.append(caught.value)
    finally:
        _optional.clear_cache()
    return errors


def run_script(source: str) -> str:
    """Run ``source`` (dedented) in a fresh interpreter; it must exit 0. Its stdout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def modules_loaded_by_importing(names: str, prefix: str) -> List[str]:
    """The modules named ``prefix...`` that a fresh interpreter has loaded after
    importing mapmatched_torch, its providers and ``from mapmatched_torch import names``."""
    stdout = run_script(
        f"""
        import sys
        import mapmatched_torch
        import mapmatched_torch.providers
        from mapmatched_torch import {names}
        print(sorted(name for name in sys.modules if name.startswith({prefix!r})))
        """
    )
    return ast.literal_eval(stdout.strip())
