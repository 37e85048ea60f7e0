#!/usr/bin/env bash
# One command that sets up a fresh machine: creates .venv and installs megatron_hybrid with its
# test and viz extras, in the order megatron-core 0.19.2 needs (see README.md).
#
#   bash scripts/setup.sh            # uses python3.11 if present, else python3
#   PYTHON=python3.12 bash scripts/setup.sh
#
# Why the order matters:
#   1. torch first, pinned: a bare `torch` requirement resolved by pip pulls GBs of CUDA wheels.
#      An interpreter that already has torch>=2.6 (the GPU machines) is reused as is.
#   2. megatron-core imports triton and its torch_dist save needs psutil, but it declares neither.
#   3. megatron-core 0.19.2 says Requires-Python>=3.12 although its cp311 wheel works, so on 3.11
#      it is installed alone with --no-deps --ignore-requires-python (a global
#      --ignore-requires-python would make pip pick sdists that do not build on 3.11).
#   4. The package last, plainly: its megatron-core pin is then already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
if [[ -z "${PYTHON:-}" ]]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

py_minor=$("$PYTHON" -c 'import sys; print(sys.version_info[1])')
if "$PYTHON" - <<'PY' >/dev/null 2>&1
import torch
from packaging.version import Version
assert Version(torch.__version__.split("+")[0]) >= Version("2.6")
PY
then
  echo "setup: reusing the torch of $PYTHON"
  "$PYTHON" -m venv --system-site-packages "$VENV"
  have_torch=1
else
  "$PYTHON" -m venv "$VENV"
  have_torch=0
fi

PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
[[ $have_torch == 1 ]] || "${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" numpy "packaging>=24.2" einops triton psutil
if (( py_minor < 12 )); then
  "${PIP[@]}" --no-deps --ignore-requires-python "megatron-core==0.19.2"
else
  "${PIP[@]}" --no-deps "megatron-core==0.19.2"
fi
"${PIP[@]}" -e ".[test,viz]"
"$VENV/bin/python" -c "import torch, megatron.core, megatron_hybrid; \
print('setup: torch', torch.__version__, '| megatron-core', megatron.core.__version__, \
'| megatron_hybrid', megatron_hybrid.__version__)"
