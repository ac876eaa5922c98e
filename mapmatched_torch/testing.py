"""Test helpers: a random trellis factory, a brute-force path enumerator, devices.

:func:`enumerate_paths` is the oracle of the chain dynamic programs on tiny inputs. Its
maximum score equals the Viterbi score exactly (float64 left folds in the decoder's
order; ``fl(a + c)`` is monotone in ``a``, so the DP and the enumeration agree on the
maximum bit for bit). Its *path* is guaranteed to equal the Viterbi path only on
exactly representable inputs (integers, dyadic rationals): with general floats,
rounding can make a path tie with the optimum although the DP, which compares partial
sums, never saw that tie. Compare scores exactly everywhere, paths on integer inputs.

The Viterbi tie rule, stated on whole paths: among the optimal paths, the one with the
smallest last candidate index, then the smallest second-to-last, and so on (the
reverse-lexicographic minimum).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Iterator, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "RandomTrellis",
    "BruteForce",
    "random_trellis",
    "enumerate_paths",
    "BREAKAGES",
    "broken_trellis",
    "fused_kernels_off",
    "turn_tensors",
    "DEVICES",
    "device_available",
]

def turn_tensors(server, turns, width: int = 6) -> Tuple[torch.Tensor, torch.Tensor]:
    """One turn of S sessions, as ``MapMatchedServer.step_slots`` takes it.

    Args:
        server: a :class:`~mapmatched_torch.serving.MapMatchedServer` (its chunk codes
            number the IDs; new ones get new codes).
        turns: S lists of :class:`~mapmatched_torch.core.models.ScoredCandidate`, at most
            ``width`` each.
        width: K, the columns.

    Returns:
        ``(codes (S, K) long, raw (S, K) float64)``: chunk codes in list order then -1,
        their scores then 0.0.
    """
    codes = torch.full((len(turns), width), -1, dtype=torch.long)
    raw = torch.zeros((len(turns), width), dtype=torch.float64)
    for row, candidates in enumerate(turns):
        codes[row, : len(candidates)] = torch.tensor(server.store.codes.codes([c.chunk_id for c in candidates]))
        raw[row, : len(candidates)] = torch.tensor([c.score for c in candidates], dtype=torch.float64)
    return codes, raw


#: Device names the device-generic tests run on (CUDA ones skip without a GPU).
DEVICES = ("cpu", "cuda")


def device_available(device: str) -> bool:
    """Whether tests can run on ``device`` (``"cpu"`` always; ``"cuda"`` with a GPU)."""
    return device == "cpu" or (device == "cuda" and torch.cuda.is_available())


class RandomTrellis(NamedTuple):
    """A random padded batch.

    Attributes:
        emissions: ``(B, T, M)`` scores (use as weighted emissions or as normalized
            scores); ``fill`` at masked candidates.
        distances: ``(B, T-1, M, M)`` raw nonnegative distances ``[b, t, from, to]``;
            ``fill`` where a move touches a masked candidate.
        mask: ``(B, T, M)`` bool; real turns first, holes inside turns.
    """

    emissions: Tensor
    distances: Tensor
    mask: Tensor


def _copy_ties(values: Tensor, tie_prob: float, generator: torch.Generator) -> Tensor:
    """Replace entries (prob ``tie_prob``) by another entry of the same last-axis row."""
    width = values.shape[-1]
    source = torch.randint(0, width, values.shape, generator=generator)
    copied = values.gather(-1, source)
    return torch.where(torch.rand(values.shape, generator=generator) < tie_prob, copied, values)


def random_trellis(
    batch: int,
    turns: int,
    candidates: int,
    *,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float64,
    device: Union[str, torch.device] = "cpu",
    integer: bool = False,
    tie_prob: float = 0.25,
    pad: bool = True,
    fill: float = float("nan"),
) -> RandomTrellis:
    """A random batch of trellises with exact ties and padding.

    Values are drawn on the CPU from ``generator`` (reproducible on any device) and then
    moved to ``device``.

    Args:
        batch, turns, candidates: B, T, M.
        generator: a CPU ``torch.Generator`` (a fresh seed-0 one when None).
        dtype, device: of the float outputs.
        integer: integer-valued emissions in [-3, 3] and distances in [0, 4] (exact
            arithmetic: brute-force paths then match the DP), else normal emissions
            (std 2) and uniform [0, 3) distances.
        tie_prob: probability that an emission copies another candidate's of the same
            turn, and a distance another of the same source row.
        pad: random lengths in [1, T] and random holes (>= 1 real candidate per real
            turn); else every candidate is real.
        fill: the value written at masked positions (NaN by default: padding must never
            be read).

    Returns:
        :class:`RandomTrellis`.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    shape = (batch, turns, candidates)
    if integer:
        emissions = torch.randint(-3, 4, shape, generator=generator).to(torch.float64)
        distances = torch.randint(0, 5, (batch, turns - 1, candidates, candidates), generator=generator)
        distances = distances.to(torch.float64)
    else:
        emissions = 2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)
        distances = 3.0 * torch.rand((batch, turns - 1, candidates, candidates), generator=generator, dtype=torch.float64)
    emissions = _copy_ties(emissions, tie_prob, generator)
    distances = _copy_ties(distances.transpose(-1, -2), tie_prob, generator).transpose(-1, -2)
    if pad:
        lengths = torch.randint(1, turns + 1, (batch,), generator=generator)
        mask = torch.rand(shape, generator=generator) < 0.7
        keep = torch.randint(0, candidates, (batch, turns), generator=generator)
        mask |= torch.nn.functional.one_hot(keep, candidates).bool()
        mask &= (torch.arange(turns) < lengths.unsqueeze(1)).unsqueeze(2)
    else:
        mask = torch.ones(shape, dtype=torch.bool)
    emissions = torch.where(mask, emissions, fill)
    pairs = mask[:, :-1, :, None] & mask[:, 1:, None, :]
    distances = torch.where(pairs, distances, fill)
    return RandomTrellis(emissions.to(device, dtype), distances.to(device, dtype), mask.to(device))


