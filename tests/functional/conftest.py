"""GPU functional tests: run under torchrun, one process per GPU, NCCL.

    python3 tests/functional/run_suite.py --out DIR                # the whole suite, as CI would
    torchrun --nproc_per_node 2 -m pytest -q -m "not launcher" tests/functional  # in-process
    pytest -q -m launcher tests/functional                          # tests that start torchrun

Without GPUs (or outside torchrun) every test here is skipped with the reason. For checking the
test logic on a CPU machine, ``MH_FUNCTIONAL_ON_CPU=1`` runs them on gloo with megatron-core's
CUDA calls emulated (numerics only; timings and NCCL are not exercised), the launcher tests
with ``MH_CPU_RANKS`` processes standing for GPUs. Every test has a time
limit and the ranks of a job agree on each test's outcome (``suite_guard.py``); the files that
compile the most run last, ``MH_LANE=i/n`` splits the launcher tests into lanes, and the suite
runner's in-process lanes claim files as they go, the costliest first (``suite_plan.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import hf_fixtures
import pytest
import suite_guard
import suite_plan
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


_GUARD: suite_guard.SuiteGuard | None = None


def pytest_configure(config):
    global _GUARD
    config.addinivalue_line(
        "markers", "launcher: starts its own torchrun jobs; run with plain pytest, not torchrun"
    )
    config.addinivalue_line(
        "markers", "own_job: runs only in a torchrun job of its own (MH_OWN_JOB=1), which a "
        "launcher test starts (test_training_gpu.py::test_in_process_tests_without_p2p)",
    )  # fmt: skip
    _GUARD = suite_guard.install(config, Path(__file__).parent)
    _GUARD.runs_here = suite_plan.runs_here


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A test of a file another lane claimed (``MH_LANE_BY=claim``) is passed by: not run, not
    reported (that lane reports it)."""
    if Path(item.path).resolve().is_relative_to(Path(__file__).parent.resolve()):
        if not suite_plan.runs_here(item):
            return True
    return None


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: lanes split what is left
def pytest_collection_modifyitems(config, items):
    suite_plan.order(items)
    suite_plan.keep_lane(config, items, _GUARD.limit)
    suite_guard.deselect_finished(_GUARD, config, items)
    under_torchrun = "WORLD_SIZE" in os.environ
    no_gpu = not ON_CPU and not torch.cuda.is_available()
    own_job = os.environ.get("MH_OWN_JOB") == "1"
    for item in items:
        launcher = item.get_closest_marker("launcher") is not None
        if no_gpu:
            reason = "functional tests need CUDA GPUs"
        elif launcher and under_torchrun:
            reason = "launches its own torchrun jobs: run it with plain pytest"
        elif not launcher and not under_torchrun:
            reason = "runs under torchrun (torchrun --nproc_per_node N -m pytest ...)"
        elif item.get_closest_marker("own_job") is not None and not own_job:
            reason = ("runs in a torchrun job of its own, which "
                      "test_training_gpu.py::test_in_process_tests_without_p2p starts")  # fmt: skip
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
        # A backstop under the suite guard's per-test limit: NCCL's watchdog ends a collective
        # that waits longer than this (its default is ten minutes).
        limit = float(os.environ.get("MH_TEST_TIMEOUT", suite_guard.DEFAULT_LIMIT))
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=limit + 120))
        device = torch.device("cuda", torch.cuda.current_device())
        # torchrun gives every rank one CPU thread (OMP_NUM_THREADS=1): the tests' CPU-side
        # work (reading checkpoints, references, comparisons) would crawl. A share of the cores
        # (the suite runner's in-process lanes run side by side).
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        lanes = suite_plan.parse_lane(os.environ["MH_LANE"])[1] if "MH_LANE" in os.environ else 1
        torch.set_num_threads(max(1, min(8, suite_guard.usable_cores() // (ranks_here * lanes))))
    yield dist.get_rank(), dist.get_world_size(), device
    from megatron_hybrid.process_groups import reset_megatron_state

    reset_megatron_state()
    dist.destroy_process_group()


def one_process_groups(world, cuda_reason: str, one_process_reason: str):
    """Body of a ``pg`` fixture for tests that need CUDA and a job of one process: skips with
    the reasons given, yields fresh process groups, resets megatron's state afterwards."""
    from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

    if not torch.cuda.is_available():
        pytest.skip(cuda_reason)
    if world[1] > 1:
        pytest.skip(one_process_reason)
    yield initialize_model_parallel(seed=1)
    reset_megatron_state()


@pytest.fixture(autouse=True)
def _no_model_parallel_state_after_test():
    """megatron's model-parallel state reset after each test that left it set up, so that no
    test runs under another's layout: a test that sets up TP2 + EP2 itself and keeps it
    (``test_padding_gpu.py``) made every ``load_hf_model`` of the next file in its lane refuse
    the layout it found (2 x H200, 2026-11-29). Every rank runs the same tests, and resets at the
    same point."""
    yield
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        from megatron_hybrid.process_groups import reset_megatron_state

        reset_megatron_state()


@pytest.fixture(autouse=True)
def _default_stream_after_test():
    """The default CUDA stream current again after each test: CUDA graphs move the process to a
    side stream (``schedule/graph_capture.py``, ``use_side_stream``), which later tests must not
    inherit."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream())


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


def gpu_time_us(fn, calls: int = 20) -> float:
    """Mean microseconds of ``fn`` on the current CUDA stream over ``calls`` calls, after three
    untimed ones (compilation, allocator warm-up)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


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


def require_fla_training(device) -> None:
    """Skip unless fla's GatedDeltaNet kernels can train here: a GPU, fla importable, and its
    gated backward not refused (``training.capabilities.fla_gated_backward_refused``)."""
    if device.type != "cuda":
        pytest.skip("fla's Triton kernels need a GPU")
    pytest.importorskip("fla", reason="fla's GatedDeltaNet kernels (fla-core) are not installed")
    from megatron_hybrid.training.capabilities import fla_gated_backward_refused

    refused = fla_gated_backward_refused()
    if refused is not None:
        pytest.skip(f"fla refuses GatedDeltaNet's backward here: {refused}")


# The model sizes the checkpoint and TE tests share.
TEST_SIZES = dict(hidden_size=128, num_attention_heads=8, ffn_hidden_size=256)


def bf16_config(pattern: str, **changes):
    """The small bf16 model config of the checkpoint and TE tests (:data:`TEST_SIZES`)."""
    from megatron_hybrid.testing.models import small_config

    return small_config(
        pattern, **TEST_SIZES, bf16=True, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, **changes,
    )  # fmt: skip


def with_mla(config):
    """``config`` as an ``MLATransformerConfig`` (small MLA sizes) for patterns with ``+``."""
    import dataclasses

    from megatron.core.transformer import MLATransformerConfig

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields.update(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=64, qk_head_dim=32,
                  qk_pos_emb_head_dim=16, v_head_dim=32, rope_type="rope")  # fmt: skip
    return MLATransformerConfig(**fields)


def device_inputs(device, **kwargs) -> dict:
    """``model_inputs(**kwargs)`` with its tensors on ``device``."""
    from megatron_hybrid.testing.models import model_inputs

    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in model_inputs(**kwargs).items()}


def max_rel_diff(actual: dict, reference: dict) -> float:
    """Largest :func:`rel_error` over the tensors of two same-keyed dicts."""
    assert actual.keys() == reference.keys() and actual
    return max(rel_error(actual[k], r) for k, r in reference.items())


# -- Hugging Face fixture folders -----------------------------------------------------------------


@pytest.fixture(scope="session")
def hf_folders(world, tmp_path_factory) -> Path:
    """The folder of ``hf_fixtures.py``'s checkpoints and transformers' logits.

    ``MH_HF_FIXTURES`` names it (the suite runner makes it on this machine while the first tests
    run, and this waits for it); without it, rank 0 makes one here where transformers is
    importable. Every rank reaches the same answer, or every test using it skips with the reason.
    """
    import torch.distributed as dist

    rank, _, device = world
    root = os.environ.get("MH_HF_FIXTURES")
    if root:
        wait = float(os.environ.get("MH_HF_FIXTURES_WAIT", "90"))
        problem = hf_fixtures.wait_for(Path(root), timeout=wait)
    else:
        problem = hf_fixtures.transformers_problem()
        if problem is None:
            path = [str(tmp_path_factory.mktemp("hf_fixtures")) if rank == 0 else None]
            dist.broadcast_object_list(path, src=0)
            root = path[0]
            if rank == 0:
                with contextlib.suppress(Exception):  # FAILED holds why; read below
                    hf_fixtures.main(root)
            dist.barrier()
            problem = hf_fixtures.wait_for(Path(root), timeout=0)
    usable = torch.tensor([0 if problem else 1], device=device)
    dist.all_reduce(usable, op=dist.ReduceOp.MIN)
    if problem or not usable.item():
        pytest.skip(
            f"no Hugging Face fixture folders: {problem or 'another rank found none'} (the suite "
            "runner makes them where transformers is importable: tests/functional/run_suite.py)"
        )
    return Path(root)


# -- torchrun jobs of the launcher tests ----------------------------------------------------------

#: Variables of an enclosing torchrun job or suite phase, which a nested job must not inherit
#: (a pytest job started with this lane's ``MH_LANE`` would run only part of its tests).
_TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "MH_SYNC_DIR", "MH_TEST_RECORD",
    "MH_LANE", "MH_LANE_BY", "MH_LANE_CLAIMS",
)  # fmt: skip


def gpu_count() -> int:
    """GPUs this process may use (the launcher tests' process holds none itself); on the CPU
    check (``MH_FUNCTIONAL_ON_CPU=1``) the gloo ranks ``MH_CPU_RANKS`` stands for."""
    if ON_CPU:
        return int(os.environ.get("MH_CPU_RANKS", "0"))
    return torch.cuda.device_count()


def require_gpus(count: int) -> None:
    """Skip unless this host has ``count`` GPUs (launcher tests)."""
    have = gpu_count()
    if have < count:
        pytest.skip(f"needs {count} GPUs; this host has {have}")


@dataclass
class Job:
    """One torchrun job of a launcher test: ``torchrun --nproc_per_node nproc ARGS``."""

    args: list[str]
    nproc: int
    env: dict[str, str] = field(default_factory=dict)
    #: The exit code it must end with (None: any failure).
    expect: int | None = 0
    name: str = ""


def launch_all(jobs: list[Job], timeout: float = 200.0, *, share_gpus: bool = False) -> list[str]:
    """Run ``jobs`` on this host's GPUs, as many at a time as their GPUs fit (in order, each on
    GPUs of its own via CUDA_VISIBLE_DEVICES); their outputs, in order. With ``share_gpus`` all
    start at once on the first GPUs (small models: a job's time goes into starting and
    compiling on the CPU, not into the GPU).

    Each job runs in a session of its own, its output in a file (no pipe to fill); at
    ``timeout``, or when the suite guard times the test out, every job's whole process tree
    ends (torchrun puts each worker in a session of its own, so killing torchrun alone would
    leave them holding GPUs and ports).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(gpu_count())]
    too_big = [job.nproc for job in jobs if job.nproc > len(devices)]
    if too_big:
        pytest.skip(f"needs {max(too_big)} GPUs; this host has {len(devices)}")
    base_env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARIABLES}
    pending, running, outputs = list(range(len(jobs))), {}, [""] * len(jobs)
    free, deadline = list(devices), time.monotonic() + timeout
    failures = []
    try:
        while pending or running:
            for i in list(pending):
                job = jobs[i]
                if share_gpus:
                    use = devices[: job.nproc]
                elif job.nproc > len(free):
                    continue
                else:
                    use, free = free[: job.nproc], free[job.nproc :]
                env = {**base_env, "CUDA_VISIBLE_DEVICES": ",".join(use),
                       "PYTHONUNBUFFERED": "1", **job.env}  # fmt: skip
                # --standalone: the rendezvous store listens on a port the OS gives it (port 0);
                # a port picked free beforehand can be taken by a job beside it before it binds.
                command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                           str(job.nproc), "--standalone", *job.args]  # fmt: skip
                sink = tempfile.TemporaryFile(mode="w+")
                proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)  # fmt: skip
                suite_guard.track_child(proc)
                running[i] = (proc, sink, use, time.monotonic())
                pending.remove(i)
            for i, (proc, sink, use, began) in list(running.items()):
                if proc.poll() is None:
                    continue
                suite_guard.untrack_child(proc)
                sink.seek(0)
                outputs[i] = sink.read()
                sink.close()
                if not share_gpus:
                    free += use
                del running[i]
                job = jobs[i]
                print(f"\n[{time.monotonic() - began:.0f} s on GPU {','.join(use)}, exit "
                      f"{proc.returncode}] {job.name or ' '.join(job.args)[:120]}")  # fmt: skip
                ok = proc.returncode != 0 if job.expect is None else proc.returncode == job.expect
                if not ok:
                    failures.append(f"{job.name or job.args}: exit code {proc.returncode} "
                                    f"(expected {job.expect}):\n{outputs[i][-5000:]}")  # fmt: skip
            if running and time.monotonic() > deadline:
                names = [jobs[i].name or " ".join(jobs[i].args)[:80] for i in running]
                raise AssertionError(
                    f"torchrun job(s) still running after {timeout:.0f} s: {names}"
                )
            time.sleep(0.2)
    finally:
        for proc, sink, _, _ in running.values():
            suite_guard.kill_tree(proc.pid)
            suite_guard.untrack_child(proc)
            sink.close()
    assert not failures, "\n\n".join(failures)
    return outputs


def launch(args: Iterable[str], *, nproc: int, env: dict[str, str] | None = None,
           timeout: float = 150.0, expect: int | None = 0) -> str:  # fmt: skip
    """One torchrun job (:func:`launch_all`); its output."""
    return launch_all([Job(list(args), nproc, env or {}, expect)], timeout=timeout)[0]
