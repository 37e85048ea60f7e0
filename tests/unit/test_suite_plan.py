"""The GPU suite's plan (tests/functional/suite_plan.py) on the CPU: the slow files run last,
and lanes (``MH_LANE=i/n``) split the selected tests so that each runs in exactly one lane, the
longest spread first: launcher tests one by one, in-process tests file by file, or (claimed
files) by the first lane free to take the next file."""

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
    with pytest.raises(ValueError, match=r"MH_LANE_BY='files': expected 'test', 'file' or 'claim'"):
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


MAMBA = ["test_mamba_torch_gpu_a", "test_mamba_torch_gpu_b"]
HYBRIDEP = ["test_hybridep_gpu_a", "test_hybridep_gpu_b"]
CHECKPOINTS = ["test_checkpoints_gpu_a", "test_checkpoints_gpu_b"]


@pytest.mark.parametrize(
    ("world_size", "deep_ep", "expected"),
    [
        # Four GPUs: HybridEP 100 s, Mamba 76 s, checkpoints 43 s; the last joins Mamba.
        ("4", True, [HYBRIDEP, CHECKPOINTS + MAMBA]),
        # Without DeepEP HybridEP's tests skip at once: Mamba alone, the others together.
        ("4", False, [MAMBA, CHECKPOINTS + HYBRIDEP]),
        # Two GPUs: Mamba 176 s, HybridEP 84 s, checkpoints 33 s.
        ("2", True, [MAMBA, CHECKPOINTS + HYBRIDEP]),
        # One GPU, where HybridEP's tests skip whatever is installed.
        ("1", True, [MAMBA, CHECKPOINTS + HYBRIDEP]),
    ],
    ids=["four-gpus", "four-gpus-no-deep-ep", "two-gpus", "one-gpu"],
)  # fmt: skip
def test_in_process_lanes_take_whole_files_by_their_seconds(
    tmp_path, world_size, deep_ep, expected
):
    """``MH_LANE_BY=file``: a file's tests stay in one lane (they share compiled kernels), split
    by the seconds of the job's GPU count (:func:`suite_plan.file_seconds`), so one GPU's lanes
    are not balanced by the seconds of files that skip there, nor any lanes by a file whose
    package is missing (:data:`suite_plan.NEEDS`: here an empty ``deep_ep`` stands for it)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("test_checkpoints_gpu.py", "test_hybridep_gpu.py", "test_mamba_torch_gpu.py"):
        stem = name.removesuffix(".py")
        (suite / name).write_text(f"def {stem}_a(): pass\n\ndef {stem}_b(): pass\n")
    site = tmp_path / "site"
    (site / "deep_ep").mkdir(parents=True)
    (site / "deep_ep" / "__init__.py").write_text("")
    env = {"MH_LANE_BY": "file", "WORLD_SIZE": world_size}
    if deep_ep:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    lanes = [_collected(suite, f"{i}/2", env=env) for i in range(2)]
    assert lanes == expected


def test_each_gpu_count_has_seconds_for_the_files_that_run_there():
    """Every file the four-GPU table names has a one- and a two-GPU figure (a file that skips
    there costs a second, not the default), and the tables are the ones
    :func:`suite_plan.file_seconds` hands out."""
    assert set(suite_plan.FILE_SECONDS) <= set(suite_plan.FILE_SECONDS_ONE_GPU)
    assert set(suite_plan.FILE_SECONDS) <= set(suite_plan.FILE_SECONDS_TWO_GPUS)
    assert suite_plan.file_seconds(1) is suite_plan.FILE_SECONDS_ONE_GPU
    assert suite_plan.file_seconds(2) is suite_plan.FILE_SECONDS_TWO_GPUS
    assert suite_plan.file_seconds(4) is suite_plan.file_seconds(8) is suite_plan.FILE_SECONDS


def test_a_file_whose_package_is_missing_costs_a_second(monkeypatch):
    """:func:`suite_plan.file_cost` asks for the package by name, without importing it."""
    monkeypatch.setitem(suite_plan.NEEDS, "test_x_gpu.py", "no_such_package_here")
    seconds = {"test_x_gpu.py": 300, "test_y_gpu.py": 40}
    assert suite_plan.file_cost("test_x_gpu.py", seconds) == suite_plan.SKIPPED_FILE_SECONDS
    assert suite_plan.file_cost("test_y_gpu.py", seconds) == 40
    assert suite_plan.file_cost("test_z_gpu.py", seconds) == suite_plan.OTHER_FILE_SECONDS
    monkeypatch.setitem(suite_plan.NEEDS, "test_x_gpu.py", "json")
    assert suite_plan.file_cost("test_x_gpu.py", seconds) == 300


# ---- claimed files (MH_LANE_BY=claim) -------------------------------------------------------


def test_a_claim_goes_to_the_first_lane_and_every_rank_reads_it(tmp_path):
    assert suite_plan.claim(tmp_path, "test_a.py", lane=0, rank=0) is True
    assert suite_plan.claim(tmp_path, "test_a.py", lane=1, rank=0) is False  # second: not its
    assert suite_plan.claim(tmp_path, "test_a.py", lane=1, rank=1) is False
    assert suite_plan.claim(tmp_path, "test_a.py", lane=0, rank=1) is True
    assert [p.name for p in tmp_path.iterdir()] == ["test_a.py"]  # no draft left behind


def test_a_rank_waits_for_its_first_rank_to_claim(tmp_path):
    """Rank 1 reaches the file first and reads what its rank 0 claims."""
    import threading
    import time

    result = {}
    waiter = threading.Thread(
        target=lambda: result.update(
            ran=suite_plan.claim(tmp_path, "test_a.py", lane=0, rank=1), at=time.monotonic()
        )
    )
    began = time.monotonic()
    waiter.start()
    time.sleep(0.3)
    assert "ran" not in result  # still waiting
    assert suite_plan.claim(tmp_path, "test_a.py", lane=0, rank=0) is True
    waiter.join(timeout=30)
    assert result["ran"] is True and result["at"] - began >= 0.3


def test_a_claim_that_never_comes_is_an_error(tmp_path):
    with pytest.raises(TimeoutError, match="no lane claimed test_a.py .* within 0 s"):
        suite_plan.claim(tmp_path, "test_a.py", lane=0, rank=1, wait=0.2)


def test_claim_order_puts_the_costliest_first_and_the_fixture_files_last(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    names = ["test_hf_gpu.py", "test_lora_gpu.py", "test_fast_path_gpu.py", "test_x_gpu.py",
             "test_hf_fp8_gpu.py", "test_mamba_torch_gpu.py", "test_lora_gpu.py"]  # fmt: skip
    items = [SimpleNamespace(path=Path("/suite") / name, index=i) for i, name in enumerate(names)]
    suite_plan.claim_order(items)
    # fast path 197 s, Mamba 176 s, LoRA 14 s (its two tests in order), the unknown file 5 s;
    # then the fixture files by their seconds (the HF folders 58 s, their FP8 versions 44 s).
    assert [item.index for item in items] == [2, 5, 1, 6, 3, 0, 4]


CLAIM_CONFTEST = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {str(FUNCTIONAL)!r})
    import pytest
    import suite_plan

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(config, items):
        suite_plan.keep_lane(config, items, 120.0)

    @pytest.hookimpl(tryfirst=True)  # as tests/functional/conftest.py
    def pytest_runtest_protocol(item, nextitem):
        return None if suite_plan.runs_here(item) else True
    """)

