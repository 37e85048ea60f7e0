"""Layer specs of a hybrid stack, derived from GPTModel's own layer specs.

A GPT layer is an attention half (input norm, self-attention, residual add) followed by an MLP
half (pre-MLP norm, dense MLP or MoE, residual add). The ``*``/``+``/``D`` and ``-``/``E``
layers of a hybrid stack are exactly those halves, so their specs are cut out of the GPT layer
spec of the same backend rather than written again: module classes, fused norms and the
``sharded_state_dict_keys_map`` renames (the local GPT spec stores ``input_layernorm`` as
``self_attention.linear_qkv.layer_norm_*``) then match GPTModel by construction, and a group
``[*E]`` checkpoints under the very keys of a GPT MoE layer.

Backends are a registry (``"local"``: Megatron-Core modules only; ``"te"``: TransformerEngine,
like GPT's TE spec with fused layer norms). In both, ``M`` layers use megatron-core's
``MambaMixer`` where mamba_ssm's kernels can run and the torch Mamba2 path elsewhere
(``mamba_impl``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.hybrid.hybrid_block import (
    HybridStackSubmodules as _MCoreHybridStackSubmodules,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_hybrid.modules.attention import LocalCoreAttention, MLACoreAttention
from megatron_hybrid.modules.fast.selection import resolve_local_impl
from megatron_hybrid.modules.fast.specs import fast_layer_specs
from megatron_hybrid.modules.gated_delta_net import HybridGatedDeltaNet
from megatron_hybrid.modules.hybrid_stack import HybridStack
from megatron_hybrid.modules.mamba_torch import TorchMambaMixer, resolve_mamba_impl
from megatron_hybrid.modules.mla import HybridMLASelfAttention
from megatron_hybrid.modules.norms import local_norm_impl, plain_gamma_norm
from megatron_hybrid.modules.registry import LAYER_RUNTIMES
from megatron_hybrid.modules.router import PaddingAwareTopKRouter

__all__ = [
    "BACKENDS",
    "HybridStackSubmodules",
    "UnavailableLayer",
    "hybrid_stack_spec",
    "register_backend",
]

# The number of experts is fixed by the config at build time; GPT's MoE spec only checks that
# one is given.
_ANY_NUM_EXPERTS = 1


@dataclass
class HybridStackSubmodules(_MCoreHybridStackSubmodules):
    """Specs of every layer type of a hybrid stack, plus the stack's final norm.

    A subclass of megatron-core's ``HybridStackSubmodules`` so that megatron-core's MTP block,
    which builds its inner stack from these fields, accepts it unchanged. Layer types
    registered with :func:`~megatron_hybrid.modules.register_layer_type` keep their specs in
    ``extra_layers`` (``LayerRuntime.spec_field`` -> spec).
    """

    final_norm: Any = None
    extra_layers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _SpecOptions:
    moe_grouped_gemm: bool
    qk_layernorm: bool
    qk_l2_norm: bool
    normalization: str
    mamba_impl: str = "kernels"
    local_impl: str = "reference"


def _halves(gpt: TransformerLayerSubmodules) -> tuple[dict, dict]:
    """Split a GPT layer's submodules into its attention half and its MLP half."""
    keys_map = gpt.sharded_state_dict_keys_map or {}

    def keys_for(*roots: str) -> dict:
        return {k: v for k, v in keys_map.items() if k.startswith(roots)}

    attention = dict(
        input_layernorm=gpt.input_layernorm,
        self_attention=gpt.self_attention,
        self_attn_bda=gpt.self_attn_bda,
        sharded_state_dict_keys_map=keys_for("input_layernorm", "self_attention"),
    )
    mlp = dict(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm,
        mlp=gpt.mlp,
        mlp_bda=gpt.mlp_bda,
        sharded_state_dict_keys_map=keys_for("pre_mlp_layernorm", "mlp"),
    )
    return attention, mlp


def _layer(module: type, **submodules) -> ModuleSpec:
    return ModuleSpec(module=module, submodules=TransformerLayerSubmodules(**submodules))


