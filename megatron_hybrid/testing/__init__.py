"""What tests, benchmarks and demos outside the package reuse: gloo ranks in fresh processes
(``spawn``), small reference models and their GPT twins (``models``), EP-overlap runs
(``overlap``). Code only this repository's tests use lives under ``tests/support``.

Nothing here runs on import. The CPU emulation these tests run on is a runtime back-end:
``megatron_hybrid.runtime.select_backend("cpu").activate()``.
"""
