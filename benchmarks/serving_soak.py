"""Serving soak: sessions open and close over many steps; memory, slots and Python objects stay flat.

A clustered corpus graph (``benchmarks/serving.py``'s) as a TensorCorpusGraph; a pool of
live sessions stepped through :meth:`MapMatchedServer.step_slots` (the tensor step), a
few closing and a few opening each step (lifetimes of 1 to ``--max-turns`` turns), so
over the run far more sessions are served than are ever open at once. Every
``--report-every`` steps it prints the resident memory, the number of objects the
garbage collector tracks, the store's slot and turn capacity and the step latency.
Memory is flat when the last reports match the first ones after the warm-up: slots are
reused, long sessions give their turns back, and no Python object is left per step.

Run:  python benchmarks/serving_soak.py                       (100k steps, 256 live sessions)
      python benchmarks/serving_soak.py --steps 2000 --quick  (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving import clustered_graph  # noqa: E402

from mapmatched_torch.serving import MapMatchedServer  # noqa: E402


def resident_mb() -> float:
    """The process's resident memory now (Linux /proc), else its peak."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as stream:
            return int(stream.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--live", type=int, default=256, help="sessions open at any time")
    parser.add_argument("--batch", type=int, default=64, help="sessions stepped per step")
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=5_000)
    parser.add_argument("--max-turns", type=int, default=40)
    parser.add_argument("--report-every", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.report_every = max(1, args.steps // 4)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(args.seed)
    graph = clustered_graph(args.nodes, generator)
    server = MapMatchedServer(graph, candidate_limit=args.width, capacity=args.live)
    # every session: its slot, how many turns it has left, and the node its topic sits at
    slots = torch.tensor([server.open(f"s{i}") for i in range(args.live)])
    left = torch.randint(1, args.max_turns + 1, (args.live,), generator=generator)
    topic = torch.randint(0, args.nodes, (args.live,), generator=generator)
    opened, served, next_id = args.live, 0, args.live
    ids = {int(slot): f"s{i}" for i, slot in enumerate(slots.tolist())}
    times = []
    print(f"graph {args.nodes} nodes; {args.live} live sessions, {args.batch} stepped per step, M = {args.width}; "
          f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f}")
    print("| step | sessions served | resident MB | gc objects | slot capacity | turn capacity | p50 step ms | p99 step ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        rows = torch.randperm(args.live, generator=generator)[: args.batch]
        cluster = topic[rows] // 50
        codes = (cluster.unsqueeze(1) * 50 + torch.randint(0, 50, (args.batch, args.width), generator=generator))
        codes = codes.clamp_max(args.nodes - 1)
        # distinct candidates per row: a repeated node becomes padding at the end
        ordered, _ = codes.sort(1)
        repeated = torch.zeros_like(ordered, dtype=torch.bool)
        repeated[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
        codes = torch.where(repeated, -1, ordered).sort(1, descending=True).values
        scores = torch.randn(codes.shape, generator=generator, dtype=torch.float64)
        tick = time.perf_counter()
        out = server.step_slots(slots[rows], codes, scores, contexts=True)
        times.append(time.perf_counter() - tick)
        if bool((out.status != 0).any()):
            raise RuntimeError(f"step {step}: unexpected row failures {out.status.unique().tolist()}")
        served += args.batch
        left[rows] -= 1
        finished = rows[left[rows] <= 0]
        for row in finished.tolist():  # a conversation ends; a new one takes its place
            server.close(ids.pop(int(slots[row])))
            name = f"s{next_id}"
            next_id += 1
            slots[row] = server.open(name)
            ids[int(slots[row])] = name
            left[row] = int(torch.randint(1, args.max_turns + 1, (1,), generator=generator))
            topic[row] = int(torch.randint(0, args.nodes, (1,), generator=generator))
            opened += 1
        if step % args.report_every == 0 or step == args.steps:
            window = sorted(times)
            decoder = server.store.decoder
            print(f"| {step} | {opened} | {resident_mb():.0f} | {len(gc.get_objects())} | {decoder.capacity} | "
                  f"{decoder.turn_capacity} | {statistics.median(window) * 1e3:.2f} | "
                  f"{window[int(0.99 * (len(window) - 1))] * 1e3:.2f} |", flush=True)
            times = []
    print(f"{args.steps} steps in {time.perf_counter() - start:.0f} s; {opened} sessions opened in all, "
          f"{len(server)} open at the end; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
