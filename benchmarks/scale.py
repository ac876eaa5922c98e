"""Corpus scale: FAISS kNN graph, calibrated bound, ball table, artifact cold start.

One run, in phases, each timed with the process's peak RSS after it:

1. **data**: synthetic float16 embeddings written to ``DIR/embeddings.npy`` chunk by
   chunk (clustered: ``rows / 1000`` Gaussian centres plus noise; ``--clusters 0``:
   an unclustered control, i.i.d. normal rows) and read back memory-mapped;
2. **knn**: ``knn_graph(..., backend="faiss")`` (IVF, k = 10) from the memory map, and
   recall@10 against exact search on 1,000 sampled rows (:func:`knn_recall`);
3. **bound**: ``calibrate_bound`` (the distance to the ``--ball-size``-th nearest
   node, median over 1,000 nodes), and the ball-size distribution against the bound;
4. **balls**: the ball table for that bound, built in ``DIR/graph`` (resumable), its
   size on disk and per node; then ``save_graph``;
5. **lookups**: in a fresh process, ``load_graph`` + the distances of
   ``--sessions`` sessions x ``--width`` x ``--width`` candidate pairs (one turn step
   each; candidates near a random anchor plus random ones) from the ball table,
   cold (first) and warm (second), checked equal to the compiled engine's searches
   on the same pairs (also timed, cold cache).

Usage::

    nice python benchmarks/scale.py --rows 1000000 --dir /tmp/scale        # the README's figures
    python benchmarks/scale.py --rows 100000 --dir /tmp/scale-100k
    python benchmarks/scale.py --rows 100000 --clusters 0 --dir /tmp/scale-control
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def peak_rss_gb() -> float:
    """This process's peak RSS (VmHWM: reset by exec, unlike ru_maxrss, which a child
    started by fork + exec inherits from its parent)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_embeddings(path: Path, rows: int, dimension: int, clusters: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=(rows, dimension))
    centres = rng.normal(size=(max(clusters, 1), dimension)).astype(np.float32)
    step = 1 << 16
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        noise = rng.normal(size=(stop - start, dimension)).astype(np.float32)
        if clusters:
            out[start:stop] = centres[rng.integers(0, clusters, stop - start)] + 0.5 * noise
        else:
            out[start:stop] = noise
    out.flush()
    del out


