"""The pure parts of ``benchmarks/hybridep.py`` and the shared recorded command (the GPU run is
``bash scripts/gpu_session.sh bench-hybridep``)."""

from __future__ import annotations

import doctest
import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def modules():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("common"), importlib.import_module("hybridep")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_doctests(modules):
    for module in modules:
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_written_record_names_machine_date_and_command(modules, tmp_path):
    common, hybridep = modules
    command = common.recorded_command(
        "hybridep.py", ["--label", "no-p2p", "--out", str(tmp_path)],
        launcher="NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 4",
    )  # fmt: skip
    assert str(tmp_path) not in command and "--out benchmarks/results" in command
    meta = dict(label="no-p2p", gpus=4, gpu="NVIDIA H100 80GB HBM3", date="2026-11-27",
                command=command, setup="[*E]{4}")  # fmt: skip
    row = dict(
        median_s=0.5,
        steps_s=[0.5],
        peak_gib=3.0,
        real_tokens=3000,
        padded_tokens=4096,
        dispatched_tokens=4096,
        pad_overhead=4096 / 3000 - 1,
        real_tokens_per_s=6000.0,
    )
    results = {"alltoall": row, "hybridep": dict(row, median_s=0.4, real_tokens_per_s=7500.0)}
    hybridep.write_outputs(tmp_path, "hybridep_no-p2p_4gpu", meta, results)
    text = (tmp_path / "hybridep_no-p2p_4gpu.md").read_text()
    assert "4 x NVIDIA H100 80GB HBM3" in text and "Date 2026-11-27" in text
    assert f"command `{command}`" in text
    assert "| hybridep | 0.4000 | 3000 | 4096 | 36.5% | 4096 | 7,500 | 3.00 |" in text
    assert "hybridep 0.800" in text
    saved = json.loads((tmp_path / "hybridep_no-p2p_4gpu.json").read_text())
    assert saved["meta"] == meta and saved["results"]["hybridep"]["median_s"] == 0.4


@pytest.mark.parametrize(
    ("variant", "dispatcher", "pads"),
    [("alltoall", "alltoall", False), ("hybridep", "flex", False),
     ("hybridep_mcore_pad", "flex", True)],
    ids=["alltoall", "hybridep", "hybridep-mcore-pad"],
)  # fmt: skip
def test_each_variant_builds_its_dispatcher(modules, variant, dispatcher, pads):
    """The variants' configs (the HybridEP ones once passed the dispatcher type twice)."""
    import argparse

    _, hybridep = modules
    args = argparse.Namespace(hidden=64, heads=4, experts=4, topk=2, expert_hidden=32, layers=1)
    config = hybridep.bench_config(args, 1, variant)
    assert config.moe_token_dispatcher_type == dispatcher and config.num_layers == 2
    assert config.moe_router_dtype == "fp32" and config.moe_aux_loss_coeff == 0.0
    if dispatcher == "flex":
        assert config.moe_flex_dispatcher_backend == "hybridep"
        assert config.moe_hybridep_pad_uneven_dispatch_inputs == pads
