"""Runtime back-ends: the choice, the CPU back-end's overrides, and CPU emulation on a machine
that has GPUs (it makes the process CPU-only, or refuses once CUDA is in use)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_hybrid.runtime import RuntimeBackend, select_backend


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=240
    )


@pytest.mark.parametrize(
    ("name", "match"),
    [("gpu", r"unknown runtime back-end 'gpu'; choose one of auto, cuda, cpu"), ("", "unknown")],
    ids=["misspelt", "empty"],
)
def test_an_unknown_backend_is_refused(name, match):
    with pytest.raises(ValueError, match=match):
        select_backend(name)


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a visible GPU"):
        select_backend("cuda")
    assert select_backend("auto") == RuntimeBackend("cpu")


def test_auto_picks_cuda_where_a_gpu_is_visible(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_backend("auto") == select_backend("cuda") == RuntimeBackend("cuda")


def test_only_the_cpu_backend_overrides_the_config():
    cpu, cuda = RuntimeBackend("cpu").config_overrides(), RuntimeBackend("cuda").config_overrides()
    assert cuda == {}
    assert cpu["use_cpu_initialization"] is True and cpu["gradient_accumulation_fusion"] is False


# A machine with an unused GPU, as torch reports it before CUDA is initialised.
_FAKE_GPU = (
    "import torch; "
    "torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1; "
    "torch.cuda.is_initialized = lambda: {initialized}; "
    "from megatron_hybrid.runtime import select_backend; "
)


def test_cpu_emulation_makes_a_gpu_machine_cpu_only():
    result = _run(
        _FAKE_GPU.format(initialized=False)
        + "select_backend('cpu').activate(); "
        + "print(torch.cuda.is_available(), torch.cuda.device_count(), select_backend().name)"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "0", "cpu"]


def test_cpu_emulation_refuses_once_cuda_is_in_use():
    """Negative control of the test above: with CUDA initialised the streams are real."""
    result = _run(_FAKE_GPU.format(initialized=True) + "select_backend('cpu').activate()")
    assert result.returncode != 0
    assert "CPUEmulationError" in result.stderr and "already used CUDA" in result.stderr


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        pytest.param({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, id="unset"),
        pytest.param({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": ""},
                     id="empty-keeps-torch-default"),
        pytest.param({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"},
                     {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}, id="users-own"),
    ],
)  # fmt: skip
def test_expandable_segments_unless_the_environment_chooses(environ, expected):
    from megatron_hybrid.runtime import prefer_expandable_segments

    changed = dict(environ)
    assert prefer_expandable_segments(changed) == (not environ)
    assert changed == expected
