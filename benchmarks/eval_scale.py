"""Offline evaluation at scale: N synthetic conversations x 16 map-matching settings, decoded and scored.

Generates the built-in synthetic benchmark (10k conversations x 8 turns x 16
candidates by default; its generation is data preparation and is timed apart),
then runs the evaluation harness (:func:`mapmatched_torch.eval.runner.evaluate`) with
pointwise + a 16-setting map-matching grid (beta in {0.25, 0.5, 1, 2} x lag in
{full, 0, 1, 2}) and prints the seconds of each phase:

- ``inputs``: each chunk's candidates and qrels (sliced from memory, or drawn by the
  synthetic stream with ``--stream``, which keeps memory flat in the conversations);
- ``distances``: the (B, T-1, M, M) graph distances, filled once per chunk for all 16
  settings (a gather from the topic graph's dense table);
- ``decode``: the online rankings of the 16 settings (and pointwise), each lag group
  decoded as one stacked batch;
- ``metrics``: nDCG@{3,5,10}, Recall@{3,5,10} and MRR of every turn and ranking;
- ``decoded and scored``: inputs + normalization + distances + decode + metrics (the target:
  <= 2 minutes on the 2-core CPU for 10k conversations; <= 1 minute for 1M on an
  H200);
- ``bootstrap``: slices and paired bootstrap intervals of all 17 rankings x 5 slices
  (reported apart; ``--bootstrap 0`` skips the resampling).

Scores are normalized with tensor sums (``exact_normalization=False``: equal to the
session's ``math.fsum`` normalization up to the last bits), no embedding is involved.

``--nproc 1 2`` runs the benchmark once per process count N: N worker processes of
this script with torchrun's environment (RANK, WORLD_SIZE, ... on the loopback
interface), so :func:`~mapmatched_torch.eval.runner.evaluate` takes its distributed
path (gloo on the CPU, NCCL on CUDA: each rank decodes and scores its shard, rank 0
gathers and summarizes). It prints, per N, the seconds of the sharded phase
(``scored``: normalize + distances + decode + metrics + gather, as rank 0 sees it),
conversations (x settings) per second, the peak resident memory of every process
(``getrusage``), and the throughput ratio of each N to the first; also each process's
CPU seconds in the chunk loop and the rate and ratio they imply (on a machine shared
with other work the wall-clock figures measure the sharing). Each process runs
``--threads`` torch threads (default 1: the ratio measures scaling over processes;
the numba kernels use the same count).

Usage::

    python benchmarks/eval_scale.py                              # 10k conversations, CPU
    python benchmarks/eval_scale.py --conversations 1000000 --device cuda --batch-size 65536
    python benchmarks/eval_scale.py --conversations 100000 --nproc 1 2 --bootstrap 0 --stream
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch.eval import distributed  # noqa: E402
from mapmatched_torch.eval.runner import EvalConfig, evaluate, inputs_from_synthetic  # noqa: E402
from mapmatched_torch.eval.synthetic import make_synthetic, synthetic_stream  # noqa: E402

BETAS = (0.25, 0.5, 1.0, 2.0)
#: The phases of "decoded and scored" (the chunk loop).
SCORED = ("inputs", "normalize", "distances", "methods", "metrics")
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
    parser.add_argument("--nproc", type=int, nargs="+", default=None,
                        help="run once per process count (torchrun's environment, gloo/NCCL) and compare")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process with --nproc (default 1)")
    parser.add_argument("--stream", action="store_true",
                        help="draw the conversations chunk by chunk (synthetic_stream): memory flat in their number")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nproc:
        return launch(args)
    if distributed.torchrun_environment():
        distributed.init_from_environment(distributed.local_device(args.device))
    try:
        return run(args)
    finally:
        distributed.destroy()


def run(args: argparse.Namespace) -> int:
    """One process of the benchmark (all of it without a process group)."""
    device = distributed.local_device(args.device)

    tick = time.perf_counter()
    if args.stream:  # drawn chunk by chunk inside the scored phase, each rank its shard only
        bench = synthetic_stream(args.conversations, args.turns, args.candidates, args.seed)
    else:
        bench = make_synthetic(args.conversations, args.turns, args.candidates, args.seed, with_conversations=False)
    inputs = inputs_from_synthetic(bench, device=device)
    prepared = time.perf_counter() - tick

    config = EvalConfig(
        methods=("pointwise", "map-matched"), lambdas=(1.0,), betas=BETAS, lags=LAGS, n_bootstrap=args.bootstrap,
        exact_normalization=False, batch_size=args.batch_size, device=device, progress=None,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    cpu = time.process_time()
    result = evaluate(inputs, config)
    cpu = time.process_time() - cpu
    if args.worker:  # one JSON line for the launcher: every rank's memory, rank 0's timings
        print("BENCH " + json.dumps({
            "rank": distributed.rank(), "world_size": distributed.world_size(), "threads": torch.get_num_threads(),
            "peak_rss": peak_rss(), "prepared": prepared, "timings": None if result is None else result.timings,
            "settings": len(config.settings), "load": os.getloadavg()[0], "cpu": cpu,
        }), flush=True)
        return 0
    if result is None:  # a rank of a torchrun job other than 0: rank 0 reports
        return 0
    timings = result.timings
    scored = sum(timings[name] for name in SCORED)
    settings = len(config.settings)
    turns = args.conversations * args.turns

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.1f}")
    print(f"{args.conversations} conversations x {args.turns} turns x {args.candidates} candidates, "
          f"{settings} settings (+ pointwise): {turns * settings:,} turn rankings")
    rows = [
        ("data generation + graph (excluded)", prepared),
        ("inputs (chunks sliced, or drawn with --stream)", timings["inputs"]),
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


def peak_rss() -> int:
    """Peak resident memory of this process in bytes (``getrusage``; Linux counts KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _forwarded(args: argparse.Namespace) -> List[str]:
    """This run's options for the workers (without --nproc / --threads)."""
    forwarded = ["--conversations", str(args.conversations), "--turns", str(args.turns), "--candidates",
                 str(args.candidates), "--device", args.device, "--bootstrap", str(args.bootstrap), "--seed",
                 str(args.seed)]
    if args.batch_size is not None:
        forwarded += ["--batch-size", str(args.batch_size)]
    if args.stream:
        forwarded.append("--stream")
    return forwarded


def _run_processes(args: argparse.Namespace, processes: int) -> List[Dict]:
    """Start ``processes`` workers with torchrun's variables; their BENCH records by rank."""
    port = str(_free_port())
    threads = str(max(1, args.threads))
    workers = []
    for rank in range(processes):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(processes), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS=threads, NUMBA_NUM_THREADS=threads)
        workers.append(subprocess.Popen([sys.executable, __file__, *_forwarded(args), "--worker"], env=env,
                                        stdout=subprocess.PIPE, text=True))
    records = []
    try:
        for worker in workers:
            out, _ = worker.communicate()
            if worker.returncode != 0:
                raise SystemExit(f"a worker of the {processes}-process run failed (exit {worker.returncode})")
            records.extend(json.loads(line[6:]) for line in out.splitlines() if line.startswith("BENCH "))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    return sorted(records, key=lambda record: record["rank"])


