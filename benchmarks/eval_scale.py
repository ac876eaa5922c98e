"""Offline evaluation at scale: N synthetic conversations x 16 map-matching settings, decoded and scored.

Generates the built-in synthetic benchmark (10k conversations x 8 turns x 16
candidates by default; its generation is data preparation and is timed apart),
then runs the evaluation harness (:func:`mapmatched_torch.eval.runner.evaluate`) with
pointwise + a 16-setting map-matching grid (beta in {0.25, 0.5, 1, 2} x lag in
{full, 0, 1, 2}) and prints the seconds of each phase:

- ``distances``: the (B, T-1, M, M) graph distances, filled once per chunk for all 16
  settings (a gather from the topic graph's dense table);
- ``decode``: the online rankings of the 16 settings (and pointwise), each lag group
  decoded as one stacked batch;
- ``metrics``: nDCG@{3,5,10}, Recall@{3,5,10} and MRR of every turn and ranking;
- ``decoded and scored``: normalization + distances + decode + metrics (the target:
  <= 2 minutes on the 2-core CPU for 10k conversations; <= 1 minute for 1M on an
  H200);
- ``bootstrap``: slices and paired bootstrap intervals of all 17 rankings x 5 slices
  (reported apart; ``--bootstrap 0`` skips the resampling).

Scores are normalized with tensor sums (``exact_normalization=False``: equal to the
session's ``math.fsum`` normalization up to the last bits), no embedding is involved.

Usage::

    python benchmarks/eval_scale.py                              # 10k conversations, CPU
    python benchmarks/eval_scale.py --conversations 1000000 --device cuda --batch-size 65536
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch.eval.runner import EvalConfig, evaluate, inputs_from_synthetic  # noqa: E402
from mapmatched_torch.eval.synthetic import make_synthetic  # noqa: E402

BETAS = (0.25, 0.5, 1.0, 2.0)
LAGS = (None, 0, 1, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--candidates", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=None, help="conversations per chunk (default: auto)")
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)

    tick = time.perf_counter()
    bench = make_synthetic(args.conversations, args.turns, args.candidates, args.seed, with_conversations=False)
    inputs = inputs_from_synthetic(bench, device=device)
    prepared = time.perf_counter() - tick

    config = EvalConfig(
        methods=("pointwise", "map-matched"), lambdas=(1.0,), betas=BETAS, lags=LAGS, n_bootstrap=args.bootstrap,
        exact_normalization=False, batch_size=args.batch_size, device=device, progress=None,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    result = evaluate(inputs, config)
    timings = result.timings
    scored = timings["normalize"] + timings["distances"] + timings["methods"] + timings["metrics"]
    settings = len(config.settings)
    turns = args.conversations * args.turns

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.1f}")
    print(f"{args.conversations} conversations x {args.turns} turns x {args.candidates} candidates, "
          f"{settings} settings (+ pointwise): {turns * settings:,} turn rankings")
    rows = [
        ("data generation + graph (excluded)", prepared),
        ("normalize", timings["normalize"]),
        ("distances (once for all settings)", timings["distances"]),
        ("decode (16 settings, online rankings)", timings["methods"]),
        ("metrics", timings["metrics"]),
        ("decoded and scored", scored),
        (f"bootstrap ({args.bootstrap} resamples, {len(result.methods)} rankings x {len(result.slice_masks)} slices)",
         timings["bootstrap"]),
    ]
    width = max(len(name) for name, _ in rows)
    for name, seconds in rows:
        print(f"  {name:<{width}}  {seconds:8.2f} s")
    print(f"  {'turn rankings per second (decoded and scored)':<{width}}  {turns * settings / scored:12,.0f}")
    best = result.method(result.primary)
    print(f"primary setting {result.primary}: nDCG@3 {best.slices['all'].means['ndcg@3']:.4f} "
          f"(pointwise {result.method('pointwise').slices['all'].means['ndcg@3']:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
