"""The package imports without side effects and exposes its public API lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest


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


def test_public_names_resolve():
    out = _run(
        "import megatron_hybrid as m; "
        "from megatron_hybrid.model import hybrid_model as hm; "
        "print(m.HybridModel is hm.HybridModel, sorted(set(m.__all__) - set(dir(m))))"
    )
    assert out == "True []"


def test_any_import_path_of_the_model_has_its_schedule_plan():
    """The plan builder is imported by the model module itself: no import order can lose it
    (it used to be registered only when megatron_hybrid.schedule had been imported)."""
    out = _run(
        "import warnings, sys; warnings.simplefilter('ignore'); "
        "from megatron_hybrid.modules import HybridModel; "
        "from megatron_hybrid.model import hybrid_model as hm; "
        "import megatron_hybrid.schedule.plan as plan; "
        "print(HybridModel is hm.HybridModel, "
        "hm.build_hybrid_schedule_plan is plan.build_hybrid_schedule_plan, "
        "hm.check_schedulable is plan.check_schedulable)"
    )
    assert out == "True True True"


def test_modules_hybrid_model_is_a_deprecated_alias():
    import megatron_hybrid.modules as modules
    from megatron_hybrid.model import HybridModel

    with pytest.warns(DeprecationWarning, match="from megatron_hybrid import HybridModel"):
        alias = modules.HybridModel
    assert alias is HybridModel
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        modules.NoSuchName  # noqa: B018 - the attribute access is the test
