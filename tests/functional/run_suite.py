"""Run the whole GPU suite on this machine, as a CI runner would, and say what happened.

    python3 tests/functional/run_suite.py --out DIR [--budget SECONDS] [--gpus N] [--lanes L]
        [--in-process-lanes K] [-- PYTEST_ARGS]

Side by side, from the start, each within the one budget:

1. The Hugging Face fixture folders (``hf_fixtures.py``), made in the background on the CPU
   where transformers is importable, at low priority and with a few threads (the tests that
   read them run last and wait for them).
2. In-process tests: ``torchrun --nproc_per_node N -m pytest -m "not launcher" tests/functional``
   on all N GPUs, rank 0's output on the console, in ``K`` jobs side by side (lanes,
   ``MH_LANE`` with ``MH_LANE_BY=claim``: each job all GPUs, the files claimed one at a time by
   the first lane free to take the next, costliest first, so that more cores compile kernels at
   once and the lanes end together). A test that hangs ends its job (``suite_guard.py``); the
   job then starts again without the tests already finished, so one hang costs one test, not
   the rest of the suite. The files that read the fixture folders come last (``suite_plan.py``).
3. Launcher tests: ``pytest -m launcher tests/functional`` in ``L`` processes (lanes,
   ``MH_LANE``), each test starting its own torchrun jobs on 1, 2 or 4 of the GPUs. Their jobs
   share the GPUs with the in-process job: they are small models whose time goes into starting
   (imports, NCCL, compiling), so running them beside the in-process tests, instead of after,
   saves most of their time.

Then a summary: passed / failed / skipped per phase with every failure's message and every
skip's reason, and a markdown row for docs/gpu_tests.md. ``DIR`` gets four files: ``suite.log``
(the console, written as it comes: every phase's lines, each lane's prefixed),
``records.jsonl`` (one line per test start and end, with its phase), ``extra.log`` (the ends of
the other ranks' logs where a phase failed, and the fixture maker's output) and ``summary.md``.
The exit code is 0 only if nothing failed and everything ran within the budget.

Environment for the tests: ``MH_TRITON_ONE_CONFIG=1`` (Triton's autotuners take their first
config untimed: correctness does not depend on the config, and timing every config of every fla
kernel costs minutes on a fresh machine), ``TRITON_F32_DEFAULT=ieee`` and
``TORCHINDUCTOR_COMPILE_THREADS`` (a share of the cores per GPU process), unless set already.
``MH_COMPILE_CACHE`` (set by ``scripts/gpu_session.sh suite``) says whether Triton's and
inductor's caches started empty; the summary's row says so.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import hf_fixtures  # noqa: E402
import suite_guard  # noqa: E402

#: Seconds for the whole suite: a device call is at most 600 s and the suite must end within
#: 8 minutes (480 s), of which gpu_session.sh's wheel install and the interpreter's start take
#: some.
DEFAULT_BUDGET = 450.0
#: Launcher lanes run side by side (see the module doc). On 2 x H200 (2026-11-27) two lanes took
#: 580 s of tests in one and 340 s in the other (their split follows the tests' time limits, not
#: their times: the data test alone took 285 s); three keep each lane near 400 s.
DEFAULT_LANES = 3
#: In-process jobs side by side: on 1, 2 and 4 x H200 (2026-11-27) two jobs' files took 280-370 s
#: in one and 430-470 s in the other (about 830 s of files in all, most of it compiling on the
#: CPU); three share it at about 280 s each.
DEFAULT_IN_PROCESS_LANES = 3
PYTEST_FLAGS = ["-q", "-s", "-p", "no:cacheprovider", "-W", "ignore"]


class Console:
    """The suite's console: lines of phases running side by side, each line whole, on stdout
    and in ``suite.log`` as they come (a run cut off still leaves its log)."""

    def __init__(self, log: Path) -> None:
        self.log = open(log, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self.lock = threading.Lock()

    def write(self, text: str, prefix: str = "") -> None:
        lines = text.splitlines(keepends=True)
        with self.lock:
            for line in lines:
                sys.stdout.write(prefix + line)
                self.log.write(prefix + line)
            sys.stdout.flush()

    def close(self) -> None:
        self.log.close()


def _gpus() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        return 0, "no CUDA GPU"
    return torch.cuda.device_count(), torch.cuda.get_device_name()


class MemorySampler(threading.Thread):
    """Samples every visible GPU's used memory (``nvidia-smi``, device-wide: all processes,
    PyTorch's caches and NCCL's or Triton's own allocations alike) until :meth:`stop`."""

    def __init__(self, every: float = 5.0) -> None:
        super().__init__(name="gpu-memory", daemon=True)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.only = {v.strip() for v in visible.split(",") if v.strip()}
        self.every, self.peaks, self.total = every, {}, {}
        self.done = threading.Event()

    def run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                 "--format=csv,noheader,nounits"]  # fmt: skip
        while not self.done.wait(self.every):
            try:
                text = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in text.splitlines():
                index, used, total = (part.strip() for part in line.split(","))
                if self.only and index not in self.only:
                    continue
                self.peaks[index] = max(self.peaks.get(index, 0.0), float(used) / 1024)
                self.total[index] = float(total) / 1024

    def stop(self) -> str | None:
        """Ends sampling; the note for the summary, or None without samples."""
        self.done.set()
        if not self.peaks:
            return None
        return "GPU memory used at most (device-wide, sampled): " + "; ".join(
            f"GPU {i} {self.peaks[i]:.1f} of {self.total[i]:.0f} GiB" for i in sorted(self.peaks)
        )


