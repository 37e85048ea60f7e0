"""Triton kernels with torch callers and nothing of megatron, below the layers that use them.

:mod:`~megatron_hybrid.kernels.vocab_rows` (the softmax statistics of vocabulary rows) serves the
log-probs of ``logprobs`` and the model's cross entropy
(:mod:`~megatron_hybrid.kernels.cross_entropy`, which ``HybridModel`` runs for megatron's fused
cross entropy on CUDA); the two sit together so that the row statistics have one home under both
``model`` and ``logprobs``, and importing them loads no megatron (``logprobs``' token functions
need only torch). :mod:`~megatron_hybrid.kernels.tf32` is cuBLAS's float32 batched product on
TF32 for one custom operator (the torch Mamba2 scan's products, ``modules/ssd.py``) without
touching the rest of the process. Kernels that one fast module uses live beside it in
``modules/fast``.
"""
