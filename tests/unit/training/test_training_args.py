"""``add_hybrid_args`` / ``add_train_only_args`` flag snapshot and ``hybrid_config_from_args``."""

from __future__ import annotations

import argparse

import pytest

# Snapshots: adding, renaming or removing a flag must update these lists deliberately.
HYBRID_FLAGS = [
    "--bf16", "--clip-grad", "--context-parallel-size", "--delay-wgrad-compute",
    "--disable-bias-linear", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
    "--ffn-hidden-size", "--global-batch-size", "--hidden-size", "--hybrid-cuda-graphs",
    "--hybrid-layer-pattern",
    "--kv-channels", "--kv-lora-rank", "--load", "--load-base", "--load-hf", "--load-peft",
    "--lora-alpha", "--lora-dropout", "--lora-exclude", "--lora-rank", "--lora-targets",
    "--lr", "--mamba-head-dim",
    "--mamba-impl", "--mamba-num-groups", "--mamba-num-heads", "--mamba-state-dim",
    "--max-position-embeddings", "--micro-batch-size", "--moe-aux-loss-coeff",
    "--moe-ffn-hidden-size", "--moe-flex-dispatcher-backend", "--moe-grouped-gemm",
    "--moe-router-pre-softmax", "--moe-router-topk", "--moe-shared-expert-intermediate-size",
    "--moe-token-dispatcher-type", "--no-gradient-accumulation-fusion", "--normalization",
    "--num-attention-heads", "--num-experts",
    "--num-query-groups", "--overlap-moe-expert-parallel-comm", "--pipeline-model-parallel-size",
    "--position-embedding-type", "--q-lora-rank", "--qk-head-dim", "--qk-layernorm",
    "--qk-pos-emb-head-dim", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--save", "--save-interval", "--seed", "--seq-length",
    "--sequence-parallel", "--swiglu", "--tensor-model-parallel-size", "--train-iters",
    "--transformer-impl", "--untie-embeddings-and-output-weights", "--v-head-dim", "--vocab-size",
    "--weight-decay",
]  # fmt: skip
TRAIN_ONLY_FLAGS = [
    "--no-packed", "--on-nonfinite", "--overwrite", "--packed",
    "--round-up-seq-length", "--verbose",
]  # fmt: skip
# The train command's data, schedule, evaluation, logging and garbage collection flags
# (Megatron-LM's names; --log-dir and --synthetic-samples are the package's own).
TRAIN_FLAGS = [
    "--data-cache-path", "--data-path", "--eval-interval", "--eval-iters", "--log-dir",
    "--log-interval", "--lr-decay-iters", "--lr-decay-style", "--lr-warmup-iters",
    "--make-vocab-size-divisible-by", "--manual-gc", "--manual-gc-interval", "--min-lr",
    "--moe-router-force-load-balancing", "--no-manual-gc-eval", "--split", "--synthetic-samples",
    "--tensorboard-dir",
    "--tokenizer-model",
]  # fmt: skip

# The flags issue 6 requires by name (Megatron-LM's spelling).
REQUIRED_BY_ISSUE = [
    "--hybrid-layer-pattern", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--expert-model-parallel-size", "--context-parallel-size", "--sequence-parallel",
    "--overlap-moe-expert-parallel-comm", "--num-experts", "--moe-router-topk", "--hidden-size",
    "--num-attention-heads", "--ffn-hidden-size", "--seq-length", "--micro-batch-size",
    "--global-batch-size", "--train-iters", "--lr", "--bf16", "--seed", "--save", "--load",
    "--save-interval", "--transformer-impl",
]  # fmt: skip


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(o for o in parser._option_string_actions if o not in ("-h", "--help"))


def _train_parser() -> argparse.ArgumentParser:
    """The real ``train`` subparser of ``python -m megatron_hybrid``."""
    from megatron_hybrid.cli.main import build_parser, load_commands

    parser = build_parser(load_commands())
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["train"]


