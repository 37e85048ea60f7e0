"""Test and demo support: gloo ranks in fresh processes, small reference models, overlap
comparisons, a GatedDeltaNet reference and checkpoint helpers.

Nothing here runs on import. The CPU emulation these tests run on is a runtime back-end:
``megatron_hybrid.runtime.select_backend("cpu").activate()``.
"""
