"""Test and demo support: opt-in CPU emulation of megatron-core, state resets, small models.

Nothing here runs on import; see :func:`megatron_hybrid.runtime.cpu.enable_cpu_emulation`.
"""
