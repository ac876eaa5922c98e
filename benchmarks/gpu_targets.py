"""The GPU path's targets, measured per kernel backend, with parity checked on the same inputs.

For each backend (``triton``, and the ``torch`` path as the baseline) it decodes one
batch of the issue's shape and reports conversations per second:

- ``viterbi`` float32, B = 65,536, T = 12, M = 32 (target: >= 20M conversations/s);
- ``fixed_lag_viterbi`` (lag 2), same batch;
- ``log_partition`` forward and backward (``d log Z / d emissions, d transitions``),
  float32, B = 65,536 (target: >= 5M conversations/s);

and before any timing, checks on those very inputs that the Triton results equal the
torch path's (paths and locks identical, max-plus scores bit for bit, log Z and the
gradients within the tolerance of tests/kernels/test_triton_kernels.py). A parity
failure is recorded and the script exits non-zero.

Writes one JSON object (``--out``) and prints a table. ``--dry-run`` runs the same code
on tiny shapes (B = 6, T = 3, M = 5) on the CPU, the Triton kernels under the
interpreter: it proves the script, never a speed (its timings are labelled
``"interpreter: not a speed"`` and must never be reported).

Run:  python benchmarks/gpu_targets.py --out out/gpu_targets.json          (a CUDA device)
      python benchmarks/gpu_targets.py --dry-run --out out/dry.json        (CPU, CI)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.decode import _seconds as seconds  # noqa: E402  (median of repeats after a warm-up call)
from mapmatched_torch.kernels import decode, use_backend  # noqa: E402
from mapmatched_torch.testing import random_trellis  # noqa: E402

TARGETS = {"viterbi": 20e6, "log_partition_fwd_bwd": 5e6}
TOLERANCE = {torch.float32: 2e-5, torch.float64: 1e-12}


def calls(emissions, transitions, mask) -> Dict[str, Callable[[], object]]:
    def log_partition_fwd_bwd():
        shift_e = emissions.detach().requires_grad_()
        shift_t = transitions.detach().requires_grad_()
        log_z = decode.log_partition(shift_e, shift_t, mask)
        return log_z, torch.autograd.grad(log_z.sum(), (shift_e, shift_t))

    return {
        "viterbi": lambda: decode.viterbi(emissions, transitions, mask),
        "fixed_lag_viterbi": lambda: decode.fixed_lag_viterbi(emissions, transitions, mask, 2),
        "log_partition_fwd_bwd": log_partition_fwd_bwd,
    }


def parity(emissions, transitions, mask) -> Dict[str, bool]:
    """Triton against the torch path on the benchmark's own inputs."""
    results = {}
    for name in ("viterbi", "fixed_lag_viterbi", "log_partition_fwd_bwd"):
        with use_backend("torch"):
            expected = calls(emissions, transitions, mask)[name]()
        with use_backend("triton"):
            actual = calls(emissions, transitions, mask)[name]()
        if name == "log_partition_fwd_bwd":
            bound = TOLERANCE[emissions.dtype]
            pairs = [(actual[0], expected[0])] + list(zip(actual[1], expected[1]))
            results[name] = all(bool(((a - e).abs() <= bound * (1 + e.abs())).all()) for a, e in pairs)
        else:
            same = torch.equal(actual.paths, expected.paths) and torch.equal(actual.scores, expected.scores)
            same = same and torch.equal(torch.signbit(actual.scores), torch.signbit(expected.scores))
            if name == "fixed_lag_viterbi":
                same = same and torch.equal(actual.locks, expected.locks)
            results[name] = same
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton under its interpreter")
    parser.add_argument("--batch", type=int, default=65_536)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--candidates", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backends", nargs="+", default=["triton", "torch"])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
        args.batch, args.turns, args.candidates, args.repeats = 6, 3, 5, 1
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run with --dry-run on a CPU")
        device = torch.device("cuda")
    made = random_trellis(args.batch, args.turns, args.candidates, generator=torch.Generator().manual_seed(0),
                          dtype=torch.float32, device=device, pad=False)
    emissions, transitions, mask = made.emissions, -made.distances, made.mask
    report: Dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {"B": args.batch, "T": args.turns, "M": args.candidates, "dtype": "float32"},
        "timing": "interpreter: not a speed" if args.dry_run else "median wall seconds, after one warm-up call",
        "command": "python benchmarks/gpu_targets.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "targets_conversations_per_s": TARGETS,
    }
    report["parity"] = parity(emissions, transitions, mask)
    rates: Dict[str, Dict[str, Optional[float]]] = {}
    for backend in args.backends:
        with use_backend(backend):
            for name, call in calls(emissions, transitions, mask).items():
                elapsed = seconds(call, device, args.repeats)
                rates.setdefault(name, {})[backend] = args.batch / elapsed
    if args.dry_run:  # interpreter timings are never a speed: run, not reported
        rates = {name: {backend: None for backend in by_backend} for name, by_backend in rates.items()}
    report["conversations_per_s"] = rates
    print(f"{'kernel':24s}" + "".join(f"{backend:>16s}" for backend in args.backends) + f"{'target':>14s}")
    for name, by_backend in rates.items():
        target = TARGETS.get(name)
        cells = "".join(f"{by_backend[backend] or float('nan'):16.3g}" for backend in args.backends)
        print(f"{name:24s}{cells}{(f'{target:14.3g}' if target else ''):>14s}")
    print("parity:", report["parity"], "|", report["timing"])
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0 if all(report["parity"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