def _read_record(path: Path, collected: list | None = None) -> tuple[dict[str, dict], list[str]]:
    """Ends by node id, and node ids started (in order); ``collected`` gets the node ids the
    jobs collected."""
    ends, started = {}, []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if entry.get("event") == "start":
                started.append(entry["nodeid"])
            elif entry.get("event") == "end":
                ends[entry["nodeid"]] = entry
            elif entry.get("event") == "collected" and collected is not None:
                collected.extend(n for n in entry["nodeids"] if n not in collected)
    return ends, started


def _run(command, env, log, deadline, console=None, prefix="") -> tuple[int | None, float]:
    """Run ``command`` until it ends or ``deadline``; its output to ``log`` and the console
    (``console``, else stdout), each line after ``prefix``. Returns its exit code (None: ended
    at the deadline, with its whole process tree)."""
    began = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        start_new_session=True, text=True, errors="replace",
    )  # fmt: skip

    def copy() -> None:
        with open(log, "a") as sink:
            for line in proc.stdout:
                if console is None:
                    sys.stdout.write(prefix + line)
                else:
                    console.write(line, prefix)
                sink.write(line)
        sys.stdout.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    timed_out = False
    while proc.poll() is None:
        if time.monotonic() > deadline:
            timed_out = True
            suite_guard.kill_tree(proc.pid)
            break
        time.sleep(0.2)
    proc.wait()
    reader.join(timeout=30)
    return (None if timed_out else proc.returncode), time.monotonic() - began


def run_phase(name, command_for, env, out: Path, deadline: float, max_rounds: int = 6,
              console: Console | None = None, prefix: str = "") -> dict:  # fmt: skip
    """Run a phase's job until every collected test has an end in its record (``out/NAME.jsonl``,
    its output in ``out/NAME.log``), starting it again after an abort (the tests already
    finished are deselected then)."""
    record = out / f"{name}.jsonl"
    record.unlink(missing_ok=True)
    phase_env = {**env, "MH_TEST_RECORD": str(record)}
    log = out / f"{name}.log"
    log.unlink(missing_ok=True)
    rounds, codes, budget_hit, seconds = 0, [], False, 0.0
    while rounds < max_rounds:
        rounds += 1
        before = set(_read_record(record)[0])
        with tempfile.TemporaryDirectory(prefix=f"mh-{name}-") as sync:
            phase_env["MH_SYNC_DIR"] = sync
            code, took = _run(command_for(rounds), phase_env, log, deadline, console, prefix)
        seconds += took
        codes.append(code)
        ends, started = _read_record(record)
        # Started and never ended: the job died in it (the guard records its own aborts), or the
        # budget ran out in it.
        unfinished = [n for n in dict.fromkeys(started) if n not in ends]
        why = ("the suite's time budget ran out during it" if code is None else
               f"the job ended during it (exit code {code}): see extra.log")  # fmt: skip
        with open(record, "a") as sink:
            for nodeid in unfinished:
                sink.write(json.dumps(dict(event="end", nodeid=nodeid, outcome="failed",
                                           detail=why, aborted=True)) + "\n")  # fmt: skip
        ends, _ = _read_record(record)
        if code is None:
            budget_hit = True
            break
        new = set(ends) - before
        if not any(ends[n].get("aborted") for n in new):
            break  # a normal end: every collected test ran
        message = (f"\n== {name}: the job ended early (exit {code}); starting it again without "
                   f"the {len(ends)} test(s) already finished\n")  # fmt: skip
        if console is not None:
            console.write(message)
        else:
            print(message, flush=True)
    collected: list[str] = []
    ends, _ = _read_record(record, collected)
    not_run = [n for n in collected if n not in ends]
    return dict(name=name, ends=ends, codes=codes, rounds=rounds, seconds=seconds,
                budget_hit=budget_hit, not_run=not_run)  # fmt: skip


