"""Hugging Face oracle for converter tests: tiny random transformers checkpoints and their logits.

The converter is judged against transformers itself (5.23): :func:`make_hf_checkpoint` builds a
tiny model of one HF family, gives EVERY parameter (and the router bias buffers) a random value
away from transformers' init, and writes it with ``save_pretrained``, i.e. in the on-disk hub
layout (per-expert keys, Nemotron-H ``backbone.`` prefix) that vLLM/SGLang load; :func:`hf_logits`
is transformers' float32 forward of such a checkpoint. Random norms and routers matter: HF inits
routers to zero-ish and norms to identity, where a swapped or unfolded tensor changes nothing.

transformers binds fla's Triton kernels at import time of its Qwen3.5/Qwen3-Next modeling code
whenever ``fla`` is importable (megatron-core needs fla-core installed), and those kernels die on
CPU. The modeling modules are therefore imported with ``fla`` hidden, re-imported if something
imported them earlier with fla visible, and the bound kernels are checked to be the torch ones.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

# The rounding-scale estimator lives one folder up (tests/unit), which scripts that import this
# oracle by its own folder (GPU fixtures, subprocess tests) do not put on sys.path.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from rounding import float32_bounds, max_abs  # noqa: E402

FAMILIES: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "nemotron_h")

# family -> (transformers modeling module, config class, causal-LM class)
_CLASSES: dict[str, tuple[str, str, str]] = {
    "qwen3_5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM"),
    "nemotron_h": ("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM"),
}

# Buffers that are constants derived from the config (RoPE inverse frequencies): randomising them
# would make transformers compute a different model from the one the checkpoint describes (they
# are not saved, so a converter never sees them). Every other buffer must be randomised, and an
# unknown buffer is an error so that a new transformers version cannot slip one in unnoticed.
DERIVED_BUFFERS: tuple[str, ...] = ("inv_freq", "original_inv_freq")
RANDOMISED_BUFFERS: tuple[str, ...] = ("e_score_correction_bias",)

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "dtype": "float32",
    "attn_implementation": "eager",
    # The per-expert python loop is transformers' reference MoE path (no grouped-mm kernels).
    "experts_implementation": "eager",
}
_GDN: dict[str, Any] = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
_QWEN_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
_BASE: dict[str, dict[str, Any]] = {
    "qwen3_5": {**_COMMON, **_GDN, "intermediate_size": 96},
    "qwen3_5_moe": {**_COMMON, **_GDN, **_QWEN_MOE},
    "qwen3_next": {
        **_COMMON,
        **_GDN,
        **_QWEN_MOE,
        "intermediate_size": 96,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "deepseek_v3": {
        # head_dim is derived (= qk_rope_head_dim, the RoPE width); setting it breaks RoPE.
        **{k: v for k, v in _COMMON.items() if k != "head_dim"},
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "intermediate_size": 96,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "num_key_value_heads": 4,  # MLA: one KV head per query head
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "rope_interleave": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "nemotron_h": {
        **{k: v for k, v in _COMMON.items() if k != "rms_norm_eps"},
        "layer_norm_epsilon": 1e-6,
        # Mamba, MoE, attention, dense MLP: one mixer per block (pattern "ME*-").
        "hybrid_override_pattern": "ME*-",
        "n_groups": 2,
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "expand": 2,
        # 24 tokens = one full chunk + a partial one.
        "chunk_size": 16,
        "intermediate_size": 96,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        # transformers clamps softplus(dt + dt_bias) from below at time_step_min. The random
        # dt_bias (about 1) puts softplus near 1.3, so only a floor this high makes the clamp
        # bind for some tokens and heads and a converter that drops it fail the logits test.
        "time_step_min": 0.5,
    },
}


@contextlib.contextmanager
def _fla_hidden() -> Iterator[None]:
    """Make ``import fla`` fail (``sys.modules["fla"] = None``) and restore the entry after."""
    missing = object()
    saved = sys.modules.get("fla", missing)
    sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if saved is missing:
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved  # type: ignore[assignment]


def kernel_bindings(module: ModuleType) -> dict[str, str]:
    """``{function: module of its implementation}`` of transformers' hub-kernel wrappers.

    transformers' ``use_kernel_func_from_hub_with_fallback`` closes over the implementation it
    chose at import time (fla, mamba_ssm, causal_conv1d, or the torch function it decorates).
    """
    bound: dict[str, str] = {}
    for name, fn in vars(module).items():
        if not inspect.isfunction(fn) or not fn.__closure__:
            continue
        closure = inspect.getclosurevars(fn).nonlocals
        if "is_new_implementation" in closure:
            bound[name] = closure["implementation"].__module__
    return bound


def _foreign_kernels(module: ModuleType) -> dict[str, str]:
    return {k: v for k, v in kernel_bindings(module).items() if v != module.__name__}


_MODELING: dict[str, ModuleType] = {}


def modeling_module(family: str) -> ModuleType:
    """transformers' modeling module of ``family``, bound to its torch kernels (see module doc)."""
    _check_family(family)
    if family in _MODELING:
        return _MODELING[family]
    name = f"transformers.models.{_CLASSES[family][0]}.modeling_{_CLASSES[family][0]}"
    with _fla_hidden():
        module = importlib.import_module(name)
        if _foreign_kernels(module):
            # Imported earlier with fla visible: re-executing it rebinds the kernels (the model
            # classes are looked up by name on the module, so from_pretrained gets the new ones).
            module = importlib.reload(module)
    foreign = _foreign_kernels(module)
    if foreign:
        raise RuntimeError(f"{name} still uses non-torch kernels on CPU: {foreign}")
    _MODELING[family] = module
    return module


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown HF family {family!r}; expected one of {', '.join(FAMILIES)}")


