"""Time limits and rank agreement for the GPU suite: pytest alone, or one pytest per rank under
torchrun (one host).

A test that hangs must end as a failure that names it, and the job must go on or end, never wait.
Under torchrun every rank runs the same tests, so two more things can go wrong: a rank stuck in
a collective waits for the others as long as NCCL lets it (its watchdog: minutes), and a rank
that fails early and goes on enters the next test's collectives, which the others, still in the
last test, never match. So:

* **A watchdog thread per process** gives each test ``MH_TEST_TIMEOUT`` seconds (default
  :data:`DEFAULT_LIMIT`; the marker ``time_limit(seconds)`` sets a test's own). At the limit it
  prints the test, the rank and every thread's stack, and ends the processes the test started
  (:func:`track_child`). Then, alone, it raises :class:`TestTimeout` in the main thread: the
  test fails and the run goes on; if the main thread does not come back within ``GRACE`` seconds
  (stuck in a C call), the process exits. Under torchrun with several ranks a timeout always
  exits the process (code :data:`ABORT_CODE`): the ranks cannot agree on where they are, and
  torchrun stops the others when one exits.
* **A barrier between tests, outside NCCL** (files in a folder of this job): no rank starts a
  test before every rank has finished the one before, each rank's outcome reaches rank 0, and
  rank 0 reports the worst (a test failed on rank 2 is failed, and every rank's exit status says
  so). A rank that failed a test while other ranks are still in it (most likely waiting in a
  collective it left) waits ``GRACE`` seconds for them and then exits, naming the test.
* **A record** (``MH_TEST_RECORD=FILE``): one JSON line per test (node id, outcome, seconds,
  the skip reason or failure message, the ranks that failed it) and one when it starts. Tests
  already finished in the file are deselected when a job starts, so the suite runner
  (``tests/functional/run_suite.py``) starts the job again after an abort and loses only the
  test that hung.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

#: Seconds a test may take unless ``MH_TEST_TIMEOUT`` or its ``time_limit`` marker says more.
DEFAULT_LIMIT = 120.0
#: Exit code of a process the guard ends (a timeout, or ranks that cannot agree).
ABORT_CODE = 3
_POLL = 0.05


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity, not the host's count (a runner bound
    to part of a host, e.g. ``scripts/gpu_split.sh``'s slices, shares the rest with others)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


class TestTimeout(Exception):  # noqa: N818 - reads as what happened, like TimeoutError
    """Raised in the main thread when a test runs past its limit (single process only)."""

    __test__ = False  # not a test class


@dataclass
class Outcome:
    """One test's result on this rank (``failed`` wins over ``skipped`` over ``passed``)."""

    nodeid: str
    outcome: str = "passed"
    detail: str = ""
    seconds: float = 0.0
    ranks_failed: list[int] = field(default_factory=list)
    peak_gib: float = 0.0  # the most GPU memory this test's ranks held (the caching allocator's)


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def _short(text: str, limit: int = 600) -> str:
    """The end of a failure text (its last lines say what failed), on one line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    tail = " | ".join(lines[-6:])
    return tail if len(tail) <= limit else "..." + tail[-limit:]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return _short(str(longrepr))


# Process trees the running test started (torchrun jobs of the launcher tests).
_children: dict[int, object] = {}
_children_lock = threading.Lock()


def track_child(proc) -> None:
    """Have the guard end ``proc`` and its descendants if the running test times out."""
    with _children_lock:
        _children[proc.pid] = proc


def untrack_child(proc) -> None:
    with _children_lock:
        _children.pop(proc.pid, None)


def kill_tree(pid: int, grace: float = 5.0) -> None:
    """SIGTERM ``pid`` and every descendant (torchrun puts each worker in a session of its own,
    so its process group is not enough), then SIGKILL what is left after ``grace`` seconds."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is on every machine we run on
        os.kill(pid, signal.SIGKILL)
        return
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


