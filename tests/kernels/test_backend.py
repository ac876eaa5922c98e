"""The one kernel switch: names, scoping, the environment variable, missing extras."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mapmatched_torch.core import optional
from mapmatched_torch.core.errors import MapMatchedValueError, MissingDependencyError
from mapmatched_torch.kernels import backend, use_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_default_is_auto_numba_on_cpu_where_installed():
    assert backend.current_backend() == "auto"
    expected = "numba" if optional.has_module("numba") else None
    assert backend.backend_for(CPU) == expected


def test_torch_turns_every_kernel_off_and_restores_on_exit():
    with use_backend("torch") as chosen:
        assert isinstance(chosen, use_backend)
        assert backend.current_backend() == "torch"
        assert backend.backend_for(CPU) is None and backend.backend_for(CUDA) is None
    assert backend.current_backend() == "auto"


def test_plain_call_sets_the_backend_for_the_process():
    try:
        use_backend("torch")
        assert backend.current_backend() == "torch"
    finally:
        use_backend("auto")
    assert backend.current_backend() == "auto"


def test_numba_runs_on_cpu_tensors_only():
    pytest.importorskip("numba")
    with use_backend("numba"):
        assert backend.backend_for(CPU) == "numba"
        assert backend.backend_for(CUDA) is None  # numba has no CUDA kernels here: the torch path


def test_triton_runs_on_every_device_and_nests():
    pytest.importorskip("triton")
    with use_backend("triton"):
        assert backend.backend_for(CPU) == "triton" and backend.backend_for(CUDA) == "triton"
        with use_backend(" Torch "):
            assert backend.backend_for(CPU) is None
        assert backend.current_backend() == "triton"


@pytest.mark.parametrize("name", ["cuda", "", None, 3])
def test_unknown_names_are_refused_and_nothing_changes(name):
    with pytest.raises(MapMatchedValueError, match="unsupported kernel backend"):
        use_backend(name)
    assert backend.current_backend() == "auto"


@pytest.mark.parametrize("module", ["triton", "numba"])
def test_a_missing_extra_is_named_and_nothing_changes(monkeypatch, module):
    monkeypatch.setitem(optional._PROBED, module, ImportError(f"No module named '{module}'"))
    with pytest.raises(MissingDependencyError, match=rf"mapmatched-torch\[{module}\]"):
        use_backend(module)
    assert backend.current_backend() == "auto"
    if module == "triton":
        assert backend.backend_for(CUDA) is None  # auto without triton: the torch path on a GPU
    else:
        assert backend.backend_for(CPU) is None  # auto without numba: the torch path on the CPU


def _backend_in_subprocess(**environment):
    env = {key: value for key, value in os.environ.items()
           if key not in ("MAPMATCHED_TORCH_KERNELS", "MAPMATCHED_TORCH_FUSED")}
    env.update(environment)
    code = "from mapmatched_torch.kernels import current_backend; print(current_backend())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_variable_and_the_legacy_off_switch():
    assert _backend_in_subprocess(MAPMATCHED_TORCH_KERNELS="torch").stdout.strip() == "torch"
    assert _backend_in_subprocess(MAPMATCHED_TORCH_FUSED="0").stdout.strip() == "torch"
    assert _backend_in_subprocess().stdout.strip() == "auto"
    bad = _backend_in_subprocess(MAPMATCHED_TORCH_KERNELS="gpu")
    assert bad.returncode != 0
    assert "MAPMATCHED_TORCH_KERNELS: unsupported kernel backend: gpu (expected one of 'auto'" in bad.stderr
