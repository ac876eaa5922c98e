"""Run a command as the ranks of a small torchrun-like job (the environment torchrun sets)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(command: Callable[[int], Sequence[str]], world_size: int = 2, timeout: float = 120) -> List[Tuple[str, str]]:
    """Run ``command(rank)`` for every rank at once with torchrun's variables set
    (MASTER_ADDR 127.0.0.1, a free port, one thread each); returns each rank's
    (stdout, stderr) after asserting that every rank exited 0."""
    port = str(free_port())
    workers = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
        workers.append(subprocess.Popen(list(command(rank)), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for worker in workers:
            outputs.append(worker.communicate(timeout=timeout))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    for worker, (_, err) in zip(workers, outputs):
        assert worker.returncode == 0, err
    return outputs
