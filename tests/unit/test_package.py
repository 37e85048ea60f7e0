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
        "from megatron_hybrid.model import HybridModel; "
        "from megatron_hybrid.model import hybrid_model as hm; "
        "import megatron_hybrid.schedule.plan as plan; "
        "print(HybridModel is hm.HybridModel, "
        "hm.build_hybrid_schedule_plan is plan.build_hybrid_schedule_plan, "
        "hm.check_schedulable is plan.check_schedulable)"
    )
    assert out == "True True True"


def test_modules_has_no_hybrid_model():
    """The 0.1 alias ``megatron_hybrid.modules.HybridModel`` (an import back up) is gone."""
    import megatron_hybrid.modules as modules

    assert "HybridModel" not in dir(modules)
    with pytest.raises(AttributeError, match="no attribute 'HybridModel'"):
        modules.HybridModel  # noqa: B018 - the attribute access is the test
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        modules.NoSuchName  # noqa: B018 - the attribute access is the test


@pytest.mark.slow
def test_the_wheel_carries_the_license_and_py_typed(tmp_path):
    """What ``pip wheel .`` builds is publishable as it stands: Apache-2.0 text, PEP 561 marker."""
    import shutil
    import zipfile
    from pathlib import Path

    # A copy of the tree: the build leaves build/ and *.egg-info where it runs.
    skip = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__")
    source = shutil.copytree(Path(__file__).resolve().parents[2], tmp_path / "src", ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path / "wheel")],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheel").glob("megatron_hybrid-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        text = archive.read(license_file).decode()
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert "megatron_hybrid/py.typed" in names
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub
    assert b"License: Apache-2.0" in metadata or b"License-Expression: Apache-2.0" in metadata