#: File a's test holds its lane until the other files are claimed: whichever lane takes a, the
#: other must take b, c and d (the order every lane goes through), whatever the start order.
CLAIM_FILES = {
    "test_a.py": """
        def test_a(log):
            deadline = time.monotonic() + 60
            while not all((CLAIMS / f).exists() for f in ("test_b.py", "test_c.py", "test_d.py")):
                assert time.monotonic() < deadline, "the other lane took no file"
                time.sleep(0.05)
            log("test_a")
        """,
    "test_b.py": "def test_b1(log): log('test_b1')\n\ndef test_b2(log): log('test_b2')\n",
    "test_c.py": "def test_c(log): log('test_c')\n",
    "test_d.py": "def test_d(log): log('test_d')\n",
}
CLAIM_COMMON = textwrap.dedent("""
    import os
    import time
    from pathlib import Path

    import pytest

    CLAIMS = Path(os.environ["MH_LANE_CLAIMS"])

    @pytest.fixture
    def log():
        def write(name):
            with open(os.environ["RAN_LOG"], "a") as sink:
                sink.write(f"{os.environ['MH_LANE']} {name}\\n")
        return write
    """)


def test_lanes_take_the_next_unclaimed_file_and_run_each_test_once(tmp_path):
    """Two lanes side by side with claimed files: the lane held by file a's test runs only that
    file, the other runs every other file; every test runs once."""
    suite, claims, ran = tmp_path / "suite", tmp_path / "claims", tmp_path / "ran.log"
    suite.mkdir()
    claims.mkdir()
    (suite / "conftest.py").write_text(CLAIM_CONFTEST)
    for name, body in CLAIM_FILES.items():
        (suite / name).write_text(CLAIM_COMMON + textwrap.dedent(body))
    env = {**os.environ, "MH_LANE_BY": "claim", "MH_LANE_CLAIMS": str(claims),
           "RAN_LOG": str(ran), "WORLD_SIZE": "1", "RANK": "0"}  # fmt: skip
    lanes = [subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         str(suite)], env={**env, "MH_LANE": f"{i}/2"}, cwd=suite, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in range(2)]  # fmt: skip
    outputs = [lane.communicate(timeout=300)[0] for lane in lanes]
    assert [lane.returncode for lane in lanes] == [0, 0], outputs
    entries = [line.split() for line in ran.read_text().splitlines()]
    by_lane = {
        lane: sorted(name for lane_, name in entries if lane_ == lane) for lane in ("0/2", "1/2")
    }
    assert sorted(name for _, name in entries) == [
        "test_a",
        "test_b1",
        "test_b2",
        "test_c",
        "test_d",
    ]
    assert sorted(by_lane.values()) == [["test_a"], ["test_b1", "test_b2", "test_c", "test_d"]]
    owner = {p.name: p.read_text() for p in claims.iterdir()}
    assert sorted(owner) == sorted(CLAIM_FILES)


def test_a_test_no_lane_ended_is_not_run_once():
    """With claimed files every lane collects every test: a test is not run only if no lane
    ended it, and is listed once (the budget left file c unclaimed; b ran in lane 1)."""
    import run_suite

    collected = ["a.py::t", "b.py::t", "c.py::t"]
    phases = [
        {"name": "in_process0", "ends": {"a.py::t": {}}, "not_run": ["b.py::t", "c.py::t"]},
        {"name": "in_process1", "ends": {"b.py::t": {}}, "not_run": ["a.py::t", "c.py::t"]},
        {"name": "in_process2", "ends": {}, "not_run": list(collected)},
    ]
    run_suite.shared_not_run(phases)
    assert [p["not_run"] for p in phases] == [["c.py::t"], [], []]