def tiny_config(family: str, *, mtp_layers: int = 0, **overrides: Any) -> Any:
    """Tiny float32 transformers config of ``family`` (text-only classes).

    Args:
        family: One of :data:`FAMILIES`.
        mtp_layers: Number of MTP layers to declare in the config, under the field the real
            checkpoints use (transformers itself does not model MTP; see
            :func:`add_fake_mtp_tensors` for the weights).
        **overrides: Config fields replacing the tiny defaults (e.g. ``layer_types``,
            ``num_hidden_layers``, ``hybrid_override_pattern``).
    """
    _check_family(family)
    kwargs = dict(_BASE[family])
    if family.startswith("qwen3"):
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            # Keep the 3 x linear + 1 x full attention period for other depths.
            n = overrides["num_hidden_layers"]
            kwargs["layer_types"] = [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)
            ]
        if mtp_layers:
            kwargs["mtp_num_hidden_layers"] = mtp_layers
    elif family == "deepseek_v3":
        # transformers 5.23 defaults to 1 MTP layer (num_mtp_layers, an alias of the
        # num_nextn_predict_layers that config.json holds); the tiny model has none unless asked.
        kwargs["num_nextn_predict_layers"] = mtp_layers
    elif family == "nemotron_h":
        kwargs["num_nextn_predict_layers"] = mtp_layers
    kwargs.update(overrides)
    config_cls = getattr(importlib.import_module("transformers"), _CLASSES[family][1])
    return config_cls(**kwargs)


