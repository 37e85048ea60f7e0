#!/usr/bin/env bash
# Bring megatron-core's Mamba kernels (mamba_ssm's Triton SSD + gated norm, causal_conv1d's CUDA
# conv) to the GPU machines, which have no network and no prebuilt wheels for their torch/CUDA.
#   bash scripts/stage_mamba.sh            (CPU) download both source releases into .mamba/
#   bash scripts/stage_mamba.sh --device   (GPU, carrying [".whl", ".mamba"]) build them into
#                                          /tmp/site; then run scripts/gpu_session.sh mamba
# Only what megatron-core's MambaMixer calls is made: causal_conv1d is compiled for the device's
# own architecture (its setup.py lists nine, minutes of nvcc), and mamba_ssm's Python/Triton
# package is copied without its Mamba-1 CUDA extension, which mamba_ssm/__init__ imports
# unconditionally: an empty stand-in module satisfies that import (Mamba-1 is never called).
set -euo pipefail
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"
conv=${CAUSAL_CONV1D_VERSION:-1.7.0}
mamba=${MAMBA_SSM_VERSION:-2.3.2.post1}
if [ "${1:-}" != "--device" ]; then
  grep -qx "/.mamba/" .git/info/exclude 2>/dev/null || echo "/.mamba/" >>.git/info/exclude
  rm -rf .mamba && mkdir -p .mamba
  # pip runs each setup.py for metadata: it needs torch (the project's .venv has it); the build
  # switches keep that step from compiling or fetching wheels.
  py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
  CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE $py -m pip download -q \
    --no-deps --no-build-isolation --no-binary :all: -d .mamba \
    "causal-conv1d==$conv" "mamba-ssm==$mamba"
  ls -la .mamba
  exit 0
fi
site=/tmp/site
build=$(mktemp -d)
tar xzf ".mamba/causal_conv1d-$conv.tar.gz" -C "$build"
tar xzf ".mamba/mamba_ssm-$mamba.tar.gz" -C "$build"
cc=$(python3 -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
setup="$build/causal_conv1d-$conv/setup.py"
# Keep the device's architecture only: drop every listed -gencode pair but ours.
python3 - "$setup" "$cc" <<'EOF'
import re, sys
path, cc = sys.argv[1], sys.argv[2]
text = open(path).read()
pair = re.compile(r'cc_flag\.append\("-gencode"\)\s*\n\s*cc_flag\.append\("arch=compute_(\d+),code=sm_\d+"\)')
text = pair.sub(lambda m: m.group(0) if m.group(1) == cc else "pass", text)
open(path, "w").write(text)
EOF
grep -q "compute_$cc" "$setup" || { echo "causal_conv1d $conv does not list sm_$cc"; exit 1; }
(cd "$build/causal_conv1d-$conv" && CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=16 \
  python3 -m pip install -q --no-build-isolation --no-deps --no-cache-dir --target "$site" .)
cp -r "$build/mamba_ssm-$mamba/mamba_ssm" "$site/"
printf '"""Stand-in for mamba_ssm'"'"'s Mamba-1 CUDA extension (not built here)."""\n' \
  >"$site/selective_scan_cuda.py"
rm -rf "$build"
PYTHONPATH=$site:${PYTHONPATH:-} python3 - <<'EOF'
from megatron.core.ssm import mamba_mixer

assert mamba_mixer.HAVE_MAMBA_SSM, "mamba_ssm does not import"
assert mamba_mixer.causal_conv1d_fn is not None, "causal_conv1d does not import"
print("Mamba kernels ready (mamba_ssm Triton, causal_conv1d CUDA)")
EOF
