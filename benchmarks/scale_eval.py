"""The eval phase of ``benchmarks/scale.py``: synthetic conversations over a saved corpus, decoded by the library.

Over a directory the other phases left (``DIR/embeddings.npy``, the artifact
``DIR/graph``), read only (nothing is written into DIR):

1. **conversations** (:func:`walk_conversations`, deterministic from the seed): each
   starts at a random chunk and walks the kNN graph, one gold chunk per turn: the next
   gold is a random graph neighbour of the previous one, or with probability
   ``switch`` a random chunk (a topic switch);
2. **queries**: each turn's query is its gold chunk's unit embedding plus Gaussian noise
   of norm about ``noise`` (``noise * z / sqrt(D)``), so the nearest chunk to a query is
   often a neighbour of its gold, not the gold;
3. **candidate search**: the top ``width`` chunks of every query by cosine similarity,
   from a FAISS index of the corpus (:class:`~mapmatched_torch.graph.knn_faiss.FAISSCorpusIndex`:
   the kNN phase's index, IVF above 50,000 rows, candidates re-scored exactly);
4. **distances**: :class:`~mapmatched_torch.eval.distances.CorpusDistances` over
   ``load_graph(DIR/graph)``, i.e. the graph's ``trellis_distances`` from its ball table;
5. **decode**: the evaluation's pointwise and map-matched rankings
   (:func:`~mapmatched_torch.eval.methods.pointwise_order`,
   :func:`~mapmatched_torch.eval.methods.map_matched_orders`: the online answer of
   turn t given turns 0..t, for every beta of ``betas``, lambda 1, full decoding) of
   the z-score normalized candidate scores;
6. **metrics**: hit@1 (= nDCG@1, one gold per turn), nDCG@3 and MRR over the
   candidates (:func:`~mapmatched_torch.kernels.ranking_metrics.ranking_metrics`), then
   the paired bootstrap of map-matched minus pointwise hit@1 over conversations
   (:func:`~mapmatched_torch.eval.bootstrap.paired_bootstrap`), all turns, follow-ups
   (turn > 0) and topic switches.

Steps 2-6 run in batches of ``batch_size`` conversations, one progress line per batch on
stderr. The noise draws are consumed in conversation order, so the figures do not
depend on the batch size.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

#: metric name in the report -> the ranking_metrics key it is.
METRICS = {"hit@1": "ndcg@1", "ndcg@3": "ndcg@3", "mrr": "mrr"}


def walk_conversations(
    indptr: np.ndarray, indices: np.ndarray, count: int, turns: int, switch: float, seed: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Gold chunks of ``count`` conversations of ``turns`` turns walking a CSR graph.

    Args:
        indptr: (N + 1,) int64 CSR row pointers. indices: (E,) int64 arc targets.
        count, turns: conversations and turns per conversation.
        switch: probability that a turn's gold is a random chunk (else a random
            out-neighbour of the previous gold; a node without arcs always switches).
        seed: the walk's seed.

    Returns:
        ``(golds, switched)``: (count, turns) int64 chunk rows and (count, turns) bool,
        True where the gold jumped (never at turn 0).
    """
    rng = np.random.default_rng([seed, 34, 6])
    rows = indptr.shape[0] - 1
    golds = np.empty((count, turns), dtype=np.int64)
    switched = np.zeros((count, turns), dtype=bool)
    golds[:, 0] = rng.integers(0, rows, count)
    for turn in range(1, turns):
        previous = golds[:, turn - 1]
        start, degree = indptr[previous], indptr[previous + 1] - indptr[previous]
        step = np.minimum((rng.random(count) * degree).astype(np.int64), np.maximum(degree - 1, 0))
        neighbour = indices[np.minimum(start + step, indices.shape[0] - 1)] if indices.shape[0] else previous
        jump = (rng.random(count) < switch) | (degree == 0)
        golds[:, turn] = np.where(jump, rng.integers(0, rows, count), neighbour)
        switched[:, turn] = jump
    return golds, switched


