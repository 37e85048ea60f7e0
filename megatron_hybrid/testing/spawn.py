"""Run a function on several gloo ranks in fresh processes (for CPU tests and demos).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo
process group in each, calls ``fn(rank, world_size, *args)`` and returns the per-rank results in
rank order. An exception on any rank is re-raised in the caller with the failing rank's
traceback, so a failing multi-process test reads like a single-process one.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

from megatron_hybrid.process_groups import free_port

__all__ = ["DistributedRunError", "free_port", "run_distributed"]


class DistributedRunError(RuntimeError):
    """A rank of :func:`run_distributed` raised; the message carries its traceback."""


def _worker(rank, world_size, port, fn, args, env, queue):  # pragma: no cover - child process
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a picklable (module-level) function. Its return value must be picklable.
        world_size: number of processes.
        *args: extra picklable arguments passed to every rank.
        env: environment variables set in every child before the process group starts.
        timeout: seconds to wait for all ranks.

    Returns:
        The return values of ``fn`` in rank order.

    Raises:
        DistributedRunError: a rank raised, or not all ranks reported within ``timeout``.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    child_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, child_env, queue))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        if time.monotonic() > deadline:
            failures.append(f"timed out after {timeout:.0f} s waiting for the ranks")
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                failures.append("a rank exited without reporting (crashed or was killed)")
                break
            time.sleep(0.02)
            continue
        rank, ok, payload = queue.get()
        if ok:
            results[rank] = payload
        else:
            failures.append(f"rank {rank} raised:\n{payload}")
    for proc in procs:
        proc.join(timeout=5 if not failures else 1)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if failures:
        raise DistributedRunError("\n".join(failures))
    return [results[r] for r in range(world_size)]
