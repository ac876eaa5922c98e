"""Throughput and peak memory of the batched decoders, side by side with baselines.

Prints conversations per second for ``viterbi``, ``fixed_lag_viterbi`` (lag 2),
``log_partition`` and ``marginals`` at B in {1, 64, 1024, 4096} conversations of T=12 turns and M=32
candidates, in float32 and float64, next to

- the torch path (``use_fused_kernels(False)``: the eager chain DP that the fused
  kernels replace by default on the CPU, see ``mapmatched_torch/kernels/fused.py``),
- a plain numpy Viterbi (vectorized over B and M, loop over T; the same tie rule),
- peers when installed: torch-struct 0.5's ``LinearChainCRF`` (``argmax`` in the max
  semiring for viterbi, ``partition`` in the log semiring for log_partition; its log
  potentials are built outside the timed call) and pytorch-crf's ``CRF.decode`` (the
  time-invariant special case: one M x M transition matrix shared by all turns),
- the pure-Python ``StandaloneDecoder`` (float64; run on a few conversations only, and
  through a dict-backed graph holding the same distances),

and the ratios. "peak MB" is the extra memory one torch call needed beyond its inputs:
on CUDA ``torch.cuda.max_memory_allocated`` (reset before the call) minus the memory
allocated before it; on CPU the peak of the running sum of the tensor allocations and
frees that ``torch.profiler`` records during the call (``profile_memory=True``). The
CPU figure counts tensor bytes, not allocator slack, and is independent of tracemalloc
and of the process's resident-set high-water mark (which earlier calls already raised).
Inputs are unpadded (every conversation has all T turns), so no cleaned copy of the
transitions is made; padded batches with non-finite garbage add one.

Usage::

    python benchmarks/decode.py            # full table
    python benchmarks/decode.py --quick    # B in {1, 64, 1024}, one repeat
    python benchmarks/decode.py --device cuda
    pip install torch-struct==0.5 pytorch-crf   # optional peers (not project dependencies)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mapmatched_torch.kernels.decode import fixed_lag_viterbi, log_partition, marginals, viterbi  # noqa: E402
from mapmatched_torch.testing import fused_kernels_off, random_trellis  # noqa: E402

TURNS, CANDIDATES, LAG = 12, 32, 2


# ------------------------------------------------------------------ baselines


def numpy_viterbi(emissions: np.ndarray, transitions: np.ndarray, mask: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Plain numpy Viterbi: (B, T, M), (B, T-1, M, M) [b, t, from, to], (B, T, M) bool.

    Same recursion order and tie rule (np.argmax returns the first maximum); assumes
    unpadded turns (every conversation has all T turns) for brevity.
    """
    batch, turns, candidates = emissions.shape
    alpha = np.where(mask[:, 0], emissions[:, 0], -np.inf)
    backpointers = np.zeros((batch, turns, candidates), dtype=np.int64)
    for t in range(1, turns):
        scores = alpha[:, :, None] + transitions[:, t - 1]
        backpointers[:, t] = scores.argmax(axis=1)
        best = np.take_along_axis(scores, backpointers[:, t][:, None, :], axis=1)[:, 0]
        alpha = np.where(mask[:, t], best + emissions[:, t], -np.inf)
    paths = np.empty((batch, turns), dtype=np.int64)
    paths[:, -1] = alpha.argmax(axis=1)
    for t in range(turns - 1, 0, -1):
        paths[:, t - 1] = np.take_along_axis(backpointers[:, t], paths[:, t : t + 1], axis=1)[:, 0]
    return paths, alpha.max(axis=1)


class _DictGraph:
    """The precomputed distances of one conversation behind the CorpusGraph protocol."""

    def __init__(self, table: Dict[Tuple[str, str], float], maximum_distance: float) -> None:
        self.table, self.maximum_distance = table, maximum_distance

    def distance(self, a: str, b: str) -> float:
        return 0.0 if a == b else self.table[(a, b)]

    def neighborhood(self, chunk_id: str, radius: float):
        return ()


