"""Distributed evaluation: sharding, environment detection, and a 2-process gloo run vs one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mapmatched_torch.cli import main
from mapmatched_torch.core.errors import MapMatchedValueError
from mapmatched_torch.eval import distributed
from mapmatched_torch.eval.distributed import gather_to_all, gather_to_main, local_device, shard, torchrun_environment

from ..distributed_workers import run_ranks

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("batch, world", [(0, 1), (1, 3), (7, 2), (10, 3), (40, 2), (5, 5)])
def test_shards_are_balanced_contiguous_and_cover_every_conversation_in_order(batch, world):
    blocks = [shard(batch, r, world) for r in range(world)]
    assert [i for block in blocks for i in range(block.start, block.stop)] == list(range(batch))
    sizes = [block.stop - block.start for block in blocks]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("batch, rank, world", [(-1, 0, 1), (4, 2, 2), (4, -1, 2), (4, 0, 0)])
def test_a_bad_shard_request_names_its_numbers(batch, rank, world):
    with pytest.raises(MapMatchedValueError, match=f"batch={batch}, rank={rank}, world_size={world}"):
        shard(batch, rank, world)


def test_torchrun_environment_needs_every_variable():
    assert torchrun_environment(TORCHRUN)
    for name in TORCHRUN:
        assert not torchrun_environment({k: v for k, v in TORCHRUN.items() if k != name}), name
    assert not torchrun_environment(dict(TORCHRUN, MASTER_PORT=" "))


def test_a_plain_run_joins_no_process_group(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")  # a partial environment is not torchrun's
    assert distributed.init_from_environment("cpu") is False
    assert not distributed.is_distributed()
    assert (distributed.rank(), distributed.world_size()) == (0, 1)
    assert gather_to_main({"x": 1}) == [{"x": 1}]


def test_cuda_without_an_index_becomes_the_local_rank_only_under_torchrun(monkeypatch):
    for name, value in dict(TORCHRUN, LOCAL_RANK="1").items():
        monkeypatch.setenv(name, value)
    assert local_device("cuda") == torch.device("cuda", 1)
    assert local_device("cuda:0") == torch.device("cuda", 0)
    assert local_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("MASTER_ADDR")
    assert local_device("cuda") == torch.device("cuda")


def test_a_bad_rank_variable_is_an_input_error(monkeypatch):
    for name, value in dict(TORCHRUN, LOCAL_RANK="x").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MapMatchedValueError, match="LOCAL_RANK='x'"):
        local_device("cuda")


def _without_timings(path: Path) -> dict:
    report = json.loads(path.read_text())
    report.pop("timings")
    report.pop("world_size")
    return report


def _report_text(path: Path) -> str:
    """The JSON report's text without its timings and world size (sorted keys, as written)."""
    return json.dumps(_without_timings(path), sort_keys=True, indent=2)


def test_two_gloo_processes_write_the_one_process_report(tmp_path, monkeypatch):
    # 81 conversations: an odd split (40 + 41) across the chunk loop; 5 turns x 16 candidates make
    # the fits' gradient reductions (40 x 4 x 16 x 16 moves and more) larger than torch's grain size,
    # so they would be split over this process's threads (the ranks run on one thread each)
    small = ["eval", "--conversations", "81", "--turns", "5", "--candidates", "16", "--bootstrap", "40", "--quiet",
             "--betas", "0,0.5,2", "--lags", "full,1"]
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # the one-process run on more than one thread
    try:
        assert main([*small, "--json", str(tmp_path / "one.json"), "--markdown", str(tmp_path / "one.md")]) == 0
    finally:
        torch.set_num_threads(threads)

    outputs = run_ranks(lambda rank: [sys.executable, "-m", "mapmatched_torch", *small, "--json",
                                       str(tmp_path / "two.json"), "--markdown", str(tmp_path / "two.md")])
    assert outputs[1][0] == ""  # rank 1 prints nothing: rank 0 reports
    assert outputs[0][0] == (tmp_path / "one.md").read_text() == (tmp_path / "two.md").read_text()

    two = json.loads((tmp_path / "two.json").read_text())
    assert two["world_size"] == 2 and "gather" in two["timings"]  # the shards really travelled
    assert json.loads((tmp_path / "one.json").read_text())["world_size"] == 1
    assert _report_text(tmp_path / "two.json") == _report_text(tmp_path / "one.json")  # byte for byte


def test_without_a_group_gather_to_all_returns_the_value_alone():
    assert gather_to_all(("keys", 2)) == [("keys", 2)]
