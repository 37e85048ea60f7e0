#!/usr/bin/env bash
# Runs several scripts/gpu_session.sh sessions side by side on one GPU host, each on GPUs and
# CPU cores of its own, so that one call on a 4-GPU machine stands for the 1- and 2-GPU runners
# (16 and 32 cores, as the lent 1- and 2-GPU machines have) and a benchmark at once.
#
#   bash scripts/gpu_split.sh 'GPUS|CORES|NAME|ENV|PARTS' ['GPUS|CORES|NAME|ENV|PARTS' ...]
#
# GPUS goes to CUDA_VISIBLE_DEVICES, CORES to taskset -c, ENV (space-separated VAR=value, may be
# empty) to the session, PARTS are gpu_session.sh's parts. Each slice logs to $OUT/NAME.log and
# writes its files under $OUT/NAME; its compile caches are its own (the suite's cold times stay
# cold). Example, on 4 GPUs and 64 cores:
#
#   bash scripts/gpu_split.sh '0|0-15|suite1|SUITE_BUDGET=480|suite' \
#     '1,2|16-47|suite2|SUITE_BUDGET=480|suite' '3|48-63|perf1||train-perf logprobs'
#
# The exit status is the worst slice's; each slice's last lines are printed at the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ $# -gt 0 ] || { sed -n '2,17p' "$0"; exit 2; }
for slice in "$@"; do  # refuse a malformed slice before anything starts
  IFS='|' read -r gpus cores name env parts <<< "$slice"
  if [ -z "$gpus" ] || [ -z "$cores" ] || [ -z "$name" ] || [ -z "$parts" ]; then
    echo "gpu_split.sh: '$slice' is not 'GPUS|CORES|NAME|ENV|PARTS' (ENV may be empty)"; exit 2
  fi
done
# Once, here, not by every slice at the same time; skipped where the caller installed them
# (MH_WHEELS_INSTALLED=1, e.g. to start a job of its own beside the slices first).
if [ "${MH_WHEELS_INSTALLED:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  # The carried DeepEP wheel too (the suite part installs it where it is missing).
  for wheel in .deepep/dist/deep_ep-*.whl; do
    [ -f "$wheel" ] || continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site "$wheel" >/dev/null 2>&1 \
      || echo "installing $wheel failed (the HybridEP tests will skip)"
  done
fi
export MH_WHEELS_INSTALLED=1
pids=() names=()
for slice in "$@"; do
  IFS='|' read -r gpus cores name env parts <<< "$slice"
  mkdir -p "$OUT/$name"
  # shellcheck disable=SC2086  # ENV and PARTS are word lists
  CUDA_VISIBLE_DEVICES=$gpus OUT=$OUT/$name MH_CACHE_ROOT=/tmp/mh-compile-cache-$name \
    taskset -c "$cores" env $env bash scripts/gpu_session.sh $parts > "$OUT/$name.log" 2>&1 &
  pids+=($!) names+=("$name")
  echo "slice $name: GPUs $gpus, cores $cores, ${env:-no env}, parts: $parts (pid $!)"
done
status=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; code=$?
  [ $code = 0 ] || status=1
  echo "== slice ${names[$i]} exit $code"
done
for name in "${names[@]}"; do
  echo "===== $name (last lines of $OUT/$name.log)"; tail -40 "$OUT/$name.log"
done
exit $status
