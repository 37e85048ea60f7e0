"""Where the host's time goes in one call of a model, module by module (no GPU synchronisation).

Where a GPU idles because the host cannot launch its work fast enough, a profile's kernel table
says little: the question is which module's Python and operators cost the host its time. Two
extra calls answer it, each under hooks on every submodule of the model chunks:

* :func:`module_host_times`: host milliseconds per module class, *exclusive* (a module's own
  time minus that of the submodules it called), and the time of the call outside every module;
  nothing waits for the GPU, so while the GPU keeps up these are the host's costs;
* :func:`module_operators`: torch operators (dispatcher calls below autograd) per module class,
  exclusive, and the Python sites of the operators named in ``sites_of`` (e.g.
  ``aten.repeat_interleave``) with the device of their first tensor argument.

The hooks cost host time themselves (a few microseconds per module call), so the breakdown
shares out a call somewhat slower than a timed one.
"""

from __future__ import annotations

import collections
import time
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["module_host_times", "module_operators"]

#: Folders whose frames name an operator's site (innermost first).
_SITE_FOLDERS = ("/megatron_hybrid/", "/megatron/core/", "/fla/", "/torch/nn/", "/benchmarks/")


class _ModuleStack:
    """Forward pre/post hooks on every module under ``chunks`` keeping the current call stack."""

    def __init__(self, chunks, on_enter=None, on_exit=None):
        self.stack: list[str] = []
        self.on_enter, self.on_exit = on_enter, on_exit
        self.handles = []
        for chunk in chunks:
            for module in chunk.modules():
                self.handles.append(module.register_forward_pre_hook(self._enter))
                self.handles.append(module.register_forward_hook(self._exit, always_call=True))

    def _enter(self, module, args):
        name = type(module).__name__
        if self.on_enter is not None:
            self.on_enter(name)
        self.stack.append(name)

    def _exit(self, module, args, output):
        name = self.stack.pop()
        if self.on_exit is not None:
            self.on_exit(name)

    def close(self):
        for handle in self.handles:
            handle.remove()


def module_host_times(chunks, call) -> tuple[float, list[dict]]:
    """``call()`` once with every module's host time taken: the call's milliseconds and
    ``[{"module", "self_ms", "calls"}, ...]`` by exclusive time, most first, with a row
    ``"(outside modules)"`` for the rest of the call."""
    own = collections.Counter()
    calls = collections.Counter()
    marks: list[float] = []  # start of each open module's current own stretch

    def enter(name):
        now = time.perf_counter()
        if marks:  # the caller's own stretch ends here
            own[stack.stack[-1]] += now - marks[-1]
        marks.append(now)
        calls[name] += 1

    def exit_(name):
        now = time.perf_counter()
        own[name] += now - marks.pop()
        if marks:
            marks[-1] = now

    stack = _ModuleStack(chunks, enter, exit_)
    try:
        start = time.perf_counter()
        call()
        total = time.perf_counter() - start
    finally:
        stack.close()
    inside = sum(own.values())
    rows = [
        {"module": name, "self_ms": seconds * 1e3, "calls": calls[name]}
        for name, seconds in own.most_common()
    ]
    rows.append({"module": "(outside modules)", "self_ms": (total - inside) * 1e3, "calls": 1})
    rows.sort(key=lambda r: -r["self_ms"])
    return total * 1e3, rows


def _site(first_device) -> str:
    frames = [f for f in traceback.extract_stack()[:-3]
              if any(folder in f.filename for folder in _SITE_FOLDERS)]  # fmt: skip
    if not frames:
        return f"(torch) on {first_device}"
    frame = frames[-1]
    name = frame.filename
    for folder in _SITE_FOLDERS:
        if folder in name:
            name = folder.strip("/") + "/" + name.split(folder)[-1]
            break
    return f"{name}:{frame.lineno} on {first_device}"


def module_operators(chunks, call, sites_of=("aten.repeat_interleave",)):
    """``call()`` once counting torch's operators: ``[{"module", "ops"}, ...]`` (exclusive,
    most first, ``"(outside modules)"`` for operators outside every module) and
    ``[{"op", "site", "count"}, ...]`` for the operators whose name starts with one of
    ``sites_of``."""
    stack = _ModuleStack(chunks)
    per_module = collections.Counter()
    sites = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            per_module[stack.stack[-1] if stack.stack else "(outside modules)"] += 1
            if name.startswith(sites_of):
                first = next((a for a in args if torch.is_tensor(a)), None)
                device = first.device.type if first is not None else "-"
                sites[(name, _site(device))] += 1
            return func(*args, **(kwargs or {}))

    try:
        with Count():
            call()
    finally:
        stack.close()
    modules = [{"module": m, "ops": n} for m, n in per_module.most_common()]
    found = [{"op": op, "site": site, "count": n} for (op, site), n in sites.most_common()]
    return modules, found
