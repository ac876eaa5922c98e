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
   on the same pairs (also timed, cold cache);
6. **serving**: in another fresh process, ``load_graph`` + a ``MapMatchedServer`` over
   it, ``--sessions`` sessions opened, and ``step_indexed`` with ``--width`` distinct
   candidates per session and turn (near the session's anchor, a quarter random):
   the first step (every session's first turn: no transitions), the cold step (the
   first with transitions, nothing cached), then the p50 / p90 of ``--steps`` warm steps;
   with ``--context-radius`` the artifact also carries the context table
   (``precompute_neighborhoods``), whose build and size are reported;
7. **eval**: in a third fresh process, ``--conversations`` synthetic conversations of
   ``--eval-turns`` turns walking the kNN graph (a gold chunk per turn, topic switches
   with probability ``--switch``), each query its gold's embedding plus noise
   (``--noise``), ``--width`` candidates per turn from a FAISS index of the corpus, the
   distances from the loaded artifact's ball table, decoded pointwise and map-matched
   (``--betas``) by the evaluation's methods, scored (hit@1, nDCG@3, MRR) with a paired
   bootstrap of the hit@1 lift (``benchmarks/scale_eval.py`` says how). It reads DIR only,
   so it can run alone on a kept artifact: ``--eval-only --dir DIR`` (``--report PATH``
   writes its JSON report).

Usage::

    nice python benchmarks/scale.py --rows 1000000 --dir /tmp/scale-1m --keep   # docs/scale.md's figures
    python benchmarks/scale.py --rows 100000 --dir /tmp/scale-100k
    python benchmarks/scale.py --rows 100000 --clusters 0 --dir /tmp/scale-control
    taskset -c 1 nice python benchmarks/scale.py --eval-only --dir /tmp/scale-1m --report /tmp/eval-1m.json
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
from typing import List

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


def turn_candidates(neighbors: np.ndarray, count: int, turns: int, width: int, seed: int) -> np.ndarray:
    """(turns, count, width) distinct candidate nodes per session and turn: near the
    session's anchor (its neighbours' neighbours), a quarter (at least) random."""
    rng = np.random.default_rng(seed + 1)
    rows = neighbors.shape[0]
    out = np.empty((turns, count, width), dtype=np.int64)
    near_count = width - width // 4
    for session, anchor in enumerate(rng.integers(0, rows, count)):
        near = np.unique(neighbors[neighbors[anchor]].reshape(-1))
        for turn in range(turns):
            pool = np.concatenate([rng.permutation(near)[:near_count], rng.integers(0, rows, 4 * width)])
            _, first = np.unique(pool, return_index=True)
            out[turn, session] = pool[np.sort(first)[:width]]
    return out


def serving(directory: str, steps: int) -> dict:
    """Phase 6, run in a fresh process: a server over the loaded artifact, then its steps.

    The server's first step opens every session's first turn (no transitions: no
    distance is asked); the second is the **cold step**, the first with transitions
    (nothing cached; the ball table's pages first touched by this process); the
    later ones are the warm steps."""
    import statistics

    import torch

    from mapmatched_torch.graph import load_graph
    from mapmatched_torch.serving import MapMatchedServer

    candidates = torch.from_numpy(np.load(Path(directory) / "turns.npy"))  # (T, S, M)
    turns, count, width = candidates.shape
    if turns < 3:
        raise SystemExit("turns.npy needs at least 3 turns (a first, a cold and a warm step)")
    generator = torch.Generator().manual_seed(0)
    # shape: (T, S, M) provider scores, descending within each row
    scores = torch.rand(turns, count, width, generator=generator, dtype=torch.float64).sort(dim=2, descending=True)[0]
    started = time.perf_counter()
    graph = load_graph(Path(directory) / "graph")
    loaded = time.perf_counter() - started
    server = MapMatchedServer(graph, candidate_limit=width)
    built = time.perf_counter() - started
    ids = [f"s{i}" for i in range(count)]
    for name in ids:
        server.open(name)
    opened = time.perf_counter() - started
    times = []
    for turn in range(turns):
        begin = time.perf_counter()
        _, errors = server.step_indexed(ids, candidates[turn], scores[turn])
        times.append(time.perf_counter() - begin)
        if errors:
            raise SystemExit(f"serving step {turn}: {len(errors)} sessions failed, e.g. {next(iter(errors.values()))}")
    warm = sorted(times[2:])
    p90 = warm[min(len(warm) - 1, int(round(0.9 * (len(warm) - 1))))]
    return {
        "sessions": count, "candidates": width, "load_s": round(loaded, 3), "server_s": round(built - loaded, 3),
        "open_s": round(opened - built, 3), "first_step_s": round(times[0], 4), "cold_step_s": round(times[1], 4),
        "cold_start_s": round(opened + times[0] + times[1], 3),
        "warm_step_p50_s": round(statistics.median(warm), 4), "warm_step_p90_s": round(p90, 4),
        "warm_steps": len(warm), "contexts": graph.neighborhood_table is not None,
        "torch_threads": torch.get_num_threads(), "peak_rss_gb": round(peak_rss_gb(), 2),
    }


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


def eval_rows(evaluation: dict) -> List[str]:
    """The eval phase's figures as Markdown table rows."""
    seconds, quality, lifts = evaluation["seconds"], evaluation["quality"], evaluation["hit1_lift"]
    pointwise = quality["pointwise"]
    rows = [
        f"| eval: {evaluation['conversations']:,} conversations x {evaluation['turns']} turns x "
        f"{evaluation['width']} candidates | {evaluation['conversations_per_second']:,.0f} conversations/s "
        f"(queries {seconds['queries']:.1f} s, search {seconds['search']:.1f} s, distances "
        f"{seconds['distances']:.1f} s, decode {seconds['decode']:.1f} s, metrics {seconds['metrics']:.1f} s; "
        f"FAISS index {seconds['index']:.0f} s) |",
        f"| eval: gold among the candidates | {evaluation['gold_in_candidates']:.3f} |",
    ]
    for name, lift in lifts.items():
        matched = quality[name]
        for part, label in (("all", "all turns"), ("followup", "follow-ups (turn > 0)"), ("switch", "topic switches")):
            rows.append(
                f"| eval hit@1, {label}: pointwise / {name} (lift [95%]) | {pointwise[part]['hit@1']:.3f} / "
                f"{matched[part]['hit@1']:.3f} ({lift[part]['mean']:+.3f} [{lift[part]['low']:+.3f}, "
                f"{lift[part]['high']:+.3f}]) |"
            )
        rows.append(f"| eval nDCG@3 / MRR, all turns: pointwise / {name} | {pointwise['all']['ndcg@3']:.3f} / "
                    f"{matched['all']['ndcg@3']:.3f}, {pointwise['all']['mrr']:.3f} / {matched['all']['mrr']:.3f} |")
    rows.append(f"| peak RSS of the eval process | {evaluation['peak_rss_gb']:.2f} GiB |")
    return rows


def table_rows(report: dict) -> str:
    """The serving and eval figures as a Markdown table (docs/scale.md takes it)."""
    if "serving" not in report:  # an eval-only report
        return "\n".join([f"| {report['rows']:,} x {report['dim']} | measured |", "|---|---:|",
                           *eval_rows(report["eval"])])
    serve = report["serving"]
    rows = [
        f"| {report['rows']:,} x {report['dim']}, {serve['sessions']:,} sessions x {serve['candidates']} candidates "
        "| measured |",
        "|---|---:|",
        f"| cold start: fresh process, load + server + open + first two steps | {serve['cold_start_s']:.2f} s "
        f"(load {serve['load_s']:.2f} s, server {serve['server_s']:.2f} s, open {serve['open_s']:.2f} s) |",
        f"| first step (every session's first turn: no transitions) | {serve['first_step_s'] * 1e3:.0f} ms |",
        f"| cold step (the first with transitions, nothing cached) | {serve['cold_step_s'] * 1e3:.0f} ms |",
        f"| warm step, p50 / p90 of {serve['warm_steps']} | {serve['warm_step_p50_s'] * 1e3:.0f} / "
        f"{serve['warm_step_p90_s'] * 1e3:.0f} ms |",
        f"| peak RSS of the serving process | {serve['peak_rss_gb']:.2f} GiB |",
    ]
    if "contexts" in report:
        contexts = report["contexts"]
        rows.append(f"| context table (radius {contexts['radius']}, limit {contexts['limit']:.3f}) | "
                    f"{contexts['seconds']:.0f} s, {contexts['bytes'] / 2**20:.0f} MiB |")
    if "eval" in report:
        rows.extend(eval_rows(report["eval"]))
    return "\n".join(rows)


#: The eval phase's defaults: query noise (pointwise hit@1 0.58 on the clustered 100k
#: corpus, gold among 32 candidates 0.94) and the map-matching betas (the first is the headline:
#: the best of 2, 4, 8, 16, 32 on 1,000 conversations over 100,000 rows, seed 0).
NOISE = 2.0
BETAS = (16.0,)


def phase_options(args: argparse.Namespace) -> List[str]:
    """The options a phase's fresh process is started with."""
    return ["--dir", str(args.dir), "--width", str(args.width), "--sessions", str(args.sessions),
            "--steps", str(args.steps), "--seed", str(args.seed), "--conversations", str(args.conversations),
            "--eval-turns", str(args.eval_turns), "--noise", repr(args.noise), "--switch", repr(args.switch),
            "--eval-batch", str(args.eval_batch), "--nprobe", str(args.nprobe),
            "--betas", *[repr(beta) for beta in args.betas]]


def evaluation(args: argparse.Namespace) -> dict:
    """Phase 7, run in a fresh process (``--eval-only``); with ``--report`` its report
    (``{"rows", "dim", "eval"}``) and table are written there too."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scale_eval import evaluate_directory

    result = evaluate_directory(
        args.dir, conversations=args.conversations, turns=args.eval_turns, width=args.width, betas=args.betas,
        noise=args.noise, switch=args.switch, batch_size=args.eval_batch, nprobe=args.nprobe, seed=args.seed,
        peak_rss=peak_rss_gb,
    )
    if args.report:
        rows, dim = np.load(Path(args.dir) / "embeddings.npy", mmap_mode="r").shape
        report = {"rows": int(rows), "dim": int(dim), "eval": result}
        Path(args.report).write_text(json.dumps(report, indent=2))
        print(table_rows(report), file=sys.stderr)
    return result


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
    parser.add_argument("--steps", type=int, default=10, help="warm serving steps after the cold one")
    parser.add_argument("--context-radius", type=float, default=None,
                        help="also store the context table of this radius in the artifact")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversations", type=int, default=10_000, help="eval: synthetic conversations")
    parser.add_argument("--eval-turns", type=int, default=5, help="eval: turns per conversation")
    parser.add_argument("--noise", type=float, default=NOISE, help="eval: query noise norm (unit embeddings)")
    parser.add_argument("--switch", type=float, default=0.2, help="eval: topic-switch probability per turn")
    parser.add_argument("--betas", type=float, nargs="+", default=list(BETAS), help="eval: map-matching betas")
    parser.add_argument("--eval-batch", type=int, default=1024, help="eval: conversations per batch")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--keep", action="store_true", help="keep DIR afterwards")
    parser.add_argument("--report", help="also write the JSON report here (default with --eval-only: none; "
                                         "else DIR's sibling DIR.report.json)")
    parser.add_argument("--lookups-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serving-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--eval-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.eval_only:
        print(json.dumps(evaluation(args)))
        return
    if args.lookups_only:
        print(json.dumps(lookups(args.dir, args.width, args.sessions)))
        return
    if args.serving_only:
        print(json.dumps(serving(args.dir, args.steps)))
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
    if args.context_radius is not None:
        started = time.perf_counter()
        graph.precompute_neighborhoods(args.context_radius)
        contexts = graph.neighborhood_table
        phase("contexts", started, radius=args.context_radius, limit=contexts.limit,
              bytes=contexts.indptr.numel() * 8 + contexts.nodes.numel() * contexts.nodes.element_size(),
              entries=int(contexts.nodes.numel()))
    started = time.perf_counter()
    save_graph(graph, out, metadata={"benchmark": "scale", **{k: v for k, v in report.items() if k != "data"}})
    disk = sum(f.stat().st_size for f in out.iterdir())
    phase("save", started, artifact_bytes=disk)

    np.save(folder / "sessions.npy", sessions(neighbors.numpy(), args.sessions, args.width, args.seed))
    np.save(folder / "turns.npy", turn_candidates(neighbors.numpy(), args.sessions, args.steps + 2, args.width, args.seed))
    del graph, table, neighbors, distances, edge_index, edge_weight, embeddings
    for name, flag in (("lookups", "--lookups-only"), ("serving", "--serving-only"), ("eval", "--eval-only")):
        # stderr passes through: the eval's progress lines
        result = subprocess.run([sys.executable, __file__, flag, *phase_options(args)], check=True,
                                stdout=subprocess.PIPE, text=True)
        report[name] = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{name}: {json.dumps(report[name])}", flush=True)
    print(json.dumps(report, indent=2))
    print(table_rows(report))
    Path(args.report or folder.parent / f"{folder.name}.report.json").write_text(json.dumps(report, indent=2))
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
