"""The sparse distance cache's insertion cost as it fills (issue 36 item 4: a cache's cost
bounded by the work in hand, not by what the server saw before).

A 100,000-node cache (sparse rows: too many nodes for dense rows) takes 60 insertions of
64,000 entries (2,000 source rows x 32 targets), evicting as its row capacity is
reached, with a lookup of the same pairs after each; CPU time on one thread (torch and
numba), so that other jobs on a shared machine do not inflate it.

Run:  NUMBA_NUM_THREADS=1 python benchmarks/cache_insert.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch.graph.cache import DistanceCache  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    nodes = 100_000
    cache = DistanceCache(nodes)
    inserts, lookups = [], []
    for _ in range(60):
        sources = torch.randint(0, nodes, (2000,)).repeat_interleave(32)
        targets = torch.randint(0, nodes, (64000,))
        values = torch.rand(64000, dtype=torch.float64)
        start = time.process_time()
        cache.insert(sources, targets, values)
        inserts.append(time.process_time() - start)
        start = time.process_time()
        cache.lookup(sources, targets)
        lookups.append(time.process_time() - start)
    print(f"entries at the end: {cache.entry_count:,}; rows: {cache.cache_info().size:,}")
    print(f"insertion of 64,000 entries, CPU ms: first 10 {sum(inserts[:10]) * 100:.1f}, "
          f"last 10 {sum(inserts[-10:]) * 100:.1f}; lookup, last 10: {sum(lookups[-10:]) * 100:.1f}")


if __name__ == "__main__":
    main()
