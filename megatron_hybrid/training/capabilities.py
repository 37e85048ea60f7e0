"""What this machine can run: probes the settings validator asks before anything is built.

Each answer lives in one function, so a new code path (a torch Mamba, a local MLA attention)
relaxes its check in one place.
"""

from __future__ import annotations

import importlib.util

from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.modules.fla_backend import dqkwg_choice
from megatron_hybrid.modules.mamba_torch import mamba_kernels_available

__all__ = [
    "fla_gated_backward_refused",
    "fla_installed",
    "mamba_kernels_usable",
    "mla_core_attention_usable",
    "on_gpu",
]


def on_gpu() -> bool:
    """Whether this process runs on CUDA GPUs."""
    import torch

    return torch.cuda.is_available()


def fla_installed() -> bool:
    """Whether fla-core (GatedDeltaNet's GPU kernels) is importable."""
    return importlib.util.find_spec("fla") is not None


def mamba_kernels_usable() -> tuple[bool, str | None]:
    """Whether megatron-core's Mamba kernels (mamba_ssm, causal_conv1d, CUDA) can run here, and
    if not, why; 'M' layers run on the package's torch Mamba2 path otherwise."""
    return mamba_kernels_available()


def mla_core_attention_usable(backend: str) -> bool:
    """Whether ``backend``'s spec gives '+' (MLA) layers a core attention they can build.

    MLA asks its core attention for separate key and value head dims (``k_channels``,
    ``v_channels``); megatron-core 0.19.2's local ``DotProductAttention`` takes neither. The
    check reads the spec, so it holds as soon as the local spec gets a core attention that does.
    """
    import inspect

    try:
        spec = hybrid_stack_spec(backend)
    except ImportError:
        return False
    core = spec.submodules.mla_layer.submodules.self_attention.submodules.core_attention
    module = getattr(core, "module", core)
    return "k_channels" in inspect.signature(module.__init__).parameters


def fla_gated_backward_refused() -> str | None:
    """Why fla would refuse GatedDeltaNet's backward on this GPU, or None.

    fla-core 0.6.0 (``ops/common/chunk_o.py``) raises in the first backward on Hopper with
    Triton >= 3.4.0, < 3.7.1 (wrong results, fla issue #640) unless a backend provides the
    kernel; the package registers its own there
    (:func:`~megatron_hybrid.modules.fla_backend.dqkwg_choice`), so only a forced choice of
    fla's kernel (``MEGATRON_HYBRID_FLA_DQKWG=fla``) or fla's dispatch turned off leaves the
    refusal. Finding out in training costs the whole first-step autotune.
    """
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return None
    if importlib.util.find_spec("tilelang") is not None:
        return None
    try:
        import triton
    except ImportError:
        return None
    version = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:3])
    if not (3, 4, 0) <= version < (3, 7, 1):
        return None
    choice, why = dqkwg_choice()
    if choice == "package":
        return None
    return (
        f"fla refuses GatedDeltaNet's backward with Triton {triton.__version__} on Hopper "
        f"GPUs (wrong results, fla #640), and its replacement is off ({why})"
    )
