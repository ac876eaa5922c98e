"""``mapmatched-torch serve``: a ``--data`` folder (or a ``--graph-dir`` artifact) served over HTTP with Ray Serve."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from .parser import PROG
from .run import _status

__all__ = ["serve_parts", "run_serve"]


def serve_parts(data: str, embedder: str, dim: Optional[int], model: Optional[str], k: int,
                 maximum_distance: Optional[float], candidates: int, transition_weight: float,
                 fixed_lag: Optional[int], graph_dir: Optional[str] = None) -> Any:
    """A shard's :class:`~mapmatched_torch.integrations.ray_serve.ShardParts` for a ``--data``
    folder (built in each replica): hash/other embedder, dense provider, kNN graph (or
    ``graph_dir``'s artifact, memory-mapped, refused unless built for these passages;
    ``maximum_distance`` None: its saved bound, else 10), server."""
    import hashlib

    from ..eval.candidates import passage_embedding_text
    from ..eval.data import load_directory
    from ..eval.distances import build_corpus_graph
    from ..eval.embedders import make_embedder
    from ..integrations.ray_serve import ShardParts
    from ..providers.dense import DenseProvider
    from ..serving import MapMatchedServer

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

        graph = load_graph_for(graph_dir, dataset.passage_ids, maximum_distance=maximum_distance)
        built = (graph_fingerprint(graph), graph.maximum_distance)
    server = MapMatchedServer(graph, candidate_limit=candidates, transition_weight=transition_weight, fixed_lag=fixed_lag)
    digest = hashlib.sha256(repr((encoder, *built, candidates, transition_weight, fixed_lag)).encode())
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

    factory = functools.partial(serve_parts, str(Path(args.data).resolve()), args.embedder, args.embedding_dim,
                                args.model, args.k, args.maximum_distance, args.candidates, args.transition_weight,
                                args.fixed_lag, str(Path(args.graph_dir).resolve()) if args.graph_dir else None)
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