def _standalone_inputs(emissions: torch.Tensor, distances: torch.Tensor, mask: torch.Tensor, b: int):
    """Conversation b as a DecoderCandidate trellis (IDs unique per turn) and a dict graph."""
    from mapmatched_torch.core.models import DecoderCandidate

    e, d, m = emissions[b].double().tolist(), distances[b].double().tolist(), mask[b].tolist()
    trellis, ids = [], []
    for t, row in enumerate(m):
        if not any(row):
            break
        turn_ids = [f"t{t}c{i}" for i, real in enumerate(row) if real]
        ids.append([i for i, real in enumerate(row) if real])
        trellis.append([DecoderCandidate(c, e[t][i], e[t][i]) for c, i in zip(turn_ids, ids[-1])])
    table = {
        (f"t{t - 1}c{j}", f"t{t}c{i}"): d[t - 1][j][i] for t in range(1, len(trellis)) for j in ids[t - 1] for i in ids[t]
    }
    return trellis, _DictGraph(table, maximum_distance=max(table.values(), default=1.0) + 1.0)


def _run_standalone(problems, fixed_lag: Optional[int]) -> List[float]:
    from mapmatched_torch.standalone.decoder import StandaloneDecoder

    decoder = StandaloneDecoder()
    return [
        decoder.decode(trellis, graph, emission_weight=1.0, transition_weight=1.0, fixed_lag=fixed_lag).total_score
        for trellis, graph in problems
    ]


def standalone_baseline(
    emissions: torch.Tensor, distances: torch.Tensor, mask: torch.Tensor, fixed_lag: Optional[int] = None
) -> List[float]:
    """Decode every conversation with the pure-Python StandaloneDecoder (lambda = beta = 1).

    Each conversation becomes a DecoderCandidate trellis (chunk IDs unique per turn)
    and a dict-backed graph holding the same distances. Returns the total scores, which
    equal ``viterbi(emissions, -distances, mask).scores`` (or the fixed-lag scores)
    exactly in float64.
    """
    problems = [_standalone_inputs(emissions, distances, mask, b) for b in range(emissions.shape[0])]
    return _run_standalone(problems, fixed_lag)


# ------------------------------------------------------------------- measuring