def _with_router(moe_spec, router: type):
    """The MoE layer spec (a ``ModuleSpec`` or, in megatron-core 0.19.2, a ``partial`` of
    ``MoELayer``) with its ``MoESubmodules.router`` replaced."""
    if isinstance(moe_spec, functools.partial):
        submodules = dataclasses.replace(moe_spec.keywords["submodules"], router=router)
        return functools.partial(
            moe_spec.func, *moe_spec.args, **{**moe_spec.keywords, "submodules": submodules}
        )
    return dataclasses.replace(
        moe_spec, submodules=dataclasses.replace(moe_spec.submodules, router=router)
    )


def _gpt_derived_layers(gpt_submodules: Callable[..., TransformerLayerSubmodules], opts) -> dict:
    """Specs of ``*``, ``+``, ``-`` and ``E`` cut from the GPT layer spec of one backend."""
    common = dict(qk_layernorm=opts.qk_layernorm)
    attention, _ = _halves(gpt_submodules(qk_l2_norm=opts.qk_l2_norm, **common))
    mla, _ = _halves(gpt_submodules(multi_latent_attention=True, **common))
    _, dense = _halves(gpt_submodules(**common))
    _, moe = _halves(
        gpt_submodules(
            num_experts=_ANY_NUM_EXPERTS, moe_grouped_gemm=opts.moe_grouped_gemm, **common
        )
    )
    moe["mlp"] = _with_router(moe["mlp"], PaddingAwareTopKRouter)
    return dict(
        attention_layer=_layer(TransformerLayer, **attention),
        mla_layer=_layer(TransformerLayer, **mla),
        mlp_layer=_layer(TransformerLayer, **dense),
        moe_layer=_layer(MoETransformerLayer, **moe),
    )


def _dsa_layer(backend, norm, opts: _SpecOptions) -> ModuleSpec:
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )

    # The DSA spec reads only these options; a full MLA config is not needed to build the spec.
    spec_config = types.SimpleNamespace(
        multi_latent_attention=True,
        qk_l2_norm=False,
        qk_layernorm=opts.qk_layernorm,
        normalization=opts.normalization,
    )
    return _layer(
        TransformerLayer,
        input_layernorm=norm,
        self_attention=get_dsa_module_spec_for_backend(spec_config, backend=backend),
        self_attn_bda=get_bias_dropout_add,
    )


class UnavailableLayer:
    """Placeholder spec for a layer type a backend cannot build; building it raises."""

    def __init__(self, *args, reason: str, **kwargs):
        raise ValueError(reason)


def _unavailable(reason: str) -> ModuleSpec:
    return ModuleSpec(module=UnavailableLayer, params={"reason": reason})


def _with_mamba_impl(mamba_layer: ModuleSpec, mamba_impl: str) -> ModuleSpec:
    """``mamba_layer``, its mixer swapped for the torch Mamba2 path if ``mamba_impl == "torch"``.

    The in/out projection specs (and the TE spec's input norm fused into ``in_proj``) are kept.
    """
    if mamba_impl == "kernels":
        return mamba_layer
    mixer = dataclasses.replace(mamba_layer.submodules.mixer, module=TorchMambaMixer)
    submodules = dataclasses.replace(mamba_layer.submodules, mixer=mixer)
    return dataclasses.replace(mamba_layer, submodules=submodules)


