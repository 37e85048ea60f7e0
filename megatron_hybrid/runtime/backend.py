"""The two runtime back-ends (``cuda`` and ``cpu``) and the choice between them."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from megatron_hybrid.runtime.cpu import cpu_config_overrides, enable_cpu_emulation

__all__ = [
    "BACKEND_NAMES",
    "CUDA_ALLOC_CONF",
    "RuntimeBackend",
    "prefer_expandable_segments",
    "select_backend",
]

BACKEND_NAMES = ("auto", "cuda", "cpu")

#: The CUDA caching allocator's setting for training: expandable segments. Micro-batches of
#: varying lengths ask for blocks of ever new sizes; with fixed segments the allocator splits and
#: caches them until a request fits nowhere, then frees its cache (a device synchronisation) and
#: allocates again, and memory ends up reserved but unusable. Expandable segments grow one
#: mapping per stream instead (torchtitan trains with this setting by default).
CUDA_ALLOC_CONF = "expandable_segments:True"


def prefer_expandable_segments(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`CUDA_ALLOC_CONF` unless the environment sets an
    allocator configuration (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``, even empty:
    ``PYTORCH_CUDA_ALLOC_CONF=`` keeps torch's default). torch reads it when CUDA starts, so an
    entry point calls this first. Returns whether it set it."""
    if "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    return True


@dataclass(frozen=True)
class RuntimeBackend:
    """Where megatron-core runs in this process.

    Attributes:
        name: ``"cuda"`` (one GPU per process, NCCL) or ``"cpu"`` (megatron-core's CUDA-only
            calls emulated, gloo; see :mod:`megatron_hybrid.runtime.cpu`).
    """

    name: str

    @property
    def on_gpu(self) -> bool:
        """Whether tensors live on a GPU."""
        return self.name == "cuda"

    def activate(self) -> None:
        """Prepare the process for this back-end (idempotent).

        The CPU back-end patches megatron-core's CUDA-only calls for the whole process; only an
        entry point should call this, before it builds a model.
        """
        if not self.on_gpu:
            enable_cpu_emulation()

    def config_overrides(self) -> dict:
        """``TransformerConfig`` fields this back-end needs (none on GPUs)."""
        if self.on_gpu:
            return {}
        return cpu_config_overrides()

    def device(self):
        """The device of this rank's tensors."""
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else "cpu"

    def device_name(self) -> str:
        """What this rank computes on, for people: the GPU's name, or ``CPU``."""
        if not self.on_gpu:
            return "CPU"
        import torch

        return torch.cuda.get_device_name(torch.cuda.current_device())

    def synchronize(self) -> None:
        """Wait for queued device work (timing); a no-op on the CPU."""
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()


def select_backend(name: str = "auto") -> RuntimeBackend:
    """The back-end called ``name``; ``"auto"`` picks ``cuda`` where a GPU is visible.

    Raises:
        ValueError: ``name`` is not one of :data:`BACKEND_NAMES`, or ``cuda`` without a GPU.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"unknown runtime back-end {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    import torch

    available = torch.cuda.is_available()
    if name == "cuda" and not available:
        raise ValueError("the cuda back-end needs a visible GPU; choose 'cpu' or 'auto'")
    if name == "auto":
        name = "cuda" if available else "cpu"
    return RuntimeBackend(name)
