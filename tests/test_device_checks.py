"""benchmarks/device_checks.sh cannot rot before a device appears: its dry run (CPU, Triton's
interpreter, tiny shapes) runs here and must pass, with parity recorded and no speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_device_checks_dry_run(tmp_path):
    pytest.importorskip("triton")
    environment = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    finished = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_checks.sh"), "--dry-run"],
        env=environment, capture_output=True, text=True, timeout=300,
    )
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "all passed" in finished.stdout
    report = json.loads((tmp_path / "gpu_targets.json").read_text())
    assert report["parity"] == {"viterbi": True, "fixed_lag_viterbi": True, "log_partition_fwd_bwd": True}
    assert report["timing"] == "interpreter: not a speed"
    assert all(rate is None for rates in report["conversations_per_s"].values() for rate in rates.values())
    assert "| 4 |" in (tmp_path / "serving.log").read_text()  # the device step ran
