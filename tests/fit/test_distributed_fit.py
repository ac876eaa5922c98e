"""Sharded ``fit_weights`` and ``mapmatched-torch fit`` under 2 gloo processes equal a one-process fit exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mapmatched_torch.cli import main
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.fit import fit_weights
from mapmatched_torch.fit.sampling import sample_conversations

from ..distributed_workers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: 47 conversations in batches of 5: 8 training batches (an uneven split of the
#: validation batches too), so every rank holds some and the exchange is exercised
OPTIONS = {
    "lbfgs": {"batch_size": 5, "max_iterations": 6, "l2": 0.01, "seed": 2},
    "adam": {"batch_size": 5, "max_iterations": 3, "optimizer": "adam", "seed": 2},
}

WORKER = """
import json, sys, torch
from mapmatched_torch.fit import fit_weights
from mapmatched_torch.fit.sampling import sample_conversations
torch.distributed.init_process_group("gloo")
exchanges = []
gather = torch.distributed.all_gather_object
torch.distributed.all_gather_object = lambda *args: exchanges.append(1) or gather(*args)
data = sample_conversations(47, 3, 4, emission_weight=1.5, transition_weight=0.7,
                            generator=torch.Generator().manual_seed(5))
results = {name: fit_weights(data.conversations, data.graph, progress=False, **options)
           for name, options in json.loads(sys.argv[2]).items()}
with open(sys.argv[1], "w") as out:
    json.dump({"exchanges": len(exchanges), **{name: [r.history, r.validation_ndcg_before,
               r.validation_ndcg_after, r.stopped] for name, r in results.items()}}, out)
# both ranks are done before either tears gloo down: a rank leaving while its peer's last
# exchange is still closing can abort the peer ("terminate called without an active exception")
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


def _run_two(tmp_path: Path, command) -> list:
    """Run ``command(rank)`` as ranks 0 and 1 of a 2-process job; returns their (stdout, stderr)."""
    return run_ranks(command)


def _unset_torchrun(monkeypatch) -> None:
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)


def test_two_gloo_ranks_fit_exactly_the_one_process_weights(tmp_path, monkeypatch):
    _unset_torchrun(monkeypatch)
    data = sample_conversations(47, 3, 4, emission_weight=1.5, transition_weight=0.7,
                                generator=torch.Generator().manual_seed(5))
    one = {name: fit_weights(data.conversations, data.graph, progress=False, **options)
           for name, options in OPTIONS.items()}
    _run_two(tmp_path, lambda rank: [sys.executable, "-c", WORKER, str(tmp_path / f"rank{rank}.json"),
                                     json.dumps(OPTIONS)])
    for rank in range(2):
        sharded = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sharded.pop("exchanges") > 0  # the ranks really shared their batches' values
        for name, result in one.items():
            history, ndcg_before, ndcg_after, stopped = sharded[name]
            # every rank took the one-process steps: weights, losses and nDCG bit for bit
            assert [tuple(step) for step in history] == [tuple(step) for step in result.history], (rank, name)
            assert history[-1][3:] != history[0][3:]  # the weights moved
            assert (ndcg_before, ndcg_after, stopped) == (
                result.validation_ndcg_before, result.validation_ndcg_after, result.stopped)


def test_the_fit_command_under_two_gloo_ranks_writes_the_one_process_weights(tmp_path, monkeypatch):
    _unset_torchrun(monkeypatch)
    arguments = ["fit", "--conversations", "12", "--turns", "3", "--candidates", "6", "--quiet"]
    assert main([*arguments, "--output", str(tmp_path / "one.json")]) == 0
    outputs = _run_two(tmp_path, lambda rank: [sys.executable, "-m", "mapmatched_torch", *arguments,
                                               "--output", str(tmp_path / "two.json")])
    assert outputs[1] == ("", "")  # rank 1 fits silently; rank 0 writes
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert (one.pop("world_size"), two.pop("world_size")) == (1, 2)
    assert two == one


@pytest.mark.parametrize("value, message", [(True, "distributed=True needs an initialized"),
                                            ("yes", "distributed must be None")])
def test_distributed_without_a_process_group_or_of_a_bad_type_is_refused(value, message):
    data = sample_conversations(4, 2, 3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(MapMatchedValueError, match=message):
        fit_weights(data.conversations, data.graph, progress=False, distributed=value)
