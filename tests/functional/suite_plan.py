"""Which tests a job of the GPU suite runs, and in what order.

* **Order**: the files of :data:`RUN_LAST` run after the others, in that order: they compile
  the most kernels on a fresh machine (fla's float32 kernels, the compiled Mamba2 scan, the FP8
  kernel), so a budget that runs out leaves the fewest tests unrun, and the Hugging Face fixture
  folders, made in the background while the first tests run, are ready when ``test_hf*_gpu.py``
  read them. Within a file the order is the file's own.
* **Lanes** (``MH_LANE=i/n``: this job runs lane ``i`` of ``n``), which the suite runner starts
  side by side on the same GPUs. Most of a fresh machine's time goes into work on the CPU
  (compiling kernels, starting processes), which lanes spread over more cores. The launcher
  tests are split test by test: each starts torchrun jobs of its own and its ``time_limit``
  stands for its work. The in-process tests (``MH_LANE_BY=file``) are split file by file, since
  a file's tests share the kernels they compile; :func:`file_seconds` stands for a file's work
  (a table per GPU count: on one GPU the multi-GPU files skip at once), and a file that needs a
  package the machine lacks (:data:`NEEDS`) costs a second.
  Longest first, each to the lane with the least work so far; a lane keeps the order above.
* **Claimed files** (``MH_LANE_BY=claim``, the suite runner's in-process lanes): a file's time
  on a fresh machine varies by half from run to run (the Mamba file took 92 to 176 s on 2 x
  H200, the Hugging Face file 58 to 91 s), so lanes split by the table ended up to 110 s apart
  and the budget cut the longest. Here every lane goes through the same list of every file, the
  costliest first (:func:`claim_order`), and runs a file only if it is the first lane to reach
  it (:func:`runs_here`): a lane that finishes early takes the next file, and the lanes end
  within about a file of each other whatever each file takes.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

#: In-process test files run after the others, in this order (see the module doc).
RUN_LAST = ("test_fast_path_gpu.py", "test_packing_gpu.py", "test_hf_fp8_gpu.py", "test_hf_gpu.py")
#: Seconds of an in-process file on a fresh machine with 4 or more GPUs, for splitting files into
#: lanes: the cold runs on 4 x H200 (64 cores) of 2026-11-27, the "in-process seconds by file"
#: line of its summary; packing's layouts test, cut off there by the budget, estimated at its
#: 2-GPU share (the 1- and 2-GPU runs, on 16 and 32 cores of the same host, agree within 15 %).
#: HybridEP's from its first 2-GPU run (2 x H200, 2026-11-27: 84 s), rounded up for 4 GPUs, where
#: it has not run. ``test_cuda_graphs_gpu.py`` and ``test_gdn_fixed_gpu.py``: the cold run on
#: 1 x H200 of 2026-11-29, after their packed-rows tests (GatedDeltaNet's compile fla's varlen
#: kernels); ``test_cross_entropy_gpu.py`` from the suite run with its log-prob test (1 x H200,
#: 2026-11-29); ``test_tf32_gpu.py`` from its first suite run (1 x H200, 2026-11-29; its child
#: process). Refresh from a summary; only the lanes' balance depends on it.
FILE_SECONDS = {
    "test_fast_path_gpu.py": 190, "test_gdn_gates_gpu.py": 140, "test_packing_gpu.py": 130,
    "test_mamba_torch_gpu.py": 76, "test_ep_overlap_gpu.py": 51, "test_hf_fp8_gpu.py": 45,
    "test_checkpoints_gpu.py": 43, "test_hf_gpu.py": 40, "test_rl_gpu.py": 38,
    "test_gdn_kernels_gpu.py": 35, "test_hybridep_gpu.py": 100, "test_lora_gpu.py": 16,
    "test_fla_dqkwg_gpu.py": 8, "test_cuda_graphs_gpu.py": 64, "test_gdn_fixed_gpu.py": 10,
    "test_cross_entropy_gpu.py": 14, "test_tf32_gpu.py": 18,
}  # fmt: skip
#: The same on one GPU, where the layout, EP-overlap and HybridEP files skip in a second: the
#: mean of the two newest cold runs on one H200 (16 cores) of 2026-11-29, on a 1-GPU machine and
#: on GPU 0 of a 2-GPU host (``gpu_split.sh``; files over 30 s within 10 %). The Mamba file took
#: 100 s in the run before them, whose figures split those two (its lane then took 381 and
#: 396 s). A file missing here costs :data:`OTHER_FILE_SECONDS`.
FILE_SECONDS_ONE_GPU = {
    "test_fast_path_gpu.py": 170, "test_mamba_torch_gpu.py": 162, "test_gdn_gates_gpu.py": 120,
    "test_hf_gpu.py": 69, "test_gdn_kernels_gpu.py": 61, "test_cuda_graphs_gpu.py": 58,
    "test_packing_gpu.py": 52, "test_rl_gpu.py": 36, "test_hf_fp8_gpu.py": 22,
    "test_gdn_fixed_gpu.py": 20, "test_cross_entropy_gpu.py": 13, "test_checkpoints_gpu.py": 12,
    "test_fused_step_gpu.py": 10, "test_tf32_gpu.py": 9, "test_wgrad_fusion_gpu.py": 8,
    "test_fla_dqkwg_gpu.py": 6, "test_lora_gpu.py": 1, "test_te_backend_gpu.py": 1,
    "test_ep_overlap_gpu.py": 1, "test_hybridep_gpu.py": 1, "test_padding_gpu.py": 1,
}  # fmt: skip
#: The same on two GPUs: per file the slowest of the three cold runs on 2 x H200 (32 cores) of
#: 2026-11-29, which the order of claims follows (before claims, the lanes' split: the Mamba file
#: took 99 s on average of the first two runs and 176 s in the third, whose lane the budget cut
#: at 420 s; 92 s in a fourth). The first run was split by :data:`FILE_SECONDS`, whose HybridEP
#: 100 s, skipped without DeepEP, left one lane at 264 s while the budget cut the other two at
#: 419 s. ``test_hf_gpu.py``'s figure counts its last tests as on one GPU (cut off in the first
#: run; its wait for the fixture folders varies); ``test_packing_gpu.py``'s is the second run's
#: (cut off in the third); ``test_hybridep_gpu.py`` from its first 2-GPU run, with DeepEP.
FILE_SECONDS_TWO_GPUS = {
    "test_fast_path_gpu.py": 197, "test_mamba_torch_gpu.py": 176, "test_gdn_gates_gpu.py": 146,
    "test_packing_gpu.py": 91, "test_hybridep_gpu.py": 84, "test_gdn_kernels_gpu.py": 70,
    "test_hf_gpu.py": 58, "test_cuda_graphs_gpu.py": 50, "test_hf_fp8_gpu.py": 44,
    "test_rl_gpu.py": 42, "test_ep_overlap_gpu.py": 34, "test_checkpoints_gpu.py": 33,
    "test_gdn_fixed_gpu.py": 29, "test_cross_entropy_gpu.py": 16, "test_lora_gpu.py": 14,
    "test_tf32_gpu.py": 13, "test_fla_dqkwg_gpu.py": 7, "test_padding_gpu.py": 6,
    "test_te_backend_gpu.py": 1, "test_fused_step_gpu.py": 1, "test_wgrad_fusion_gpu.py": 1,
}  # fmt: skip
#: Seconds of a file in no table (the others took under 2 s on one GPU).
OTHER_FILE_SECONDS = 5.0
#: Files whose every test needs a package that the GPU image lacks unless it is carried: where it
#: is not importable they skip at once and cost :data:`SKIPPED_FILE_SECONDS`, not their table's
#: figure (a lane given HybridEP's 100 s without DeepEP finished 155 s before the others).
NEEDS = {"test_hybridep_gpu.py": "deep_ep", "test_te_backend_gpu.py": "transformer_engine"}
SKIPPED_FILE_SECONDS = 1.0


def file_seconds(gpus: int) -> dict[str, float]:
    """The seconds table of a job on ``gpus`` GPUs (its ``WORLD_SIZE``): one GPU's, two GPUs',
    or four GPUs' for more."""
    return {1: FILE_SECONDS_ONE_GPU, 2: FILE_SECONDS_TWO_GPUS}.get(gpus, FILE_SECONDS)


