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
import asyncio
import subprocess
import sys
import textwrap
import threading
from typing import Any, Awaitable, Callable, Dict, List, Sequence, Tuple

import numpy as np
import pytest

from mapmatched_torch.core import optional as _optional
from mapmatched_torch.core.errors import MapMatchedRuntimeError, MissingDependencyError
from mapmatched_torch.core.models import ScoredCandidate
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
        assert report["raw_score"] == result.candidates[report["provider_rank"]].score
        assert not any(report["text_known"] for _, report in items)
        adapters.append(adapter)
    return adapters


def check_rejects_query(provider: Any, query: Any, message: str) -> None:
    """A framework provider refuses a bad query in ``retrieve``, ``aretrieve`` and (as
    query 1) ``retrieve_batch``."""
    with pytest.raises(ValueError, match=message):
        provider.retrieve(query, 1)
    with pytest.raises(ValueError, match=message):
        asyncio.run(provider.aretrieve(query, 1))
    with pytest.raises(ValueError, match=f"query 1 .*{message}"):
        provider.retrieve_batch(["q", query], 1)


def check_batch_and_aretrieve_equal_retrieve(provider: Any) -> None:
    """``retrieve_batch(QUERIES)`` and ``aretrieve`` of each query equal ``retrieve``;
    an empty batch gives ``[]``."""
    expected = [provider.retrieve(query, LIMIT) for query in QUERIES]
    assert provider.retrieve_batch(QUERIES, LIMIT) == expected
    assert [asyncio.run(provider.aretrieve(query, LIMIT)) for query in QUERIES] == expected
    assert provider.retrieve_batch([], LIMIT) == []


def check_session_over_the_provider(provider: Any, expected: Sequence[Any]) -> None:
    """A session over ``provider`` (chain graph, :func:`session_options`) answers
    ``QUERIES`` with ``expected``, the plain session's results, traces included; the
    conversation revised earlier turns."""
    session = MapMatchedRetriever(chain_graph(), provider=provider, **session_options()).session()
    got = [session.retrieve(query) for query in QUERIES]
    assert got == list(expected)
    assert [r.trace.to_dict() for r in got] == [r.trace.to_dict() for r in expected]
    assert any(r.trace.revised_prior_indices for r in expected)


def check_async_conversation(
    adapter: Any, ask: Callable[[str], Awaitable[Any]], ids: Callable[[Any], List[str]], expected: Sequence[Any]
) -> None:
    """Awaiting ``ask(query)`` for each of ``QUERIES`` in turn gives the contexts (by
    ``ids``), the final trace and the path of ``expected``, the plain conversation."""

    async def talk() -> List[Any]:
        return [await ask(query) for query in QUERIES]

    answers = asyncio.run(talk())
    assert [ids(answer) for answer in answers] == [list(r.context_chunk_ids) for r in expected]
    assert adapter.trace.to_dict() == expected[-1].trace.to_dict()
    assert adapter.session.path == expected[-1].path


def check_adapter_needs_a_provider(build: Callable[..., Any]) -> None:
    """``build(engine, **kwargs)`` (an ``as_..._retriever``) refuses a retriever or a
    server without a provider, and the refused server build opens no session."""
    graph = chain_graph()
    with pytest.raises(ValueError, match="needs a CandidateProvider to answer queries: pass provider= to MapMatchedRetriever"):
        build(MapMatchedRetriever(graph))
    without_provider = MapMatchedServer(graph)
    with pytest.raises(ValueError, match="pass provider= to MapMatchedServer"):
        build(without_provider, session_id="x")
    assert len(without_provider) == 0


