#!/usr/bin/env bash
# Runs on a lent GPU machine (see ../shared/gpu/README.md): install the carried wheels, then run
# the requested parts, logging under $OUT. Usage: bash scripts/gpu_session.sh PART [PART ...]
#   functional   torchrun -m pytest tests/functional (all GPUs of the machine)
#   bench        benchmarks/ep_overlap.py with NVLink
#   bench-nop2p  benchmarks/ep_overlap.py with NCCL_P2P_DISABLE=1
#   launcher     tests/functional tests that start their own torchrun jobs (train, pretrain)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $NGPU ($(python3 -c 'import torch; print(torch.cuda.get_device_name())'))"
status=0
for part in "$@"; do
  start=$(date +%s)
  case $part in
    functional)
      torchrun --nproc_per_node "$NGPU" -m pytest -q -s -p no:cacheprovider -W ignore \
        tests/functional 2>&1 | grep -v "Warning\|warnings.warn\|^\s*$" | tee "$OUT/functional.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    launcher)
      python3 -m pytest -q -s -p no:cacheprovider -W ignore -m launcher tests/functional 2>&1 \
        | grep -v "Warning\|warnings.warn" | tee "$OUT/launcher.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench)
      torchrun --nproc_per_node "$NGPU" benchmarks/ep_overlap.py --label nvlink --out "$OUT" \
        2>&1 | grep -v "Warning\|warnings.warn\|DEPRECATED" | tee "$OUT/bench_nvlink.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench-nop2p)
      NCCL_P2P_DISABLE=1 torchrun --nproc_per_node "$NGPU" benchmarks/ep_overlap.py \
        --label no-p2p --out "$OUT" 2>&1 | grep -v "Warning\|warnings.warn\|DEPRECATED" \
        | tee "$OUT/bench_nop2p.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    *) echo "unknown part $part"; status=2 ;;
  esac
  echo "== $part took $(( $(date +%s) - start )) s"
done
exit $status
