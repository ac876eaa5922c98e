"""The ``mapmatched-torch`` command line.

``mapmatched-torch eval`` (also ``python -m mapmatched_torch eval``) evaluates
pointwise retrieval, map-matching over a (lambda, beta, lag) grid, history
concatenation, Maximal Marginal Relevance, the resolved-query oracle (when rewrites
exist), the geodesic bound and cross-fitted weights, by slice, with bootstrap
intervals and a verdict, and prints the markdown report.

Without a data option it runs the built-in deterministic synthetic benchmark (a
topic graph; conversations that drill and jump, with underspecified follow-ups) in
seconds::

    mapmatched-torch eval
    mapmatched-torch eval --data ../shared/data/inscit_dev --embedder wordllama --graph knn \\
        --json /tmp/inscit.json --markdown /tmp/inscit.md --plots /tmp/inscit-plots

``mapmatched-torch fit`` takes the same data options and writes the fitted lambda and
beta (:func:`mapmatched_torch.fit.fit_weights`) as JSON, to ``--json`` like ``eval``'s
report (``--output``, its old name, is still accepted)::

    mapmatched-torch fit --data ../shared/data/inscit_dev --json /tmp/inscit-weights.json

``fit --method {map-matched,gated,mixed,mixed+gated,auto} --out DIR`` writes one model
directory (:mod:`mapmatched_torch.fit.artifacts`; the learned methods fitted on every
conversation by :mod:`mapmatched_torch.eval.model_fit`, ``auto`` the one with the best
cross-fitted nDCG@3) that ``MapMatchedRetriever.from_pretrained(DIR, graph=...)`` loads::

    mapmatched-torch fit --data ../shared/data/inscit_dev --embedder wordllama --method auto --out /tmp/model

``mapmatched-torch graph build`` writes a graph artifact (kNN graph, calibrated bound,
ball table; :mod:`mapmatched_torch.eval.graph_command`) that ``eval`` and ``fit`` read
with ``--graph-dir``::

    mapmatched-torch graph build --passages corpus.passages.jsonl --out /tmp/corpus-graph
    mapmatched-torch eval --data ../shared/data/inscit_dev --graph-dir /tmp/corpus-graph

Under ``torchrun`` (its environment present), ``eval`` shards the conversations over
the processes (gloo on CPU, NCCL on CUDA; :mod:`mapmatched_torch.eval.distributed`)
and rank 0 alone prints and writes; ``fit`` shards its batches the same way and
every rank takes the one-process optimizer steps (rank 0 writes)::

    torchrun --nproc-per-node 4 -m mapmatched_torch eval --device cuda --json /tmp/report.json

``mapmatched-torch serve`` (extra ``[ray]``) serves a ``--data`` folder over HTTP with
Ray Serve (:mod:`mapmatched_torch.integrations.ray_serve`) until SIGINT or SIGTERM;
``--graph-dir`` serves a saved graph artifact instead of building one (its context rows
read from the artifact's context table, ``graph build --context-radius``, at that
table's radius unless ``--context-radius`` says another: docs/scale.md)::

    mapmatched-torch serve --data ../shared/data/inscit_dev --embedder hash --shards 2 --port 8000
    mapmatched-torch serve --data ../shared/data/inscit_dev --graph-dir /tmp/corpus-graph

Every output file is written into a temporary file beside it and renamed over it
(:mod:`mapmatched_torch.core.files`); ``eval``'s reports are renamed together at the
end, so an interrupted run leaves the old reports, never a mix of old and new.

Exit status: 0 on success, 2 on a usage or input error (the message says what is wrong),
1 when memory runs out (a resource failure), 130 on an interrupt (Ctrl-C; one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from .parser import PROG, build_parser
from .run import check_outputs, check_sources, run_fit, run_eval
from .serve import run_serve

__all__ = ["build_parser", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage or input error, 1 out of
    memory, 130 interrupted).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    from ..core.errors import MapMatchedError, out_of_memory

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "graph":
            from ..eval.graph_command import run_graph_command

            return _graph(run_graph_command, args)
        if args.command != "serve":
            check_sources(parser, args)  # also the eval- or fit-only options
            check_outputs(parser, args)
    except SystemExit as stop:  # argparse's usage errors (2) and --help (0), as a return value
        return stop.code if isinstance(stop.code, int) else 2
    try:
        if args.command == "serve":
            return run_serve(args)
        return run_fit(args) if args.command == "fit" else run_eval(args)
    except (MemoryError, RuntimeError) as error:  # MapMatchedResourceError, torch's allocation failures
        if not out_of_memory(error):
            raise
        detail = f": {error}" if str(error) else ""
        smaller = "a smaller data set or --batch-size" if args.command == "eval" else "a smaller data set"
        print(f"{PROG} {args.command}: error: out of memory{detail} (a resource failure, not a problem in the input; "
              f"free memory, or use {smaller})", file=sys.stderr)
        return 1
    except (MapMatchedError, OSError) as error:  # an input error, or a file that cannot be read or written
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; the outputs are all old or all new
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


def _graph(run: Any, args: argparse.Namespace) -> int:
    """``graph ...``: input errors as one line (exit 2), like eval and fit."""
    from ..core.errors import MapMatchedError

    try:
        return run(args)
    except (MapMatchedError, OSError) as error:
        print(f"{PROG} graph {args.graph_command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} graph {args.graph_command}: interrupted (a ball table build resumes where it stopped)",
              file=sys.stderr)
        return 130