def launch(args: argparse.Namespace) -> int:
    """``--nproc N1 N2 ...``: the benchmark per process count, and the throughput ratios."""
    print(f"{args.conversations} conversations x {args.turns} turns x {args.candidates} candidates, device "
          f"{args.device}, torch {torch.__version__}, {args.threads} thread(s) per process, "
          f"{os.cpu_count()} cores, load average before {os.getloadavg()[0]:.1f}")
    first = cpu_first = None
    for processes in args.nproc:
        records = _run_processes(args, processes)
        main = records[0]
        timings = main["timings"]
        scored = sum(timings[name] for name in SCORED) + timings.get("gather", 0.0)
        rate = args.conversations / scored
        first = rate if first is None else first
        memory = ", ".join(f"rank {r['rank']} {r['peak_rss'] / 2 ** 30:.2f} GiB" for r in records)
        print(f"--nproc {processes}: scored {scored:.2f} s (decode {timings['methods']:.2f} s, gather "
              f"{timings.get('gather', 0.0):.2f} s; bootstrap {timings['bootstrap']:.2f} s, generation "
              f"{main['prepared']:.2f} s apart)")
        print(f"  {rate:,.0f} conversations x {main['settings']} settings per second "
              f"({rate * args.turns * main['settings']:,.0f} turn rankings per second), "
              f"ratio to --nproc {args.nproc[0]}: {rate / first:.2f}x")
        print(f"  peak RSS per process: {memory}; load average after {os.getloadavg()[0]:.1f}")
        # on a shared machine wall time is not the processes' own: their CPU seconds in the chunk loop
        # (rank 0: the loop's own clock; the others: all of evaluate, which ends with the gather) bound what
        # they would do alone
        loop = [timings["cpu"]] + [r["cpu"] for r in records[1:]]
        busiest = max(loop)
        cpu_rate = args.conversations / busiest
        cpu_first = cpu_rate if cpu_first is None else cpu_first
        seconds = ", ".join(f"{value:.1f}" for value in loop)
        print(f"  CPU seconds of the chunk loop per process: {seconds}; "
              f"{cpu_rate:,.0f} conversations per busiest-process CPU second, ratio {cpu_rate / cpu_first:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
