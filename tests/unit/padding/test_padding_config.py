"""padding_config_from, PaddingConfig, the THD-support rules and the import-purity promise."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hybrid.padding import (
    PaddingConfig,
    padding_config_from,
    thd_unsupported_reason,
    thd_unsupported_reason_for,
)


class FakeGroup:
    """Stands in for a torch ProcessGroup: padding only calls ``size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def make_config(**kwargs) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kwargs)


MOE_HYBRIDEP = dict(
    num_moe_experts=8,
    moe_token_dispatcher_type="flex",
    moe_flex_dispatcher_backend="hybridep",
    moe_router_dtype="fp32",
)

# The flex/HybridEP dispatcher settings on a dense model: no MoE dispatch, no HybridEP term.
DENSE_FLEX = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")
# megatron-core refuses variable_seq_lengths with its default (allgather) dispatcher.
VARLEN = dict(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")


@pytest.mark.parametrize(
    "config_kwargs, groups, expected",
    [
        ({}, {}, dict(tp=1, cp=1, sp=False, quant=None, hybridep=False, tp_ep=1)),
        (
            dict(
                sequence_parallel=True,
                tensor_model_parallel_size=2,
                expert_tensor_parallel_size=1,
                **MOE_HYBRIDEP,
            ),
            dict(tp=2, ep=8, tp_ep=16),
            dict(tp=2, sp=True, hybridep=True, ep=8, tp_ep=16, chunk=128),
        ),
        (dict(fp8="e4m3", fp8_recipe="mxfp8"), dict(cp=2), dict(cp=2, quant="mxfp8")),
        (dict(fp8="hybrid", fp8_recipe="tensorwise"), {}, dict(quant="tensorwise")),
        (dict(fp4="e2m1"), {}, dict(quant="nvfp4")),
        (dict(sequence_parallel=True, tensor_model_parallel_size=2), dict(tp=1), dict(sp=False)),
        (DENSE_FLEX, {}, dict(hybridep=False)),
        (VARLEN, dict(pp=4), dict(pp=4, variable_seq_lengths=True)),
        ({}, dict(ep=4, expt_tp=2), dict(ep=4, tp_ep=8)),
    ],
    ids=["defaults", "tp2-sp-ep8-hybridep", "cp2-mxfp8", "tensorwise", "fp4", "sp-off-at-tp1"]
    + ["dense-flex", "pp-varlen", "tp-ep-from-factors"],
)
def test_padding_config_from(config_kwargs, groups, expected):
    pgs = ProcessGroupCollection(**{k: FakeGroup(v) for k, v in groups.items()})
    pc = padding_config_from(make_config(**config_kwargs), pgs, environ={})
    for name, value in expected.items():
        assert getattr(pc, name) == value, name


def test_padding_config_honours_chunk_env():
    pgs = ProcessGroupCollection(tp=FakeGroup(2))
    env = {"NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "256"}
    pc = padding_config_from(make_config(**MOE_HYBRIDEP), pgs, chunk=64, environ=env)
    assert pc.chunk == 256


def test_padding_config_requires_process_groups():
    with pytest.raises(ValueError, match="pass the model's ProcessGroupCollection"):
        padding_config_from(make_config(), None)


def test_padding_config_plans_and_setup_alignment():
    pc = PaddingConfig(tp=2, sp=True, hybridep=True, ep=8, tp_ep=16, pp=2)
    assert pc.fixed_length_required and pc.needs_group_equalize
    assert pc.divisible_by(4) == 64 and pc.bshd(cur_len=100, batch_size=4).padded_len == 128
    assert pc.thd([100, 30]).total_tokens == 256
    assert pc.align_seq_length(4096, micro_batch_size=4) == 4096
    with pytest.raises(ValueError, match="seq_length=4000 is not a multiple of 64"):
        pc.align_seq_length(4000, micro_batch_size=4)
    assert pc.align_seq_length(4000, micro_batch_size=4, force_policy="round_up") == 4032
    with pytest.raises(ValueError, match="beyond max_position_embeddings=4000"):
        pc.align_seq_length(
            4000, micro_batch_size=4, force_policy="round_up", max_position_embeddings=4000
        )
    with pytest.raises(ValueError, match="lower seq_length to 3968 or raise"):
        pc.align_seq_length(
            4000, micro_batch_size=4, force_policy="round_up", max_position_embeddings=4000
        )
    with pytest.raises(ValueError, match="no aligned length fits; raise max_position_embeddings"):
        pc.align_seq_length(
            40, micro_batch_size=4, force_policy="round_up", max_position_embeddings=40
        )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=0), "tp must be an integer >= 1"),
        (dict(quant="fp7"), "unknown quantisation"),
        (dict(tp=2, sp="no"), "sp must be True or False, got 'no'"),
        (dict(sp=True, tp=1), "sp=True needs tp > 1"),
        (dict(hybridep=1), "hybridep must be True or False"),
    ],
    ids=["tp0", "quant", "sp-string", "sp-without-tp", "hybridep-int"],
)
def test_padding_config_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PaddingConfig(**kwargs)