def _parse(*argv: str) -> argparse.Namespace:
    from megatron_hybrid.cli.main import build_parser, load_commands

    return build_parser(load_commands()).parse_args(["train", *argv])


def test_flags_snapshot():
    from megatron_hybrid.training.arguments import FLAGS, add_hybrid_args

    assert sorted(f.option for f in FLAGS) == HYBRID_FLAGS
    assert len({f.option for f in FLAGS}) == len(FLAGS), "duplicate flag in FLAGS"
    assert _options(add_hybrid_args(argparse.ArgumentParser())) == HYBRID_FLAGS


def test_train_only_flags_snapshot():
    from megatron_hybrid.cli.train import add_train_only_args

    parser = argparse.ArgumentParser()
    add_train_only_args(parser)
    assert _options(parser) == TRAIN_ONLY_FLAGS


def test_train_flags_snapshot():
    from megatron_hybrid.training.train_flags import TRAIN_FLAGS as FLAGS
    from megatron_hybrid.training.train_flags import add_train_flags

    parser = argparse.ArgumentParser()
    add_train_flags(parser)
    assert _options(parser) == TRAIN_FLAGS == sorted(f.option for f in FLAGS)
    assert all(f.kwargs.get("help") for f in FLAGS)


@pytest.mark.parametrize("command", ["train", "prepare-data"])
def test_help_renders(command, capsys):
    from megatron_hybrid.cli.main import main

    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--tokenizer-model" in out
    if command == "train":
        assert "10% of --train-iters when fine-tuning" in out and "--data-path [W] PREFIX" in out


def test_train_command_has_exactly_the_snapshot_flags():
    assert _options(_train_parser()) == sorted(HYBRID_FLAGS + TRAIN_ONLY_FLAGS + TRAIN_FLAGS)
    assert set(REQUIRED_BY_ISSUE) <= set(HYBRID_FLAGS)


def test_every_flag_has_help():
    from megatron_hybrid.training.arguments import FLAGS

    assert [f.option for f in FLAGS if not f.kwargs.get("help")] == []


def test_existing_flags_are_skipped():
    """Megatron-LM's parser defines most flags itself; add_hybrid_args must leave those alone."""
    from megatron_hybrid.training.arguments import add_hybrid_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seq-length", type=int, default=4096)
    hidden_action = parser._option_string_actions["--hidden-size"]
    add_hybrid_args(parser)  # must not raise argparse.ArgumentError (conflicting option)
    assert parser._option_string_actions["--hidden-size"] is hidden_action
    assert _options(parser) == HYBRID_FLAGS
    args = parser.parse_args(["--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4"])
    assert (args.hidden_size, args.seq_length, args.bf16) == (1024, 4096, False)
    assert args.num_experts == 4
    # Adding twice (e.g. two extra_args_providers) is also harmless.
    add_hybrid_args(parser)
    assert _options(parser) == HYBRID_FLAGS


def test_model_shape_groups_only():
    from megatron_hybrid.training.arguments import MODEL_SHAPE_GROUPS, add_hybrid_args

    options = _options(add_hybrid_args(argparse.ArgumentParser(), groups=MODEL_SHAPE_GROUPS))
    assert "--hybrid-layer-pattern" in options and "--num-experts" in options
    assert "--train-iters" not in options and "--tensor-model-parallel-size" not in options


def _config(*argv: str, namespace: argparse.Namespace | None = None):
    from megatron_hybrid.runtime.cpu import cpu_config_overrides
    from megatron_hybrid.training.config import hybrid_config_from_args

    return hybrid_config_from_args(namespace or _parse(*argv), **cpu_config_overrides())


