"""Run the whole GPU suite on this machine, as a CI runner would, and say what happened.

    python3 tests/functional/run_suite.py --out DIR [--budget SECONDS] [--gpus N]

1. Makes the Hugging Face fixture folders (``hf_fixtures.py``) in the background where
   transformers is importable (the tests that read them wait for them).
2. In-process tests: ``torchrun --nproc_per_node N -m pytest -m "not launcher" tests/functional``
   on all N GPUs, rank 0's output on the console (every rank's under ``DIR/ranks``). A test that
   hangs ends the job (``suite_guard.py``); the job then starts again without the tests already
   finished, so one hang costs one test, not the rest of the suite.
3. Launcher tests: ``pytest -m launcher tests/functional`` in one process, which starts its own
   torchrun jobs on 1, 2 or 4 of the GPUs (nothing else holds a GPU then, so jobs of another
   world size than the suite's cannot compete with it for GPUs or ports).
4. A summary: passed / failed / skipped per phase with every failure's message and every skip's
   reason, and a markdown row for docs/gpu_tests.md (``DIR/summary.md``). The exit code is 0
   only if nothing failed and everything ran within the budget.

Environment for the tests: ``MH_TRITON_ONE_CONFIG=1`` (Triton's autotuners take their first
config untimed: correctness does not depend on the config, and timing every config of every fla
kernel costs minutes on a fresh machine) and ``TRITON_F32_DEFAULT=ieee``, unless set already.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
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

#: Seconds kept for the launcher phase when the in-process phase runs long, by GPU count: its
#: torchrun jobs take 20-30 s each to start; 1 GPU: 3 jobs, 2 GPUs: 9 one after another,
#: 4 GPUs: 9 in 7 rounds (2-GPU jobs side by side).
LAUNCHER_RESERVE = {1: 100.0, 2: 230.0}
LAUNCHER_RESERVE_MORE_GPUS = 190.0
PYTEST_FLAGS = ["-q", "-s", "-p", "no:cacheprovider", "-W", "ignore"]


def _gpus() -> tuple[int, str]:
    import torch

    if not torch.cuda.is_available():
        return 0, "no CUDA GPU"
    return torch.cuda.device_count(), torch.cuda.get_device_name()


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


def _run(command, env, log, deadline) -> tuple[int | None, float]:
    """Run ``command`` until it ends or ``deadline``; its output to the console and ``log``.
    Returns its exit code (None: ended at the deadline, with its whole process tree)."""
    began = time.monotonic()
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        start_new_session=True, text=True, errors="replace",
    )  # fmt: skip

    def copy() -> None:
        with open(log, "a") as sink:
            for line in proc.stdout:
                sys.stdout.write(line)
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


def run_phase(name, command_for, env, out: Path, deadline: float, max_rounds: int = 6) -> dict:
    """Run a phase's job until every collected test has an end in its record, starting it again
    after an abort (the tests already finished are deselected then)."""
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
            code, took = _run(command_for(rounds), phase_env, log, deadline)
        seconds += took
        codes.append(code)
        ends, started = _read_record(record)
        # Started and never ended: the job died in it (the guard records its own aborts), or the
        # budget ran out in it.
        unfinished = [n for n in dict.fromkeys(started) if n not in ends]
        why = ("the suite's time budget ran out during it" if code is None else
               f"the job ended during it (exit code {code}): see ranks.log")  # fmt: skip
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
        print(f"\n== {name}: the job ended early (exit {code}); starting it again without the "
              f"{len(ends)} test(s) already finished", flush=True)  # fmt: skip
    collected: list[str] = []
    ends, _ = _read_record(record, collected)
    not_run = [n for n in collected if n not in ends]
    return dict(name=name, ends=ends, codes=codes, rounds=rounds, seconds=seconds,
                budget_hit=budget_hit, not_run=not_run)  # fmt: skip


def _collect_rank_logs(ranks: Path, target: Path, phase: dict, lines: int = 60) -> None:
    """The ends of the other ranks' logs (rank 0's is on the console) where the phase failed."""
    failed = any(e["outcome"] == "failed" for e in phase["ends"].values())
    if not failed and all(c in (0, 5) for c in phase["codes"]):
        return
    with open(target, "w") as sink:
        for path in sorted(ranks.rglob("*.log")):
            text = path.read_text(errors="replace").splitlines()
            if text:
                sink.write(f"==> {path.relative_to(ranks)} (last {lines} lines)\n")
                sink.write("\n".join(text[-lines:]) + "\n")


def _summarise(phases, gpus, device, fixtures_note, total, out: Path) -> int:
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
    if fixtures_note:
        lines.append(f"   Hugging Face fixtures: {fixtures_note}")
    for phase, nodeid, detail in failures:
        lines.append(f"FAILED [{phase}] {nodeid}: {detail}")
    for phase in phases:
        for nodeid in phase["not_run"]:
            why = "the time budget ran out, or its job kept ending"
            lines.append(f"NOT RUN [{phase['name']}] {nodeid}: {why}")
    for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
        lines.append(f"SKIPPED x{n}: {reason}")
    text = "\n".join(lines)
    print(text, flush=True)
    date = datetime.date.today().isoformat()
    reasons = "; ".join(f"{n} x {r}" for r, n in sorted(skips.items(), key=lambda kv: -kv[1]))
    row = (f"| {gpus} | {date} | {gpus} x {device} | `bash scripts/gpu_session.sh suite` | "
           f"{counts['passed']} / {counts['failed']} / {counts['skipped']}"
           f"{' / not run ' + str(sum(len(p['not_run']) for p in phases)) if not_clean else ''}"
           f" | {total:.0f} s | "
           f"{'; '.join(n for _, n, _ in failures) or 'none'} | {reasons} |")  # fmt: skip
    (out / "summary.md").write_text(text + "\n\nrow for docs/gpu_tests.md:\n" + row + "\n")
    ok = not failures and not not_clean and counts["passed"] + counts["skipped"] > 0
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/mh-suite", help="logs and the summary go here")
    parser.add_argument("--budget", type=float, default=470.0,
                        help="seconds for the whole suite (default 470)")  # fmt: skip
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--cpu", type=int, default=0, metavar="RANKS",
                        help="check the runner on a CPU: RANKS gloo processes stand for GPUs, "
                        "megatron-core's CUDA calls emulated (MH_FUNCTIONAL_ON_CPU=1)")  # fmt: skip
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for both pytest runs")
    args = parser.parse_args(argv)
    began = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus, device = (args.cpu, "CPU rank (gloo, emulated)") if args.cpu else _gpus()
    gpus = gpus if args.gpus is None else min(args.gpus, gpus)
    print(f"== GPU suite: {gpus} x {device}, Python {platform.python_version()}, "
          f"budget {args.budget:.0f} s", flush=True)  # fmt: skip
    env = dict(os.environ)
    env.setdefault("MH_TRITON_ONE_CONFIG", "1")
    env.setdefault("TRITON_F32_DEFAULT", "ieee")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if args.cpu:
        env.update(MH_FUNCTIONAL_ON_CPU="1", MH_CPU_RANKS=str(args.cpu))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))

    fixtures_note, maker = "", None
    if env.get("MH_HF_FIXTURES"):
        fixtures_note = f"given: {env['MH_HF_FIXTURES']}"
    elif (problem := hf_fixtures.transformers_problem()) is not None:
        fixtures_note = f"not made: {problem}"
    else:
        folder = Path(tempfile.mkdtemp(prefix="mh-hf-fixtures-"))
        (folder / hf_fixtures.MAKING).touch()
        maker = subprocess.Popen(
            [sys.executable, str(HERE / "hf_fixtures.py"), str(folder)],
            stdout=open(out / "hf_fixtures.log", "w"), stderr=subprocess.STDOUT, cwd=ROOT,
            env={**env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "8"},
        )  # fmt: skip
        env["MH_HF_FIXTURES"] = str(folder)
        fixtures_note = f"made here in {folder}"

    phases = []
    if gpus == 0:
        print("no GPU: every test would skip; nothing run", flush=True)
    else:
        deadline = began + args.budget
        reserve = LAUNCHER_RESERVE.get(gpus, LAUNCHER_RESERVE_MORE_GPUS)
        ranks = Path(tempfile.mkdtemp(prefix="mh-suite-ranks-"))

        def in_process(round_: int) -> list[str]:
            return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus),
                    "--log-dir", str(ranks / f"round{round_}"), "--redirects", "3", "--tee", "3",
                    "--local-ranks-filter", "0", "-m", "pytest", "tests/functional", "-m",
                    "not launcher and not own_job", *PYTEST_FLAGS, *args.pytest_args]  # fmt: skip

        def launcher(_round: int) -> list[str]:
            return [sys.executable, "-m", "pytest", "tests/functional", "-m", "launcher",
                    *PYTEST_FLAGS, *args.pytest_args]  # fmt: skip

        phases.append(run_phase("in_process", in_process, env, out, deadline - reserve))
        _collect_rank_logs(ranks, out / "ranks.log", phases[-1])
        phases.append(run_phase("launcher", launcher, env, out, deadline))
    if maker is not None:
        if maker.poll() is None:
            suite_guard.kill_tree(maker.pid)
        elif maker.returncode != 0:
            fixtures_note += f" (failed: see {out / 'hf_fixtures.log'})"
    return _summarise(phases, gpus, device, fixtures_note, time.monotonic() - began, out)


if __name__ == "__main__":
    sys.exit(main())
