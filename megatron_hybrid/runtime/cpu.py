"""The CPU runtime back-end: megatron-core's CUDA-only calls emulated on the CPU.

megatron-core 0.19.2 hard-codes CUDA in places that have nothing to do with the math: the RNG
tracker, ``torch.cuda.current_device()`` as an allocation device, side streams and events in the
MoE dispatcher and the combined-1F1B schedule, ``device="cuda"`` token counters in the pipeline
schedules, and CUDA-only split-size conversion in the all-to-all dispatcher. With the patches in
this module the same code runs on CPU with gloo, so the package's behaviour can be tested (and
the ``train`` command demonstrated) on machines without a GPU.

Nothing here is applied on import: an entry point chooses this back-end
(:func:`megatron_hybrid.runtime.select_backend`), and :func:`enable_cpu_emulation` patches the
process once (idempotent). On a machine with GPUs it first makes the process CPU-only (torch
reports no CUDA device afterwards), so CPU runs and tests behave the same everywhere; it refuses
once CUDA has been initialised in the process, because the patches would then silently turn
real streams into no-ops. Streams are dummies, so the emulation reproduces numerics, never
overlap or timing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types

__all__ = [
    "CPUEmulationError",
    "cpu_config_overrides",
    "enable_cpu_emulation",
]

_LOCK = threading.Lock()
_ENABLED = False


class CPUEmulationError(RuntimeError):
    """CPU emulation was requested where it must not run."""


def cpu_config_overrides() -> dict:
    """TransformerConfig fields for a CPU run: fused CUDA kernels off, weights built on the CPU.

    The unfused paths compute the same functions. GatedDeltaNet needs no setting: the emulation
    gives megatron torch versions of fla's kernels (:mod:`megatron_hybrid.modules.gdn_torch`),
    which also take packed rows; ``deterministic_mode`` (megatron's own torch path) would refuse
    them.
    """
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


class _DummyEvent:
    """Stands in for ``torch.cuda.Event``: on one CPU stream every event is already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def wait(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def query(self):
        return True


class _DummyStream(_DummyEvent):
    """Stands in for ``torch.cuda.Stream``; all work runs in program order on the CPU."""

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, event=None):
        return event or _DummyEvent()

    @staticmethod
    def priority_range():
        return (0, 0)

    def __eq__(self, other):
        return isinstance(other, _DummyStream)

    def __hash__(self):
        return 0


def _hide_cuda(torch) -> None:
    # This process runs on the CPU only: nothing may pick a GPU behind the emulation's back.
    torch.cuda.is_available = lambda: False
    torch.cuda.device_count = lambda: 0


def _patch_torch_cuda(torch) -> None:
    stream = _DummyStream()
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = _DummyStream
    torch.cuda.Event = _DummyEvent
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.default_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.is_current_stream_capturing = lambda: False
    # The combined-1F1B nodes call record_stream on every freed input; on CPU it is meaningless.
    torch.Tensor.record_stream = lambda self, s=None: None
    # Tied embeddings across pipeline stages are moved with .cuda() before their all-reduce.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _patch_rng(torch) -> None:
    import megatron.core.tensor_parallel.random as mrandom

    base = mrandom.CudaRNGStatesTracker

    class CPURNGStatesTracker(base):
        """megatron's RNG tracker over the CPU generator (the 'device' generator here)."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise RuntimeError(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    mrandom.CudaRNGStatesTracker = CPURNGStatesTracker
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom._CUDA_RNG_STATE_TRACKER = None
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _patch_moe_split_sizes(torch) -> None:
    # The all-to-all dispatcher converts split sizes with maybe_move_tensor_to_cpu(as_numpy=True),
    # which only converts CUDA tensors; gloo's all_to_all_single then rejects torch tensors.
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_schedules(torch) -> None:
    # schedules.py allocates its token counters with device="cuda" (also at PP=1).
    import megatron.core.pipeline_parallel.schedules as schedules

    class _CPUTorch(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch, name)

    proxy = _CPUTorch("torch")

    def _on_cpu(factory):
        def wrapper(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return wrapper

    for name in ("zeros", "ones", "tensor", "empty", "full"):
        setattr(proxy, name, _on_cpu(getattr(torch, name)))
    schedules.torch = proxy


def _patch_causal_masks(torch) -> None:
    # The unfused softmax builds its default causal mask with device="cuda".
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    def get_default_causal_mask(sq: int):
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    def get_sliding_window_causal_mask(sq: int, skv: int, window_size):
        ones = torch.ones(sq, skv, dtype=torch.bool)
        upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    for module in (transformer_utils, fused_softmax):
        module.get_default_causal_mask = get_default_causal_mask
        module.get_sliding_window_causal_mask = get_sliding_window_causal_mask


def _patch_torch_norm() -> None:
    # WrappedTorchNorm (megatron's local norm without apex) refuses sequence parallelism although a
    # torch norm is correct under SP once its parameters are marked for the TP grad all-reduce.
    # The package's own local spec uses TorchNorm for that reason; GPTModel reference models
    # in tests need the same tolerance.
    from megatron.core.transformer import torch_norm

    # lazy: the CLI imports runtime for --help, which must not load megatron
    from megatron_hybrid.modules.norms import TorchNorm

    def build_torch_norm(cls, config, hidden_size, eps=1e-5, **kwargs):
        return TorchNorm(config, hidden_size, eps=eps)

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(build_torch_norm)


def _patch_te_free_recompute() -> None:
    # CheckpointWithoutOutput (pre-MLP-norm recompute) always takes its FP8 branch, which
    # references TransformerEngine names; without TE, give them FP8-off stand-ins.
    import megatron.core.tensor_parallel.random as mrandom

    if getattr(mrandom, "HAVE_TE", False):
        return

    class _FP8Off:
        @staticmethod
        def is_fp8_enabled():
            return False

        @staticmethod
        def get_fp8_recipe():
            return None

    mrandom.FP8GlobalStateManager = _FP8Off
    mrandom.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
    mrandom.fp8_autocast = lambda **kwargs: contextlib.nullcontext()


def _patch_gated_delta_net() -> None:
    # fla's kernels are Triton (no CPU driver): megatron's GatedDeltaNet calls torch functions
    # with fla's contract instead, packed rows (cu_seqlens) included.
    # lazy: the CLI imports runtime for --help, which must not load megatron
    from megatron_hybrid.modules.gdn_torch import install

    install()


def enable_cpu_emulation() -> None:
    """Patch this process so megatron-core's CUDA-only calls run on CPU (gloo).

    Idempotent. Where GPUs are visible the process becomes CPU-only first (torch reports no CUDA
    device afterwards). Also disables TorchDynamo, because megatron's ``jit_fuser`` is
    ``torch.compile``, which costs 10 s or more per kernel on a small CPU machine and changes no
    result.

    Raises:
        CPUEmulationError: CUDA has already been initialised in this process.
    """
    global _ENABLED
    with _LOCK:
        if _ENABLED:
            return
        import torch

        if torch.cuda.is_initialized():
            raise CPUEmulationError(
                "CPU emulation replaces CUDA streams and the CUDA RNG with dummies; it must not "
                "run in a process that has already used CUDA. Choose the CPU back-end before "
                "any GPU work, or run on the GPUs (no emulation needed)."
            )
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        import torch._dynamo

        torch._dynamo.config.disable = True
        _hide_cuda(torch)
        _patch_torch_cuda(torch)
        _patch_rng(torch)
        _patch_moe_split_sizes(torch)
        _patch_schedules(torch)
        _patch_causal_masks(torch)
        _patch_torch_norm()
        _patch_te_free_recompute()
        _patch_gated_delta_net()
        _ENABLED = True