@pytest.mark.parametrize(
    ("argv", "num_layers", "mtp", "vpp"),
    [
        pytest.param(["[*E]{2}", "--num-experts", "4"], 4, None, None, id="grouped"),
        pytest.param(["*E*E", "--num-experts", "4"], 4, None, None, id="ungrouped"),
        pytest.param(["[*-]{3}"], 6, None, None, id="dense_repeated"),
        pytest.param(["[*E]{2}/*E", "--num-experts", "4"], 4, 1, None, id="mtp_one_depth"),
        pytest.param(["[*-]{2}/*-/*-"], 4, 2, None, id="mtp_two_depths"),
        pytest.param(
            ["[*E]|[*E]|[*E]|[*E]", "--num-experts", "4", "--pipeline-model-parallel-size", "2"],
            8, None, 2, id="pipes_pp2_vpp2",
        ),
        pytest.param(
            ["[*E]|[*E]|[*E]|[*E]", "--num-experts", "4", "--pipeline-model-parallel-size", "4"],
            8, None, None, id="pipes_pp4_no_vpp",
        ),
        pytest.param(
            ["[*E]{4}", "--num-experts", "4", "--pipeline-model-parallel-size", "2"],
            8, None, None, id="no_pipes_pp2",
        ),
        pytest.param(["[G-]{2}", "--swiglu"], 4, None, None, id="gdn_with_swiglu"),
        pytest.param(["(M-M*-){2}"], 10, None, None, id="mamba_defaults"),
    ],
)  # fmt: skip
def test_config_from_args(argv, num_layers, mtp, vpp):
    config = _config("--hybrid-layer-pattern", *argv)
    assert config.num_layers == num_layers
    assert config.mtp_num_layers == mtp
    assert config.virtual_pipeline_model_parallel_size == vpp


def test_config_carries_model_flags():
    config = _config(
        "--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "8", "--moe-router-topk", "3",
        "--hidden-size", "32", "--num-attention-heads", "2", "--ffn-hidden-size", "48",
        "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--bf16",
    )  # fmt: skip
    import torch

    assert (config.num_moe_experts, config.moe_router_topk) == (8, 3)
    assert (config.hidden_size, config.num_attention_heads, config.ffn_hidden_size) == (32, 2, 48)
    assert config.moe_ffn_hidden_size == 48  # defaults to --ffn-hidden-size
    assert (config.expert_model_parallel_size, config.tensor_model_parallel_size) == (2, 2)
    assert config.sequence_parallel and config.bf16 and config.params_dtype == torch.bfloat16


def test_mla_pattern_builds_an_mla_config():
    """'+' layers get megatron-core's MLATransformerConfig with the MLA flags (defaults train)."""
    from megatron.core.transformer import MLATransformerConfig

    config = _config("--hybrid-layer-pattern", "[+E]{2}", "--num-experts", "4",
                     "--kv-lora-rank", "24", "--v-head-dim", "12")  # fmt: skip
    assert isinstance(config, MLATransformerConfig) and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank) == (None, 24)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (16, 8, 12)
    plain = _config("--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4")
    assert not isinstance(plain, MLATransformerConfig)


def test_topk_one_passes_pre_softmax():
    config = _config("--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4",
                     "--moe-router-topk", "1", "--moe-router-pre-softmax")  # fmt: skip
    assert config.moe_router_topk == 1 and config.moe_router_pre_softmax


@pytest.mark.parametrize("given", [True, False], ids=["forced", "learnt"])
def test_force_load_balancing_reaches_the_router(given):
    """``train --moe-router-force-load-balancing`` (a train-only flag) sets megatron-core's
    field; without it routing is learnt (the control)."""
    argv = ["--hybrid-layer-pattern", "[*E]{2}", "--num-experts", "4"]
    argv += ["--moe-router-force-load-balancing"] if given else []
    from megatron_hybrid.training.config import hybrid_config_from_args
    from megatron_hybrid.training.train_settings import settings_from_args

    config = hybrid_config_from_args(settings_from_args(_parse(*argv)))
    assert config.moe_router_force_load_balancing is given


