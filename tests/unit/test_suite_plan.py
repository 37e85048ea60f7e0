"""The GPU suite's plan (tests/functional/suite_plan.py) on the CPU: the slow files run last,
and lanes (``MH_LANE=i/n``) split the selected tests so that each runs in exactly one lane, the
longest spread first: launcher tests one by one, in-process tests file by file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

FUNCTIONAL = Path(__file__).resolve().parents[1] / "functional"
sys.path.insert(0, str(FUNCTIONAL))
import suite_plan  # noqa: E402


def test_slow_files_run_last_in_their_order_and_the_rest_keep_theirs():
    names = ["test_hf_gpu.py", "test_b.py", "test_fast_path_gpu.py", "test_a.py",
             "test_hf_fp8_gpu.py", "test_packing_gpu.py", "test_b.py"]  # fmt: skip
    items = [SimpleNamespace(path=Path("/suite") / name, index=i) for i, name in enumerate(names)]
    suite_plan.order(items)
    assert [item.index for item in items] == [1, 3, 6, 2, 5, 4, 0]


def test_lanes_take_the_longest_first_onto_the_least_loaded_lane():
    assert suite_plan.lanes_of([300, 240, 200, 200, 150], 2) == [0, 1, 1, 0, 1]
    assert suite_plan.lanes_of([120, 120, 120], 3) == [0, 1, 2]
    assert suite_plan.lanes_of([120, 120], 1) == [0, 0]
    assert suite_plan.lanes_of([], 2) == []


@pytest.mark.parametrize("value", ["2/2", "1", "a/b", "-1/2", "0/0"])
def test_a_bad_lane_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"MH_LANE=.*expected 'i/n' with 0 <= i < n"):
        suite_plan.parse_lane(value)


def test_a_bad_lane_unit_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("MH_LANE", "0/2")
    monkeypatch.setenv("MH_LANE_BY", "files")
    with pytest.raises(ValueError, match=r"MH_LANE_BY='files': expected 'test' or 'file'"):
        suite_plan.keep_lane(None, [], 120.0)


CONFTEST = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(FUNCTIONAL)!r})
    import pytest
    import suite_plan

    def pytest_configure(config):
        config.addinivalue_line("markers", "time_limit(seconds): its limit")
        config.addinivalue_line("markers", "launcher: starts jobs")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(config, items):
        suite_plan.order(items)
        suite_plan.keep_lane(config, items, 120.0)
    """)

TESTS = textwrap.dedent("""
    import pytest

    @pytest.mark.launcher
    @pytest.mark.time_limit(240)
    def test_pretrain(): pass

    @pytest.mark.launcher
    @pytest.mark.time_limit(200)
    def test_train(): pass

    @pytest.mark.launcher
    @pytest.mark.time_limit(300)
    def test_resume(): pass

    @pytest.mark.launcher
    @pytest.mark.time_limit(150)
    def test_nonfinite(): pass

    @pytest.mark.time_limit(1000)  # split with the rest, it would take lane 0 for itself
    def test_in_process(): pass
    """)


def _collected(suite: Path, lane: str | None, *args: str, env=None) -> list[str]:
    env = {**{k: v for k, v in os.environ.items() if k != "MH_LANE"}, **(env or {})}
    if lane is not None:
        env["MH_LANE"] = lane
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", *args, str(suite)],
        capture_output=True, text=True, env=env, cwd=suite, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode in (0, 5), run.stdout + run.stderr
    return [line.split("::")[-1] for line in run.stdout.splitlines() if "::" in line]


def test_lanes_split_what_the_markers_selected_each_test_once(tmp_path):
    """Lanes split the tests left after ``-m`` (the marker's deselection comes first), so the
    in-process test neither runs in a lane nor shifts the split."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_jobs.py").write_text(TESTS)
    everything = _collected(tmp_path, None, "-m", "launcher")
    lanes = [_collected(tmp_path, f"{i}/2", "-m", "launcher") for i in range(2)]
    assert everything == ["test_pretrain", "test_train", "test_resume", "test_nonfinite"]
    assert lanes == [["test_resume", "test_nonfinite"], ["test_pretrain", "test_train"]]


@pytest.mark.parametrize(
    ("world_size", "expected"),
    [
        # 2 GPUs and more: HybridEP 100 s, Mamba 76 s, checkpoints 43 s; the last joins Mamba.
        ("4", [["test_hybridep_gpu_a", "test_hybridep_gpu_b"],
               ["test_checkpoints_gpu_a", "test_checkpoints_gpu_b",
                "test_mamba_torch_gpu_a", "test_mamba_torch_gpu_b"]]),
        # One GPU, where HybridEP's tests skip at once: Mamba 100 s alone, the others together.
        ("1", [["test_mamba_torch_gpu_a", "test_mamba_torch_gpu_b"],
               ["test_checkpoints_gpu_a", "test_checkpoints_gpu_b",
                "test_hybridep_gpu_a", "test_hybridep_gpu_b"]]),
    ],
    ids=["four-gpus", "one-gpu"],
)  # fmt: skip
def test_in_process_lanes_take_whole_files_by_their_seconds(tmp_path, world_size, expected):
    """``MH_LANE_BY=file``: a file's tests stay in one lane (they share compiled kernels), split
    by the seconds of the job's GPU count (:func:`suite_plan.file_seconds`), so one GPU's lanes
    are not balanced by the seconds of files that skip there."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name in ("test_checkpoints_gpu.py", "test_hybridep_gpu.py", "test_mamba_torch_gpu.py"):
        stem = name.removesuffix(".py")
        (tmp_path / name).write_text(f"def {stem}_a(): pass\n\ndef {stem}_b(): pass\n")
    env = {"MH_LANE_BY": "file", "WORLD_SIZE": world_size}
    lanes = [_collected(tmp_path, f"{i}/2", env=env) for i in range(2)]
    assert lanes == expected


def test_one_gpu_seconds_cover_the_files_that_run_there():
    """Every file the multi-GPU table names has a one-GPU figure (a file that skips there costs
    a second, not the default), and the tables are the ones :func:`suite_plan.file_seconds`
    hands out."""
    assert set(suite_plan.FILE_SECONDS) <= set(suite_plan.FILE_SECONDS_ONE_GPU)
    assert suite_plan.file_seconds(1) is suite_plan.FILE_SECONDS_ONE_GPU
    assert suite_plan.file_seconds(2) is suite_plan.file_seconds(4) is suite_plan.FILE_SECONDS
