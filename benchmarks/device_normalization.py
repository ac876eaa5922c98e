"""How often the device step's normalization cannot certify a row's exact sums (and
refuses it with StepCode.EXACT_SUM_ON_HOST), and that every other row equals the exact
normalization bit for bit.

Run:  python benchmarks/device_normalization.py [--rows 20000] [--width 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch.kernels.normalization import normalize_score_rows, normalize_score_rows_on_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(1)
    rows, width = args.rows, args.width
    kinds = {
        "normal": lambda: torch.randn(rows, width, generator=generator, dtype=torch.float64),
        "cosine-like [0.2, 0.8)": lambda: torch.rand(rows, width, generator=generator, dtype=torch.float64) * 0.6 + 0.2,
        "integers (ties)": lambda: torch.randint(-3, 3, (rows, width), generator=generator).double(),
        "tiny (1e-300)": lambda: torch.randn(rows, width, generator=generator, dtype=torch.float64) * 1e-300,
        "huge (1e300)": lambda: torch.randn(rows, width, generator=generator, dtype=torch.float64) * 1e300,
    }
    print("| data | normalization | flagged for the host | unflagged rows that differ |")
    print("|---|---|---:|---:|")
    for name, make in kinds.items():
        values = make()
        counts = torch.randint(1, width + 1, (rows,), generator=generator)
        for method in ("zscore", "center"):
            exact = normalize_score_rows(values, counts, method)
            device, host = normalize_score_rows_on_device(values, counts, method)
            same = (exact.view(torch.int64) == device.view(torch.int64)).all(1)
            print(f"| {name} | {method} | {int(host.sum())} of {rows} | {int((~same & ~host).sum())} |")


if __name__ == "__main__":
    main()