def race_two_async_turns(gate: Any, ask: Callable[[str], Awaitable[Any]]) -> Tuple[Any, Any]:
    """Await ``ask(QUERIES[1])`` while ``ask(QUERIES[0])`` waits inside ``gate`` (which
    sets ``gate.entered`` and then awaits ``gate.agate``, made here), then open the gate.
    Returns the first answer and the second's answer or exception."""

    async def race() -> Tuple[Any, Any]:
        gate.agate = asyncio.Event()
        first = asyncio.ensure_future(ask(QUERIES[0]))
        for _ in range(10_000):
            if gate.entered.is_set():
                break
            await asyncio.sleep(0)
        second = await asyncio.wait_for(asyncio.gather(ask(QUERIES[1]), return_exceptions=True), 10)
        gate.agate.set()
        return await first, second[0]

    return asyncio.run(race())


def check_second_thread_refused(gate: Any, first: Callable[[], Any], second: Callable[[], Any], message: str) -> None:
    """While ``first()`` runs in a thread, held inside ``gate`` (which sets
    ``gate.entered`` and waits for ``gate.gate``), ``second()`` raises
    MapMatchedRuntimeError matching ``message``; then the gate opens and ``first`` ends."""
    worker = threading.Thread(target=first)
    worker.start()
    assert gate.entered.wait(10)
    with pytest.raises(MapMatchedRuntimeError, match=message):
        second()
    gate.gate.set()
    worker.join(10)


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


#: Bad queries and limits with the messages a vector-store provider gives.
BAD_QUERIES = [("", "^query must not be empty$"), (None, "must be a string"), (b"q", "must be a string")]
BAD_LIMITS = [(0, "limit must be greater than zero, got 0"), (-2, "limit must be greater than zero, got -2"),
              (True, "limit must be an integer, got True"), (1.5, "limit must be an integer, got 1.5")]


def check_rejects_bad_limit(provider: Any, limit: Any, message: str) -> None:
    """``retrieve`` and ``retrieve_batch`` both refuse ``limit``."""
    with pytest.raises(ValueError, match=message):
        provider.retrieve("q0", limit)
    with pytest.raises(ValueError, match=message):
        provider.retrieve_batch(["q0"], limit)


def check_batch_argument_errors(provider: Any) -> None:
    """An empty batch gives ``[]``; a single string and an empty query (named by its
    position) are refused."""
    assert provider.retrieve_batch([], 2) == []
    with pytest.raises(ValueError, match="not a single string"):
        provider.retrieve_batch("q", 2)
    with pytest.raises(ValueError, match="query 1 must not be empty"):
        provider.retrieve_batch(["q", ""], 2)


def check_brute_force_top_five(provider: Any, metric: str) -> None:
    """For every ``STORE_QUERIES`` query, ``provider`` (over the vector-store corpus)
    returns the brute-force top five of ``metric`` (see :func:`brute_force`) with their
    scores, best first; a distance metric's scores are <= 0."""
    for query, vector in STORE_QUERIES.items():
        got = provider.retrieve(query, 5)
        expected = brute_force(metric, vector)
        order = sorted(range(len(STORE_IDS)), key=lambda i: -expected[i])[:5]
        assert [c.chunk_id for c in got] == [STORE_IDS[i] for i in order], query
        assert [c.score for c in got] == pytest.approx([expected[i] for i in order], rel=1e-5, abs=1e-5)
        assert all(a.score >= b.score for a, b in zip(got, got[1:]))
        if _METRICS[metric] in ("euclid", "manhattan", "squared_l2"):
            assert all(c.score <= 0.0 for c in got)


def check_zero_distance_is_positive_zero(provider: Any) -> None:
    """``provider`` embeds every query as ``STORE_VECTORS[4]`` and scores by a distance:
    the best candidate is that chunk, with score +0.0."""
    best = provider.retrieve("the fifth chunk", 1)[0]
    assert best.chunk_id == STORE_IDS[4]
    assert best.score == 0.0 and np.copysign(1.0, best.score) == 1.0


#: The positions of five identical vectors in :func:`tied_vectors`.
TIED = (1, 3, 5, 7, 9)


def tied_vectors() -> np.ndarray:
    """``STORE_VECTORS`` with the rows of ``TIED`` set to ``10 * STORE_VECTORS[5]``: the
    nearest to that row by every metric, all equally near."""
    vectors = STORE_VECTORS.copy()
    vectors[list(TIED)] = 10.0 * vectors[5]
    return vectors