def shared_not_run(phases: list[dict]) -> None:
    """Lanes that share their tests (claimed files): each collects every test and runs a share,
    so a test is not run only if no lane ended it, and it is listed once, under the first lane
    that collected it."""
    ended = set().union(*(phase["ends"] for phase in phases))
    listed: set[str] = set()
    for phase in phases:
        phase["not_run"] = [n for n in phase["not_run"] if n not in ended and n not in listed]
        listed.update(phase["not_run"])


def _rank_logs(ranks: Path, phase: dict, lines: int = 60) -> str:
    """The ends of the other ranks' logs (rank 0's is on the console) where the phase failed."""
    failed = any(e["outcome"] == "failed" for e in phase["ends"].values())
    if not failed and all(c in (0, 5) for c in phase["codes"]):
        return ""
    parts = []
    for path in sorted(ranks.rglob("*.log")):
        text = path.read_text(errors="replace").splitlines()
        if text:
            parts.append(f"==> {path.relative_to(ranks)} (last {lines} lines)\n")
            parts.append("\n".join(text[-lines:]) + "\n")
    return "".join(parts)


def _merge_records(phases: list[dict], work: Path, target: Path) -> None:
    """Every phase's record in one file, each line with its phase."""
    with open(target, "w") as sink:
        for phase in phases:
            record = work / f"{phase['name']}.jsonl"
            if not record.exists():
                continue
            for line in record.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                sink.write(json.dumps({"phase": phase["name"], **entry}) + "\n")


def _summarise(phases, gpus, device, notes, total, out: Path, console: Console) -> int:
    counts = collections.Counter()
    failures, skips = [], collections.Counter()
    for phase in phases:
        for entry in phase["ends"].values():
            counts[entry["outcome"]] += 1
            if entry["outcome"] == "failed":
                failures.append((phase["name"], entry["nodeid"], entry.get("detail", "")))
            elif entry["outcome"] == "skipped":
                skips[entry.get("detail", "")] += 1
    not_clean = [p["name"] for p in phases if p["budget_hit"] or p["not_run"] or
                 any(c not in (0, 1, 5) for c in p["codes"])]  # fmt: skip
    lines = [
        f"\n== GPU suite on {gpus} x {device}: {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['skipped']} skipped in {total:.0f} s"
    ]
    for phase in phases:
        c = collections.Counter(e["outcome"] for e in phase["ends"].values())
        lines.append(f"   {phase['name']}: {c['passed']} passed, {c['failed']} failed, "
                     f"{c['skipped']} skipped, {phase['seconds']:.0f} s, {phase['rounds']} "
                     f"job(s), exit codes {phase['codes']}"
                     + ("  (time budget ran out)" if phase["budget_hit"] else ""))  # fmt: skip
    lines += [f"   {note}" for note in notes]
    for phase, nodeid, detail in failures:
        lines.append(f"FAILED [{phase}] {nodeid}: {detail}")
    for phase in phases:
        for nodeid in phase["not_run"]:
            why = "the time budget ran out, or its job kept ending"
            lines.append(f"NOT RUN [{phase['name']}] {nodeid}: {why}")
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        lines.append(f"SKIPPED x{n}: {reason}")
    slowest = sorted((e.get("seconds") or 0.0, e["nodeid"]) for p in phases
                     for e in p["ends"].values())[-8:]  # fmt: skip
    lines.append("slowest: " + "; ".join(f"{n.split('/')[-1]} {t:.0f} s" for t, n in slowest[::-1]))
    hungriest = sorted((e.get("peak_gib") or 0.0, e["nodeid"]) for p in phases
                       for e in p["ends"].values())[-5:]  # fmt: skip
    lines.append("most GPU memory (one rank's peak, reserved): " + "; ".join(
        f"{n.split('/')[-1]} {g:.1f} GiB" for g, n in hungriest[::-1]))  # fmt: skip
    # What suite_plan's seconds tables (the in-process lanes' split) are refreshed from.
    by_file = collections.Counter()
    for phase in phases:
        if phase["name"].startswith("in_process"):
            for entry in phase["ends"].values():
                by_file[entry["nodeid"].split("::")[0].split("/")[-1]] += (
                    entry.get("seconds") or 0.0
                )
    lines.append("in-process seconds by file: " + "; ".join(
        f"{name} {t:.0f}" for name, t in by_file.most_common()))  # fmt: skip
    text = "\n".join(lines)
    console.write(text + "\n")
    date = datetime.date.today().isoformat()
    reasons = "; ".join(f"{n} x {r}" for r, n in sorted(skips.items(), key=lambda kv: -kv[1]))
    cache = os.environ.get("MH_COMPILE_CACHE", "")
    command = "`bash scripts/gpu_session.sh suite`" + (f" ({cache} compile cache)" if cache else "")
    row = (f"| {gpus} | {date} | {gpus} x {device} | {command} | "
           f"{counts['passed']} / {counts['failed']} / {counts['skipped']}"
           f"{' / not run ' + str(sum(len(p['not_run']) for p in phases)) if not_clean else ''}"
           f" | {total:.0f} s | "
           f"{'; '.join(n for _, n, _ in failures) or 'none'} | {reasons} |")  # fmt: skip
    (out / "summary.md").write_text(text + "\n\nrow for docs/gpu_tests.md:\n" + row + "\n")
    ok = not failures and not not_clean and counts["passed"] + counts["skipped"] > 0
    return 0 if ok else 1


