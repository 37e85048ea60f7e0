"""What this machine can run: probes the settings validator asks before anything is built.

Each answer lives in one function, so a new code path (a torch Mamba, a local MLA attention)
relaxes its check in one place.
"""

from __future__ import annotations

import importlib.util
import os

from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.modules.fla_backend import dqkwg_choice
from megatron_hybrid.modules.mamba_torch import mamba_kernels_available

__all__ = [
    "fla_gated_backward_refused",
    "fla_installed",
    "flex_backend_unavailable",
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


def flex_backend_unavailable(backend: str) -> str | None:
    """Why megatron-core's flex dispatcher cannot use ``backend`` here, or None.

    Both backends come from DeepEP (``deep_ep``). HybridEP is its ``hybrid_ep_cpp`` extension,
    built only from DeepEP's hybrid-ep branch (its main branch and the old ``deep-ep`` release
    on PyPI have none; megatron-core 0.19.2's ``fused_a2a.py`` then leaves ``hybrid_ep_dispatch``
    None and the dispatcher raises when the model is built). HybridEP compiles its kernels at
    first use with ``$CUDA_HOME/bin/nvcc`` (DeepEP ``csrc/hybrid_ep/jit/compiler.cu``), so an
    unset ``CUDA_HOME`` fails in the first forward pass; the answer names that too. Nothing is
    imported: the check runs on machines without GPUs as well.
    """
    if importlib.util.find_spec("deep_ep") is None:
        return "needs DeepEP (the deep_ep package), which is not installed"
    if backend != "hybridep":
        return None
    if importlib.util.find_spec("hybrid_ep_cpp") is None:
        return (
            "needs DeepEP built from its hybrid-ep branch (deep_ep.HybridEPBuffer); the installed "
            "deep_ep has no HybridEP extension (hybrid_ep_cpp)"
        )
    cuda_home = os.environ.get("CUDA_HOME", "")
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not cuda_home or not os.access(nvcc, os.X_OK):
        where = f"{nvcc} does not exist" if cuda_home else "CUDA_HOME is not set"
        return (
            f"compiles HybridEP's kernels at first use with $CUDA_HOME/bin/nvcc, but {where}: "
            "export CUDA_HOME=<the CUDA toolkit folder>"
        )
    return None
