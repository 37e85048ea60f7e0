"""Code only this repository's tests use: numerical references and investigations (GatedDeltaNet
recurrences, fla's WY solve and gate gradients, Triton interpreter patches), packing and
checkpoint comparisons. Importable as ``support`` by ``tests/unit`` and ``tests/functional``
(``tests/conftest.py`` puts this folder's parent on ``sys.path``); the package ships what tests
outside it reuse (``megatron_hybrid.testing``: gloo spawning, small models, overlap runs).
"""

from pathlib import Path

#: The ``tests`` folder: put it on ``sys.path`` of a subprocess that imports ``support``.
TESTS_DIR = str(Path(__file__).resolve().parents[1])
