"""The GPU suite's guard (tests/functional/suite_guard.py) on the CPU: a test that sleeps fails
at its limit and the run goes on; under torchrun (two gloo ranks) a rank stuck in a collective
ends the whole job within the limit, naming the test, and the job started again with the same
record runs only what is left; a rank that fails while the other waits for it in a collective
ends the job after the grace period; a failure on rank 1 alone is the test's failure on rank 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_hybrid.process_groups import free_port

FUNCTIONAL = Path(__file__).resolve().parents[1] / "functional"

CONFTEST = textwrap.dedent(f"""
    import sys
    from pathlib import Path
    sys.path.insert(0, {str(FUNCTIONAL)!r})
    import suite_guard

    def pytest_configure(config):
        global GUARD
        GUARD = suite_guard.install(config, Path(__file__).parent)

    def pytest_collection_modifyitems(config, items):
        suite_guard.deselect_finished(GUARD, config, items)
    """)

SINGLE = textwrap.dedent("""
    import time

    def test_first():
        pass

    def test_sleeps():
        time.sleep(600)

    def test_after():
        pass
    """)

RANKS = textwrap.dedent("""
    import os
    import time

    import pytest
    import torch.distributed as dist

    RANK = int(os.environ["RANK"])

    @pytest.fixture(scope="module", autouse=True)
    def gloo():
        dist.init_process_group("gloo")
        yield

    def test_rank1_sleeps_rank0_waits():
        if RANK == 1:
            time.sleep(600)
        dist.barrier()

    def test_after():
        dist.barrier()
    """)

EARLY = textwrap.dedent("""
    import os

    import pytest
    import torch.distributed as dist

    RANK = int(os.environ["RANK"])

    @pytest.fixture(scope="module", autouse=True)
    def gloo():
        dist.init_process_group("gloo")
        yield

    def test_one_rank_fails():
        assert RANK != 1, "rank 1 fails alone"

    def test_rank0_fails_early():
        assert RANK != 0, "rank 0 gives up before the collective"
        dist.barrier()

    def test_never_reached():
        dist.barrier()
    """)


def _suite(tmp_path: Path, tests: str) -> Path:
    tmp_path.mkdir()
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_guarded.py").write_text(tests)
    return tmp_path


def _run(tmp_path: Path, nproc: int | None, record: Path, **env) -> tuple[int, str, float]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               str(tmp_path)]  # fmt: skip
    if nproc:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master-port", str(free_port()), *command[1:]]  # fmt: skip
    child_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    child_env.update(MH_TEST_RECORD=str(record), OMP_NUM_THREADS="1", **env)
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=child_env, cwd=tmp_path,
                          timeout=300, check=False)  # fmt: skip
    return done.returncode, done.stdout + done.stderr, time.monotonic() - began


def _ends(record: Path) -> dict[str, dict]:
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    return {e["nodeid"].split("::")[-1]: e for e in entries if e["event"] == "end"}


@pytest.mark.slow
def test_a_sleeping_test_fails_at_its_limit_and_the_run_goes_on(tmp_path):
    suite, record = _suite(tmp_path / "suite", SINGLE), tmp_path / "record.jsonl"
    code, output, seconds = _run(suite, None, record, MH_TEST_TIMEOUT="3")
    assert code == 1, output
    assert "TIMEOUT" in output and "test_sleeps" in output and "ran past its limit" in output
    ends = _ends(record)
    assert [ends[n]["outcome"] for n in ("test_first", "test_sleeps", "test_after")] == [
        "passed", "failed", "passed"]  # fmt: skip
    assert "ran past its limit of 3 s" in ends["test_sleeps"]["detail"]
    assert seconds < 300, seconds  # the sleep alone is 600 s
    assert ends["test_sleeps"]["seconds"] < 30, ends["test_sleeps"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_stuck_in_a_collective_ends_the_job_and_the_runner_runs_the_rest(tmp_path):
    """The suite runner's phase loop (run_suite.run_phase): the first job ends at the stuck
    test's limit, the second runs only the test left."""
    sys.path.insert(0, str(FUNCTIONAL))
    import run_suite

    suite = _suite(tmp_path / "suite", RANKS)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(MH_TEST_TIMEOUT="4", OMP_NUM_THREADS="1")

    def command(_round):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master-port", str(free_port()), "-m", "pytest", "-q", "-p",
                "no:cacheprovider", "-o", "addopts=", str(suite)]  # fmt: skip

    began = time.monotonic()
    phase = run_suite.run_phase("job", command, env, tmp_path, time.monotonic() + 500)
    assert time.monotonic() - began < 450  # rank 1 sleeps 600 s, gloo waits 30 minutes
    assert phase["rounds"] == 2 and not phase["budget_hit"], phase
    stuck = phase["ends"]["test_guarded.py::test_rank1_sleeps_rank0_waits"]
    assert stuck["outcome"] == "failed" and stuck["aborted"], stuck
    assert stuck["seconds"] < 30, stuck
    assert "timed out after 4 s" in stuck["detail"] and "job aborted" in stuck["detail"]
    assert phase["ends"]["test_guarded.py::test_after"]["outcome"] == "passed"
    assert "== suite guard, rank" in (tmp_path / "job.log").read_text()  # said where seen


