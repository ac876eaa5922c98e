"""``mapmatched-torch eval`` and ``fit``: the checks of their options, their inputs, and the runs."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .parser import _FIT_VALIDATION_MINIMUM, PROG

__all__ = ["check_sources", "check_outputs", "run_eval", "run_fit"]


# --------------------------------------------------------------------------- running


def _status(args: argparse.Namespace, message: str) -> None:
    from ..eval.runner import main_process

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


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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
    from ..core.model_artifacts import is_model_artifact

    path = Path(args.out)
    if path.exists() and not (path.is_dir() and is_model_artifact(path)):
        what = "a directory that is not a model directory" if path.is_dir() else "a file"
        parser.error(f"--out {args.out}: is {what}; refusing to replace it (give a new path or a model directory)")
    problem = _unwritable(path.parent)
    if problem is not None:
        parser.error(f"--out {args.out}: {problem}")


def check_sources(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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
    from ..eval.methods import METHODS

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
    from ..core.errors import MapMatchedValueError
    from ..eval import data

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
    from ..eval.distances import kernels_need_compiling

    if kernels_need_compiling(device):
        _status(args, f"{PROG} {args.command}: compiling graph kernels (first run only; cached on disk)")


def _device(args: argparse.Namespace) -> Any:
    import torch

    from ..eval.distributed import local_device

    try:
        device = local_device(args.device)  # cuda -> cuda:LOCAL_RANK under torchrun
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        from ..core.errors import MapMatchedValueError

        raise MapMatchedValueError(f"--device {args.device!r} is not usable here: {error}") from None
    return device


def _inputs(args: argparse.Namespace, device: Any) -> Any:
    from ..eval.embedders import make_embedder
    from ..core.progress import progress_wanted
    from ..eval.runner import inputs_from_dataset, inputs_from_synthetic, main_process

    dataset = _load_dataset(args)
    stream = getattr(args, "stream", False)
    if stream and dataset is not None:
        from ..core.errors import MapMatchedValueError

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
    from ..eval.candidates import passage_embedding_text
    from ..eval.distances import build_corpus_graph
    from ..eval.synthetic import make_synthetic, synthetic_stream

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
            from ..eval.distances import synthetic_graph
            from ..graph import TensorCorpusGraph, calibrate_bound

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
    from ..eval.graph_command import load_graph_for

    _status(args, f"{PROG} {args.command}: loading the graph artifact {args.graph_dir}")
    bound = args.maximum_distance if args.maximum_distance not in (None, "auto") else None
    return load_graph_for(args.graph_dir, passage_ids, maximum_distance=bound, device=device)


def run_eval(args: argparse.Namespace) -> int:
    """``eval``: in torchrun's environment inside its process group (gloo on CPU, NCCL on CUDA)."""
    from ..eval.distributed import destroy, init_from_environment, world_size

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
    from ..core.files import output_group
    from ..eval.plots import write_plots
    from ..eval.report import report_warnings, to_markdown, write_json, write_markdown
    from ..eval.runner import EvalConfig, evaluate

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


def run_fit(args: argparse.Namespace) -> int:
    """``fit``: :func:`mapmatched_torch.fit.fit_weights` on the data's labelled conversations; the JSON.

    Under torchrun every rank joins the process group (gloo on CPU, NCCL on CUDA)
    and fits its shard of the batches; the result equals a one-process fit, and rank 0
    alone writes it.
    """
    from ..eval.distributed import destroy, init_from_environment

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

    from ..core.errors import MapMatchedValueError
    from ..core.files import write_text_atomic
    from ..eval.distributed import world_size
    from ..eval.model_fit import (EVAL_METHODS, choose_method, cross_fitted_metrics, fit_learned, fit_map_matched,
                                 learned_payload, pointwise_model)
    from ..eval.report import sanitize
    from ..eval.runner import main_process

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
        from ..fit.artifacts import save_model

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