def _randomise(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Give every parameter and non-derived buffer a random value away from HF's init.

    Matrices (and packed expert / conv tensors) get N(0, 1/fan_in) with fan_in = last dim, so
    activations stay O(1) through the tiny stack. 1-D parameters (norm gammas, zero-centred or
    not, A_log, dt_bias, D, biases) get N(0, 0.1^2) added to their init: identity norms become
    non-trivial and zero-centred ones non-zero. Router bias buffers get N(0, 0.2^2).
    """
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.dim() >= 2:
                param.copy_(noise / math.sqrt(param.shape[-1]))
            else:
                param.copy_(param.float() + 0.1 * noise)
        for name, buf in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in DERIVED_BUFFERS:
                continue
            if leaf not in RANDOMISED_BUFFERS:
                raise RuntimeError(
                    f"buffer {name} is neither a derived constant {DERIVED_BUFFERS} nor a "
                    f"randomised one {RANDOMISED_BUFFERS}: decide how the oracle treats it"
                )
            buf.copy_(0.2 * torch.randn(buf.shape, generator=generator, dtype=torch.float32))


def build_model(
    family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> torch.nn.Module:
    """The randomised in-memory transformers model that :func:`make_hf_checkpoint` saves.

    Values are drawn in float32 from ``seed`` and then cast, so two dtypes hold the same model up
    to rounding. Tensors named in the class's ``_keep_in_fp32_modules_strict``
    (``e_score_correction_bias`` of DeepSeek-V3 and Nemotron-H) stay float32, as
    ``from_pretrained(dtype=bfloat16)`` keeps them and real checkpoints store them; transformers
    5.23's ``_from_config(dtype=bfloat16)`` would cast them to bfloat16 and ``save_pretrained``
    would then write them so.
    """
    module = modeling_module(family)
    config = tiny_config(family, **overrides)
    model_cls = getattr(module, _CLASSES[family][2])
    torch.manual_seed(seed)
    model = model_cls._from_config(config, dtype=torch.float32)
    _randomise(model, torch.Generator().manual_seed(seed))
    if dtype != torch.float32:
        keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        # Snapshot before the cast: a float32 tensor restored from bfloat16 would be rounded.
        fp32 = {
            name: tensor.detach().clone()
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if any(k in name for k in keep)
        }
        model.to(dtype)
        for name, value in fp32.items():
            owner, _, leaf = name.rpartition(".")
            target = model.get_submodule(owner)
            if leaf in target._buffers:
                target._buffers[leaf] = value
            else:
                target._parameters[leaf].data = value
        model.config.dtype = dtype
    return model.eval()


def make_hf_checkpoint(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny randomised ``family`` model with ``save_pretrained`` and return its directory.

    Args:
        family: One of :data:`FAMILIES`.
        out_dir: Directory to write (created).
        seed: Seed of the random values.
        dtype: Storage dtype of the weights (``e_score_correction_bias`` stays float32).
        max_shard_size: ``save_pretrained``'s shard limit, e.g. ``"20KB"`` for a sharded
            checkpoint with ``model.safetensors.index.json``; None writes one file.
        **overrides: Passed to :func:`tiny_config` (including ``mtp_layers``).
    """
    model = build_model(family, seed=seed, dtype=dtype, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


def hf_logits(
    path: str | Path,
    input_ids: torch.Tensor,
    *,
    rounding: contextlib.AbstractContextManager | None = None,
) -> torch.Tensor:
    """transformers' float32 logits ``[batch, seq, vocab]`` of the checkpoint at ``path``.

    ``rounding`` is a context the forward pass (not the loading) runs in: for
    :func:`logits_bound`, :class:`rounding.RoundingJitter`.
    """
    family = _family_of(Path(path))
    modeling_module(family)  # bind the torch kernels before transformers resolves the class
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad(), rounding or contextlib.nullcontext():
        out = model(input_ids=input_ids, use_cache=False)
    return out.logits.float()


_MODEL_TYPES: dict[str, str] = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    # The hub's (vision-language) layout written by to_vlm_layout.
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
    "deepseek_v3": "deepseek_v3",
    "nemotron_h": "nemotron_h",
}


def _family_of(path: Path) -> str:
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"{path}/config.json: model_type {model_type!r} is not an oracle family")
    return _MODEL_TYPES[model_type]


_ST_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
}


def safetensors_files(path: str | Path) -> dict[str, list[str]]:
    """``{file name: [tensor names]}`` of a checkpoint directory, via the index if there is one."""
    from safetensors import safe_open

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            files.setdefault(file, []).append(name)
        return files
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: neither model.safetensors nor its index")
    with safe_open(single, framework="pt") as f:
        return {single.name: list(f.keys())}


