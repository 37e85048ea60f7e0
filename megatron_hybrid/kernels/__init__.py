"""Triton kernels shared across the package's layers, each with its torch-only caller.

:mod:`~megatron_hybrid.kernels.vocab_rows` (the softmax statistics of vocabulary rows) serves the
log-probs of ``logprobs`` and the model's cross entropy
(:mod:`~megatron_hybrid.kernels.cross_entropy`, which ``HybridModel`` runs for megatron's fused
cross entropy on CUDA). They need torch and, to run, Triton; nothing else of the package but
``triton_lazy``, so importing them loads no megatron. Kernels that one fast module uses live
beside it in ``modules/fast``.
"""
