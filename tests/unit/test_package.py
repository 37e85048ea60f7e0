"""The package imports without side effects and exposes its public API lazily."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_import_has_no_side_effects():
    out = _run(
        "import sys, megatron_hybrid; "
        "print('torch' in sys.modules, 'megatron' in sys.modules, megatron_hybrid.__version__)"
    )
    torch_loaded, megatron_loaded, version = out.split()
    assert (torch_loaded, megatron_loaded) == ("False", "False")
    assert version.count(".") == 2


def test_public_names_resolve_and_register_the_schedule():
    out = _run(
        "import megatron_hybrid as m; "
        "from megatron_hybrid.modules import hybrid_model as hm; "
        "print(m.HybridModel is hm.HybridModel, hm._SCHEDULE_PLAN_BUILDER is not None, "
        "sorted(set(m.__all__) - set(dir(m))))"
    )
    assert out == "True True []"
