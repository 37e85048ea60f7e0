#!/usr/bin/env bash
# CPU side: bring a Triton >= 3.7.1 to the GPU machines, for fla's GatedDeltaNet backward on
# Hopper (fla 0.6.0 refuses it with older Triton: wrong results, fla issue #640). The wheel is
# too large for one device call (64 MiB), so it is slimmed (no AMD backend, CUPTI, Blackwell
# ptxas or profiler), packed with xz and split; each device call carries one part.
#   bash scripts/stage_triton.sh            download, slim, pack, split into .tritonparts/
#   bash scripts/stage_triton.sh --stage K  copy part K (and the manifest) into .tparts/
# and on the device, carrying [".whl", ".tparts"]: bash scripts/gpu_session.sh triton ...
# The device side collects the parts in /tmp/tparts and unpacks Triton into /tmp/tsite once all
# are there; parts vanish with the machine (about 30 s idle), so stage them back to back.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
version=${TRITON_VERSION:-3.9.0}
for d in /.tparts/ /.tritonparts/; do
  grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude
done
if [ "${1:-}" = "--stage" ]; then
  rm -rf .tparts && mkdir -p .tparts
  cp ".tritonparts/triton_part_0$2" .tritonparts/manifest .tparts/
  du -sh .tparts
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$work" "triton==$version"
(cd "$work" && unzip -q triton-*.whl && rm triton-*.whl)
rm -rf "$work"/triton/backends/amd "$work"/triton/backends/nvidia/lib/cupti* \
  "$work"/triton/backends/nvidia/bin/ptxas-blackwell "$work"/triton/instrumentation/*.so \
  "$work"/triton/_C/libproton.so
# Triton discovers backends through its entry points and looks up ptxas-blackwell on import even
# on Hopper: drop the AMD entry, and let the Hopper ptxas answer for the removed binary.
sed -i '/amd/d' "$work/triton-$version.dist-info/entry_points.txt"
ln -s ptxas "$work/triton/backends/nvidia/bin/ptxas-blackwell"
rm -rf .tritonparts && mkdir -p .tritonparts
tar cf - -C "$work" triton "triton-$version.dist-info" | xz -6 -T0 >"$work/triton.tar.xz"
split -b 53M -d "$work/triton.tar.xz" .tritonparts/triton_part_
(cd .tritonparts && sha256sum triton_part_* >manifest)
ls -la .tritonparts