def noisy_queries(rows: np.ndarray, golds: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """(B, T, D) float64 queries: each gold's unit embedding plus ``noise * z / sqrt(D)``.

    ``rows`` is the (N, D) corpus (memory-mapped); the gold rows are read in sorted order.
    """
    flat = golds.reshape(-1)
    order = np.argsort(flat, kind="stable")
    vectors = np.empty((flat.size, rows.shape[1]), dtype=np.float64)
    vectors[order] = np.asarray(rows[flat[order]], dtype=np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors += noise / np.sqrt(rows.shape[1]) * rng.standard_normal(vectors.shape)
    return vectors.reshape(*golds.shape, rows.shape[1])


def _slice_means(values: Dict[str, "object"], masks: Dict[str, "object"]) -> Dict[str, Dict[str, float]]:
    """{slice: {metric: mean over the slice's turns}} of (N,) metric columns."""
    return {name: {metric: round(float(column[mask].mean()), 4) for metric, column in values.items()}
            for name, mask in masks.items()}


def evaluate_directory(
    directory: str,
    *,
    conversations: int = 10_000,
    turns: int = 5,
    width: int = 32,
    betas: Sequence[float] = (16.0,),
    noise: float = 2.0,
    switch: float = 0.2,
    batch_size: int = 1024,
    nprobe: int = 16,
    seed: int = 0,
    resamples: int = 1000,
    examples: int = 1,
    peak_rss: Optional[Callable[[], float]] = None,
) -> dict:
    """The eval phase over ``directory`` (module docstring); returns the report.

    Args:
        directory: the scale run's DIR (``embeddings.npy``, ``graph/``), only read.
        conversations, turns: C conversations of T turns.
        width: M candidates per turn.
        betas: the map-matched settings' betas (lambda 1, full decoding).
        noise: the queries' noise norm (their gold's embedding has norm 1).
        switch: the probability of a topic switch per turn.
        batch_size: conversations per batch.
        nprobe: IVF lists probed per query.
        seed: the walk's and the noise's seed (the index's too).
        resamples: bootstrap resamples.
        examples: the first conversations to list in the report's ``examples``: golds,
            candidate rows, raw scores and each method's top-1 row per turn.
        peak_rss: a function giving the process's peak RSS in GiB (for progress lines).

    Returns:
        The report (a JSON-able dict; ``quality[method][slice][metric]`` the means,
        ``hit1_lift[method][slice]`` the bootstrap of map-matched minus pointwise hit@1).
    """
    import torch

    from mapmatched_torch.core.checks import check_positive_int
    from mapmatched_torch.core.errors import MapMatchedValueError
    from mapmatched_torch.eval.bootstrap import paired_bootstrap
    from mapmatched_torch.eval.candidates import Candidates, normalize_candidate_scores
    from mapmatched_torch.eval.distances import CorpusDistances
    from mapmatched_torch.eval.methods import Setting, gather_passages, map_matched_orders, pointwise_order
    from mapmatched_torch.graph import load_graph
    from mapmatched_torch.graph.knn_faiss import FAISSCorpusIndex
    from mapmatched_torch.kernels.ranking_metrics import SparseQrels, ranking_metrics

    for name, value in (("conversations", conversations), ("turns", turns), ("width", width),
                        ("batch_size", batch_size), ("nprobe", nprobe)):
        check_positive_int(value, name)
    if not (np.isfinite(noise) and noise >= 0.0) or not 0.0 <= switch <= 1.0:
        raise MapMatchedValueError(f"noise must be finite and >= 0 and switch in [0, 1], got {noise} and {switch}")
    peak_rss = peak_rss or (lambda: float("nan"))
    seconds: Dict[str, float] = {key: 0.0 for key in ("queries", "search", "distances", "decode", "metrics")}
    folder = Path(directory)
    begun = clock = time.perf_counter()
    graph = load_graph(folder / "graph")
    embeddings = np.load(folder / "embeddings.npy", mmap_mode="r")
    ids = graph.vocabulary.chunk_ids
    if embeddings.shape[0] != len(ids):
        raise MapMatchedValueError(f"{folder}: {embeddings.shape[0]} embeddings but {len(ids)} graph nodes")
    lookup = CorpusDistances(graph, ids)
    seconds["load"] = time.perf_counter() - clock
    clock = time.perf_counter()
    corpus = FAISSCorpusIndex(embeddings, ids, nprobe=nprobe, seed=seed, progress=True)
    seconds["index"] = time.perf_counter() - clock

    clock = time.perf_counter()
    adjacency = graph.adjacency
    golds, switched = walk_conversations(adjacency.indptr.numpy(), adjacency.indices.numpy(), conversations, turns,
                                         switch, seed)
    seconds["walk"] = time.perf_counter() - clock
    settings = [Setting(1.0, float(beta), None) for beta in betas]
    names = ["pointwise"] + [f"map-matched beta={beta:g}" for beta in betas]
    # shape: per method and metric, (C * T,) per-turn values in (conversation, turn) order
    columns: Dict[str, Dict[str, List]] = {name: {metric: [] for metric in METRICS} for name in names}
    found: List = []
    shown: List[dict] = []
    noise_rng = np.random.default_rng([seed, 34, 7])
    batches = (conversations + batch_size - 1) // batch_size
    started = time.perf_counter()
    for number, first in enumerate(range(0, conversations, batch_size), start=1):
        last = min(first + batch_size, conversations)
        clock = time.perf_counter()
        queries = noisy_queries(embeddings, golds[first:last], noise, noise_rng)
        seconds["queries"] += time.perf_counter() - clock

        clock = time.perf_counter()
        scores, rows = corpus.search(queries.reshape(-1, queries.shape[-1]), width)
        shape = (last - first, turns, width)
        candidates = Candidates(torch.from_numpy(rows).view(shape), torch.from_numpy(scores).view(shape),
                                torch.ones(shape, dtype=torch.bool))
        seconds["search"] += time.perf_counter() - clock

        clock = time.perf_counter()
        # shape: (B, T-1, M, M) [b, t, from, to]
        distances = lookup.consecutive(candidates.index)
        seconds["distances"] += time.perf_counter() - clock

        clock = time.perf_counter()
        normalized = normalize_candidate_scores(candidates.scores, candidates.mask)
        # shape: (1 + S, B, T, M) slot orders, best first
        orders = torch.cat([pointwise_order(normalized, candidates.mask).unsqueeze(0),
                            map_matched_orders(normalized, distances, candidates.mask, settings)])
        seconds["decode"] += time.perf_counter() - clock

        clock = time.perf_counter()
        gold = torch.from_numpy(golds[first:last]).reshape(-1, 1)
        qrels = SparseQrels(gold, torch.ones(gold.shape, dtype=torch.float64))
        found.append((candidates.index.reshape(-1, width) == gold).any(dim=1))
        for name, order in zip(names, orders):
            ranked = gather_passages(candidates.index, order).reshape(-1, width)
            values = ranking_metrics(ranked, qrels, ks=(1, 3))
            for metric, key in METRICS.items():
                columns[name][metric].append(values[key])
        for row in range(max(0, min(examples, last) - first)):  # the first conversations, as they were ranked
            shown.append({"golds": golds[first + row].tolist(), "switched": switched[first + row].tolist(),
                          "candidates": candidates.index[row].tolist(), "scores": candidates.scores[row].tolist(),
                          **{name: candidates.index[row].gather(-1, order[row, :, :1]).view(-1).tolist()
                             for name, order in zip(names, orders)}})
        seconds["metrics"] += time.perf_counter() - clock
        elapsed = time.perf_counter() - started
        print(f"eval batch {number}/{batches}: {last:,}/{conversations:,} conversations, {elapsed:.1f} s "
              f"(search {seconds['search']:.1f}, distances {seconds['distances']:.1f}, decode {seconds['decode']:.1f}), "
              f"peak RSS {peak_rss():.2f} GiB", file=sys.stderr, flush=True)

    clock = time.perf_counter()
    values = {name: {metric: torch.cat(parts) for metric, parts in metrics.items()} for name, metrics in columns.items()}
    conversation = torch.arange(conversations).repeat_interleave(turns)
    position = torch.arange(turns).repeat(conversations)
    masks = {"all": torch.ones(conversations * turns, dtype=torch.bool), "followup": position > 0,
             "switch": torch.from_numpy(switched.reshape(-1))}
    quality = {name: _slice_means(metrics, masks) for name, metrics in values.items()}
    lifts = {}
    for name in names[1:]:
        lifts[name] = {}
        for slice_name, mask in masks.items():
            result = paired_bootstrap(values[name]["hit@1"], values["pointwise"]["hit@1"], conversation, mask,
                                      n_resamples=resamples, seed=seed)
            lifts[name][slice_name] = {"mean": round(result.mean, 4), "low": round(result.low, 4),
                                       "high": round(result.high, 4), "turns": result.n_turns}
    seconds["bootstrap"] = time.perf_counter() - clock
    seconds["total"] = time.perf_counter() - begun  # from the artifact's load on
    decoded = sum(seconds[key] for key in ("queries", "search", "distances", "decode", "metrics"))
    return {
        "conversations": conversations, "turns": turns, "width": width, "noise": noise, "switch": switch,
        "betas": list(betas), "batch_size": batch_size, "index": corpus.kind, "nprobe": nprobe,
        "widened_queries": corpus.widened, "index_seconds": {k: round(v, 2) for k, v in corpus.seconds.items()},
        "seconds": {key: round(value, 2) for key, value in seconds.items()},
        "conversations_per_second": round(conversations / decoded, 1) if decoded else None,
        "gold_in_candidates": round(float(torch.cat(found).double().mean()), 4),
        "switch_turns": int(switched.sum()), "quality": quality, "hit1_lift": lifts, "examples": shown,
        "torch_threads": torch.get_num_threads(), "peak_rss_gb": round(peak_rss(), 2),
    }