def on_disk_tensors(path: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of every tensor in the checkpoint's safetensors files."""
    from safetensors import safe_open

    path = Path(path)
    result: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file, names in safetensors_files(path).items():
        with safe_open(path / file, framework="pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise KeyError(f"{path}: index maps {name} to {file}, which lacks it")
                sl = f.get_slice(name)
                result[name] = (_ST_DTYPES[sl.get_dtype()], tuple(sl.get_shape()))
    return result


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint at ``path`` (test helper; the models are tiny)."""
    from safetensors.torch import load_file

    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        out.update(load_file(path / file))
    return out


_VLM_ARCHITECTURES = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def to_vlm_layout(path: str | Path) -> Path:
    """Rewrite a Qwen3.5 text checkpoint in place into the hub's vision-language layout.

    The published Qwen3.5 checkpoints are ``*ForConditionalGeneration`` ones: config.json has
    ``model_type`` ``qwen3_5`` / ``qwen3_5_moe`` with the text fields under ``text_config``, and
    the language model's tensors are ``model.language_model.*`` (``lm_head`` and ``mtp.*`` stay
    top-level). transformers 5.23 loads this layout into the text ``*ForCausalLM`` (its
    ``qwen3_5_text`` conversion strips ``language_model``), so :func:`hf_logits` works on both.
    No ``model.visual.*`` tensors are added.
    """
    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    family = _family_of(path)
    if family not in _VLM_ARCHITECTURES or config["model_type"] == family:
        raise ValueError(
            f"{path}: not a Qwen3.5 text checkpoint (model_type {config['model_type']})"
        )

    def rename(name: str) -> str:
        return (
            "model.language_model." + name[len("model.") :] if name.startswith("model.") else name
        )

    for file in safetensors_files(path):
        tensors = load_file(path / file)
        save_file(
            {rename(k): v for k, v in tensors.items()}, path / file, metadata={"format": "pt"}
        )
    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    text = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version")}
    wrapped = {
        "architectures": [_VLM_ARCHITECTURES[family]],
        "model_type": family,
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "transformers_version": config.get("transformers_version"),
    }
    (path / "config.json").write_text(json.dumps(wrapped, indent=2, sort_keys=True) + "\n")
    return path


#: A tiny vision tower for the multimodal Qwen3.5 classes (transformers 5.23
#: ``Qwen3_5*VisionConfig``): two blocks, hidden 32, patches of 4, merged into hidden 64.
_TINY_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
}
_VLM_CONFIGS = {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig"}


def make_vlm_checkpoint(
    family: str, out_dir: str | Path, *, seed: int = 0, max_shard_size: str | None = None
) -> Path:
    """Save a tiny randomised multimodal Qwen3.5 (``*ForConditionalGeneration``: the text model
    of :func:`tiny_config` under ``model.language_model.``, a vision tower under
    ``model.visual.``) with ``save_pretrained``, as the hub releases are laid out."""
    if family not in _VLM_ARCHITECTURES:
        raise ValueError(f"{family}: no multimodal class (one of {sorted(_VLM_ARCHITECTURES)})")
    module = modeling_module(family)
    config_cls = getattr(importlib.import_module("transformers"), _VLM_CONFIGS[family])
    text = tiny_config(family).to_dict()
    config = config_cls(
        text_config=text,
        vision_config=dict(_TINY_VISION),
        image_token_id=250,
        video_token_id=251,
        vision_start_token_id=252,
        vision_end_token_id=253,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(module, _VLM_ARCHITECTURES[family])._from_config(config, dtype=torch.float32)
    _randomise(model, torch.Generator().manual_seed(seed))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.eval().save_pretrained(out, **kwargs)
    return out


def vlm_logits(path: str | Path, input_ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    """``(class name, float32 logits)`` of a multimodal folder loaded as the class its
    config.json's ``architectures`` names (text-only input)."""
    family = _family_of(Path(path))
    module = modeling_module(family)
    architecture = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    model = (
        getattr(module, architecture)
        .from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        )
        .eval()
    )
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False)
    return type(model).__name__, out.logits.float()


# --- MTP tensors (transformers drops them on load, so save_pretrained never writes them) ------
#
# On-disk names of the real checkpoints, as mapped by NVIDIA-NeMo/Megatron-Bridge:
# - Qwen3.5 / Qwen3.5-MoE (src/megatron/bridge/models/qwen/qwen35_bridge.py,
#   _get_moe_mtp_mappings / _get_dense_mtp_mappings): top-level ``mtp.fc.weight`` (eh_proj,
#   [H, 2H]), ``mtp.pre_fc_norm_embedding.weight`` (enorm), ``mtp.pre_fc_norm_hidden.weight``
#   (hnorm), ``mtp.norm.weight`` (final norm), and one full-attention decoder layer
#   ``mtp.layers.{i}.{input_layernorm, post_attention_layernorm, self_attn.*, mlp.*}`` with
#   per-expert MoE keys (Qwen3.5; Qwen3.6 packs them as ``experts.gate_up_proj``). Qwen3-Next
#   checkpoints use the same ``mtp.*`` layout
#   (src/megatron/bridge/models/qwen/qwen3_next_bridge.py).
# - DeepSeek-V3 (src/megatron/bridge/models/deepseek/common.py, get_common_mapping_list): MTP
#   layer i is ``model.layers.{num_hidden_layers + i}.*``: a MoE decoder layer plus ``enorm``,
#   ``hnorm``, ``eh_proj`` and ``shared_head.norm``; the real checkpoint also stores
#   ``shared_head.head`` and ``embed_tokens`` copies there (shared with the main model, unmapped
#   by Megatron-Bridge).


