"""Distributed evaluation under ``torchrun``: environment detection, process group, sharding, gathering.

``torchrun --nproc-per-node N -m mapmatched_torch eval ...`` starts N processes with
the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``). :func:`init_from_environment` joins them in a process group (gloo
on CPU, NCCL on CUDA) only when that environment is present, so a plain run never
touches ``torch.distributed``. :func:`evaluate <mapmatched_torch.eval.runner.evaluate>`
then decodes and scores only :func:`shard` of the conversations on each rank and
:func:`gather_to_main` brings the per-turn metrics to rank 0 (one method at a
time), which runs the bootstrap and writes the report. With an input stream
(:class:`~mapmatched_torch.eval.inputs.SyntheticInputStream`) each rank also draws
only its own shard's conversations, chunk by chunk.

Sharding is by contiguous balanced blocks of conversations in input order (rank r
gets ``[r * B // W, (r + 1) * B // W)``), so concatenating the gathered per-turn
tensors in rank order restores the one-process order exactly: every per-turn
computation is per conversation, hence the report equals a one-process run except
for its timings and ``world_size``.

Example:
    >>> shard(10, rank=1, world_size=3)
    slice(3, 6, None)
    >>> [shard(2, rank=r, world_size=3) for r in range(3)]
    [slice(0, 0, None), slice(0, 1, None), slice(1, 2, None)]
"""

from __future__ import annotations

import os
from typing import Any, List, Mapping, Optional, Union

import torch

from ..core.errors import MapMatchedRuntimeError, MapMatchedValueError
from ..core.sharding import shard  # noqa: F401  (public here too: the conversations' shards)

__all__ = [
    "TORCHRUN_VARIABLES",
    "torchrun_environment",
    "init_from_environment",
    "destroy",
    "is_distributed",
    "rank",
    "world_size",
    "local_device",
    "shard",
    "gather_to_main",
    "gather_to_all",
    "main_process",
]

#: The variables torchrun (and ``torch.distributed.launch``) set in every worker.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_environment(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether every variable of :data:`TORCHRUN_VARIABLES` is set (non-empty).

    Args:
        environ: the environment (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    return all(environ.get(name, "").strip() for name in TORCHRUN_VARIABLES)


def _environment_int(name: str) -> int:
    text = os.environ.get(name, "").strip()
    try:
        return int(text)
    except ValueError:
        raise MapMatchedValueError(f"the torchrun variable {name}={text!r} is not an integer: "
                                   "launch with torchrun, or unset the variable for a plain run") from None


def local_device(device: Union[str, torch.device]) -> torch.device:
    """The device of this worker: ``cuda`` without an index becomes ``cuda:LOCAL_RANK`` under torchrun.

    A device with an index, a CPU device, or a plain run is returned unchanged.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torchrun_environment():
        return torch.device("cuda", _environment_int("LOCAL_RANK"))
    return device


def init_from_environment(device: Union[str, torch.device]) -> bool:
    """Join torchrun's process group when its environment is present; returns whether this call did.

    The backend is NCCL for a CUDA ``device`` (which becomes the current CUDA
    device) and gloo otherwise. Without torchrun's environment, or when a group is
    already initialized, nothing happens (False). Pair a True with :func:`destroy`.

    Raises:
        MapMatchedRuntimeError: ``torch.distributed`` is not available in this build.
    """
    if not torchrun_environment():
        return False
    distributed = torch.distributed
    if not distributed.is_available():
        raise MapMatchedRuntimeError("torchrun's environment is set but this torch build has no torch.distributed: "
                                     "install a torch with distributed support, or run without torchrun")
    if distributed.is_initialized():
        return False
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    distributed.init_process_group(backend=backend, rank=_environment_int("RANK"),
                                   world_size=_environment_int("WORLD_SIZE"))
    return True


def destroy() -> None:
    """Leave the process group (nothing when none is initialized)."""
    if is_distributed():
        torch.distributed.destroy_process_group()


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialized."""
    distributed = torch.distributed
    return bool(distributed.is_available() and distributed.is_initialized())


def rank() -> int:
    """This process's rank in the initialized group (0 without one)."""
    return torch.distributed.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Processes in the initialized group (1 without one)."""
    return torch.distributed.get_world_size() if is_distributed() else 1


def gather_to_main(value: Any) -> Optional[List[Any]]:
    """Every rank's picklable ``value`` on rank 0, in rank order; None on the other ranks.

    Without a process group: ``[value]``. Tensors should be on the CPU (they are
    pickled); with NCCL the current CUDA device carries the exchange.
    """
    if not is_distributed():
        return [value]
    distributed = torch.distributed
    main = distributed.get_rank() == 0
    gathered: Optional[List[Any]] = [None] * distributed.get_world_size() if main else None
    distributed.gather_object(value, gathered, dst=0)
    return gathered


def gather_to_all(value: Any) -> List[Any]:
    """Every rank's picklable ``value`` on every rank, in rank order (``[value]`` without a group).

    For small values every rank must agree on (e.g. which method keys exist); bulky
    per-turn tensors go to rank 0 alone with :func:`gather_to_main`.
    """
    if not is_distributed():
        return [value]
    gathered: List[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def main_process() -> bool:
    """Whether this process should print: not a worker of a distributed job (rank 0,
    by ``torch.distributed`` when initialized, else by the ``RANK`` / ``LOCAL_RANK``
    environment variables that launchers such as torchrun set)."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank() == 0
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in ("RANK", "LOCAL_RANK"))
