"""Mamba2 in torch with megatron-core's ``MambaMixer`` parameters, for where its kernels can't run.

megatron-core 0.19.2's ``MambaMixer`` (``megatron/core/ssm/mamba_mixer.py``) refuses to build
without mamba_ssm and has no torch path, so a pattern with ``M`` could not run on a CPU or on a
GPU without the extra kernels. :class:`TorchMambaMixer` takes ``MambaMixer``'s constructor
arguments, makes the same parameters with the same names, shapes, TP sharding and
initialisation (``in_proj``, ``conv1d_weight``, ``conv1d_bias``, ``dt_bias``, ``A_log``, ``D``,
``norm.weight``, ``out_proj``; distributed checkpoints name the conv ones ``conv1d.weight`` and
``conv1d.bias``), and computes the training forward of ``MambaMixer`` with the torch functions
of :mod:`megatron_hybrid.modules.ssd`. Checkpoints move between the two classes unchanged:
``sharded_state_dict`` is ``MambaMixer``'s own.

Which class a spec uses is decided by :func:`resolve_mamba_impl` (``hybrid_stack_spec``'s
``mamba_impl`` argument): ``"auto"`` picks the kernels where they can run (CUDA and mamba_ssm and
causal_conv1d importable) and this class elsewhere; ``"torch"`` forces this class (to check the
kernels against it on a GPU); ``"kernels"`` forces megatron-core's class.

Covered: TP and SP (the linears' own sharding; each rank norms the groups it holds), CP
(megatron-core's ``MambaContextParallel`` all-to-all, as in ``MambaMixer``) and packed (THD)
input through ``PackedSeqParams.seq_idx``. Not covered: inference (no decode state is kept;
``inference_context`` is refused) and ``mamba_training_ssm_states_dtype`` other than float32
(the torch scan keeps float32 states).
"""

from __future__ import annotations

import math

import torch
from megatron.core.ssm.mamba_context_parallel import MambaContextParallel
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)
from torch import nn

from megatron_hybrid.modules.registry import layer_runtime
from megatron_hybrid.modules.ssd import gated_rms_norm, mamba2_scan
from megatron_hybrid.padding.fixed import FixedPackedSeqParams, fixed_seq_idx
from megatron_hybrid.pattern import MAMBA

__all__ = [
    "MAMBA_IMPLS",
    "MEGATRON_GATED_NORM_EPS",
    "GatedRMSNorm",
    "TorchMambaMixer",
    "mamba_kernels_available",
    "resolve_mamba_impl",
    "with_mixer_params",
]

#: The gated norm's epsilon megatron-core's MambaMixer hard-codes (megatron-core 0.19.2,
#: ``ssm/mamba_mixer.py``); this class's default.
MEGATRON_GATED_NORM_EPS = 1e-5

#: Values of ``hybrid_stack_spec(mamba_impl=...)`` and ``train --mamba-impl``.
MAMBA_IMPLS = ("auto", "torch", "kernels")


def mamba_kernels_available() -> tuple[bool, str | None]:
    """Whether megatron-core's ``MambaMixer`` can train here, and if not, why not."""
    from megatron.core.ssm import mamba_mixer

    if not mamba_mixer.HAVE_MAMBA_SSM:
        return False, "mamba_ssm is not importable"
    # mamba_split_conv1d_scan_combined calls causal_conv1d's CUDA functions.
    if mamba_mixer.causal_conv1d_fn is None:
        return False, "causal_conv1d is not importable"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    return True, None


def resolve_mamba_impl(mamba_impl: str) -> str:
    """``"torch"`` or ``"kernels"`` for ``mamba_impl`` (one of :data:`MAMBA_IMPLS`).

    Raises:
        ValueError: unknown value, or ``"kernels"`` where they cannot run.
    """
    if mamba_impl not in MAMBA_IMPLS:
        raise ValueError(f"mamba_impl must be one of {MAMBA_IMPLS}, got {mamba_impl!r}")
    available, reason = mamba_kernels_available()
    if mamba_impl == "kernels" and not available:
        raise ValueError(
            f"mamba_impl='kernels' needs megatron-core's MambaMixer kernels, but {reason}. "
            "Install mamba-ssm and causal-conv1d on a CUDA machine, or use mamba_impl='auto' "
            "or 'torch' (train: --mamba-impl auto) for the torch Mamba2 path."
        )
    if mamba_impl == "auto":
        return "kernels" if available else "torch"
    return mamba_impl