def _mtp_specs(
    family: str, config: dict[str, Any], tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    if family == "nemotron_h":
        return _nemotron_mtp_specs(config, tensors)
    if not (family.startswith("qwen3") or family == "deepseek_v3"):
        raise ValueError(f"{family}: no known on-disk MTP layout")
    hidden = config["hidden_size"]
    layers = config["num_hidden_layers"]
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def layer_template(index: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        prefix = f"model.layers.{index}."
        return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}

    wdtype = tensors["model.embed_tokens.weight"][0]
    if family.startswith("qwen3"):
        count = config.get("mtp_num_hidden_layers", 0)
        full = [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"]
        if not full:
            raise ValueError(f"{family}: MTP needs a full-attention layer to copy the layout from")
        template = layer_template(full[-1])
        for name, shape in (
            ("fc.weight", (hidden, 2 * hidden)),
            ("pre_fc_norm_embedding.weight", (hidden,)),
            ("pre_fc_norm_hidden.weight", (hidden,)),
            ("norm.weight", (hidden,)),
        ):
            if count:
                specs[f"mtp.{name}"] = (wdtype, shape)
        for i in range(count):
            specs.update({f"mtp.layers.{i}.{k}": v for k, v in template.items()})
    else:
        count = config.get("num_nextn_predict_layers", 0)
        if layers <= config["first_k_dense_replace"]:
            raise ValueError("deepseek_v3: MTP needs a MoE layer to copy the layout from")
        template = layer_template(layers - 1)
        vocab = config["vocab_size"]
        for i in range(count):
            prefix = f"model.layers.{layers + i}."
            specs.update({prefix + k: v for k, v in template.items()})
            specs[prefix + "enorm.weight"] = (wdtype, (hidden,))
            specs[prefix + "hnorm.weight"] = (wdtype, (hidden,))
            specs[prefix + "eh_proj.weight"] = (wdtype, (hidden, 2 * hidden))
            specs[prefix + "shared_head.norm.weight"] = (wdtype, (hidden,))
            specs[prefix + "shared_head.head.weight"] = (wdtype, (vocab, hidden))
            specs[prefix + "embed_tokens.weight"] = (wdtype, (vocab, hidden))
    return specs


def _nemotron_mtp_specs(
    config: dict[str, Any], tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Nemotron-3's MTP: depth d's blocks flattened as ``mtp.layers.{d*L + i}.{norm,mixer}.*``,
    ``eh_proj``/``enorm``/``hnorm`` on its first block, ``final_layernorm`` on its last
    (Megatron-Bridge src/megatron/bridge/models/nemotronh/nemotron_h_bridge.py)."""
    main, block_types = config["layers_block_type"], config["mtp_layers_block_type"]
    hidden, per_depth = config["hidden_size"], len(block_types)
    wdtype = tensors["backbone.embeddings.weight"][0]
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for depth in range(config.get("num_nextn_predict_layers", 0)):
        for i, block_type in enumerate(block_types):
            if block_type not in main:
                raise ValueError(f"nemotron_h: MTP block {block_type!r} has no main-layer layout")
            source = f"backbone.layers.{len(main) - 1 - main[::-1].index(block_type)}."
            prefix = f"mtp.layers.{depth * per_depth + i}."
            for name, spec in tensors.items():
                if name.startswith(source):
                    specs[prefix + name[len(source) :]] = spec
        first, last = (
            f"mtp.layers.{depth * per_depth}.",
            f"mtp.layers.{(depth + 1) * per_depth - 1}.",
        )
        specs[first + "eh_proj.weight"] = (wdtype, (hidden, 2 * hidden))
        specs[first + "enorm.weight"] = (wdtype, (hidden,))
        specs[first + "hnorm.weight"] = (wdtype, (hidden,))
        specs[last + "final_layernorm.weight"] = (wdtype, (hidden,))
    return specs


def add_fake_mtp_tensors(path: str | Path, family: str, *, seed: int = 1) -> dict[str, Any]:
    """Append random MTP tensors under the real checkpoints' names; return them.

    The count comes from config.json (``mtp_num_hidden_layers`` for the Qwen families,
    ``num_nextn_predict_layers`` for DeepSeek-V3; see :func:`tiny_config`'s ``mtp_layers``).
    They go into a new shard ``model-mtp.safetensors`` recorded in
    ``model.safetensors.index.json``; a single-file checkpoint is first turned into a one-shard
    indexed one. Matrices get N(0, 1/fan_in); norm weights N(0, 0.1^2) in the Qwen families
    (zero-centred there, also in MTP) and 1 + N(0, 0.1^2) in DeepSeek-V3.
    """
    from safetensors.torch import save_file

    path = Path(path)
    _check_family(family)
    config = json.loads((path / "config.json").read_text())
    tensors = on_disk_tensors(path)
    specs = _mtp_specs(family, config, tensors)
    if not specs:
        raise ValueError(f"{path}/config.json declares no MTP layers; pass mtp_layers= to build")
    generator = torch.Generator().manual_seed(seed)
    new: dict[str, torch.Tensor] = {}
    for name, (dtype, shape) in sorted(specs.items()):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if len(shape) >= 2:
            value = noise / math.sqrt(shape[-1])
        elif name.endswith("e_score_correction_bias") or family.startswith("qwen3"):
            value = 0.2 * noise if name.endswith("bias") else 0.1 * noise  # zero-centred norms
        else:
            value = 1 + 0.1 * noise
        new[name] = value.to(dtype).contiguous()
    # DeepSeek's MTP layer stores copies of the shared embedding and output head.
    copies = {
        "embed_tokens.weight": "model.embed_tokens.weight",
        "shared_head.head.weight": "lm_head.weight",
    }
    originals = read_tensors(path) if family == "deepseek_v3" else {}
    for name in new:
        for suffix, original in copies.items():
            if family == "deepseek_v3" and name.endswith(suffix):
                new[name] = originals[original].clone()

    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
        index = {
            "metadata": {"total_size": 0},
            "weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors},
        }
        index["metadata"]["total_size"] = sum(
            math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            for dtype, shape in tensors.values()
        )
    save_file(new, path / "model-mtp.safetensors", metadata={"format": "pt"})
    for name, value in new.items():
        index["weight_map"][name] = "model-mtp.safetensors"
        index["metadata"]["total_size"] += value.numel() * value.element_size()
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return new


#: The families megatron_hybrid.hf converts (Nemotron-H is added with the Mamba torch path).
CONVERTED = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "nemotron_h")
SEQ = 24

#: Max abs logit difference allowed against transformers where the model is well conditioned:
#: logits of size ~4 in float32 (sequence 24), over 10x the rounding scale of such models.
TOLERANCE = 1e-4


def logits_bound(folder, input_ids, reference=None) -> float:
    """:data:`TOLERANCE`, or the float32 rounding scale of the logits times the margin.

    Derived from the computation, not from one machine's rounding: ours and transformers'
    logits are two float32 evaluations of the same function, each off by about the response of
    the model to random roundings of every operation (:func:`rounding.float32_error_scale`,
    which includes the amplification through GatedDeltaNet's ``exp(A_log)`` recurrence), times
    :data:`rounding.ROUNDING_MARGIN`. With the oracle's seed-0 weights the scale is 7.3e-4 for
    Qwen3.5-MoE, 3.4e-4 for Qwen3.5, 8.8e-5 for Qwen3-Next and under 1e-5 elsewhere; the
    largest error seen on any machine (2.2e-4, Qwen3.5-MoE at TP2, where a fixed 1e-4 failed)
    is 13x under its bound. A single mapping bug moves the logits by O(1) (the negative
    controls in test_hf_convert.py).

    ``reference`` (transformers' float32 logits) is accepted for the callers' signature and not
    used: the bound must not depend on this machine's rounding of it.
    """
    del reference
    bounds = float32_bounds(
        lambda rounding: {"logits": hf_logits(folder, input_ids, rounding=rounding)},
        measure=max_abs,
        floor=TOLERANCE,
    )
    return bounds["logits"]


#: What :func:`add_serving_files` gives a folder: a chat template and generation defaults that
#: differ from every default, so that a copy is told from a stand-in.
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
GENERATION = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "max_new_tokens": 7,
              "temperature": 0.6, "top_p": 0.9, "do_sample": True}  # fmt: skip


def add_serving_files(folder: str | Path) -> Path:
    """Give a model folder what serving needs beside the weights, built locally (no hub): a
    WordLevel tokenizer trained on a few strings (``tokenizers``) wrapped in
    ``PreTrainedTokenizerFast`` with a chat template, saved with ``save_pretrained``, and a
    ``generation_config.json`` of :data:`GENERATION`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
    text = ["the hybrid model reads tokens", "a tokenizer goes with every export", "hello world"]
    tokenizer.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    GenerationConfig(**GENERATION).save_pretrained(folder)
    return Path(folder)
