"""Packaging for megatron_hybrid (tool configuration lives in pyproject.toml)."""

import re
from pathlib import Path

from setuptools import find_packages, setup

_ROOT = Path(__file__).parent
_VERSION = re.search(
    r'__version__ = "([^"]+)"', (_ROOT / "megatron_hybrid" / "package_info.py").read_text()
).group(1)

setup(
    name="megatron_hybrid",
    version=_VERSION,
    description=(
        "Hybrid (Mamba / GatedDeltaNet / attention / MoE) layer stacks for Megatron-Core: "
        "grouped layer patterns, GPTModel-compatible checkpoints, combined-1F1B EP overlap, "
        "HybridEP padding"
    ),
    long_description=(_ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_hybrid", "megatron_hybrid.*"]),
    # PEP 561: the package is typed.
    package_data={"megatron_hybrid": ["py.typed"]},
    install_requires=[
        # Installed beforehand by scripts/setup.sh with --no-deps (its wheel claims >=3.12 only).
        "megatron-core==0.19.2",
        # Install torch before this package; a bare requirement would pull CUDA wheels.
        "torch>=2.6",
        # megatron-core imports triton and its torch_dist save needs psutil; it declares neither.
        "triton",
        "psutil",
        "einops",
        "numpy",
        # Hugging Face checkpoints in and out (megatron_hybrid.hf); convert's progress bars.
        "safetensors>=0.4",
        "tqdm",
    ],
    extras_require={
        # fla-core: GatedDeltaNet ('G') layers run in the CPU tests (megatron's torch path).
        # transformers: the reference the Hugging Face conversion tests compare against.
        # ruff, black: .ci/run lints and format-checks before the tests; pinned, because their
        # rules and formatting change between releases.
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "fla-core==0.6.0",
            "transformers==5.23.0",
            # peft: the reference the LoRA tests compare against (adapter folders in and out).
            "peft==0.21.2",
            "ruff==0.17.6",
            "black==26.10.1",
        ],
        "viz": ["matplotlib>=3.7"],
        # prepare-data and train --tokenizer-model: Hugging Face tokenizers (AutoTokenizer).
        "data": ["transformers>=4.51"],
        # train --tensorboard-dir.
        "tensorboard": ["tensorboard>=2.15"],
        # GatedDeltaNet ('G') layers; pure-Python wheels.
        "gdn": ["fla-core==0.6.0", "flash-linear-attention==0.6.0"],
    },
    entry_points={"console_scripts": ["megatron-hybrid=megatron_hybrid.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: POSIX :: Linux",
    ],
)
