"""How much of the best single method's lift the report's headline keeps on small sets.

The headline (``cross-fitted primary``) ranks each selection fold with the method best
on the other folds (:mod:`mapmatched_torch.eval.selection`). On a small set the folds
can pick different near-tied methods, and each fold then tends to get the method that
is worse on it, so the headline keeps less than the best method's lift. This script
draws ``--subsets`` random subsets of ``--size`` conversations (seeded), runs the
default evaluation on each (every default method, no bootstrap), and prints, per
subset and as mean / min over the subsets, the headline's all-turn nDCG@3 lift over
pointwise divided by the lift of the best single method on that subset (chosen in
hindsight, the ceiling of any selection), for the default selection
(``--selection-folds``, default 5, preferring ``mixed`` unless the other folds show it
worse by more than one standard error), for the plain best of the other folds (no
preference, the default before issue 33's item 3) and for the 2-fold plain best.

Usage (the figure of docs/experiment_log.md; INSCIT dev has 86 conversations, so subsets of 60)::

    python benchmarks/headline_stability.py --data ../shared/data/inscit_dev
"""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Dict, List

from mapmatched_torch.eval import data
from mapmatched_torch.eval.embedders import make_embedder
from mapmatched_torch.eval.methods import cross_fitting_folds
from mapmatched_torch.eval.runner import EvalConfig, evaluate, inputs_from_dataset
from mapmatched_torch.eval.selection import SELECTION_METHOD, cross_fitted_selection, selection_candidates


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a normalized data directory (e.g. ../shared/data/inscit_dev)")
    parser.add_argument("--size", type=int, default=60, help="conversations per subset")
    parser.add_argument("--subsets", type=int, default=10, help="random subsets (seeds first..first+subsets-1)")
    parser.add_argument("--first", type=int, default=0, help="the first subset's seed")
    parser.add_argument("--embedder", default="wordllama", help="embedder name (make_embedder)")
    parser.add_argument("--embedding-dim", type=int, default=256, help="embedding dimension")
    parser.add_argument("--candidates", type=int, default=20, help="candidates per turn")
    parser.add_argument("--k", type=int, default=10, help="kNN neighbours")
    parser.add_argument("--selection-folds", type=int, default=5, help="the headline's selection folds")
    return parser


def _mean(values, mask) -> float:
    picked = values[mask]
    return math.fsum(picked.tolist()) / len(picked) if len(picked) else math.nan


def main() -> None:
    args = _parser().parse_args()
    dataset = data.load_directory(args.data)
    embedder = make_embedder(args.embedder, dim=args.embedding_dim)
    count = len(dataset.conversations)
    if not 2 <= args.size <= count:
        raise SystemExit(f"--size must be in [2, {count}] (the data has {count} conversations)")
    rows: List[Dict[str, float]] = []
    print(f"{args.subsets} random subsets of {args.size} of {count} conversations; all-turn nDCG@3 lift over pointwise")
    print("| subset | best single method | its lift | headline lift | kept | plain 5-fold best | kept "
          "| plain 2-fold best | kept |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for subset in range(args.first, args.first + args.subsets):
        started = time.perf_counter()
        keep = sorted(random.Random(subset).sample(range(count), args.size))
        part = data.Dataset(dataset.name, tuple(dataset.conversations[i] for i in keep), dataset.passages)
        inputs = inputs_from_dataset(part, embedder, graph="knn", k=args.k, candidates=args.candidates, progress=False)
        result = evaluate(inputs, EvalConfig(n_bootstrap=0, seed=subset, selection_folds=args.selection_folds,
                                             progress=False))
        everything = result.slice_masks["all"]
        scores = {key: _mean(values["ndcg@3"], everything) for key, values in result.per_turn.items()}
        base = scores["pointwise"]
        described = {m.key: (m.method, m.params) for m in result.methods}
        candidates = selection_candidates(described)
        best = max(candidates, key=lambda key: scores[key])
        row = {"best": scores[best] - base, "headline": scores[result.primary] - base}
        for name, folds in (("plain", args.selection_folds), ("previous", result.config["fit_folds"])):
            plain = cross_fitted_selection(result.per_turn, candidates, result.conversation, everything,
                                           cross_fitting_folds(inputs.num_conversations, folds, subset))
            row[name] = _mean(plain.metrics["ndcg@3"], everything) - base
        rows.append(row)
        assert described[result.primary][0] == SELECTION_METHOD
        print(f"| {subset} | {best} | {row['best']:+.4f} | {row['headline']:+.4f} | "
              f"{row['headline'] / row['best']:.0%} | {row['plain']:+.4f} | {row['plain'] / row['best']:.0%} | "
              f"{row['previous']:+.4f} | {row['previous'] / row['best']:.0%} |"
              f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    for name, label in (("headline", f"{args.selection_folds}-fold selection preferring mixed (default)"),
                        ("plain", f"{args.selection_folds}-fold plain best (before)"),
                        ("previous", "2-fold plain best")):
        kept = [row[name] / row["best"] for row in rows]
        print(f"{label}: keeps {sum(kept) / len(kept):.0%} of the best single method's lift on average "
              f"(min {min(kept):.0%})")


if __name__ == "__main__":
    main()