@contextlib.contextmanager
def fused_kernels_off() -> Iterator[None]:
    """Run the block on the torch path (the fused kernels off), restoring the setting after."""
    from .kernels.backend import use_backend

    with use_backend("torch"):
        yield


#: The ways :func:`broken_trellis` breaks a trellis (each one a check of the decoders).
BREAKAGES = ("nan_emission", "inf_transition", "nan_transition", "empty_first_turn", "gap", "overflow")


def broken_trellis(breakage: Optional[str]) -> Tuple[Tensor, Tensor, Tensor]:
    """A (3, 4, 2) float32 trellis ``(emissions, transitions, mask)`` broken one way.

    Args:
        breakage: one of :data:`BREAKAGES`: a NaN emission at a real candidate, a -inf
            or NaN transition between real candidates, an empty first turn, a real turn
            after an empty one, or emissions so large (3e38) that a forward score
            overflows; or None (intact).

    Returns:
        Zero emissions and transitions, every candidate real, except for the breakage.
    """
    emissions = torch.zeros(3, 4, 2)
    transitions = torch.zeros(3, 3, 2, 2)
    mask = torch.ones(3, 4, 2, dtype=torch.bool)
    if breakage == "nan_emission":
        emissions[1, 2, 1] = float("nan")
    elif breakage == "inf_transition":
        transitions[2, 1, 0, 1] = -float("inf")
    elif breakage == "nan_transition":
        transitions[0, 2, 1, 0] = float("nan")
    elif breakage == "empty_first_turn":
        mask[1, 0] = False
    elif breakage == "gap":
        mask[2, 1] = False
    elif breakage == "overflow":
        emissions[1, :, :] = 3e38
    elif breakage is not None:
        raise ValueError(f"breakage must be one of {BREAKAGES}, got {breakage!r}")
    return emissions, transitions, mask


class BruteForce(NamedTuple):
    """What :func:`enumerate_paths` finds for one conversation (all in float64).

    Attributes:
        score: the best path score (left folds ``(s + trans) + e``).
        path: the best path by the Viterbi tie rule, one index per real turn.
        log_partition: logsumexp of all path scores.
        marginals: ``(T, M)`` float64 posterior marginals, 0 at padding.
        path_count: how many paths were enumerated.
    """

    score: float
    path: Tuple[int, ...]
    log_partition: float
    marginals: Tensor
    path_count: int


def _path_score(emissions: List[List[float]], transitions: List[List[List[float]]], path: Tuple[int, ...]) -> float:
    score = emissions[0][path[0]]
    for t in range(1, len(path)):
        score = (score + transitions[t - 1][path[t - 1]][path[t]]) + emissions[t][path[t]]
    return score


