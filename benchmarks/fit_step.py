"""One fitting step's loss and gradient, on the fused kernels and on the torch path.

The shape of what ``fit`` does per batch: ``-log_likelihood(lam * e, -(beta * d), mask,
gold).sum()`` and its ``backward()`` into ``lam`` and ``beta``, for B conversations of
T = 12 turns and M = 32 candidates (every candidate real), in float32 and float64.
The fused run takes the log-semiring kernels' forward and backward passes
(``mapmatched_torch/kernels/fused.py``); the torch-path run turns them off
(``fused_kernels_off``) and differentiates the eager chain DP with autograd. Printed:
the median of ``--repeats`` timed steps after one warm-up step, and how far the two
runs' loss and gradients are apart.

Run:  python benchmarks/fit_step.py                 (B = 1024)
      python benchmarks/fit_step.py --batch 4096
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
import sys
from typing import Callable, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mapmatched_torch.kernels.decode import log_likelihood  # noqa: E402
from mapmatched_torch.testing import fused_kernels_off  # noqa: E402


def fit_step(emissions: torch.Tensor, distances: torch.Tensor, mask: torch.Tensor, gold: torch.Tensor
             ) -> Callable[[], Tuple[float, float, float]]:
    """A closure running one step: (loss, d loss / d lam, d loss / d beta)."""

    def run() -> Tuple[float, float, float]:
        lam = torch.tensor(1.0, dtype=emissions.dtype, requires_grad=True)
        beta = torch.tensor(0.5, dtype=emissions.dtype, requires_grad=True)
        loss = -log_likelihood(lam * emissions, -(beta * distances), mask, gold).sum()
        loss.backward()
        return loss.item(), lam.grad.item(), beta.grad.item()

    return run


def timed(step: Callable[[], Tuple[float, float, float]], repeats: int) -> Tuple[float, Tuple[float, float, float]]:
    result = step()  # warm-up: loads the kernels
    seconds: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    batch, turns, candidates = args.batch, 12, 32
    emissions64 = torch.randn(batch, turns, candidates, generator=generator, dtype=torch.float64)
    distances64 = 3 * torch.rand(batch, turns - 1, candidates, candidates, generator=generator, dtype=torch.float64)
    mask = torch.ones(batch, turns, candidates, dtype=torch.bool)
    gold = torch.randint(0, candidates, (batch, turns), generator=generator)
    print(f"threads={torch.get_num_threads()} B={batch} T={turns} M={candidates} repeats={args.repeats}")
    print(f"{'dtype':<9}{'fused ms':>10}{'torch path ms':>15}{'speed-up':>10}{'largest relative difference':>30}")
    for dtype in (torch.float32, torch.float64):
        step = fit_step(emissions64.to(dtype), distances64.to(dtype), mask, gold)
        fused_seconds, fused_result = timed(step, args.repeats)
        with fused_kernels_off():
            torch_seconds, torch_result = timed(step, args.repeats)
        difference = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(fused_result, torch_result))
        print(f"{str(dtype).replace('torch.', ''):<9}{fused_seconds * 1e3:>10.1f}{torch_seconds * 1e3:>15.1f}"
              f"{torch_seconds / fused_seconds:>9.2f}x{difference:>30.2e}")


if __name__ == "__main__":
    main()