def _local_layers(opts: _SpecOptions) -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = local_norm_impl()

    def gpt_submodules(**kwargs):
        sub = get_gpt_layer_local_submodules(normalization=opts.normalization, **kwargs)
        # GPT's local spec takes its norms from megatron's LNImpl (WrappedTorchNorm without
        # apex), which refuses sequence parallelism and zero-centred gains: use the package's.
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if getattr(sub, name) is not IdentityOp:
                setattr(sub, name, norm)
        attention = sub.self_attention.submodules
        for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):
            if getattr(attention, name, None) is WrappedTorchNorm:
                setattr(attention, name, norm)
        # megatron-core's local DotProductAttention refuses packed (THD) batches and MLA's two
        # head sizes; the package's local core attention takes both.
        multi_latent = kwargs.get("multi_latent_attention")
        attention.core_attention = MLACoreAttention if multi_latent else LocalCoreAttention
        if multi_latent:
            # megatron-core's MLA splits the RoPE key's gradient over TP without summing it
            # (column-parallel linear_kv_down_proj, the local spec): modules/mla.py sums it.
            sub.self_attention = dataclasses.replace(
                sub.self_attention, module=HybridMLASelfAttention
            )
        return sub

    layers = _gpt_derived_layers(gpt_submodules, opts)
    # megatron-core's DSA indexer needs a plain (non-parallel) linear layer that only the
    # TransformerEngine backend provides.
    layers["dsa_layer"] = _unavailable(
        "'D' (DeepSeek sparse attention) layers need the 'te' backend in megatron-core 0.19.2: "
        "build the spec with hybrid_stack_spec('te')"
    )
    layers["gdn_layer"] = _layer(
        TransformerLayer,
        # Without TE the input norm cannot be fused into in_proj, so it is a separate module.
        input_layernorm=norm,
        self_attention=ModuleSpec(
            module=HybridGatedDeltaNet,
            submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear,
                out_norm=plain_gamma_norm(norm),
                out_proj=RowParallelLinear,
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
    )
    layers["mamba_layer"] = _with_mamba_impl(
        ModuleSpec(
            module=MambaLayer,
            submodules=MambaLayerSubmodules(
                norm=norm,
                mixer=ModuleSpec(
                    module=MambaMixer,
                    submodules=MambaMixerSubmodules(
                        in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                    ),
                ),
                mamba_bda=get_bias_dropout_add,
            ),
        ),
        opts.mamba_impl,
    )
    layers["final_norm"] = norm
    layers["mtp_block_spec"] = _mtp_block_spec(norm, ColumnParallelLinear)
    if opts.local_impl == "fast":
        layers = fast_layer_specs(layers)
    return layers


def _te_layers(opts: _SpecOptions) -> dict:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        raise ImportError(
            "hybrid_stack_spec(backend='te') needs TransformerEngine, which is not importable "
            "here. Install transformer-engine, or use backend='local' (Megatron-Core modules "
            "only; every feature of megatron_hybrid works with it)."
        )
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_submodules,
    )
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as mcore_spec

    layers = _gpt_derived_layers(get_gpt_layer_with_transformer_engine_submodules, opts)
    layers["dsa_layer"] = _dsa_layer(TESpecProvider(), TENorm, opts)
    # Mamba and GatedDeltaNet have no GPT counterpart: megatron-core's hybrid TE specs.
    layers["mamba_layer"] = _with_mamba_impl(mcore_spec.submodules.mamba_layer, opts.mamba_impl)
    # GatedDeltaNet's gated output norm is a plain gain in fla and transformers, also when the
    # model's other norms are zero-centred (Qwen3.5, Qwen3-Next).
    gdn = copy.deepcopy(mcore_spec.submodules.gdn_layer)
    gdn.submodules.self_attention.submodules.out_norm = plain_gamma_norm(
        gdn.submodules.self_attention.submodules.out_norm
    )
    gdn.submodules.self_attention.module = HybridGatedDeltaNet  # float32 decay
    layers["gdn_layer"] = gdn
    layers["final_norm"] = TENorm
    layers["mtp_block_spec"] = _mtp_block_spec(TENorm, TEColumnParallelLinear)
    return layers


#: Backend name -> function building the layer specs (a dict of HybridStackSubmodules fields).
BACKENDS: dict[str, Callable[[_SpecOptions], dict]] = {"local": _local_layers, "te": _te_layers}


def register_backend(name: str, build_layers: Callable[[_SpecOptions], dict]) -> None:
    """Add a spec backend (for example a Kitchen or inference variant).

    ``build_layers(options)`` returns every :class:`HybridStackSubmodules` field; it may add
    specs for registered layer types under their ``LayerRuntime.spec_field`` (those it leaves
    out come from the type's ``default_spec``).
    """
    if name in BACKENDS:
        raise ValueError(f"spec backend {name!r} is already registered")
    BACKENDS[name] = build_layers


def _registered_layer_specs(backend: str, extra: dict) -> dict:
    """``extra`` (specs a backend built beyond the built-in fields) plus the default spec of
    every registered layer type the backend did not build."""
    defaults = {
        runtime.spec_field: runtime.default_spec(backend)
        for runtime in LAYER_RUNTIMES.values()
        if runtime.spec_field not in extra and runtime.default_spec is not None
    }
    return {**extra, **defaults}


