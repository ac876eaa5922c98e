"""Quality against the distance bound: does ``maximum_distance`` matter, and where?

For each bound, the same inputs (candidates, embeddings, graph arcs) are evaluated
with only the graph's ``maximum_distance`` changed (no bootstrap), and one row is
printed: the bound, the ball sizes it gives (mean and median over every node, the
centre not counted), pointwise nDCG@3, the map-matched nDCG@3 at each beta of the
grid, and the cross-fitted primary (the beta chosen on held-out folds: the honest
figure). Bounds: ``auto`` calibrated for ball sizes 4 .. 256
(:func:`mapmatched_torch.graph.calibrate_bound`), plus the fixed default 10.

Usage::

    python benchmarks/bound_quality.py --data /work/shared/data/inscit_dev --embedder hash
    python benchmarks/bound_quality.py --synthetic            # eval/synthetic.py, 200 x 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np

BETAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="a normalized dataset directory")
    parser.add_argument("--embedder", default="hash")
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--ball-sizes", default="4,8,16,32,64,128,256")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    from mapmatched_torch.eval.runner import EvalConfig, evaluate
    from mapmatched_torch.graph import TensorCorpusGraph, ball_size_summary, build_ball_table, calibrate_bound

    if args.synthetic:
        from mapmatched_torch.eval.distances import synthetic_graph
        from mapmatched_torch.eval.runner import inputs_from_synthetic
        from mapmatched_torch.eval.synthetic import make_synthetic

        bench = make_synthetic(200, 8, 16, 0)
        inputs = inputs_from_synthetic(bench, graph=synthetic_graph(bench, dense=False))
    else:
        from mapmatched_torch.eval.data import load_directory
        from mapmatched_torch.eval.embedders import make_embedder
        from mapmatched_torch.eval.runner import inputs_from_dataset

        inputs = inputs_from_dataset(load_directory(args.data), make_embedder(args.embedder), progress=False)
    base = inputs.graph
    bounds = [("auto", int(size), calibrate_bound(base.adjacency, ball_size=int(size)))
              for size in args.ball_sizes.split(",")] + [("fixed", None, 10.0)]
    rows = []
    for kind, size, bound in bounds:
        graph = TensorCorpusGraph(base.adjacency, base.vocabulary, maximum_distance=bound, directed=base.directed)
        balls = ball_size_summary(build_ball_table(base.adjacency, bound).ball_sizes())
        started = time.perf_counter()
        result = evaluate(dataclasses.replace(inputs, graph=graph),
                          EvalConfig(betas=BETAS, n_bootstrap=0, progress=False))
        from mapmatched_torch.eval.report import to_json_dict

        means = {m["key"]: m["slices"]["all"]["means"]["ndcg@3"] for m in to_json_dict(result)["methods"]}
        row = {"bound": round(bound, 4), "kind": kind, "ball_size_target": size,
               "ball_mean": round(balls["mean"], 1), "ball_p50": balls["p50"],
               "pointwise": round(means["pointwise"], 4),
               **{f"beta={beta:g}": round(means[f"map-matched lambda=1 beta={beta:g} full"], 4) for beta in BETAS},
               "cross_fitted_primary": round(means["cross-fitted primary (2-fold selection)"], 4),
               "seconds": round(time.perf_counter() - started, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