def enumerate_paths(emissions: Tensor, transitions: Tensor, mask_b: Tensor) -> BruteForce:
    """Score every path of ONE conversation (tiny inputs only: prod of turn sizes paths).

    Args:
        emissions: ``(T, M)`` weighted emissions.
        transitions: ``(T-1, M, M)`` weighted transitions ``[t, from, to]``.
        mask_b: ``(T, M)`` bool; real turns first, each with >= 1 candidate. Lock a turn
            by masking all but one candidate.

    Returns:
        :class:`BruteForce`. Cost: O(T * prod_t |S_t|) Python operations.
    """
    mask_list = mask_b.tolist()
    length = sum(1 for row in mask_list if any(row))
    if length == 0 or any(not any(row) for row in mask_list[:length]):
        raise ValueError("enumerate_paths needs a conversation with real turns first")
    values = emissions.detach().to("cpu", torch.float64).tolist()
    moves = transitions.detach().to("cpu", torch.float64).tolist()
    options = [[m for m, real in enumerate(row) if real] for row in mask_list[:length]]
    scored = [(path, _path_score(values, moves, path)) for path in itertools.product(*options)]
    best = max(score for _, score in scored)
    best_path = min((path for path, score in scored if score == best), key=lambda path: path[::-1])
    log_z = best + math.log(math.fsum(math.exp(score - best) for _, score in scored))
    marginals = torch.zeros(mask_b.shape, dtype=torch.float64)
    for path, score in scored:
        weight = math.exp(score - log_z)
        for t, m in enumerate(path):
            marginals[t, m] += weight
    return BruteForce(best, best_path, log_z, marginals, len(scored))


def random_slot_run(backend: str, dtype: torch.dtype, lag: Optional[int], beta: float, seed: int, *,
                    width: int = 5, slots: int = 6, turns: int = 7, device: Union[str, torch.device] = "cpu",
                    learned: Optional[str] = None):
    """Every step output and the final state of a random :class:`~mapmatched_torch.kernels.slot_decoder.SlotDecoder`
    run on the kernel ``backend`` (:func:`~mapmatched_torch.kernels.backend.use_backend`'s names): random subsets of
    slots step each turn, with exact ties (integer scores and distances) in about a third of the turns, an
    overflowing row now and then, and slots released and reallocated. Two backends' runs must be equal bit for bit.
    ``learned``: ``"gated"`` or ``"calibrated"`` decodes with a random
    :class:`~mapmatched_torch.kernels.transitions.GatedTransitions` of beta ``beta`` (a gate on one random
    feature per move; ``"calibrated"`` also saturates the distances) in place of the fixed model, and each
    output also holds the learned costs along the paths.

    Returns:
        ``(outputs, tensors)``: one tuple of :class:`~mapmatched_torch.kernels.slot_decoder.SlotStep` tensors per
        turn, and the decoder's ``state_dict()["tensors"]`` at the end.
    """
    import random

    from .kernels.backend import use_backend
    from .kernels.slot_decoder import SlotDecoder
    from .kernels.transitions import GatedTransitions

    with use_backend(backend):
        rng = random.Random(seed)
        generator = torch.Generator().manual_seed(seed)
        model = None
        if learned is not None:
            model = GatedTransitions(beta, num_features=1, calibrate=learned == "calibrated", cap=1.5, device=device)
            with torch.no_grad():
                model.gate_bias.fill_(rng.uniform(-1.0, 1.0))
                model.gate_weights.fill_(rng.uniform(-2.0, 2.0))
        decoder = SlotDecoder(width, transition_weight=beta, fixed_lag=lag, capacity=2, dtype=dtype, device=device,
                              transitions=model)
        table = [decoder.allocate() for _ in range(slots)]
        outputs = []
        for _ in range(turns):
            picked = torch.tensor(sorted(rng.sample(table, rng.randint(1, slots))))
            count = picked.shape[0]
            mask = torch.rand(count, width, generator=generator) < 0.7
            mask[:, 0] |= ~mask.any(1)
            if rng.random() < 0.3:  # exact ties: integer scores and distances
                scores = torch.randint(-2, 3, (count, width), generator=generator).double()
                distances = torch.randint(0, 3, (count, width, width), generator=generator).double()
            else:
                scores = torch.randn(count, width, generator=generator, dtype=torch.float64)
                distances = torch.rand(count, width, width, generator=generator, dtype=torch.float64) * 3
            if rng.random() < 0.1:  # an overflowing row
                scores[0] = 1e308 if dtype == torch.float64 else 1e38
            if model is None:
                step = decoder.step(picked.to(device), scores.to(device), mask.to(device), distances.to(device))
                outputs.append(tuple(step))
            else:
                features = torch.randn(count, width, 1, generator=generator, dtype=torch.float64)
                step = decoder.step(picked.to(device), scores.to(device), mask.to(device), distances.to(device),
                                    features=features.to(device))
                outputs.append(tuple(step) + (decoder.path_costs(picked.to(device), step.paths),))
            if rng.random() < 0.2:
                released = rng.choice(table)
                decoder.release(released)
                table[table.index(released)] = decoder.allocate()
        return outputs, decoder.state_dict()["tensors"]


