"""Nemotron-H beyond the shared family tests: Mamba's numerics, its row layout, legacy configs.

test_hf_convert / test_hf_parallel / test_hf_roundtrip hold Nemotron-H (``ME*-``) to
transformers' logits at TP1, TP2, EP2 and PP2 and to a bitwise round trip with MTP. Here: each
Mamba-specific mapping or numerics bug moves the logits past the tolerance (so those tests can
fail on it), the hub's legacy config spellings convert to the same model, and the fields that
would change the math are refused.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import hf_oracle
import pytest
import torch
from hf_oracle import TOLERANCE

from megatron_hybrid.hf import HFConfigError, dry_run, load_hf_model
from megatron_hybrid.hf import weights as hf_weights
from megatron_hybrid.modules.mamba_torch import TorchMambaMixer, with_mixer_params


def _logits(model, input_ids):
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        return model.eval()(input_ids, positions, None)


def _error(model, reference, input_ids) -> float:
    return (_logits(model, input_ids) - reference).abs().max().item()


def _swap_rows(hf_suffix: str, first: str, second: str):
    """A plan bug: the key pieces ``first`` and ``second`` read each other's HF rows."""

    def bug(plan):
        rows = {}
        for link in plan.links:
            if link.hf_name.endswith(hf_suffix):
                rows[link.key.rsplit(".", 1)[-1]] = link.hf_rows
        out = []
        for link in plan.links:
            piece = link.key.rsplit(".", 1)[-1]
            if link.hf_name.endswith(hf_suffix) and piece in (first, second):
                other = rows[second if piece == first else first]
                link = dataclasses.replace(link, hf_rows=other)
            out.append(link)
        return out

    return bug


@pytest.mark.parametrize(
    "bug",
    [
        _swap_rows("mixer.in_proj.weight", "z", "x"),
        _swap_rows("mixer.conv1d.weight", "B", "C"),
    ],
    ids=["in-proj-z-x-swapped", "conv1d-B-C-swapped"],
)
def test_mamba_row_bugs_move_logits(bug, hf_folders, input_ids, pg, monkeypatch):
    folder, reference, _ = hf_folders["nemotron_h"]
    build = hf_weights.build_plan

    def buggy(conversion, key_shapes, family=None):
        plan, unresolved = build(conversion, key_shapes, family)
        return dataclasses.replace(plan, links=bug(plan)), unresolved

    monkeypatch.setattr(hf_weights, "build_plan", buggy)
    assert _error(load_hf_model(folder), reference, input_ids) > 1000 * TOLERANCE


@pytest.mark.parametrize(
    ("attribute", "megatron_value"),
    [("dt_limit", (0.0, float("inf"))), ("norm_eps", 1e-5)],
    ids=["no-dt-clamp", "megatron-norm-eps"],
)
def test_megatron_mamba_numerics_miss_transformers(
    attribute, megatron_value, hf_folders, input_ids, pg
):
    """With megatron-core's own dt clamp or gated-norm epsilon the logits leave the bound: the
    oracle's time_step_min (0.5) and layer_norm_epsilon (1e-6) make both matter."""
    folder, reference, bound = hf_folders["nemotron_h"]
    model = load_hf_model(folder)
    mixers = [m for m in model.modules() if isinstance(m, TorchMambaMixer)]
    assert mixers and all(m.dt_limit == (0.5, float("inf")) for m in mixers)
    assert all(m.norm_eps == 1e-6 and m.norm.eps == 1e-6 for m in mixers)
    assert _error(model, reference, input_ids) <= bound
    for mixer in mixers:
        setattr(mixer, attribute, megatron_value)
        mixer.norm.eps = mixer.norm_eps
    assert _error(model, reference, input_ids) > 10 * TOLERANCE


def _edit_config(folder, tmp_path, drop=(), **changes):
    copy = shutil.copytree(folder, tmp_path / "edited")
    config = json.loads((copy / "config.json").read_text())
    for name in drop:
        config.pop(name)
    config.update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_hub_legacy_config_converts_to_the_same_model(hf_folders, input_ids, tmp_path, pg):
    """Published Nemotron-H configs spell the layout ``hybrid_override_pattern`` with
    ``num_hidden_layers`` and some Mamba fields ``mamba_*``: the same model either way."""
    folder, reference, bound = hf_folders["nemotron_h"]
    config = json.loads((folder / "config.json").read_text())
    legacy = _edit_config(
        folder,
        tmp_path,
        drop=("layers_block_type", "n_groups", "conv_kernel"),
        hybrid_override_pattern="ME*-",
        num_hidden_layers=4,
        mamba_n_groups=config["n_groups"],
        mamba_d_conv=config["conv_kernel"],
    )
    assert torch.equal(hf_oracle.hf_logits(legacy, input_ids), reference)  # transformers agrees
    conversion, report = dry_run(legacy)
    assert report.ok, report.lines()
    assert conversion.pattern.pattern == "ME*-"
    assert conversion.config_kwargs["mamba_num_groups"] == config["n_groups"]
    assert _error(load_hf_model(legacy), reference, input_ids) <= bound


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
        ({"moe_latent_size": 16}, "moe_latent_size"),
        ({"conv_kernel": 3}, "conv_kernel"),
        ({"use_conv_bias": False}, "use_conv_bias"),
        ({"layers_block_type": ["linear_attention", "moe", "gdn", "mlp"]}, "layers_block_type"),
        ({"num_hidden_layers": 6}, "num_hidden_layers"),
    ],
    ids=["activation", "latent-moe", "conv-width", "conv-bias", "block-type", "layer-count"],
)
def test_fields_that_change_the_math_are_refused(changes, field, hf_folders, tmp_path, pg):
    folder = _edit_config(hf_folders["nemotron_h"][0], tmp_path, **changes)
    with pytest.raises(HFConfigError, match=field):
        load_hf_model(folder)


def test_notes_say_where_megatron_core_kernels_differ(hf_folders):
    conversion, report = dry_run(hf_folders["nemotron_h"][0])
    assert report.ok
    notes = " ".join(conversion.notes)
    assert "time_step_min" in notes and "layer_norm_epsilon" in notes
    assert conversion.mamba_mixer_params == {"dt_limit": (0.5, float("inf")), "norm_eps": 1e-6}


def test_mixer_params_reach_only_the_torch_mixer():
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_hybrid import hybrid_stack_spec

    params = {"dt_limit": (0.1, float("inf")), "norm_eps": 1e-6}
    torch_spec = with_mixer_params(hybrid_stack_spec("local", mamba_impl="torch"), params)
    assert torch_spec.submodules.mamba_layer.submodules.mixer.params == params
    # The fast path's mixer (a TorchMambaMixer subclass, built on GPUs) gets them as well.
    fast = with_mixer_params(hybrid_stack_spec("local", mamba_impl="torch", local_impl="fast"),
                             params)  # fmt: skip
    assert fast.submodules.mamba_layer.submodules.mixer.params == params
    kernels = dataclasses.replace(
        torch_spec.submodules.mamba_layer.submodules.mixer, module=MambaMixer, params={}
    )
    layer = dataclasses.replace(
        torch_spec.submodules.mamba_layer,
        submodules=dataclasses.replace(torch_spec.submodules.mamba_layer.submodules, mixer=kernels),
    )
    kernel_spec = dataclasses.replace(
        torch_spec, submodules=dataclasses.replace(torch_spec.submodules, mamba_layer=layer)
    )
    assert with_mixer_params(kernel_spec, params) is kernel_spec
