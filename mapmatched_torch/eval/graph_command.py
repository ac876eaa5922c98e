"""``mapmatched-torch graph build``: a graph artifact from a passages file or an embeddings file.

The kNN graph (exact up to 50,000 rows, FAISS beyond, or as ``--backend`` says), its
bound (``auto``: :func:`~mapmatched_torch.graph.calibrate_bound`, or a number), the
ball table for that bound (unless ``--no-balls``), the context table of a radius (with
``--context-radius``: every node's neighbourhood, what a server's context rows read)
and the recall@k of the picks on a sample (FAISS builds), written with
:func:`~mapmatched_torch.graph.save_graph`; the manifest's ``metadata`` records how
(options, recall, ball sizes, the context table's size, seconds). ``eval``, ``fit``
and ``serve`` read it with ``--graph-dir`` (:func:`load_graph_for`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["add_graph_parser", "run_graph_command", "parse_bound", "parse_radius", "load_graph_for",
           "build_graph_artifact"]

#: ``--backend auto`` uses the exact kNN search up to this many rows.
EXACT_UP_TO = 50_000


def parse_bound(text: str) -> Any:
    """``--maximum-distance``: ``auto`` or a finite number > 0."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a finite number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected auto or a finite number > 0, got {text!r}")
    return value


def parse_radius(text: str) -> float:
    """``--context-radius``: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def add_graph_parser(commands: Any, formatter: Any) -> None:
    """The ``graph`` command and its ``build`` subcommand."""
    graph = commands.add_parser("graph", help="corpus graph artifacts (build)",
                                description="Build corpus graph artifacts that eval and fit read with --graph-dir.")
    actions = graph.add_subparsers(dest="graph_command", metavar="ACTION")
    actions.required = True
    build = actions.add_parser(
        "build", formatter_class=formatter,
        help="build a kNN graph, its calibrated bound and ball table into a directory",
        description="Build the kNN graph of a corpus (from a passages file and an embedder, or from an embeddings "
                    ".npy file, memory-mapped), calibrate its bound, precompute every node's bounded ball, and write "
                    "them as a graph artifact directory (loaded memory-mapped by eval/fit --graph-dir).",
    )
    source = build.add_mutually_exclusive_group(required=True)
    source.add_argument("--passages", metavar="FILE", help="normalized passages JSON Lines (id, text, ...)")
    source.add_argument("--embeddings", metavar="FILE", help="an (N, D) .npy matrix (float16/float32), read "
                        "memory-mapped")
    build.add_argument("--ids", metavar="FILE", help="with --embeddings: the N chunk IDs, one per line "
                       "(default: the row numbers)")
    build.add_argument("--embedder", default="hash", help="with --passages: hash, wordllama or sentence-transformers")
    build.add_argument("--model", metavar="PATH", help="sentence-transformers model (with --embedder)")
    build.add_argument("--embedding-dim", type=int, default=None, help="hash/wordllama dimension")
    build.add_argument("--k", type=int, default=10, help="kNN neighbours per chunk")
    build.add_argument("--backend", choices=("auto", "exact", "faiss"), default="auto",
                       help=f"kNN search: exact, faiss (approximate), auto = exact up to {EXACT_UP_TO} rows")
    build.add_argument("--faiss-index", choices=("auto", "flat", "ivf", "hnsw"), default="auto", help="FAISS index")
    build.add_argument("--nprobe", type=int, default=16, help="IVF lists probed per query")
    build.add_argument("--maximum-distance", type=parse_bound, default="auto",
                       help="the graph's bound: auto (calibrated from --ball-size) or a number")
    build.add_argument("--ball-size", type=int, default=64,
                       help="auto bound: the median node reaches this many nodes within it")
    build.add_argument("--no-balls", action="store_true", help="do not precompute the ball table")
    build.add_argument("--context-radius", type=parse_radius, default=None, metavar="R",
                       help="also store every node's context neighbourhood within R (a context table, 4 bytes an "
                            "entry): serve --graph-dir at this context radius reads its context rows instead of "
                            "searching them (default: no table)")
    build.add_argument("--recall-sample", type=int, default=1000,
                       help="rows on which recall@k against exact search is measured (FAISS builds; 0: none)")
    build.add_argument("--seed", type=int, default=0, help="FAISS training and sampling seed")
    build.add_argument("--out", metavar="DIR", required=True, help="the artifact directory")
    build.add_argument("--quiet", action="store_true", help="no progress or status lines")


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _inputs(args: argparse.Namespace) -> Tuple[Any, List[str], Dict[str, Any]]:
    """``(embeddings, ids, facts)`` from ``--passages`` + embedder or ``--embeddings`` (+ ``--ids``)."""
    import numpy as np

    from ..core.errors import MapMatchedValueError

    if args.embeddings:
        try:
            matrix = np.load(args.embeddings, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise MapMatchedValueError(f"{args.embeddings} is not a .npy matrix: {error}") from None
        if matrix.ndim != 2:
            raise MapMatchedValueError(f"{args.embeddings} holds shape {matrix.shape}, expected (N, D)")
        if args.ids:
            ids = [line.rstrip("\n") for line in Path(args.ids).read_text(encoding="utf-8").splitlines()]
        else:
            ids = [str(row) for row in range(matrix.shape[0])]
        return matrix, ids, {"embeddings": str(args.embeddings), "dtype": str(matrix.dtype)}
    from .candidates import passage_embedding_text
    from .datasets import read_passages
    from .embedders import make_embedder

    passages = read_passages(args.passages)
    embedder = make_embedder(args.embedder, dim=args.embedding_dim, model=args.model, progress=not args.quiet)
    _say(args.quiet, f"graph build: embedding {len(passages)} passages with {embedder!r}")
    embeddings = embedder.encode([passage_embedding_text(passage) for passage in passages])
    return embeddings, [passage.id for passage in passages], {"passages": str(args.passages),
                                                               "embedder": repr(embedder)}


def build_graph_artifact(args: argparse.Namespace) -> Dict[str, Any]:
    """Build and write the artifact; returns the facts recorded in its manifest."""
    from ..graph import TensorCorpusGraph, ball_size_summary, calibrate_bound, knn_graph, save_graph

    started = time.perf_counter()
    embeddings, ids, facts = _inputs(args)
    rows = len(ids)
    backend = args.backend if args.backend != "auto" else ("exact" if rows <= EXACT_UP_TO else "faiss")
    info: Dict[str, Any] = {}
    options = {"index": args.faiss_index, "nprobe": args.nprobe, "seed": args.seed, "info": info,
               "recall_sample": args.recall_sample}
    _say(args.quiet, f"graph build: kNN graph of {rows} chunks (k={args.k}, {backend})")
    clock = time.perf_counter()
    graph = knn_graph(embeddings, ids, args.k, maximum_distance=args.maximum_distance, backend=backend,
                      faiss_options=options if backend == "faiss" else None, progress=None if not args.quiet else False)
    facts.update({"rows": rows, "k": args.k, "backend": backend, "knn_seconds": round(time.perf_counter() - clock, 2)})
    if info:
        facts["faiss"] = info
    if "recall_at_k" in info:
        facts["recall_at_k"] = info["recall_at_k"]
        _say(args.quiet, f"graph build: recall@{args.k} = {info['recall_at_k']:.4f} on {info['recall_sample']} rows")
    if args.maximum_distance == "auto" and args.ball_size != 64:
        bound = calibrate_bound(graph.adjacency, ball_size=args.ball_size, seed=args.seed)
        graph = TensorCorpusGraph(graph.adjacency, graph.vocabulary, maximum_distance=bound)
    facts.update({"maximum_distance": graph.maximum_distance, "bound": "auto" if args.maximum_distance == "auto"
                  else "fixed", "ball_size": args.ball_size})
    out = Path(args.out)
    if not args.no_balls:
        _say(args.quiet, f"graph build: ball table for bound {graph.maximum_distance:.6g}")
        clock = time.perf_counter()
        graph.precompute_balls(directory=out, progress=None if not args.quiet else False)
        facts["balls_seconds"] = round(time.perf_counter() - clock, 2)
        facts["ball_sizes"] = ball_size_summary(graph.ball_table.ball_sizes())
    if args.context_radius is not None:
        _say(args.quiet, f"graph build: context table within radius {args.context_radius:g} "
                         f"(limit {min(args.context_radius, graph.maximum_distance):.6g}) of {rows} chunks")
        clock = time.perf_counter()
        graph.precompute_neighborhoods(args.context_radius, progress=None if not args.quiet else False)
        facts["contexts"] = _context_facts(graph.neighborhood_table, time.perf_counter() - clock)
    facts["seconds"] = round(time.perf_counter() - started, 2)
    save_graph(graph, out, metadata=facts)
    return facts


def _context_facts(table: Any, seconds: float) -> Dict[str, Any]:
    """The summary of a :class:`~mapmatched_torch.graph.neighborhood_table.NeighborhoodTable`:
    radius, limit, entries, bytes (both arrays), the widest row, seconds."""
    counts = table.indptr[1:] - table.indptr[:-1]
    size = table.indptr.numel() * table.indptr.element_size() + table.nodes.numel() * table.nodes.element_size()
    return {"radius": table.radius, "limit": table.limit, "entries": int(table.nodes.numel()), "bytes": int(size),
            "widest": int(counts.max()) if counts.numel() else 0, "seconds": round(seconds, 2)}


def run_graph_command(args: argparse.Namespace) -> int:
    """``graph build``: write the artifact, print its facts as JSON on stdout."""
    facts = build_graph_artifact(args)
    print(json.dumps({"out": str(args.out), **facts}, sort_keys=True, default=str))
    contexts = facts.get("contexts")
    table = "" if contexts is None else (
        f" (context table: radius {contexts['radius']:g}, {contexts['entries']:,} entries, "
        f"{contexts['bytes']:,} bytes = {contexts['bytes'] / 2**20:.1f} MiB, widest row {contexts['widest']})")
    _say(args.quiet, f"graph build: wrote {args.out} in {facts['seconds']:.1f} s{table}")
    return 0


def load_graph_for(directory: str, passage_ids: Sequence[str], *, maximum_distance: Optional[float] = None,
                   device: Any = None, context_radius: Optional[float] = None) -> Any:
    """``--graph-dir``: the artifact's graph, refused unless built for exactly these passages
    (and, with ``context_radius``, unless it holds a context table of that radius)."""
    from ..graph import load_graph

    return load_graph(directory, chunk_ids=passage_ids, maximum_distance=maximum_distance, device=device,
                      context_radius=context_radius)
