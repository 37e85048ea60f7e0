"""Triton kernels with torch callers and nothing of megatron, below the layers that use them.

:mod:`~megatron_hybrid.kernels.vocab_rows` (the softmax statistics of vocabulary rows) serves the
log-probs of ``logprobs`` and the model's cross entropy
(:mod:`~megatron_hybrid.kernels.cross_entropy`, which ``HybridModel`` runs for megatron's fused
cross entropy on CUDA); the two sit together so that the row statistics have one home under both
``model`` and ``logprobs``, and importing them loads no megatron (``logprobs``' token functions
need only torch). Kernels that one fast module uses live beside it in ``modules/fast``.
"""
