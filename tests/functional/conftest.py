"""GPU functional tests: run under torchrun, one process per GPU, NCCL.

    torchrun --nproc_per_node 2 -m pytest -q tests/functional     # in-process tests
    pytest -q -m launcher tests/functional                          # tests that start torchrun

Without GPUs (or outside torchrun) every test here is skipped with the reason. For checking the
test logic on a CPU machine, ``MH_FUNCTIONAL_ON_CPU=1`` runs them on gloo with megatron-core's
CUDA calls emulated (numerics only; timings and NCCL are not exercised).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from megatron_hybrid.testing.overlap import rel_error

ON_CPU = os.environ.get("MH_FUNCTIONAL_ON_CPU") == "1"


def _autotune_first_config_only() -> None:
    """``MH_TRITON_ONE_CONFIG=1``: Triton's autotuners take their first (pruned) config untimed.

    A fresh GPU machine compiles and times every config of every fla kernel on first use
    (minutes of device time); correctness tests do not depend on which valid config runs, only
    speed does, so benchmarks never set this. Every timing then ties, and the autotuner keeps the
    first config that its own pruning left, compiling only that one.
    """
    if os.environ.get("MH_TRITON_ONE_CONFIG") != "1":
        return
    import triton.runtime.autotuner as autotuner

    autotuner.Autotuner._bench = lambda self, *args, config, **kwargs: [0.0, 0.0, 0.0]


_autotune_first_config_only()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "launcher: starts its own torchrun jobs; run with plain pytest, not torchrun"
    )


def pytest_collection_modifyitems(config, items):
    under_torchrun = "WORLD_SIZE" in os.environ
    no_gpu = not ON_CPU and not torch.cuda.is_available()
    for item in items:
        launcher = item.get_closest_marker("launcher") is not None
        if no_gpu:
            reason = "functional tests need CUDA GPUs"
        elif launcher and under_torchrun:
            reason = "launches its own torchrun jobs: run it with plain pytest"
        elif not launcher and not under_torchrun:
            reason = "runs under torchrun (torchrun --nproc_per_node N -m pytest ...)"
        else:
            continue
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def world():
    """The process group of this torchrun job: ``(rank, world_size, device)``."""
    import torch.distributed as dist

    if ON_CPU:
        from megatron_hybrid.runtime.cpu import enable_cpu_emulation

        enable_cpu_emulation()
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        device = torch.device("cuda", torch.cuda.current_device())
    yield dist.get_rank(), dist.get_world_size(), device
    from megatron_hybrid.process_groups import reset_megatron_state

    reset_megatron_state()
    dist.destroy_process_group()


@pytest.fixture
def shared_dir(world, tmp_path_factory):
    """A directory every rank of this (single-host) job sees: rank 0's temporary folder."""
    import torch.distributed as dist

    path = [str(tmp_path_factory.mktemp("shared")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return path[0]


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 off in cuBLAS and cuDNN, so float32 references are float32 (cuDNN defaults to TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def report(title: str, rows: list[tuple]) -> None:
    """Print a small table on rank 0 (pytest -s shows it; logs keep it)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return
    print(f"\n== {title}")
    for row in rows:
        print("   " + " | ".join(str(c) for c in row))


#: Experts per MoE layer of the shared small configs (``megatron_hybrid.testing.models``).
NUM_EXPERTS = 4


def layout_fits(world_size: int, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                cp: int = 1) -> bool:  # fmt: skip
    """Whether ``world_size`` ranks can host the layout (megatron-core's divisibility rules)."""
    etp = tp if etp is None else etp
    return (
        world_size % (tp * pp * cp) == 0
        and world_size % (etp * ep * pp) == 0
        and NUM_EXPERTS % ep == 0
    )


def require_ep_overlap(world_size: int) -> None:
    """Skip unless EP = ``world_size`` can overlap: EP >= 2 dividing the experts."""
    if world_size < 2 or NUM_EXPERTS % world_size:
        pytest.skip(
            f"EP overlap runs EP = world size, which must be >= 2 and divide the {NUM_EXPERTS} "
            f"experts; this job has {world_size} rank(s) (run on 2 or 4 GPUs)"
        )


# The model sizes the checkpoint and TE tests share.
TEST_SIZES = dict(hidden_size=128, num_attention_heads=8, ffn_hidden_size=256)


def bf16_config(pattern: str, **changes):
    """The small bf16 model config of the checkpoint and TE tests (:data:`TEST_SIZES`)."""
    from megatron_hybrid.testing.models import small_config

    return small_config(
        pattern, **TEST_SIZES, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, **changes,
    )  # fmt: skip


def device_inputs(device, **kwargs) -> dict:
    """``model_inputs(**kwargs)`` with its tensors on ``device``."""
    from megatron_hybrid.testing.models import model_inputs

    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in model_inputs(**kwargs).items()}


def max_rel_diff(actual: dict, reference: dict) -> float:
    """Largest :func:`rel_error` over the tensors of two same-keyed dicts."""
    assert actual.keys() == reference.keys() and actual
    return max(rel_error(actual[k], r) for k, r in reference.items())