def test_config_from_partial_namespace():
    """Flags a foreign parser did not define take this package's defaults."""
    namespace = argparse.Namespace(hybrid_layer_pattern="[*-]{2}", hidden_size=32)
    config = _config(namespace=namespace)
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (4, 32, 128)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        pytest.param(["--hybrid-layer-pattern", "[*E]{2}"],
                     r"has MoE \('E'\) layers; set --num-experts", id="moe_without_num_experts"),
        pytest.param(["--hybrid-layer-pattern", "[G-]{2}"], r"must be SiLU: add --swiglu",
                     id="gdn_without_swiglu"),
        pytest.param(["--hybrid-layer-pattern", "[*-]|[*-]|[*-]",
                      "--pipeline-model-parallel-size", "2"],
                     r"3 '\|'-separated segments, which is not a multiple of "
                     r"--pipeline-model-parallel-size 2", id="segments_not_multiple_of_pp"),
        pytest.param(["--hybrid-layer-pattern", "[*-]|[*-]"],
                     r"2 '\|'-separated segments but there is no pipeline parallelism",
                     id="pipes_without_pp"),
        # A parallel rule: train's validate_settings names it; a bare config, megatron-core.
        pytest.param(["--hybrid-layer-pattern", "[*-]{2}", "--sequence-parallel"],
                     r"Cannot use sequence parallelism without tensor parallelism",
                     id="sequence_parallel_with_tp1"),
        pytest.param([], r"--hybrid-layer-pattern is required", id="no_pattern"),
        pytest.param(["--hybrid-layer-pattern", "M-", "--mamba-head-dim", "24"],
                     r"2 x --hidden-size = 128 channels, not a multiple of --mamba-head-dim 24",
                     id="mamba_head_dim"),
        pytest.param(["--hybrid-layer-pattern", "M-", "--mamba-num-groups", "3"],
                     r"8 heads in --mamba-num-groups 3 groups over TP 1", id="mamba_groups"),
        pytest.param(["--hybrid-layer-pattern", "M-", "--tensor-model-parallel-size", "4"],
                     r"groups over TP 4: groups must divide the heads and TP must divide",
                     id="mamba_groups_over_tp"),
    ],
)  # fmt: skip
def test_config_errors(argv, match):
    with pytest.raises(ValueError, match=match):
        _config(*argv)


@pytest.mark.parametrize(
    "impl, fusion, refused",
    [
        pytest.param("local", True, True, id="local-fused-refused"),
        pytest.param("local", False, False, id="local-unfused"),
        pytest.param("transformer_engine", True, False, id="te-own-softmax"),
    ],
)
def test_megatron_lm_refuses_missing_softmax_kernel(impl, fusion, refused):
    import importlib.util

    from megatron_hybrid.training.megatron_lm import check_fused_kernels

    if importlib.util.find_spec("scaled_masked_softmax_cuda") is not None:
        pytest.skip("the fused softmax extension is installed here")
    args = argparse.Namespace(transformer_impl=impl, masked_softmax_fusion=fusion)
    if refused:
        with pytest.raises(ValueError, match="--no-masked-softmax-fusion"):
            check_fused_kernels(args)
    else:
        check_fused_kernels(args)


def test_config_carries_mamba_flags():
    config = _config(
        "--hybrid-layer-pattern", "M*-", "--mamba-state-dim", "32", "--mamba-head-dim", "8",
        "--mamba-num-groups", "4", "--mamba-num-heads", "12",
    )  # fmt: skip
    assert (config.mamba_state_dim, config.mamba_head_dim) == (32, 8)
    assert (config.mamba_num_groups, config.mamba_num_heads) == (4, 12)


def test_megatron_lm_without_megatron_training(monkeypatch, capsys):
    """Python 3.11 cannot import megatron.training: --help still works, a run says how to fix."""
    import sys

    from megatron_hybrid.training import megatron_lm

    monkeypatch.setitem(sys.modules, "megatron.training", None)  # `import` raises ImportError
    assert megatron_lm.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--hybrid-layer-pattern" in out and "Python >= 3.12" in out
    assert megatron_lm.main(["--hybrid-layer-pattern", "[*E]{2}"]) == 2
    err = capsys.readouterr().err
    assert "cannot import megatron.training" in err and "PYTHON=python3.12" in err