class GatedRMSNorm(nn.Module):
    """mamba_ssm's ``RMSNormGated`` (``norm_before_gate=False``) in torch, TP-sharded on dim 0.

    Holds only ``weight`` (initialised to ones), like mamba_ssm's module.
    """

    def __init__(self, hidden_size: int, group_size: int, eps: float, tp_group, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.group_size = group_size
        self.eps = eps
        self.tp_group = tp_group

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """``rmsnorm(y * silu(z)) * weight`` per group of channels."""
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``weight`` sharded along dim 0 over TP, like megatron-core's ``ExtendedRMSNorm``."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )


def _tp_param(param: nn.Parameter) -> nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = 0
    return param


class TorchMambaMixer(MegatronModule):
    """megatron-core's ``MambaMixer`` computed in torch; same arguments, parameters and keys.

    Args:
        config: model config; reads ``mamba_state_dim``, ``mamba_head_dim``,
            ``mamba_num_groups``, ``mamba_num_heads``, ``params_dtype``, ``fp8``,
            ``perform_initialization``, ``init_method``, ``output_layer_init_method``,
            ``mamba_training_ssm_states_dtype`` (float32 or None only).
        submodules: ``in_proj`` and ``out_proj`` specs (column/row parallel linears).
        d_model: hidden size.
        d_conv: causal conv width.
        conv_init: conv weights uniform in ``[-conv_init, conv_init]`` (None: Kaiming).
        expand: ``d_inner = expand * d_model`` unless ``mamba_num_heads`` is set.
        A_init_range: ``A`` uniform in this range (``A_log = log A``).
        D_has_hdim: one ``D`` per channel instead of per head.
        rmsnorm: gated RMS norm after the scan (else the scan output is only gated).
        norm_before_gate: must be False (as in megatron-core).
        dt_min: smallest initial step size.
        dt_max: largest initial step size.
        dt_init: unused, as in megatron-core (always log-uniform).
        dt_scale: unused, as in megatron-core.
        dt_init_floor: floor of the initial step sizes.
        bias: must be False (as in megatron-core).
        conv_bias: must be True (as in megatron-core).
        chunk_size: steps per chunk of the scan (any value computes the same function).
        dt_limit: ``(low, high)`` clamp of the step size ``softplus(dt + dt_bias)``;
            megatron-core's ``(0, inf)`` clamps nothing, transformers' Nemotron-H uses
            ``(time_step_min, inf)``.
        norm_eps: epsilon of the gated RMS norm (megatron-core hard-codes 1e-5).
        layer_number: 1-based layer number.
        pg_collection: process groups (``tp`` and ``cp`` are used).
        pp_layer_offset: unused (only inference caches need it).
        name: module name, passed to the linear layers.
    """

    #: Packed calls take fixed-size boundaries (CUDA graphs of packed rows, ``schedule.graphs``):
    #: the scan reads only ``seq_idx``, made from them on the device (:func:`fixed_seq_idx`).
    reads_fixed_packed_on_device = True

    def __init__(
        self,
        config,
        submodules: MambaMixerSubmodules,
        d_model: int,
        d_conv: int = 4,
        conv_init: float | None = None,
        expand: int = 2,
        A_init_range: tuple[float, float] = (1, 16),  # noqa: N803 - megatron-core's name
        D_has_hdim: bool = False,  # noqa: N803
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 128,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        norm_eps: float = MEGATRON_GATED_NORM_EPS,
        layer_number: int | None = None,
        pg_collection=None,
        pp_layer_offset: int = 0,
        name: str | None = None,
    ):
        super().__init__(config)
        if pg_collection is None:
            raise ValueError("TorchMambaMixer needs pg_collection (a ProcessGroupCollection)")
        _check_options(config, bias, conv_bias, norm_before_gate, A_init_range, chunk_size)
        _check_numerics(dt_limit, norm_eps)
        self.dt_limit, self.norm_eps = (float(dt_limit[0]), float(dt_limit[1])), float(norm_eps)
        self.d_model, self.d_conv, self.conv_init, self.expand = d_model, d_conv, conv_init, expand
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, False
        self.chunk_size, self.layer_number = chunk_size, layer_number
        self.pp_layer_offset = pp_layer_offset
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.d_state = config.mamba_state_dim
        self.headdim = config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        self.activation = "silu"
        valid_head_dim = isinstance(self.headdim, int) and self.headdim > 0  # else: _check_sizes
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            self.d_inner = self.nheads * self.headdim if valid_head_dim else 0
        else:
            self.d_inner = int(expand * d_model)
            if valid_head_dim and self.d_inner % self.headdim:
                raise ValueError(
                    f"Mamba: d_inner = expand * hidden_size = {self.d_inner} is not a multiple "
                    f"of mamba_head_dim {self.headdim}; change mamba_head_dim or set "
                    "mamba_num_heads"
                )
            self.nheads = self.d_inner // self.headdim if valid_head_dim else 0
        self._check_sizes(config)
        tp = self.tp_group.size()
        self.nheads_local_tp = self.nheads // tp
        self.d_inner_local_tp = self.d_inner // tp
        self.ngroups_local_tp = self.ngroups // tp

        self.in_proj = build_module(
            submodules.in_proj,
            d_model,
            2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads,  # z x B C dt
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
            name=f"{name}.in_proj" if name is not None else None,
        )
        # Rows per TP rank are [z, x, B, C, dt] of the local shard; resharding reads this.
        self.in_proj.weight.partition_sizes = [
            self.d_inner_local_tp,
            self.d_inner_local_tp,
            self.ngroups_local_tp * self.d_state,
            self.ngroups_local_tp * self.d_state,
            self.nheads_local_tp,
        ]
        self._init_ssm_parameters(config, A_init_range, dt_min, dt_max, dt_init_floor)
        if rmsnorm:
            self.norm = self.norm_class(
                self.d_inner_local_tp,
                group_size=self.d_inner_local_tp // self.ngroups_local_tp,
                eps=self.norm_eps,
                tp_group=self.tp_group,
                device=self._device(),
                dtype=config.params_dtype,
            )
            _tp_param(self.norm.weight)
        self.out_proj = build_module(
            submodules.out_proj,
            self.d_inner,
            d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
            name=f"{name}.out_proj" if name is not None else None,
        )
        # megatron-core's all-to-all context parallelism (heads <-> sequence) and its views of
        # this rank's parameters; identities at cp = 1.
        self.cp = MambaContextParallel(
            cp_group=pg_collection.cp,
            d_inner_local_tp=self.d_inner_local_tp,
            nheads_local_tp=self.nheads_local_tp,
            ngroups_local_tp=self.ngroups_local_tp,
            d_state=self.d_state,
            conv1d_weight_cp1=self.conv1d_weight,
            conv1d_bias_cp1=self.conv1d_bias,
            conv1d_padding=d_conv - 1,
            dt_bias_cp1=self.dt_bias,
            A_log_cp1=self.A_log,
            D_cp1=self.D,
            D_has_hdim=D_has_hdim,
        )

    #: The gated norm's class (a subclass may compute the same norm another way).
    norm_class = GatedRMSNorm

    # Checkpoint layout and inference-state shapes are megatron-core's own, so both classes
    # read each other's checkpoints.
    sharded_state_dict = MambaMixer.sharded_state_dict
    mamba_state_shapes_per_request = MambaMixer.mamba_state_shapes_per_request

    def _device(self):
        return torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")

    def _check_sizes(self, config) -> None:
        tp = self.tp_group.size()
        problems = []
        for value, what in (
            (self.d_state, "mamba_state_dim"),
            (self.headdim, "mamba_head_dim"),
            (self.ngroups, "mamba_num_groups"),
            (self.nheads, "the number of Mamba heads"),
        ):
            if value is None or value <= 0:
                problems.append(f"{what} must be a positive integer, got {value}")
        if not problems:
            if self.nheads % tp:
                problems.append(f"{self.nheads} Mamba heads do not divide over TP {tp}")
            if self.ngroups % tp:
                problems.append(f"mamba_num_groups {self.ngroups} does not divide over TP {tp}")
            if self.nheads % self.ngroups:
                problems.append(
                    f"{self.nheads} Mamba heads do not split into {self.ngroups} groups"
                )
            proj = 2 * self.d_inner + 2 * self.ngroups * self.d_state + self.nheads
            if config.fp8 and proj % 16:
                problems.append(f"FP8 needs the in_proj width ({proj}) to be a multiple of 16")
        if problems:
            raise ValueError("Mamba layer sizes: " + "; ".join(problems))

    def _init_ssm_parameters(self, config, a_init_range, dt_min, dt_max, dt_init_floor) -> None:
        """conv, dt_bias, A_log and D, created and initialised in megatron-core's order."""
        device = self._device()
        conv_dim = self.d_inner_local_tp + 2 * self.ngroups_local_tp * self.d_state  # x B C
        conv_sizes = [
            self.d_inner_local_tp,
            self.ngroups_local_tp * self.d_state,
            self.ngroups_local_tp * self.d_state,
        ]
        dtype = config.params_dtype
        with get_cuda_rng_tracker().fork():
            self.conv1d_weight = _tp_param(
                nn.Parameter(torch.empty(conv_dim, 1, self.d_conv, device=device, dtype=dtype))
            )
            self.conv1d_bias = _tp_param(
                nn.Parameter(torch.empty(conv_dim, device=device, dtype=dtype))
            )
            self.conv1d_weight.partition_sizes = conv_sizes
            self.conv1d_bias.partition_sizes = conv_sizes
            # nn.Conv1d's default initialisation first, then megatron's re-initialisation of the
            # weight: the same random draws as megatron-core, so a seed gives the same weights.
            nn.init.kaiming_uniform_(self.conv1d_weight, a=math.sqrt(5))
            bound = 1 / math.sqrt(self.d_conv)
            nn.init.uniform_(self.conv1d_bias, -bound, bound)
            if config.perform_initialization:
                if self.conv_init is not None:
                    nn.init.uniform_(self.conv1d_weight, -self.conv_init, self.conv_init)
                else:
                    nn.init.kaiming_uniform_(self.conv1d_weight, a=math.sqrt(5))
        with get_cuda_rng_tracker().fork():
            # softplus(dt_bias) log-uniform in [dt_min, dt_max], floored.
            log_range = math.log(dt_max) - math.log(dt_min)
            dt = torch.rand(self.nheads_local_tp, device=device, dtype=dtype)
            dt = torch.exp(dt * log_range + math.log(dt_min)).clamp(min=dt_init_floor)
            self.dt_bias = _tp_param(nn.Parameter(dt + torch.log(-torch.expm1(-dt))))
            a = torch.empty(self.nheads_local_tp, dtype=torch.float32, device=device)
            if config.perform_initialization:
                a = a.uniform_(*a_init_range)
            self.A_log = _tp_param(nn.Parameter(torch.log(a)))  # float32, as in megatron-core
        d_size = self.d_inner_local_tp if self.D_has_hdim else self.nheads_local_tp
        self.D = _tp_param(nn.Parameter(torch.ones(d_size, device=device)))  # float32

    def forward(
        self,
        hidden_states: torch.Tensor,
        inference_context=None,
        *,
        inference_params=None,
        packed_seq_params=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[S, B, d_model]`` (sequence-sharded under SP) -> ``(output, out_proj bias)``."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "the torch Mamba2 path (TorchMambaMixer) keeps no decode state, so it cannot run "
                "inference; use megatron-core's MambaMixer (mamba_impl='kernels', needs "
                "mamba-ssm and causal-conv1d on a GPU)"
            )
        seq_idx = None
        if isinstance(packed_seq_params, FixedPackedSeqParams):
            seq_idx = fixed_seq_idx(packed_seq_params)  # on the device: CUDA graphs replay it
        elif packed_seq_params is not None:
            seq_idx = packed_seq_params.seq_idx
            if seq_idx is None:
                raise ValueError(
                    "packed (THD) input to a Mamba layer needs packed_seq_params.seq_idx, which "
                    "PackedSeqParams builds only when total_tokens is set; set total_tokens"
                )
        zxbcdt, _ = self.in_proj(hidden_states)
        zxbcdt = self.cp.pre_conv_ssm(zxbcdt, packed_seq_params)
        y = self._ssm(zxbcdt.transpose(0, 1), seq_idx).transpose(0, 1)
        y = self.cp.post_conv_ssm(y, packed_seq_params)
        if self.rmsnorm:
            y = self.norm(y)
        return self.out_proj(y)

    def _ssm(self, zxbcdt: torch.Tensor, seq_idx: torch.Tensor | None) -> torch.Tensor:
        """``[B, L, z|x|B|C|dt]`` -> gated scan output ``[B, L, d_inner_local]`` (dtype kept)."""
        cp = self.cp
        return mamba2_scan(
            zxbcdt,
            cp.get_conv1d_weight().squeeze(1),
            cp.get_conv1d_bias(),
            cp.get_dt_bias(),
            cp.get_A_log(),
            cp.get_D(),
            seq_idx,
            heads=cp.nheads_local_tpcp,
            groups=cp.ngroups_local_tpcp,
            state=self.d_state,
            head_dim=self.headdim,
            chunk_size=self.chunk_size,
            dt_limit=self.dt_limit,
            d_has_hdim=self.D_has_hdim,
        )


def _check_numerics(dt_limit, norm_eps) -> None:
    low, high = dt_limit
    if not (0 <= low <= high):
        raise ValueError(f"TorchMambaMixer: dt_limit {tuple(dt_limit)} needs 0 <= low <= high")
    if not norm_eps > 0:
        raise ValueError(f"TorchMambaMixer: norm_eps must be > 0, got {norm_eps}")


def with_mixer_params(stack_spec, params: dict):
    """``stack_spec`` with ``params`` added to its Mamba mixer's arguments (torch path only).

    Hugging Face families whose Mamba numerics differ from megatron-core's defaults (Nemotron-H:
    ``dt_limit``, ``norm_eps``) pass them here. megatron-core's ``MambaMixer`` takes neither, so
    a spec that uses it is returned unchanged: the conversion's notes say what then differs.
    """
    import dataclasses

    field = layer_runtime(MAMBA).spec_field
    layer = getattr(stack_spec.submodules, field, None)
    mixer_class = layer.submodules.mixer.module if layer is not None else None
    torch_path = isinstance(mixer_class, type) and issubclass(mixer_class, TorchMambaMixer)
    if not params or not torch_path:  # the fast path's mixer is a TorchMambaMixer too
        return stack_spec
    mixer = layer.submodules.mixer
    mixer = dataclasses.replace(mixer, params={**(mixer.params or {}), **params})
    layer = dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, mixer=mixer)
    )
    submodules = dataclasses.replace(stack_spec.submodules, **{field: layer})
    return dataclasses.replace(stack_spec, submodules=submodules)


def _check_options(config, bias, conv_bias, norm_before_gate, a_init_range, chunk_size) -> None:
    """The options megatron-core's MambaMixer asserts on, and those this class leaves out."""
    problems = []
    if bias:
        problems.append("bias=True (megatron-core's MambaMixer asserts no bias)")
    if not conv_bias:
        problems.append("conv_bias=False (megatron-core's MambaMixer asserts a conv bias)")
    if norm_before_gate:
        problems.append("norm_before_gate=True (megatron-core's MambaMixer asserts False)")
    if not (0 < a_init_range[0] <= a_init_range[1]):
        problems.append(f"A_init_range {a_init_range} (need 0 < low <= high)")
    if chunk_size <= 0:
        problems.append(f"chunk_size {chunk_size} (need a positive integer)")
    states_dtype = getattr(config, "mamba_training_ssm_states_dtype", None)
    if states_dtype not in (None, torch.float32):
        problems.append(
            f"mamba_training_ssm_states_dtype={states_dtype} (the torch path keeps float32 "
            "states; unset it or use mamba_impl='kernels')"
        )
    if problems:
        raise ValueError("TorchMambaMixer does not support " + "; ".join(problems))