@pytest.mark.slow
@pytest.mark.distributed
def test_ranks_agree_and_an_early_failure_ends_the_job(tmp_path):
    suite, record = _suite(tmp_path / "suite", EARLY), tmp_path / "record.jsonl"
    code, output, seconds = _run(suite, 2, record, MH_TEST_TIMEOUT="600", MH_TEST_GRACE="2")
    assert code != 0, output
    assert seconds < 300, seconds  # well inside the 600 s limit
    ends = _ends(record)
    alone = ends["test_one_rank_fails"]
    assert alone["outcome"] == "failed" and alone["ranks_failed"] == [1], alone
    assert "rank 1 fails alone" in alone["detail"]
    early = ends["test_rank0_fails_early"]
    assert early["outcome"] == "failed" and early["aborted"] and early["seconds"] < 30, early
    assert "still in the test after 2 s" in early["detail"]
    assert "test_never_reached" not in ends


PASSED_BY = textwrap.dedent("""
    import time

    import pytest

    @pytest.fixture(scope="session")
    def world():
        yield
        time.sleep(600)  # a teardown that hangs (destroying process groups, say)

    def test_runs(world):
        pass

    def test_elsewhere(world):  # another lane's: passed by, so test_runs was not the last
        pass
    """)
PASSED_BY_CONFTEST = CONFTEST + textwrap.dedent("""
    import pytest

    def pytest_configure(config):  # replaces the one above: the guard and who runs what
        global GUARD
        GUARD = suite_guard.install(config, Path(__file__).parent)
        GUARD.runs_here = lambda item: item.name != "test_elsewhere"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(item, nextitem):
        return True if item.name == "test_elsewhere" else None
    """)


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "control-unguarded"])
def test_the_session_teardown_after_a_passed_by_test_has_the_time_limit(tmp_path, guarded):
    """Where the last test a job runs is not the last it collected (claimed files), pytest tears
    the session fixtures down after the tests: a hang there ends the process at the limit, with
    the guard's message. Control: without the guard's session-end hook the teardown still runs
    when the limit is long past."""
    sys.path.insert(0, str(FUNCTIONAL))
    import suite_guard

    suite, record = tmp_path / "suite", tmp_path / "record.jsonl"
    suite.mkdir()
    (suite / "conftest.py").write_text(PASSED_BY_CONFTEST)
    (suite / "test_guarded.py").write_text(PASSED_BY)
    if not guarded:  # the guard without its session-end hook, in the child
        (suite / "conftest.py").write_text(
            PASSED_BY_CONFTEST + "\ndel suite_guard.SuiteGuard.pytest_sessionfinish\n"
        )
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               str(suite)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update(MH_TEST_RECORD=str(record), OMP_NUM_THREADS="1", MH_TEST_TIMEOUT="3",
               MH_TEST_GRACE="2")  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=suite)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        assert not guarded, "the session teardown hung past the limit: " + output
        return
    assert guarded, "the control ended by itself: " + output
    assert proc.returncode == suite_guard.ABORT_CODE, output
    assert "TIMEOUT (between tests)" in output, output
    assert _ends(record)["test_runs"]["outcome"] == "passed"
    assert "test_elsewhere" not in _ends(record)  # passed by: neither run nor recorded