def _start_fixtures(env: dict, work: Path) -> tuple[subprocess.Popen | None, str]:
    """Start making the Hugging Face fixture folders in the background, or say why not.

    The maker runs transformers on the CPU while the tests compile kernels there too: it gets a
    quarter of the cores (at least 2, at most 8) and a lower priority, so that it takes what
    the tests leave.
    """
    if env.get("MH_HF_FIXTURES"):
        return None, f"given: {env['MH_HF_FIXTURES']}"
    if (problem := hf_fixtures.transformers_problem()) is not None:
        return None, f"not made: {problem}"
    folder = Path(tempfile.mkdtemp(prefix="mh-hf-fixtures-"))
    (folder / hf_fixtures.MAKING).touch()
    threads = str(max(2, min(8, suite_guard.usable_cores() // 4)))
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    maker = subprocess.Popen(
        [*nice, sys.executable, str(HERE / "hf_fixtures.py"), str(folder)],
        stdout=open(work / "hf_fixtures.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT,
        env={**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads},
    )  # fmt: skip
    env["MH_HF_FIXTURES"] = str(folder)
    return maker, f"made here in {folder} ({threads} threads{', nice 10' if nice else ''})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/mh-suite", help="logs and the summary go here")
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        help=f"seconds for the whole suite (default {DEFAULT_BUDGET:.0f})",
    )
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument(
        "--lanes",
        type=int,
        default=DEFAULT_LANES,
        help=f"launcher processes side by side (default {DEFAULT_LANES})",
    )
    parser.add_argument("--in-process-lanes", type=int, default=DEFAULT_IN_PROCESS_LANES,
                        help="in-process torchrun jobs side by side, each on all GPUs, the files "
                        f"split between them (default {DEFAULT_IN_PROCESS_LANES})")  # fmt: skip
    parser.add_argument("--cpu", type=int, default=0, metavar="RANKS",
                        help="check the runner on a CPU: RANKS gloo processes stand for GPUs, "
                        "megatron-core's CUDA calls emulated (MH_FUNCTIONAL_ON_CPU=1)")  # fmt: skip
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for every pytest run")
    args = parser.parse_args(argv)
    if args.lanes < 1 or args.in_process_lanes < 1:
        parser.error(f"--lanes and --in-process-lanes must be at least 1, got {args.lanes} and "
                     f"{args.in_process_lanes}")  # fmt: skip
    began = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mh-suite-"))
    console = Console(out / "suite.log")
    gpus, device = (args.cpu, "CPU rank (gloo, emulated)") if args.cpu else _gpus()
    gpus = gpus if args.gpus is None else min(args.gpus, gpus)
    device = f"{device}, {suite_guard.usable_cores()} CPU cores"  # a slice of a host says so
    console.write(f"== GPU suite: {gpus} x {device}, Python {platform.python_version()}, "
                  f"budget {args.budget:.0f} s, {args.in_process_lanes} in-process and "
                  f"{args.lanes} launcher lane(s)\n")  # fmt: skip
    env = dict(os.environ)
    env.setdefault("MH_TRITON_ONE_CONFIG", "1")
    env.setdefault("TRITON_F32_DEFAULT", "ieee")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Inductor gives every process that compiles a pool of min(32, cores) workers; with the
    # lanes' ranks and the launcher jobs' side by side, a share each keeps them within the cores.
    processes = max(1, gpus) * (args.in_process_lanes + args.lanes)
    cores = suite_guard.usable_cores()
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, cores // processes)))
    if args.cpu:
        env.update(MH_FUNCTIONAL_ON_CPU="1", MH_CPU_RANKS=str(args.cpu))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    maker, fixtures_note = _start_fixtures(env, work)
    notes = [f"Hugging Face fixtures: {fixtures_note}"]
    if os.environ.get("CUDA_VISIBLE_DEVICES"):  # e.g. one slice of scripts/gpu_split.sh
        notes.append(f"GPUs {os.environ['CUDA_VISIBLE_DEVICES']} of the host")
    if os.environ.get("MH_COMPILE_CACHE"):
        notes.append(f"compile caches: {os.environ['MH_COMPILE_CACHE']}")
    phases: list[dict] = []
    in_process_names: list[str] = []
    ranks = work / "ranks"
    if gpus == 0:
        console.write("no GPU: every test would skip; nothing run\n")
    else:
        deadline = began + args.budget

        def in_process_job(name: str):
            def command(round_: int) -> list[str]:
                return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                        str(gpus), "--standalone", "--log-dir",
                        str(ranks / name / f"round{round_}"), "--redirects", "3", "--tee", "3",
                        "--local-ranks-filter", "0", "-m", "pytest", "tests/functional", "-m",
                        "not launcher and not own_job", *PYTEST_FLAGS,
                        *args.pytest_args]  # fmt: skip

            return command

        def launcher(_round: int) -> list[str]:
            return [sys.executable, "-m", "pytest", "tests/functional", "-m", "launcher",
                    *PYTEST_FLAGS, *args.pytest_args]  # fmt: skip

        jobs = []
        claims = work / "claims"  # the in-process lanes' claimed files (suite_plan.claim)
        claims.mkdir()
        for lane in range(args.in_process_lanes):
            name = f"in_process{lane}" if args.in_process_lanes > 1 else "in_process"
            lane_env = {**env, "MH_LANE": f"{lane}/{args.in_process_lanes}",
                        "MH_LANE_BY": "claim", "MH_LANE_CLAIMS": str(claims)}  # fmt: skip
            prefix = f"[{name}] " if args.in_process_lanes > 1 else ""
            jobs.append((name, in_process_job(name), lane_env, prefix))
        in_process_names = [name for name, *_ in jobs]
        for lane in range(args.lanes):
            name = f"launcher{lane}" if args.lanes > 1 else "launcher"
            jobs.append((name, launcher, {**env, "MH_LANE": f"{lane}/{args.lanes}"},
                         f"[{name}] "))  # fmt: skip
        results: dict[str, dict] = {}

        def run(name, command_for, phase_env, prefix) -> None:
            results[name] = run_phase(name, command_for, phase_env, work, deadline,
                                      console=console, prefix=prefix)  # fmt: skip

        threads = [threading.Thread(target=run, args=job, name=job[0]) for job in jobs]
        sampler = MemorySampler()
        sampler.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if (memory := sampler.stop()) is not None:
            notes.append(memory)
        phases = [results[name] for name, *_ in jobs]
        shared_not_run([p for p in phases if p["name"] in in_process_names])
    extra = [_rank_logs(ranks / p["name"], p) for p in phases if p["name"] in in_process_names]
    if maker is not None:
        if maker.poll() is None:
            suite_guard.kill_tree(maker.pid)
            notes[0] += " (unfinished when the tests ended)"
        elif maker.returncode != 0:
            notes[0] += " (failed: see extra.log)"
        made = (work / "hf_fixtures.log").read_text(errors="replace")
        extra.append("==> hf_fixtures.py\n" + made)
    (out / "extra.log").write_text("".join(extra))
    _merge_records(phases, work, out / "records.jsonl")
    code = _summarise(phases, gpus, device, notes, time.monotonic() - began, out, console)
    console.close()
    # What is worth keeping is in DIR now; the fixture folders were made for this run only.
    shutil.rmtree(work, ignore_errors=True)
    if maker is not None:
        shutil.rmtree(env["MH_HF_FIXTURES"], ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