def sessions(neighbors: np.ndarray, count: int, width: int, seed: int) -> np.ndarray:
    """(count, 2, width) candidate nodes: per session two turns near one anchor, a quarter random."""
    rng = np.random.default_rng(seed)
    rows = neighbors.shape[0]
    anchors = rng.integers(0, rows, count)
    out = np.empty((count, 2, width), dtype=np.int64)
    for session, anchor in enumerate(anchors):
        near = np.unique(neighbors[neighbors[anchor]].reshape(-1))
        picks = rng.choice(near, size=(2, width - width // 4), replace=near.size < 2 * width)
        out[session, :, : width - width // 4] = picks
        out[session, :, width - width // 4:] = rng.integers(0, rows, (2, width // 4))
    return out


def lookups(directory: str, width: int, count: int) -> dict:
    """Phase 5, run in a fresh process: cold start, then warm lookups, then the search engine."""
    import torch

    from mapmatched_torch.graph import TensorCorpusGraph, load_graph

    started = time.perf_counter()
    graph = load_graph(Path(directory) / "graph")
    loaded = time.perf_counter() - started
    pairs = np.load(Path(directory) / "sessions.npy")
    chunk_index = torch.from_numpy(pairs)  # (B, T=2, M)
    first = time.perf_counter()
    cold = graph.trellis_distances(chunk_index)
    cold_s = time.perf_counter() - first
    cold_start = time.perf_counter() - started
    warm_times = []
    for _ in range(3):
        again = time.perf_counter()
        warm = graph.trellis_distances(chunk_index)
        warm_times.append(time.perf_counter() - again)
    search = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=graph.maximum_distance)
    again = time.perf_counter()
    searched = search.trellis_distances(chunk_index, engine="compiled")
    search_s = time.perf_counter() - again
    return {
        "load_s": loaded, "first_lookup_s": cold_s, "cold_start_s": cold_start, "warm_lookup_s": min(warm_times),
        "pairs": int(cold.numel()), "equal_to_search": bool(torch.equal(cold, searched) and torch.equal(warm, cold)),
        "search_s_cold_cache": search_s, "peak_rss_gb": peak_rss_gb(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--clusters", type=int, default=None, help="default rows / 1000; 0: unclustered control")
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--ball-size", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=1024)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--keep", action="store_true", help="keep DIR afterwards")
    parser.add_argument("--lookups-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lookups_only:
        print(json.dumps(lookups(args.dir, args.width, args.sessions)))
        return

    import torch

    from mapmatched_torch.graph import (
        TensorCorpusGraph, ball_size_summary, calibrate_bound, faiss_knn_neighbors, knn_recall, save_graph,
    )
    from mapmatched_torch.graph.knn import _union_edges  # noqa: PLC2701 (the benchmark reuses the union step)

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    clusters = args.rows // 1000 if args.clusters is None else args.clusters
    report: dict = {"rows": args.rows, "dim": args.dim, "k": args.k, "clusters": clusters, "nprobe": args.nprobe}

    def phase(name: str, started: float, **values) -> None:
        report[name] = {"seconds": round(time.perf_counter() - started, 2), "peak_rss_gb": round(peak_rss_gb(), 2),
                        **values}
        print(f"{name}: {json.dumps(report[name])}", flush=True)

    started = time.perf_counter()
    path = folder / "embeddings.npy"
    write_embeddings(path, args.rows, args.dim, clusters, args.seed)
    phase("data", started, bytes=path.stat().st_size)

    embeddings = np.load(path, mmap_mode="r")
    ids = [f"chunk-{i:08d}" for i in range(args.rows)]
    started = time.perf_counter()
    info: dict = {}
    neighbors, distances = faiss_knn_neighbors(embeddings, ids, args.k, index="ivf", nprobe=args.nprobe,
                                               seed=args.seed, info=info, progress=True)
    edge_index, edge_weight = _union_edges(neighbors, distances, 1e-6, 10.0)
    info["faiss_seconds"] = {key: round(value, 2) for key, value in info.pop("seconds").items()}
    phase("knn", started, **info)  # seconds: the whole phase (FAISS, exact re-scoring, the union)
    started = time.perf_counter()
    recall = knn_recall(embeddings, neighbors, sample=1000, seed=args.seed)
    phase("recall", started, recall_at_k=recall)

    started = time.perf_counter()
    graph = TensorCorpusGraph.from_edge_index(edge_index, edge_weight, chunk_ids=ids, num_nodes=args.rows)
    bound = calibrate_bound(graph.adjacency, ball_size=args.ball_size, seed=args.seed)
    graph = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=bound)
    phase("bound", started, maximum_distance=bound, ball_size=args.ball_size,
          edge_distance_quantiles=[round(float(q), 4) for q in np.quantile(edge_weight.numpy(), [0.1, 0.5, 0.9])])

    started = time.perf_counter()
    out = folder / "graph"
    if out.exists():
        shutil.rmtree(out)
    graph.precompute_balls(directory=out, progress=True)
    table = graph.ball_table
    phase("balls", started, bytes=table.nbytes, bytes_per_node=round(table.nbytes / args.rows, 1),
          sizes=ball_size_summary(table.ball_sizes()))
    started = time.perf_counter()
    save_graph(graph, out, metadata={"benchmark": "scale", **{k: v for k, v in report.items() if k != "data"}})
    disk = sum(f.stat().st_size for f in out.iterdir())
    phase("save", started, artifact_bytes=disk)

    np.save(folder / "sessions.npy", sessions(neighbors.numpy(), args.sessions, args.width, args.seed))
    del graph, table, neighbors, distances, edge_index, edge_weight, embeddings
    command = [sys.executable, __file__, "--lookups-only", "--dir", str(folder), "--width", str(args.width),
               "--sessions", str(args.sessions)]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    report["lookups"] = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"lookups: {json.dumps(report['lookups'])}", flush=True)
    print(json.dumps(report, indent=2))
    (folder.parent / f"{folder.name}.report.json").write_text(json.dumps(report, indent=2))
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