def _release_gpu_memory() -> float:
    """Returns this process's peak reserved GPU memory (GiB) since the last test and hands its
    cached blocks back to the driver.

    The runner's lanes put several processes on every GPU; memory one test's process keeps cached
    is memory a neighbour's test cannot get (on 4 x H100, 2026-11-28: a Triton launch and an
    NCCL all-to-all failed with CUDA out of memory while the neighbours held their caches).
    """
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    import gc

    gc.collect()
    peak = torch.cuda.max_memory_reserved() / 2**30
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return round(peak, 2)


def _kill_children() -> None:
    with _children_lock:
        procs = list(_children.values())
        _children.clear()
    for proc in procs:
        kill_tree(proc.pid)


class SuiteGuard:
    """The pytest plugin; :func:`install` registers one per process."""

    def __init__(self, config, root: Path) -> None:
        self.config = config
        self.here = Path(root).resolve()
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.limit = _env_float("MH_TEST_TIMEOUT", DEFAULT_LIMIT)
        self.grace = _env_float("MH_TEST_GRACE", 30.0)
        record = os.environ.get("MH_TEST_RECORD")
        self.record = Path(record) if record else None
        self.sync_dir = self._sync_dir() if self.world > 1 else None
        self.index = 0
        self.current: Outcome | None = None
        self.in_phase = False
        self.lock = threading.Lock()
        self.deadline: float | None = None
        self.soft_fired = False
        self.started = 0.0
        self.limit_now = self.limit
        self.stop = threading.Event()
        self.main_thread = threading.main_thread().ident
        if self.world == 1 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._raise_timeout)
        self.thread = threading.Thread(target=self._watch, name="suite-guard", daemon=True)
        self.thread.start()
        #: ``item -> bool``: whether this job runs a test (False: another lane does; it is then
        #: neither run, recorded nor agreed on). The functional conftest sets it.
        self.runs_here = lambda item: True

    # -- the job's folder for the barrier ---------------------------------------------------

    @staticmethod
    def _sync_dir() -> Path:
        """A folder every rank of this torchrun job names alike: torchrun starts its workers
        itself, so they share its process id (their parent's), which no other job has now."""
        name = os.environ.get("MH_SYNC_DIR") or str(
            Path(tempfile.gettempdir())
            / f"mh-functional-{os.getppid()}-{os.environ.get('MASTER_PORT', '0')}"
        )
        path = Path(name)
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- records ----------------------------------------------------------------------------

    def finished_nodeids(self) -> set[str]:
        """Node ids the record already holds an end for."""
        if self.record is None or not self.record.exists():
            return set()
        done = set()
        for line in self.record.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut off by a killed process
            if entry.get("event") == "end":
                done.add(entry["nodeid"])
        return done

    def _write_record(self, **entry) -> None:
        if self.record is None:
            return
        line = json.dumps(entry) + "\n"
        # One short append: atomic among the ranks of this host.
        fd = os.open(self.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    # -- the watchdog -----------------------------------------------------------------------

    def _say(self, text: str) -> None:
        message = f"\n== suite guard, rank {self.rank}: {text}\n"
        streams = [sys.__stderr__] + ([sys.stderr] if sys.stderr is not sys.__stderr__ else [])
        for stream in streams:
            try:
                stream.write(message)
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass

    def _watch(self) -> None:
        while not self.stop.wait(0.2):
            with self.lock:
                late = self.deadline is not None and time.monotonic() > self.deadline
                soft = self.soft_fired
            if late:
                self._fire(hard=soft or self.world > 1)

    def _fire(self, hard: bool) -> None:
        current = self.current
        nodeid = current.nodeid if current else "(between tests)"
        limit = self.limit_now
        if hard:  # the process ends: say it where a person sees it, not into pytest's capture
            self._release_capture()
        self._say(f"TIMEOUT {nodeid}: still running after {limit:.0f} s; every thread's stack:")
        try:
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        except (OSError, ValueError, AttributeError):
            pass
        _kill_children()
        if hard:
            reason = "job aborted" if self.world > 1 else "the test did not return"
            self.abort(f"timed out after {limit:.0f} s on rank {self.rank} ({reason})")
        with self.lock:
            self.soft_fired = True
            self.deadline = time.monotonic() + self.grace
        signal.pthread_kill(self.main_thread, signal.SIGUSR1)

    def _release_capture(self) -> None:
        """Give stdout and stderr back from pytest's capture (the process is about to end)."""
        capman = self.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            with contextlib.suppress(Exception):
                capman.suspend_global_capture(in_=False)

    def _raise_timeout(self, signum, frame) -> None:
        with self.lock:
            fired, in_phase = self.soft_fired, self.in_phase
        if fired and in_phase:
            nodeid = self.current.nodeid if self.current else "?"
            raise TestTimeout(f"{nodeid} ran past its limit of {self.limit_now:.0f} s")

    def abort(self, message: str) -> None:
        """End this process (and with it, under torchrun, the job), recording the test."""
        self._release_capture()
        current = self.current
        if current is not None and self._claim_abort():
            self._write_record(
                event="end", nodeid=current.nodeid, outcome="failed", detail=message,
                seconds=round(time.monotonic() - self.started, 1), ranks_failed=[self.rank],
                aborted=True,
            )  # fmt: skip
        self._say(f"ABORT {current.nodeid if current else ''}: {message}")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(ABORT_CODE)

    def _claim_abort(self) -> bool:
        """Whether this rank writes the abort's record (the first rank to get here does)."""
        if self.sync_dir is None:
            return True
        try:
            os.close(os.open(self.sync_dir / f"abort.{self.index}", os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    # -- hooks ------------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not Path(item.path).resolve().is_relative_to(self.here):
            return (yield)  # a test of another folder in the same session: not ours to guard
        # Another lane's (claimed files): a hook of the conftest passes it by. A claim that
        # never comes (this lane's rank 0 gone) raises here, outside any test: torchrun has
        # ended the job by then anyway, as it does when any worker dies.
        if not self.runs_here(item):
            return (yield)
        marker = item.get_closest_marker("time_limit")
        self.limit_now = float(marker.args[0]) if marker else self.limit
        self.current = Outcome(item.nodeid)
        self.started = time.monotonic()
        if self.rank == 0:
            self._write_record(event="start", nodeid=item.nodeid)
        with self.lock:
            self.soft_fired = False
            self.deadline = self.started + self.limit_now
        result = yield
        self.current.seconds = round(time.monotonic() - self.started, 1)
        self.current.peak_gib = _release_gpu_memory()
        outcome = self._agree(self.current)
        with self.lock:
            self.deadline = None
        _kill_children()
        if self.rank == 0:
            self._write_record(event="end", **asdict(outcome))
        self.index += 1
        self.current = None
        return result

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        """The session's last fixture teardowns under a test's time limit: where the last test
        this job ran was not the last it collected (its lane passed by files another lane
        claimed), pytest tears the session fixtures down here, outside any test (the functional
        ``world`` fixture destroys the process groups)."""
        self.limit_now = self.limit
        with self.lock:
            self.soft_fired = False
            self.deadline = time.monotonic() + self.limit
        try:
            return (yield)
        finally:
            with self.lock:
                self.deadline = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        with self._phase():
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        with self._phase():
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item):
        with self._phase():
            return (yield)

    @contextlib.contextmanager
    def _phase(self):
        """Marks setup, call and teardown: only there may a timeout raise in the main thread
        (pytest turns it into the test's failure; elsewhere it would break pytest itself)."""
        with self.lock:
            self.in_phase = True
        try:
            yield
        finally:
            with self.lock:
                self.in_phase = False

    def pytest_runtest_logreport(self, report) -> None:
        current = self.current
        if current is None or report.nodeid != current.nodeid:
            return
        if report.failed and current.outcome != "failed":
            current.outcome = "failed"
            current.detail = _short(report.longreprtext)
        elif report.skipped and current.outcome == "passed":
            current.outcome = "skipped"
            current.detail = _skip_reason(report)

    def pytest_unconfigure(self, config) -> None:
        """The other ranks end after rank 0 has printed its summary: torchrun stops every
        worker as soon as one exits with an error, which would cut rank 0's report short."""
        self.stop.set()
        if self.sync_dir is None:
            return
        done = self.sync_dir / "rank0.finished"
        if self.rank == 0:
            done.touch()
            return
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(_POLL)

    # -- ranks agree --------------------------------------------------------------------------

    def _agree(self, mine: Outcome) -> Outcome:
        """Wait (outside NCCL) until every rank has finished this test; the worst outcome."""
        if self.sync_dir is None:
            if mine.outcome == "failed":
                mine.ranks_failed = [self.rank]
            return mine
        own = self.sync_dir / f"{self.index}.{self.rank}.json"
        tmp = own.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(mine)))
        os.replace(tmp, own)
        waiting_since = time.monotonic()
        paths = [self.sync_dir / f"{self.index}.{r}.json" for r in range(self.world)]
        while True:
            missing = [r for r, p in enumerate(paths) if not p.exists()]
            if not missing:
                break
            if mine.outcome == "failed" and time.monotonic() - waiting_since > self.grace:
                self.abort(
                    f"failed here ({mine.detail}); rank(s) {missing} still in the test after "
                    f"{self.grace:.0f} s, most likely waiting in a collective this rank left"
                )
            time.sleep(_POLL)  # the watchdog's deadline still covers this wait
        outcomes = [Outcome(**json.loads(p.read_text())) for p in paths]
        worst = Outcome(
            mine.nodeid,
            seconds=max(o.seconds for o in outcomes),
            peak_gib=max(o.peak_gib for o in outcomes),
        )
        failed = [r for r, o in enumerate(outcomes) if o.outcome == "failed"]
        if failed:
            worst.outcome, worst.ranks_failed = "failed", failed
            worst.detail = "; ".join(f"rank {r}: {outcomes[r].detail}" for r in failed)
        elif any(o.outcome == "skipped" for o in outcomes):
            skipped = next(o for o in outcomes if o.outcome == "skipped")
            worst.outcome, worst.detail = "skipped", skipped.detail
        if failed and mine.outcome != "failed":
            # Every rank's exit status says the test failed; -x stops every rank alike.
            session = self.config._mh_session
            session.testsfailed += 1
            maxfail = self.config.getvalue("maxfail")
            if maxfail and session.testsfailed >= maxfail:
                session.shouldfail = f"stopping after {session.testsfailed} failures"
            if self.rank == 0:
                self._say(f"FAILED on rank(s) {failed}: {mine.nodeid}: {worst.detail}")
        return worst

    def pytest_sessionstart(self, session) -> None:
        self.config._mh_session = session

    def pytest_collection_finish(self, session) -> None:
        """Record what this job will run, so that a runner can tell what never ran."""
        if self.rank == 0:
            nodeids = [item.nodeid for item in session.items
                       if Path(item.path).resolve().is_relative_to(self.here)]  # fmt: skip
            self._write_record(event="collected", nodeids=nodeids)


def install(config, root: Path) -> SuiteGuard:
    """Register the guard (from ``pytest_configure``) for the tests under ``root``, and its
    marker."""
    config.addinivalue_line(
        "markers", "time_limit(seconds): this test's own limit (the suite guard's default: "
        "MH_TEST_TIMEOUT, else 120 s)",
    )  # fmt: skip
    guard = SuiteGuard(config, root)
    config.pluginmanager.register(guard, "mh_suite_guard")
    return guard


def deselect_finished(guard: SuiteGuard, config, items) -> None:
    """Drop the tests the record already finished (a job started again after an abort)."""
    done = guard.finished_nodeids()
    if not done:
        return
    kept = [item for item in items if item.nodeid not in done]
    dropped = [item for item in items if item.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
