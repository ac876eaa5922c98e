"""``mapmatched-torch serve``: a ``--data`` folder (or a ``--graph-dir`` artifact) served over HTTP with Ray Serve."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional, Tuple

from .parser import PROG
from .run import _status

__all__ = ["serve_parts", "run_serve", "serving_contexts"]


def serving_contexts(graph_dir: Optional[str], context_radius: Optional[float], maximum_distance: Optional[float],
                     search_contexts: bool = False) -> Tuple[float, Optional[float], Optional[str]]:
    """How ``serve``'s contexts meet ``--graph-dir``'s context table (docs/scale.md,
    "Serving a saved graph").

    Args:
        graph_dir: the artifact (None: a graph built from ``--data``, no table).
        context_radius: ``--context-radius`` (None: the artifact's table's radius if it
            has one, else the server's default).
        maximum_distance: ``--maximum-distance`` (None: the artifact's saved bound).
        search_contexts: ``--search-contexts``: a radius the table does not answer is
            served (its rows searched, the server warns) instead of refused.

    Returns:
        ``(radius, table_radius, line)``: the context radius to serve at; the radius of
        the context table :func:`~mapmatched_torch.graph.load_graph` must find (None: no
        table is read); a status line for the user, or None.

    Raises:
        MapMatchedValueError: the artifact holds a context table whose limit differs
            from the served radius's (both radii named, and the fixes), without
            ``search_contexts``.
    """
    import inspect

    from ..core.errors import MapMatchedValueError
    from ..graph import read_manifest
    from ..serving import MapMatchedServer
    from ..serving.contexts import context_table_mismatch

    default = inspect.signature(MapMatchedServer).parameters["context_radius"].default
    radius = default if context_radius is None else context_radius
    if graph_dir is None:
        return radius, None, None
    manifest = read_manifest(graph_dir)
    stored = manifest.get("contexts")
    if stored is None:
        return radius, None, (f"{PROG} serve: {graph_dir} holds no context table: each chunk's context row (radius "
                              f"{radius:g}) is searched on its first decode; graph build --context-radius {radius:g} "
                              "would make them reads")
    if context_radius is None:
        radius = stored["radius"]
    bound = manifest["maximum_distance"] if maximum_distance is None else maximum_distance
    problem = context_table_mismatch(stored["radius"], stored["limit"], radius, bound)
    if problem is None:
        return radius, stored["radius"], f"{PROG} serve: context rows (radius {radius:g}) read from {graph_dir}'s table"
    if not search_contexts:
        raise MapMatchedValueError(
            f"graph artifact {graph_dir}: {problem}; or serve at its radius (--context-radius {stored['radius']!r}, "
            "or no --context-radius), or pass --search-contexts to serve this radius by searching"
        )
    return radius, None, None  # the server warns (ContextTableWarning) with the same problem


def serve_parts(data: str, embedder: str, dim: Optional[int], model: Optional[str], k: int,
                 maximum_distance: Optional[float], candidates: int, transition_weight: float,
                 fixed_lag: Optional[int], graph_dir: Optional[str] = None, context_radius: Optional[float] = None,
                 search_contexts: bool = False) -> Any:
    """A shard's :class:`~mapmatched_torch.integrations.ray_serve.ShardParts` for a ``--data``
    folder (built in each replica): hash/other embedder, dense provider, kNN graph (or
    ``graph_dir``'s artifact, memory-mapped, refused unless built for these passages;
    ``maximum_distance`` None: its saved bound, else 10), server at the context radius
    :func:`serving_contexts` chooses (its context table read, checked on load)."""
    import hashlib

    from ..eval.candidates import passage_embedding_text
    from ..eval.data import load_directory
    from ..eval.distances import build_corpus_graph
    from ..eval.embedders import make_embedder
    from ..integrations.ray_serve import ShardParts
    from ..providers.dense import DenseProvider
    from ..serving import MapMatchedServer

    radius, table_radius, _ = serving_contexts(graph_dir, context_radius, maximum_distance, search_contexts)
    dataset = load_directory(data)
    encoder = make_embedder(embedder, dim=dim, model=model, device="cpu", progress=False)
    embeddings = encoder.encode([passage_embedding_text(p) for p in dataset.passages])
    provider = DenseProvider(embeddings, dataset.passage_ids, metric="inner_product")
    if graph_dir is None:
        bound = 10.0 if maximum_distance is None else maximum_distance
        graph = build_corpus_graph("knn", dataset.passages, embeddings, k=k, maximum_distance=bound, progress=False)
        built = (k, bound)
    else:
        from ..eval.graph_command import load_graph_for
        from ..graph import graph_fingerprint

        graph = load_graph_for(graph_dir, dataset.passage_ids, maximum_distance=maximum_distance,
                               context_radius=table_radius)
        built = (graph_fingerprint(graph), graph.maximum_distance)
    server = MapMatchedServer(graph, candidate_limit=candidates, transition_weight=transition_weight, fixed_lag=fixed_lag,
                              context_radius=radius)
    digest = hashlib.sha256(repr((encoder, *built, candidates, transition_weight, fixed_lag, radius)).encode())
    digest.update(embeddings.numpy().tobytes())
    digest.update("\x1f".join(dataset.passage_ids).encode())
    return ShardParts(server=server, provider=provider, embedder=encoder, fingerprint=digest.hexdigest())


def run_serve(args: argparse.Namespace) -> int:
    """``serve``: deploy, print the URL, wait for SIGINT / SIGTERM, shut down."""
    import functools
    import signal
    import threading

    from ..core.optional import import_optional

    ray = import_optional("ray", "ray", "mapmatched-torch serve")
    from ray import serve

    from ..integrations.ray_serve import run

    graph_dir = str(Path(args.graph_dir).resolve()) if args.graph_dir else None
    _, _, line = serving_contexts(graph_dir, args.context_radius, args.maximum_distance, args.search_contexts)
    if line is not None:
        _status(args, line)
    factory = functools.partial(serve_parts, str(Path(args.data).resolve()), args.embedder, args.embedding_dim,
                                args.model, args.k, args.maximum_distance, args.candidates, args.transition_weight,
                                args.fixed_lag, graph_dir, args.context_radius, args.search_contexts)
    factory()  # the data and options fail here, before Ray starts
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    started = not ray.is_initialized()
    if args.address:
        ray.init(address=args.address)
    elif started:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        state_dir = str(Path(args.state_dir).resolve()) if args.state_dir else None
        _, url = run(factory, host=args.host, port=args.port, shards=args.shards, state_dir=state_dir,
                     max_batch_size=args.max_batch_size)
        print(f"{PROG} serve: {url} ({args.shards} shards; POST {url}/v1/sessions; Ctrl-C stops)", flush=True)
        while not stop.wait(0.5):
            pass
        _status(args, f"{PROG} serve: stopping")
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
    return 0