def file_cost(name: str, seconds: dict[str, float]) -> float:
    """A file's seconds for the lanes' split: :data:`SKIPPED_FILE_SECONDS` where the package it
    needs (:data:`NEEDS`) is not importable, else its figure in ``seconds``."""
    needed = NEEDS.get(name)
    if needed is not None and importlib.util.find_spec(needed) is None:
        return SKIPPED_FILE_SECONDS
    return float(seconds.get(name, OTHER_FILE_SECONDS))


def order(items: list) -> None:
    """Sort ``items`` in place: the files of :data:`RUN_LAST` last (a stable sort)."""
    rank = {name: i + 1 for i, name in enumerate(RUN_LAST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).name, 0))


def parse_lane(value: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)``.

    Raises:
        ValueError: not two integers with ``0 <= i < n``.
    """
    try:
        lane, lanes = (int(part) for part in value.split("/"))
    except ValueError:
        lane, lanes = -1, 0
    if not 0 <= lane < lanes:
        raise ValueError(f"MH_LANE={value!r}: expected 'i/n' with 0 <= i < n, e.g. '0/2'")
    return lane, lanes


def lanes_of(costs: list[float], lanes: int) -> list[int]:
    """The lane of each test: longest first, each to the lane with the least cost so far (ties:
    the lower lane)."""
    totals = [0.0] * lanes
    lane_of = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        lane = min(range(lanes), key=lambda j: (totals[j], j))
        lane_of[i] = lane
        totals[lane] += costs[i]
    return lane_of


def _file(item) -> str:
    return Path(str(item.path)).name


#: In-process files that read the Hugging Face fixture folders (made in the background).
FIXTURE_FILES = ("test_hf_fp8_gpu.py", "test_hf_gpu.py")
#: Seconds a rank waits for its lane's first rank to claim a file (or find it claimed).
CLAIM_WAIT = 120.0
#: ``file -> runs here`` for this process (each file is claimed once).
_CLAIMED: dict[str, bool] = {}


def claim_order(items: list) -> None:
    """Sort ``items`` in place for claimed files: the costliest file first (:func:`file_cost`
    in the :func:`file_seconds` of the job's ``WORLD_SIZE``), except the files that read the
    Hugging Face fixture folders, which come last (the folders are made while the other tests
    run); a file's tests in their own order."""
    seconds = file_seconds(int(os.environ.get("WORLD_SIZE", "1")))
    files = list(dict.fromkeys(_file(item) for item in items))
    rank = {name: (name in FIXTURE_FILES, -file_cost(name, seconds), i)
            for i, name in enumerate(files)}  # fmt: skip
    items.sort(key=lambda item: rank[_file(item)])


def claim(folder: Path, name: str, lane: int, rank: int, wait: float = CLAIM_WAIT) -> bool:
    """Whether lane ``lane`` runs file ``name``: the first lane to claim it in ``folder`` does.

    The lane's rank 0 claims (a file named ``name`` holding the lane's number, linked into
    place whole, so that no reader sees it half written and no second claim replaces it); every
    rank then reads the claim, waiting up to ``wait`` seconds for it, so the ranks of a job
    agree without a collective. A lane's job started again (after a hung test) finds its own
    claims and runs what is left of its files.

    Args:
        folder: the claims, shared by the lanes of one run.
        name: the test file's name.
        lane: this job's lane (``MH_LANE``'s ``i``).
        rank: this process's rank in its job.
        wait: seconds to wait for the claim to appear.

    Raises:
        TimeoutError: no claim appeared within ``wait`` seconds (the lane's rank 0 is gone).
    """
    target = folder / name
    if rank == 0 and not target.exists():
        draft = folder / f".{name}.{lane}.{os.getpid()}"
        draft.write_text(str(lane))
        try:
            os.link(draft, target)
        except FileExistsError:
            pass  # another lane was first
        finally:
            draft.unlink()
    deadline = time.monotonic() + wait
    while not target.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no lane claimed {name} in {folder} within {wait:.0f} s (this lane's rank 0 "
                "did not reach it)"
            )
        time.sleep(0.05)
    return target.read_text() == str(lane)


def runs_here(item) -> bool:
    """Whether this job runs ``item``: always, unless its lanes claim files
    (``MH_LANE_BY=claim``, ``MH_LANE_CLAIMS`` the folder), where only the lane that claimed the
    item's file runs it (:func:`claim`, once per file)."""
    if os.environ.get("MH_LANE_BY") != "claim" or not os.environ.get("MH_LANE"):
        return True
    name = _file(item)
    if name not in _CLAIMED:
        lane, _ = parse_lane(os.environ["MH_LANE"])
        folder = Path(os.environ["MH_LANE_CLAIMS"])
        _CLAIMED[name] = claim(folder, name, lane, int(os.environ.get("RANK", "0")))
    return _CLAIMED[name]


def keep_lane(config, items: list, default_cost: float) -> None:
    """Deselect the tests of other lanes where ``MH_LANE`` is set: by test (``time_limit``, else
    ``default_cost``), or by file where ``MH_LANE_BY=file`` (:func:`file_cost` in the
    :func:`file_seconds` of the job's ``WORLD_SIZE``); where ``MH_LANE_BY=claim`` every lane
    keeps every test in :func:`claim_order` and :func:`runs_here` decides as it goes."""
    value = os.environ.get("MH_LANE")
    if not value:
        return
    lane, lanes = parse_lane(value)
    by = os.environ.get("MH_LANE_BY", "test")
    if by == "claim":
        if not os.environ.get("MH_LANE_CLAIMS"):
            raise ValueError("MH_LANE_BY=claim needs MH_LANE_CLAIMS, a folder the lanes share")
        claim_order(items)
        return
    if by == "file":
        files = list(dict.fromkeys(_file(item) for item in items))
        seconds = file_seconds(int(os.environ.get("WORLD_SIZE", "1")))
        costs = [file_cost(name, seconds) for name in files]
        lane_of_file = dict(zip(files, lanes_of(costs, lanes), strict=True))
        lane_of = [lane_of_file[_file(item)] for item in items]
    elif by == "test":
        costs = []
        for item in items:
            marker = item.get_closest_marker("time_limit")
            costs.append(float(marker.args[0]) if marker else default_cost)
        lane_of = lanes_of(costs, lanes)
    else:
        raise ValueError(f"MH_LANE_BY={by!r}: expected 'test', 'file' or 'claim'")
    dropped = [item for item, j in zip(items, lane_of, strict=True) if j != lane]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item, j in zip(items, lane_of, strict=True) if j == lane]