class HostReads:
    """What :func:`record_host_reads` saw: one ``(operation, where)`` per host read."""

    def __init__(self) -> None:
        self.reads: List[Tuple[str, str]] = []
        #: the devices of every tensor the block's operations read or made
        self.devices: set = set()

    def __bool__(self) -> bool:
        return bool(self.reads)

    def __str__(self) -> str:
        return "\n".join(f"{operation} at {where}" for operation, where in self.reads) or "no host reads"


#: Tensor methods that read a tensor's values on the host (or copy it there).
_HOST_METHODS = frozenset({
    "tolist", "numpy", "item", "cpu", "__bool__", "__int__", "__float__", "__index__", "__len__", "__iter__",
    "__array__", "__format__", "__repr__",
})
#: aten operations that synchronize with the host: a scalar read, or an output whose shape depends on values.
_HOST_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::unique",
    "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::repeat_interleave",
    "aten::equal", "aten::is_nonzero",
})


@contextlib.contextmanager
def record_host_reads() -> Iterator[HostReads]:
    """Record every operation in the block that reads tensor values back to the host:
    ``.item()``, ``bool(tensor)``, ``int(tensor)``, ``.tolist()``, ``.numpy()``, ``.cpu()``
    and ``.to("cpu")``, and the aten operations whose output shape depends on values
    (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ...).

    On the CPU nothing synchronizes, so these reads cost little; on a GPU each one
    waits for the device. A step that records none can run ahead of the host and be
    captured in a CUDA graph. Only Python-level tensor calls and dispatched operations
    are seen (a C++ extension reading memory directly is not). ``devices`` collects the
    device of every tensor the block's operations touched (residency checks).

    Example:
        >>> import torch
        >>> with record_host_reads() as reads:
        ...     _ = torch.ones(3).sum() * 2
        >>> bool(reads)
        False
        >>> with record_host_reads() as reads:
        ...     _ = torch.ones(3)[torch.tensor([True, False, True])]
        >>> [operation for operation, _ in reads.reads]
        ['aten::index']
    """
    import traceback

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    found = HostReads()

    def where() -> str:
        frames = [frame for frame in traceback.extract_stack()[:-3] if "mapmatched_torch" in frame.filename
                  and not frame.filename.endswith("testing.py")]
        return f"{frames[-1].filename.rsplit('mapmatched_torch/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            to_host = name == "to" and any(
                (isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu")
                for value in list(args[1:]) + [kwargs.get("device")] if value is not None
                and isinstance(value, (str, torch.device))
            ) and isinstance(args[0], Tensor) and args[0].device.type != "cpu"
            if name in _HOST_METHODS or to_host:
                found.reads.append((f"Tensor.{name}", where()))
            return func(*args, **kwargs)

    def masks(indices: object) -> bool:
        return isinstance(indices, (list, tuple)) and any(
            isinstance(index, Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices
        )

    class Operations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            # boolean-mask indexing runs nonzero inside the operation
            if name in _HOST_OPS or (name.startswith("aten::index") and len(args) > 1 and masks(args[1])):
                found.reads.append((name, where()))
            result = func(*args, **(kwargs or {}))
            for value in list(args) + list((kwargs or {}).values()) + [result]:
                for tensor in (value if isinstance(value, (list, tuple)) else (value,)):
                    if isinstance(tensor, Tensor):
                        found.devices.add(tensor.device)
            return result

    with Functions(), Operations():
        yield found