@pytest.mark.parametrize(
    "symbols, options, match",
    [
        ("[*E]", dict(transformer_impl="transformer_engine"), None),
        ("[*E]", dict(transformer_impl="local"), None),
        ("[*E]", dict(transformer_impl="local", cp_size=2), r"attention \('\*'\).*cp > 1"),
        ("+-", dict(transformer_impl="local"), None),
        ("+-", dict(transformer_impl="local", cp_size=2), r"MLA \('\+'\).*cp > 1"),
        ("+-", dict(transformer_impl="transformer_engine"), None),
        ("DE", dict(transformer_impl="local"), r"'D'\) is built only by the TE backend"),
        ("DE", dict(transformer_impl="transformer_engine"), None),
        ("[GE]", dict(), None),
        ("[GE]", dict(deterministic_mode=True), r"GatedDeltaNet \('G'\) in deterministic mode"),
        ("M-", dict(), None),
        ("M-", dict(use_mamba_mem_eff_path=False), "memory-efficient path"),
        ("M-", dict(cp_size=2, transformer_impl="local"), "thd_get_partitioned_indices"),
        ("M-", dict(cp_size=2), None),
        ({"-", "E"}, dict(transformer_impl="local", deterministic_mode=True), None),
        ("[*E]|[*E]/*E", dict(transformer_impl="inference_optimized"), "was not checked"),
    ],
    ids=["attn-te", "attn-local", "attn-local-cp", "mla-local", "mla-local-cp", "mla-te"]
    + ["dsa-local", "dsa-te", "gdn", "gdn-deterministic", "mamba", "mamba-no-mem-eff"]
    + ["mamba-cp-local", "mamba-cp-te", "mlp-moe", "inference"],
)
def test_thd_support_rules(symbols, options, match):
    reason = thd_unsupported_reason(symbols, **options)
    if match is None:
        assert reason is None
    else:
        assert reason is not None and re.search(match, reason), reason


def test_thd_support_lists_every_refusing_layer():
    reason = thd_unsupported_reason("M*G", transformer_impl="local", deterministic_mode=True)
    assert "GatedDeltaNet ('G')" in reason and "Mamba" not in reason and "'*'" not in reason
    reason = thd_unsupported_reason("M*G", transformer_impl="local", cp_size=2)
    assert "attention ('*')" in reason and "Mamba ('M')" in reason


def test_thd_support_from_transformer_config():
    config = make_config(deterministic_mode=True, transformer_impl="local")
    assert "deterministic" in thd_unsupported_reason_for("GE", config)
    assert thd_unsupported_reason_for("GE", make_config()) is None


@pytest.mark.parametrize(
    "symbols, options, match",
    [("X", {}, "unknown layer symbol 'X'"), ("*", dict(transformer_impl="te"), "transformer_impl")],
    ids=["symbol", "impl"],
)
def test_thd_support_rejects_bad_input(symbols, options, match):
    with pytest.raises(ValueError, match=match):
        thd_unsupported_reason(symbols, **options)


def test_planners_import_without_torch():
    """Importing the planners must not import torch (docs/architecture.md, "Guarantees and
    targets": the pure part stays pure)."""
    code = (
        "import sys\n"
        "from megatron_hybrid.padding import seq_divisible_by, bshd_pad, thd_pack, group_equalize\n"
        "from megatron_hybrid.padding import padding_config_from, thd_unsupported_reason\n"
        "assert 'torch' not in sys.modules and 'megatron.core' not in sys.modules, 'impure'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
