"""Which tests a job of the GPU suite runs, and in what order.

* **The in-process job** runs the files of :data:`RUN_LAST` after the others, in that order:
  they compile the most kernels on a fresh machine (fla's float32 kernels, the compiled Mamba2
  scan, the FP8 kernel), so a budget that runs out leaves the fewest tests unrun, and the
  Hugging Face fixture folders, made in the background while the first tests run, are ready
  when ``test_hf*_gpu.py`` read them. Within a file the order is the file's own.
* **The launcher tests** can be split into lanes (``MH_LANE=i/n``: this job runs lane ``i`` of
  ``n``), which the suite runner starts side by side: each test starts torchrun jobs of its own,
  which spend most of their time starting (imports, NCCL, compiling), not on the GPUs. A test
  goes to the lane with the least work so far, longest first, its ``time_limit`` standing for
  its work; a lane keeps the file's order.
"""

from __future__ import annotations

import os
from pathlib import Path

#: In-process test files run after the others, in this order (see the module doc).
RUN_LAST = ("test_fast_path_gpu.py", "test_packing_gpu.py", "test_hf_fp8_gpu.py", "test_hf_gpu.py")


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


def keep_lane(config, items: list, default_cost: float) -> None:
    """Deselect the tests of other lanes where ``MH_LANE`` is set."""
    value = os.environ.get("MH_LANE")
    if not value:
        return
    lane, lanes = parse_lane(value)
    costs = []
    for item in items:
        marker = item.get_closest_marker("time_limit")
        costs.append(float(marker.args[0]) if marker else default_cost)
    lane_of = lanes_of(costs, lanes)
    dropped = [item for item, j in zip(items, lane_of, strict=True) if j != lane]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item, j in zip(items, lane_of, strict=True) if j == lane]