def _mtp_block_spec(norm, eh_proj) -> ModuleSpec:
    """MTP block spec: norms and projection; the MTP layer builds its inner stack itself."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )

    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[
                ModuleSpec(
                    module=MultiTokenPredictionLayer,
                    submodules=MultiTokenPredictionLayerSubmodules(
                        enorm=norm,
                        hnorm=norm,
                        eh_proj=eh_proj,
                        mtp_model_layer=None,  # built by the MTP layer from the MTP pattern
                        layer_norm=norm,
                    ),
                )
            ]
        ),
    )


def hybrid_stack_spec(
    backend: str = "local",
    *,
    config=None,
    moe_grouped_gemm: bool | None = None,
    qk_layernorm: bool | None = None,
    qk_l2_norm: bool | None = None,
    normalization: str | None = None,
    mamba_impl: str = "auto",
    local_impl: str = "auto",
) -> ModuleSpec:
    """Spec of a :class:`~megatron_hybrid.HybridStack` whose layers mirror GPTModel's.

    Args:
        backend: ``"local"`` (Megatron-Core modules; mirrors ``get_gpt_layer_local_spec``) or
            ``"te"`` (TransformerEngine; mirrors ``get_gpt_layer_with_transformer_engine_spec``).
        config: a ``TransformerConfig`` to take the options below from, as GPTModel's
            ``get_gpt_decoder_block_spec`` does. Explicit keyword arguments win over it.
        moe_grouped_gemm: grouped-GEMM experts (changes expert checkpoint keys, as in GPT).
        qk_layernorm: layer norm on queries and keys.
        qk_l2_norm: L2 norm on queries and keys.
        normalization: ``"LayerNorm"`` or ``"RMSNorm"``.
        mamba_impl: how ``M`` layers compute: ``"kernels"`` (megatron-core's ``MambaMixer``:
            mamba_ssm and causal_conv1d on a GPU), ``"torch"`` (the torch Mamba2 path,
            :class:`~megatron_hybrid.modules.mamba_torch.TorchMambaMixer`: same parameters and
            checkpoints, runs anywhere, slower) or ``"auto"`` (the kernels where they can run,
            else torch). ``metainfo["mamba_impl"]`` records the choice.
        local_impl: for the ``"local"`` backend: ``"fast"`` (the fast TE-free GPU path of
            :mod:`megatron_hybrid.modules.fast`: SDPA attention, grouped-GEMM experts, a
            parallel-scan GatedDeltaNet torch path, a compiled torch Mamba2; same parameters and
            checkpoints), ``"reference"`` (megatron-core's local modules as they are) or
            ``"auto"`` (fast where CUDA is available). Other backends ignore it.
            ``metainfo["local_impl"]`` records the choice.

    Returns:
        A ``ModuleSpec`` for ``HybridStack`` with :class:`HybridStackSubmodules`; its
        ``metainfo`` records the backend and options, which ``HybridModel`` checks against its
        config.

    Raises:
        ValueError: unknown backend, ``mamba_impl`` or ``local_impl``, or
            ``mamba_impl="kernels"`` where the kernels cannot run.
        ImportError: backend ``"te"`` without TransformerEngine.
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown spec backend {backend!r}; choose one of {sorted(BACKENDS)} "
            "(register more with megatron_hybrid.modules.specs.register_backend)"
        )

    def pick(value, attr, default):
        if value is not None:
            return value
        return getattr(config, attr, default) if config is not None else default

    resolve_local_impl(local_impl)  # validated for every backend; only "local" has two paths
    opts = _SpecOptions(
        moe_grouped_gemm=bool(pick(moe_grouped_gemm, "moe_grouped_gemm", False)),
        qk_layernorm=bool(pick(qk_layernorm, "qk_layernorm", False)),
        qk_l2_norm=bool(pick(qk_l2_norm, "qk_l2_norm", False)),
        normalization=pick(normalization, "normalization", "LayerNorm"),
        mamba_impl=resolve_mamba_impl(mamba_impl),
        local_impl=resolve_local_impl(local_impl) if backend == "local" else "reference",
    )
    layers = BACKENDS[backend](opts)
    names = {f.name for f in fields(HybridStackSubmodules)} - {"extra_layers"}
    missing = names - set(layers)
    if missing:
        raise ValueError(f"spec backend {backend!r} did not define {sorted(missing)}")
    # Specs of registered layer types: the backend's own where it builds them, else the type's
    # default.
    extra = {name: layers.pop(name) for name in set(layers) - names}
    layers["extra_layers"] = _registered_layer_specs(backend, extra)
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(**layers),
        metainfo={"backend": backend, **opts.__dict__},
    )
