"""``validate_settings``: every invocation the issue saw fail late (or train wrongly) is refused
up front, naming the flag and the fix; valid invocations pass."""

from __future__ import annotations

import argparse

import pytest

from megatron_hybrid.training.train_settings import TrainSettings, settings_from_args

BASE = ["--hybrid-layer-pattern", "[*E]{4}", "--num-experts", "4"]


def _parse(*argv: str) -> TrainSettings:
    from megatron_hybrid.cli.main import build_parser, load_commands

    return settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))


def _validate(argv, world_size=1, on_gpu=False, scopes=None):
    from megatron_hybrid.training.validation import SCOPES, validate_settings

    validate_settings(_parse(*argv), world_size=world_size, on_gpu=on_gpu,
                      scopes=scopes or SCOPES)  # fmt: skip


# (extra flags on top of BASE or a full argv, world size, message). The first three trained
# wrongly with exit 0 before; the rest crashed late with a traceback.
REFUSED = [
    pytest.param(
        BASE + ["--clip-grad", "-1"], 1, r"--clip-grad -1.0 must be >= 0", id="clip-grad-negative"
    ),
    pytest.param(
        BASE
        + [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "-1",
        ],
        1,
        r"--recompute-num-layers -1 must be >= 1",
        id="recompute-num-layers-negative",
    ),
    pytest.param(
        BASE[:2] + ["--num-experts", "4", "--moe-router-topk", "0"],
        1,
        r"--moe-router-topk 0 must be >= 1",
        id="topk-zero",
    ),
    pytest.param(
        [
            "--hybrid-layer-pattern",
            "[*E]{4}",
            "--num-experts",
            "3",
            "--expert-model-parallel-size",
            "2",
        ],
        2,
        r"--num-experts 3 is not divisible by --expert-model-parallel-size 2",
        id="experts-not-divisible-by-ep",
    ),
    pytest.param(
        BASE + ["--moe-router-topk", "8"],
        1,
        r"--moe-router-topk 8 exceeds --num-experts 4",
        id="topk-above-experts",
    ),
    pytest.param(
        BASE + ["--expert-model-parallel-size", "3"],
        1,
        r"--expert-model-parallel-size 3 .* does not divide the 1 process",
        id="ep-above-world",
    ),
    pytest.param(
        BASE + ["--overlap-moe-expert-parallel-comm"],
        1,
        r"--overlap-moe-expert-parallel-comm .* needs --expert-model-parallel-size > 1",
        id="overlap-ep1",
    ),
    pytest.param(
        BASE + ["--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2"],
        2,
        r"--overlap-moe-expert-parallel-comm needs --bf16",
        id="overlap-fp32",
    ),
    pytest.param(
        BASE + ["--delay-wgrad-compute"],
        1,
        r"--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm",
        id="delay-wgrad-alone",
    ),
    pytest.param(
        BASE + ["--save", "/proc/ckpt"], 1, r"--save /proc/ckpt cannot be written", id="save-proc"
    ),
    pytest.param(
        BASE + ["--hidden-size", "62"],
        1,
        r"head dimension is 15 \(--hidden-size 62 / --num-attention-heads 4\): make it even, "
        r"e\.g\. --kv-channels 16",
        id="odd-rope-head-dim",
    ),
    pytest.param(
        BASE + ["--kv-channels", "7"],
        1,
        r"head dimension is 7 \(--kv-channels 7\): make it even, e\.g\. --kv-channels 8",
        id="odd-kv-channels",
    ),
    pytest.param(
        BASE + ["--num-query-groups", "3"],
        1,
        r"--num-query-groups 3 must divide --num-attention-heads 4",
        id="query-groups",
    ),
    pytest.param(
        BASE + ["--moe-token-dispatcher-type", "flex"],
        1,
        r"flex needs --tensor-model-parallel-size x --expert-model-parallel-size > 1",
        id="flex-single-rank",
    ),
    pytest.param(
        BASE + ["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "64"],
        1,
        r"--max-position-embeddings 64 is below --seq-length 128",
        id="learned-positions-short",
    ),
    pytest.param(
        BASE + ["--moe-router-topk", "1"], 1, r"needs --moe-router-pre-softmax", id="topk-one"
    ),
    pytest.param(
        BASE + ["--train-iters", "0"], 1, r"--train-iters 0 must be >= 1", id="train-iters-0"
    ),
    pytest.param(
        BASE + ["--train-iters", "-5"], 1, r"--train-iters -5 must be >= 1", id="train-iters-neg"
    ),
    pytest.param(
        BASE + ["--save-interval", "0"], 1, r"--save-interval 0 must be >= 1", id="save-interval-0"
    ),
    pytest.param(
        BASE + ["--save-interval", "-1"],
        1,
        r"--save-interval -1 must be >= 1",
        id="save-interval-neg",
    ),
    pytest.param(
        BASE + ["--global-batch-size", "0"],
        1,
        r"--global-batch-size 0 must be >= 1",
        id="global-batch-0",
    ),
    pytest.param(
        BASE + ["--global-batch-size", "6"],
        1,
        r"--global-batch-size 6 is not a multiple of --micro-batch-size",
        id="global-batch-split",
    ),
    pytest.param(
        BASE + ["--ffn-hidden-size", "0"], 1, r"--ffn-hidden-size 0 must be >= 1", id="ffn-0"
    ),
    pytest.param(
        BASE + ["--micro-batch-size", "-1"],
        1,
        r"--micro-batch-size -1 must be >= 1",
        id="micro-batch-neg",
    ),
    pytest.param(
        BASE + ["--seq-length", "0"], 1, r"--seq-length 0 must be >= 8", id="seq-length-0"
    ),
    pytest.param(
        BASE + ["--tensor-model-parallel-size", "0"],
        1,
        r"--tensor-model-parallel-size 0 must be >= 1",
        id="tp-0",
    ),
    pytest.param(
        BASE + ["--pipeline-model-parallel-size", "-2"],
        1,
        r"--pipeline-model-parallel-size -2 must be >= 1",
        id="pp-neg",
    ),
    pytest.param(
        BASE + ["--expert-model-parallel-size", "0"],
        1,
        r"--expert-model-parallel-size 0 must be >= 1",
        id="ep-0",
    ),
    pytest.param(
        BASE + ["--expert-tensor-parallel-size", "0"],
        1,
        r"--expert-tensor-parallel-size 0 must be >= 1",
        id="etp-0",
    ),
    pytest.param(
        BASE + ["--context-parallel-size", "0"],
        1,
        r"--context-parallel-size 0 must be >= 1",
        id="cp-0",
    ),
    pytest.param(BASE + ["--hidden-size", "0"], 1, r"--hidden-size 0 must be >= 1", id="hidden-0"),
    pytest.param(
        BASE + ["--num-attention-heads", "0"],
        1,
        r"--num-attention-heads 0 must be >= 1",
        id="heads-0",
    ),
    pytest.param(
        BASE + ["--kv-channels", "-4"], 1, r"--kv-channels -4 must be >= 1", id="kv-channels-neg"
    ),
    pytest.param(BASE + ["--vocab-size", "0"], 1, r"--vocab-size 0 must be >= 1", id="vocab-0"),
    pytest.param(
        BASE + ["--hidden-size", "2"],
        1,
        r"--hidden-size 2 is smaller than --num-attention-heads 4",
        id="head-without-channels",
    ),
    pytest.param(
        BASE + ["--tensor-model-parallel-size", "2", "--vocab-size", "255"],
        2,
        r"--vocab-size 255 is not divisible by --tensor-model-parallel-size 2",
        id="vocab-tp",
    ),
    pytest.param(
        BASE + ["--tensor-model-parallel-size", "2"],
        1,
        r"1 process\(es\) cannot hold --tensor-model-parallel-size x",
        id="tp-above-world",
    ),
    pytest.param(
        BASE + ["--context-parallel-size", "2"],
        2,
        r"--context-parallel-size 2 needs .* --transformer-impl transformer_engine",
        id="cp-needs-te",
    ),
    pytest.param(
        BASE + ["--transformer-impl", "transformer_engine"],
        1,
        r"--transformer-impl transformer_engine needs CUDA GPUs",
        id="te-on-cpu",
    ),
    pytest.param(
        BASE + ["--recompute-granularity", "full"],
        1,
        r"--recompute-granularity full needs --recompute-method",
        id="recompute-full-alone",
    ),
    pytest.param(
        BASE + ["--recompute-method", "block", "--recompute-num-layers", "1"],
        1,
        r"need --recompute-granularity full",
        id="recompute-method-alone",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[*-]|[*-]|[*-]", "--pipeline-model-parallel-size", "2"],
        2,
        r"3 '\|'-separated segments, which is not a multiple",
        id="segments-pp",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[*E]{3}", "--num-experts", "4"]
        + ["--pipeline-model-parallel-size", "4"],
        4,
        r"--pipeline-model-parallel-size 4 must divide the 6 physical layers of '\[\*E\]\{3\}': "
        r"put 3 '\|' between",
        id="pp-does-not-divide-layers",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[*E]{3}", "--num-experts", "4"]
        + ["--pipeline-model-parallel-size", "2"],
        1,  # the pattern's problem is reported before the world size's
        r"(?s)cuts logical layer 1 .*fix: put 1 '\|' between logical layers",
        id="pp-cuts-a-group",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[M-]{2}", "--mamba-impl", "kernels"],
        1,
        r"--mamba-impl kernels needs megatron-core's Mamba kernels, but",
        id="mamba-kernels-on-cpu",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[D-]{2}"], 1, r"'D' .* need DSA indexer settings", id="dsa"
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[+E]{2}", "--num-experts", "4", "--qk-pos-emb-head-dim", "7"],
        1,
        r"--qk-pos-emb-head-dim 7 must be even",
        id="mla-odd-rope",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[+-]{2}", "--kv-lora-rank", "0"],
        1,
        r"--kv-lora-rank 0 must be >= 1",
        id="mla-rank-0",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[G-]{2}"],
        1,
        r"must be SiLU: add --swiglu",
        id="gdn-without-swiglu",
    ),
    pytest.param(["--num-experts", "4"], 1, r"--hybrid-layer-pattern is required", id="no-pattern"),
    pytest.param(
        BASE + ["--manual-gc-interval", "10"],
        1,
        r"--manual-gc-interval 10 only apply with --manual-gc .* add --manual-gc",
        id="gc-interval-without-manual-gc",
    ),
    pytest.param(
        BASE + ["--no-manual-gc-eval"],
        1,
        r"--no-manual-gc-eval only apply with --manual-gc",
        id="gc-eval-without-manual-gc",
    ),
    pytest.param(
        BASE + ["--manual-gc", "--manual-gc-interval", "-1"],
        1,
        r"--manual-gc-interval -1 must be >= 0",
        id="gc-interval-negative",
    ),
    pytest.param(
        BASE + ["--synthetic-samples", "documents", "--data-path", "corpus"],
        1,
        r"--synthetic-samples documents lays out the built-in synthetic data, but --data-path",
        id="synthetic-samples-with-data-path",
    ),
    pytest.param(BASE + ["--seed", "-3"], 1, r"--seed -3 must be >= 0", id="negative-seed"),
    pytest.param(
        ["--hybrid-layer-pattern", "[*E]{4}"],
        1,
        r"has MoE \('E'\) layers; set --num-experts",
        id="moe-without-experts",
    ),
    pytest.param(
        ["--hybrid-layer-pattern", "[*-]{2}", "--moe-router-force-load-balancing"],
        1,
        r"--moe-router-force-load-balancing: the pattern '\[\*-\]\{2\}' has no MoE",
        id="force-balance-without-moe",
    ),
]


@pytest.mark.parametrize(("argv", "world_size", "match"), REFUSED)
def test_refused_before_anything_starts(argv, world_size, match):
    from megatron_hybrid.training.validation import SettingsError

    with pytest.raises(SettingsError, match=match):
        _validate(argv, world_size=world_size)


@pytest.mark.parametrize(
    ("argv", "world_size"),
    [
        pytest.param(BASE, 1, id="defaults"),
        pytest.param(BASE + ["--clip-grad", "0"], 1, id="clip-grad-off"),
        pytest.param(
            BASE + ["--moe-router-topk", "1", "--moe-router-pre-softmax"], 1, id="topk-one"
        ),
        pytest.param(
            BASE
            + [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            1,
            id="recompute",
        ),
        pytest.param(
            [
                "--hybrid-layer-pattern",
                "[*E]{4}",
                "--num-experts",
                "4",
                "--expert-model-parallel-size",
                "2",
                "--overlap-moe-expert-parallel-comm",
                "--bf16",
            ],
            2,
            id="overlap-ep2",
        ),
        pytest.param(
            BASE
            + [
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-model-parallel-size",
                "2",
            ],
            4,
            id="tp2-ep2-on-4",
        ),
        pytest.param(
            BASE + ["--hidden-size", "62", "--kv-channels", "16"], 1, id="kv-channels-fix"
        ),
        pytest.param(["--hybrid-layer-pattern", "[G-]{2}", "--swiglu"], 1, id="gdn"),
        pytest.param(
            BASE + ["--manual-gc", "--manual-gc-interval", "10", "--no-manual-gc-eval"],
            1,
            id="manual-gc",
        ),
        pytest.param(
            [
                "--hybrid-layer-pattern",
                "[*E]{2}|[*E]{2}",
                "--num-experts",
                "4",
                "--pipeline-model-parallel-size",
                "2",
            ],
            2,
            id="pipes-pp2",
        ),
    ],
)
def test_valid_settings_pass(argv, world_size):
    """Negative control: the rules refuse only what cannot work."""
    _validate(argv, world_size=world_size)


def test_mla_gate_reads_the_spec(monkeypatch):
    """'+' on the local backend waits for a core attention with k/v head dims (from the spec)."""
    from megatron_hybrid.training import capabilities, validation

    argv = ["--hybrid-layer-pattern", "[+E]{2}", "--num-experts", "4"]
    usable = capabilities.mla_core_attention_usable("local")
    if not usable:
        with pytest.raises(
            validation.SettingsError, match=r"'\+' \(MLA\) layers with --transformer"
        ):
            _validate(argv)
    monkeypatch.setattr(capabilities, "mla_core_attention_usable", lambda backend: True)
    _validate(argv)


def test_gdn_on_a_gpu_where_fla_refuses_its_backward(monkeypatch):
    """Stop before the first step (not after its autotune) with the exact fix."""
    from megatron_hybrid.training import capabilities, validation

    argv = ["--hybrid-layer-pattern", "[G-]{2}", "--swiglu"]
    monkeypatch.setattr(capabilities, "fla_installed", lambda: True)
    refused = "fla refuses GatedDeltaNet's backward with Triton 3.6.0 on Hopper GPUs"
    monkeypatch.setattr(capabilities, "fla_gated_backward_refused", lambda: refused)
    fix = r"Triton 3\.6\.0 .*pip install 'triton>=3\.7\.1' or pip install tilelang"
    with pytest.raises(validation.SettingsError, match=fix):
        _validate(argv, on_gpu=True, scopes=("model", "device"))
    monkeypatch.setattr(capabilities, "fla_gated_backward_refused", lambda: None)
    _validate(argv, on_gpu=True, scopes=("model", "device"))  # negative control
    monkeypatch.setattr(capabilities, "fla_installed", lambda: False)
    with pytest.raises(validation.SettingsError, match=r"need fla-core: pip install fla-core"):
        _validate(argv, on_gpu=True, scopes=("model", "device"))


HYBRIDEP = BASE + ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend",
                   "hybridep", "--expert-model-parallel-size", "2", "--bf16"]  # fmt: skip


@pytest.fixture
def deep_ep_as(monkeypatch, tmp_path):
    """``deep_ep_as(*modules, nvcc=bool)``: pretend exactly these DeepEP modules are installed
    and ``CUDA_HOME`` holds (or lacks) an executable ``bin/nvcc``."""
    import importlib.util

    real = importlib.util.find_spec

    def install(*modules, nvcc=True):
        fake = {name: object() for name in modules}
        monkeypatch.setattr(
            importlib.util, "find_spec",
            lambda name, *a: fake.get(name) if name in ("deep_ep", "hybrid_ep_cpp") else real(
                name, *a),
        )  # fmt: skip
        home = tmp_path / "cuda"
        (home / "bin").mkdir(parents=True, exist_ok=True)
        if nvcc:
            (home / "bin" / "nvcc").write_text("#!/bin/sh\n")
            (home / "bin" / "nvcc").chmod(0o755)
        monkeypatch.setenv("CUDA_HOME", str(home))

    return install


@pytest.mark.parametrize(
    "modules, nvcc, match",
    [
        ((), True, r"hybridep needs DeepEP \(the deep_ep package\), which is not installed"),
        (("deep_ep",), True, r"needs DeepEP built from its hybrid-ep branch .*hybrid_ep_cpp"),
        (("deep_ep", "hybrid_ep_cpp"), False, r"\$CUDA_HOME/bin/nvcc, but .*bin/nvcc does not"),
    ],
    ids=["no-deepep", "deepep-without-hybridep", "no-nvcc"],
)
def test_hybridep_needs_deepep_hybridep_and_nvcc(deep_ep_as, modules, nvcc, match):
    """Refused by name before the model is built (megatron-core raises only at build time, and
    HybridEP's kernel compiler only in the first forward pass)."""
    from megatron_hybrid.training.validation import SettingsError

    deep_ep_as(*modules, nvcc=nvcc)
    with pytest.raises(SettingsError, match=match):
        _validate(HYBRIDEP, world_size=2, on_gpu=True)


def test_hybridep_cuda_home_unset(deep_ep_as, monkeypatch):
    from megatron_hybrid.training.validation import SettingsError

    deep_ep_as("deep_ep", "hybrid_ep_cpp")
    monkeypatch.delenv("CUDA_HOME")
    with pytest.raises(SettingsError, match=r"CUDA_HOME is not set: export CUDA_HOME="):
        _validate(HYBRIDEP, world_size=2, on_gpu=True)


def test_hybridep_with_ep_overlap_is_accepted(deep_ep_as):
    """megatron-core 0.19.2 runs combined-1F1B with the flex dispatcher's hybridep backend
    (``fine_grained_callables.py``), so the pair passes; the same flags fail on a CPU and
    without DeepEP (negative controls)."""
    from megatron_hybrid.training.validation import SettingsError

    argv = HYBRIDEP + ["--overlap-moe-expert-parallel-comm"]
    with pytest.raises(SettingsError, match=r"flex needs CUDA GPUs"):
        _validate(argv, world_size=2, on_gpu=False)
    deep_ep_as()
    with pytest.raises(SettingsError, match=r"needs DeepEP"):
        _validate(argv, world_size=2, on_gpu=True)
    deep_ep_as("deep_ep", "hybrid_ep_cpp")
    _validate(argv, world_size=2, on_gpu=True)


def test_world_size_comes_from_torchrun(monkeypatch):
    """Without an explicit world size, WORLD_SIZE (set by torchrun) decides."""
    from megatron_hybrid.training.validation import SettingsError, validate_settings

    args = _parse(*BASE, "--expert-model-parallel-size", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    validate_settings(args, on_gpu=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SettingsError, match="does not divide the 1 process"):
        validate_settings(args, on_gpu=False)


def test_save_into_a_regular_file(tmp_path):
    from megatron_hybrid.training.validation import SettingsError

    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(SettingsError, match=r"--save .*file is a file"):
        _validate(BASE + ["--save", str(target)])
    _validate(BASE + ["--save", str(tmp_path / "new" / "dir")])  # created, writable
    assert (tmp_path / "new" / "dir").is_dir()


def test_model_scope_skips_train_and_parallel_rules():
    """check-checkpoint checks only the model's needs (no world size, no --train-iters)."""
    _validate(
        BASE
        + [
            "--train-iters",
            "0",
            "--expert-model-parallel-size",
            "8",
            "--transformer-impl",
            "transformer_engine",
        ],
        scopes=("model",),
    )


@pytest.mark.parametrize(
    ("argv", "scopes", "match"),
    [
        pytest.param(["--hybrid-layer-pattern", "M-", "--mamba-head-dim", "24"], ("model",),
                     r"2 x --hidden-size = 128 channels, not a multiple of --mamba-head-dim 24",
                     id="mamba-head-dim"),
        pytest.param(["--hybrid-layer-pattern", "M-", "--mamba-num-groups", "3"], ("model",),
                     r"8 heads in --mamba-num-groups 3 groups over TP 1", id="mamba-groups"),
        pytest.param(["--hybrid-layer-pattern", "[*E]{2}"], ("model",),
                     r"has MoE \('E'\) layers; set --num-experts", id="moe-without-experts"),
        pytest.param(["--hybrid-layer-pattern", "[G-]{2}"], ("model",),
                     r"must be SiLU: add --swiglu", id="gdn-without-swiglu"),
        pytest.param(["--hybrid-layer-pattern", "[*-]{2}", "--sequence-parallel"], ("parallel",),
                     r"--sequence-parallel needs --tensor-model-parallel-size > 1",
                     id="sequence-parallel-tp1"),
    ],
)  # fmt: skip
def test_the_config_builders_rules_live_in_the_table(argv, scopes, match):
    """The rules the config builder used to re-raise are the table's: validate_settings (and
    check-checkpoint's model scope) sees them, with the same message."""
    from megatron_hybrid.training.validation import SettingsError

    with pytest.raises(SettingsError, match=match):
        _validate(argv, scopes=scopes)


def test_mamba_runs_without_kernels_and_the_gate_is_one_function(monkeypatch):
    """'M' takes the torch Mamba2 path without kernels; asking for the kernels is decided by
    mamba_kernels_usable alone."""
    from megatron_hybrid.training import capabilities

    _validate(["--hybrid-layer-pattern", "[M-]{2}"])
    monkeypatch.setattr(capabilities, "mamba_kernels_usable", lambda: (True, None))
    _validate(["--hybrid-layer-pattern", "[M-]{2}", "--mamba-impl", "kernels"])


def test_every_rule_names_a_known_flag():
    from megatron_hybrid.training.validation import RULES

    assert {flag for rule in RULES for flag in rule.flags} <= _parse_options()


def _parse_options() -> set[str]:
    from megatron_hybrid.cli.main import build_parser, load_commands

    parser = build_parser(load_commands())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices["train"]._option_string_actions)


def test_only_rank_zero_prints_settings_errors(monkeypatch, capsys):
    """Under torchrun every rank refuses (exit 2), one prints the message."""
    from megatron_hybrid.cli.main import main

    argv = ["train", *BASE, "--clip-grad", "-1"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(argv) == 2
    assert capsys.readouterr().err == ""
    assert main(["train", "--hybrid-layer-pattern", "[*E"]) == 2  # a pattern error alike
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(argv) == 2
    assert "error: --clip-grad -1.0 must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "on_gpu", "match"),
    [
        pytest.param(
            [], False, r"--hybrid-cuda-graphs captures CUDA graphs, which need GPUs", id="cpu"
        ),
        pytest.param(
            [
                "--recompute-granularity",
                "full",
                "--recompute-method",
                "uniform",
                "--recompute-num-layers",
                "1",
            ],
            True,
            r"cannot replay forwards that recompute re-runs",
            id="recompute",
        ),
    ],
)
def test_cuda_graphs_refused_where_they_cannot_run(extra, on_gpu, match):
    from megatron_hybrid.training.validation import SettingsError

    with pytest.raises(SettingsError, match=match):
        _validate(BASE + ["--hybrid-cuda-graphs", *extra], on_gpu=on_gpu)
