"""benchmarks/host_breakdown.py: host time and operators per module class, exclusive."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))


class _Slow(torch.nn.Module):
    """Spends ``seconds`` of its own, then calls ``inner``."""

    def __init__(self, seconds, inner=None):
        super().__init__()
        self.seconds, self.inner = seconds, inner

    def forward(self, x):
        time.sleep(self.seconds)
        x = x + 1
        return self.inner(x) if self.inner is not None else x


class _Leaf(torch.nn.Module):
    def forward(self, x):
        time.sleep(0.1)
        return torch.repeat_interleave(x, torch.tensor([1, 2, 1])) * 2


def test_host_times_are_exclusive_and_add_up_to_the_call():
    from host_breakdown import module_host_times

    model = _Slow(0.03, _Leaf())

    def call():
        time.sleep(0.01)  # outside every module
        model(torch.ones(3))

    total, rows = module_host_times([model], call)
    by_name = {r["module"]: r for r in rows}
    assert abs(sum(r["self_ms"] for r in rows) - total) < 1e-6
    # Exclusive: the outer module's own 30 ms, not its 130 ms with the leaf's 100 ms (a sleep
    # may overrun on a loaded machine, never end early).
    assert 28 <= by_name["_Slow"]["self_ms"] < 100 and by_name["_Leaf"]["self_ms"] >= 98
    assert by_name["(outside modules)"]["self_ms"] >= 9
    assert by_name["_Slow"]["calls"] == by_name["_Leaf"]["calls"] == 1
    # Hooks are gone after the call.
    assert not model._forward_hooks and not model.inner._forward_pre_hooks


def test_operators_are_counted_per_module_with_the_named_op_s_sites():
    from host_breakdown import module_operators

    model = _Slow(0.0, _Leaf())
    modules, sites = module_operators([model], lambda: model(torch.ones(3)))
    counts = {m["module"]: m["ops"] for m in modules}
    assert counts["_Slow"] >= 1 and counts["_Leaf"] >= 2  # add; repeat_interleave and mul
    assert len(sites) == 1 and sites[0]["op"].startswith("aten.repeat_interleave")
    assert sites[0]["site"].endswith("on cpu") and sites[0]["count"] == 1