def torch_path(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with the fused kernels off (the eager chain DP)."""

    def run() -> object:
        with fused_kernels_off():
            return call()

    return run


def torch_struct_calls(emissions: torch.Tensor, transitions: torch.Tensor) -> Dict[str, Callable[[], object]]:
    """torch-struct's LinearChainCRF on the same trellis (unpadded), or {} without it.

    Its log potentials are ``(B, T-1, C_next, C_prev)``: turn 0's emission is folded into
    the first step, each later emission into the step that enters it."""
    try:
        from torch_struct import LinearChainCRF
    except ImportError:
        return {}
    potentials = transitions.transpose(-1, -2) + emissions[:, 1:, :, None]
    potentials[:, 0] += emissions[:, 0, None, :]
    return {
        "viterbi": lambda: LinearChainCRF(potentials).argmax,  # max semiring + autograd backtrack
        "log_partition": lambda: LinearChainCRF(potentials).partition,
    }


def pytorch_crf_call(emissions: torch.Tensor, transitions: torch.Tensor) -> Optional[Callable[[], object]]:
    """pytorch-crf's Viterbi with turn 0's transition matrix for every turn, or None."""
    try:
        from torchcrf import CRF
    except ImportError:
        return None
    crf = CRF(emissions.shape[2], batch_first=True).to(emissions.device, emissions.dtype)
    with torch.no_grad():
        crf.transitions.copy_(transitions[0, 0])
        crf.start_transitions.zero_()
        crf.end_transitions.zero_()
    return lambda: crf.decode(emissions)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up call."""
    call()
    _synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _profiled_peak_bytes(call: Callable[[], object]) -> int:
    """Peak of the running sum of tensor allocations minus frees during one call, from
    ``torch.profiler`` (``profile_memory=True``): ops carry their net allocation,
    ``[memory]`` events the frees made outside an op; ordered by start time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    deltas = []
    for event in prof.events():
        delta = event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        if delta:
            deltas.append((event.time_range.start, delta))
    current = peak = 0
    for _, delta in sorted(deltas):
        current += delta
        peak = max(peak, current)
    return peak


def peak_extra_mb(call: Callable[[], object], device: torch.device) -> str:
    """Peak extra memory of one call in MiB (see the module docstring for the method)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return f"{(torch.cuda.max_memory_allocated(device) - before) / 2**20:.1f}"
    return f"{_profiled_peak_bytes(call) / 2**20:.1f}"


# ------------------------------------------------------------------------ main


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B in {1, 64, 1024}, one repeat, fewer standalone runs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=int, nargs="*", help="override the batch sizes")
    parser.add_argument("--repeats", type=int, help="timed calls per measurement (median)")
    parser.add_argument("--standalone", type=int, help="conversations decoded by the standalone baseline")
    parser.add_argument(
        "--compile", action="store_true", help="fuse the max-plus step with torch.compile (use_compiled_kernels)"
    )
    args = parser.parse_args(argv)
    if args.compile:
        from mapmatched_torch.kernels.chain import use_compiled_kernels

        use_compiled_kernels(True)
    device = torch.device(args.device)
    batches = args.batches or ([1, 64, 1024] if args.quick else [1, 64, 1024, 4096])
    repeats = args.repeats or (1 if args.quick else 3)
    standalone_count = args.standalone if args.standalone is not None else (2 if args.quick else 8)

    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"T={TURNS} M={CANDIDATES} lag={LAG} repeats={repeats}"
    )
    header = (
        f"{'op':<16}{'dtype':<9}{'B':>6}{'ours conv/s':>15}{'baseline':>14}{'base conv/s':>14}{'ratio':>9}"
        f"{'peak MB':>10}"
    )
    print(header)
    print("-" * len(header))
    generator = torch.Generator().manual_seed(0)
    for batch in batches:
        emissions64, distances64, mask = random_trellis(
            batch, TURNS, CANDIDATES, generator=generator, pad=False, tie_prob=0.0
        )
        paths64 = viterbi(emissions64, -distances64, mask).paths
        paths32 = viterbi(emissions64.float(), -distances64.float(), mask).paths
        same = int((paths64 == paths32).all(dim=1).sum())
        print(f"# B={batch}: float32 paths equal float64 paths for {same}/{batch} conversations")
        standalone_rates: Dict[str, float] = {}
        count = min(batch, standalone_count)
        problems = [_standalone_inputs(emissions64, distances64, mask, b) for b in range(count)]
        for op, lag in (("viterbi", None), ("fixed_lag", LAG)) if count else ():
            start = time.perf_counter()
            expected = _run_standalone(problems, lag)
            standalone_rates[op] = count / (time.perf_counter() - start)
            decode = viterbi if lag is None else lambda *a: fixed_lag_viterbi(*a, LAG)
            ours = decode(emissions64[:count], -distances64[:count], mask[:count]).scores.tolist()
            assert ours == expected, f"{op}: torch float64 scores differ from the standalone decoder's"
        for dtype in (torch.float32, torch.float64):
            emissions = emissions64.to(device, dtype)
            transitions = (-distances64).to(device, dtype)
            on_device = mask.to(device)
            calls = {
                "viterbi": lambda: viterbi(emissions, transitions, on_device),
                "fixed_lag": lambda: fixed_lag_viterbi(emissions, transitions, on_device, LAG),
                "log_partition": lambda: log_partition(emissions, transitions, on_device),
                "marginals": lambda: marginals(emissions, transitions, on_device),
            }
            numpy_inputs = (emissions.cpu().numpy(), transitions.cpu().numpy(), mask.numpy())
            peers = torch_struct_calls(emissions, transitions)
            crf = pytorch_crf_call(emissions, transitions)
            for op, call in calls.items():
                rate = batch / _seconds(call, device, repeats)
                peak = peak_extra_mb(call, device)
                baselines: List[Tuple[str, Optional[float]]] = []
                baselines.append(("torch path", batch / _seconds(torch_path(call), device, repeats)))
                if op in peers:
                    baselines.append(("torch-struct", batch / _seconds(peers[op], device, repeats)))
                if op == "viterbi" and crf is not None:
                    baselines.append(("pytorch-crf", batch / _seconds(crf, device, repeats)))
                if op == "viterbi":
                    numpy_seconds = _seconds(lambda: numpy_viterbi(*numpy_inputs), torch.device("cpu"), repeats)
                    baselines.append(("numpy", batch / numpy_seconds))
                if dtype == torch.float64 and op in standalone_rates:
                    baselines.append(("standalone", standalone_rates[op]))
                for baseline, base_rate in baselines or [("-", None)]:
                    _print_row(op, dtype, batch, rate, baseline, base_rate, peak)


def _print_row(op, dtype, batch, rate, baseline, base_rate, peak) -> None:
    ratio = f"{rate / base_rate:.1f}x" if base_rate else "-"
    base = f"{base_rate:,.0f}" if base_rate else "-"
    dtype_name = str(dtype).replace("torch.", "")
    print(f"{op:<16}{dtype_name:<9}{batch:>6}{rate:>15,.0f}{baseline:>14}{base:>14}{ratio:>9}{peak:>10}")


if __name__ == "__main__":
    main()