def check_ties_keep_the_store_rank(got: Sequence[ScoredCandidate], store_order: Sequence[str]) -> None:
    """Candidates for a query of ``tied_vectors()[5]`` keep the store's own order
    (``store_order``: chunk IDs as the store returned them); the tied chunks come first."""
    assert [c.chunk_id for c in got] == list(store_order)
    assert {c.chunk_id for c in got[:5]} == {STORE_IDS[i] for i in TIED}
    assert len({c.score for c in got[:5]}) == 1


def check_limit_cuts(provider: Any) -> None:
    """``limit`` cuts the answer; a limit above the store's size returns every chunk."""
    assert len(provider.retrieve("q0", 1)) == 1
    everything = provider.retrieve("q0", 100)
    assert sorted(c.chunk_id for c in everything) == sorted(STORE_IDS)
    assert provider.retrieve("q0", 4) == everything[:4]


def check_batch_error_names_the_query(build: Callable[[Callable[[str], Any]], Any]) -> None:
    """A bad query vector in a batch is named by its position; ``build(embed_query)``
    makes the provider."""
    table = dict(STORE_QUERIES, bad=np.full(STORE_DIMENSION, np.nan, dtype=np.float32))
    with pytest.raises(ValueError, match="^query vector values must be finite: the vector for query 1 has nan at dimension 0"):
        build(table.__getitem__).retrieve_batch(["q0", "bad"], 2)


def check_accepts_row_matrices_lists_and_torch_tensors(build: Callable[[Callable[[str], Any]], Any]) -> None:
    """A query vector as a numpy row, a (1, D) matrix, a list or a torch tensor (with
    grad) gives the same candidates; ``build(embed_query)`` makes the provider."""
    torch = pytest.importorskip("torch")
    vector = STORE_QUERIES["q3"]
    table = {"numpy": vector, "row": vector[None, :], "list": vector.tolist(), "tensor": torch.tensor(vector, requires_grad=True)}
    provider = build(table.__getitem__)
    reference = provider.retrieve("numpy", 4)
    for query in ("row", "list", "tensor"):
        assert provider.retrieve(query, 4) == reference, query


def check_store_session_parity(
    provider: Any, options: Dict[str, Any], by_hand: Callable[[str], Sequence[ScoredCandidate]]
) -> None:
    """Along ``STORE_CONVERSATION``, a session over ``provider`` equals a plain session
    fed ``by_hand(query)`` (the store's answer, converted without provider code; asked
    after the provider's turn), result and trace, turn by turn."""
    graph = store_graph()
    through = MapMatchedRetriever(graph, provider=provider, **options).session()
    plain = MapMatchedRetriever(graph, **options).session()
    for query in STORE_CONVERSATION:
        got = through.retrieve(query)
        expected = plain.retrieve_candidates(by_hand(query))
        assert got.path.chunk_ids == expected.path.chunk_ids
        assert got.trace.to_dict() == expected.trace.to_dict()
        assert got == expected
    assert through.path == plain.path


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
    a MissingDependencyError (an ImportError) naming ``pip install 'mapmatched-torch[extra]'`` (and ``pip install -e '.[extra]'``).
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
                assert f"`pip install 'mapmatched-torch[{extra}]'`" in str(caught.value)
                assert f"`pip install -e '.[{extra}]'`" in str(caught.value)
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


def import_error_without(module: str, provider: str, arguments: str) -> str:
    """In a fresh interpreter where ``module`` cannot be imported, mapmatched_torch and
    ``providers.<provider>`` import (and are the same object), and building
    ``provider(arguments)`` raises an ImportError. Its message."""
    return run_script(
        f"""
        import sys
        sys.modules[{module!r}] = None
        import mapmatched_torch
        from mapmatched_torch.providers import {provider}
        assert mapmatched_torch.{provider} is {provider}
        try:
            {provider}({arguments})
        except ImportError as error:
            print(error)
        """
    )


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
