#!/usr/bin/env bash
# Runs on a lent GPU machine (see ../shared/gpu/README.md): install the carried wheels, then run
# the requested parts, logging under $OUT. Usage: bash scripts/gpu_session.sh PART [PART ...]
#   data         tests/functional/test_data_gpu.py alone (prepare-data, then train --data-path
#                --packed and on synthetic data side by side, one GPU): tokens per step and
#                tokens/s of each, with no suite beside them
#   suite        the whole GPU suite as a runner runs it (tests/functional/run_suite.py): HF
#                fixtures made here, in-process tests on all GPUs (a hung test ends the job and
#                the rest runs again) and beside them the launcher tests; per-test time limits,
#                the whole within $SUITE_BUDGET s (default 450); summary.md holds the
#                docs/gpu_tests.md row. Triton's and inductor's caches go to $OUT as
#                compile_cache.tar.xz.* (at most 3 parts of 15 MiB); carried back in
#                .compile_cache/ they make the next run a warm one, which its row says
#   functional   torchrun -m pytest tests/functional (all GPUs of the machine)
#   bench        benchmarks/ep_overlap.py with NVLink
#   bench-nop2p  benchmarks/ep_overlap.py with NCCL_P2P_DISABLE=1 (both take $BENCH_ARGS)
#   launcher     tests/functional tests that start their own torchrun jobs (train, pretrain)
#   triton       collect the carried .tparts/ part (scripts/stage_triton.sh); once all parts
#                are there, unpack Triton >= 3.7.1 into /tmp/tsite for the parts below
#   gdn-fla      the [GE]{2} test and the GatedDeltaNet kernel tests (fla and megatron's torch
#                path against a recurrent reference) on /tmp/tsite's Triton (backward included)
#   bench-ge     bench / bench-nop2p's ge_* variants again with fla kernels (--append, $BENCH_ARGS)
#   bench-ge-nop2p
#   profile      grouped and [GE] plain/overlap with fla kernels on /tmp/tsite's Triton, one
#                profiled step each (benchmarks/trace_summary.py), label nvlink-profile; with
#                PROFILE_NOP2P=1 also no-p2p-profile. $BENCH_ARGS come last, so a --variants
#                there replaces the part's own list
#   host         benchmarks/host_overhead.py (one GPU), not bound, then bound to 1 and 2 cores
#   ge-exp       ge_plain / ge_overlap with fla kernels in several configurations ($GE_EXPS;
#                NCCL_P2P_DISABLE from the environment)
#   te           tests/functional/test_te_backend_gpu.py (TE installed by the staged
#                ../shared/gpu/device_install_te.sh calls into /tmp/site)
#   hf           tests/functional/test_hf_gpu.py on the folders of tests/functional/hf_fixtures.py
#                (made on a CPU into .hf_fixtures/, carried) and benchmarks/hf_export.py
#   hf-fp8       tests/functional/test_hf_fp8_gpu.py (the fused FP8 kernel vs its torch reference,
#                the *_fp8 folders of hf_fixtures.py, a GPU-sized model through FP8 and back) and
#                benchmarks/hf_export.py --quantize fp8
#   lora         tests/functional/test_lora_gpu.py on one GPU (LoRA on TE linears, fused norm +
#                linear and grouped-GEMM experts against the local backend's math; TE from
#                /tmp/site as for te) and benchmarks/lora.py ($LORA_BENCH_ARGS)
#   packing      tests/functional/test_packing_gpu.py: packed == separate with fla's cu_seqlens
#                kernels, Mamba's kernels where built and TE's attention where installed, and
#                forward_logprobs (forward only: no Triton staging needed; one fla config each)
#   gdn-gates    the [GE]{2} GatedDeltaNet gate-gradient check alone (fla bf16 and float32, as
#                shipped and with an IEEE WY-inverse merge, vs the torch path; replays against
#                float64; one GPU, /tmp/tsite's Triton, one fla config)
#   logprobs     benchmarks/logprobs.py: forward_logprobs packed vs padded, one GPU
#                ($LOGPROBS_ARGS)
#   grpo         examples/grpo_toy.py on one GPU (the GRPO loop end to end: reward per step and
#                the reward curve in $OUT/grpo; $GRPO_ARGS last, e.g. --lora-rank 8 or --gdn)
#   mfu          the fast TE-free path: its numerics against the reference path
#                (tests/functional/test_fast_path_gpu.py, one GPU), then benchmarks/mfu.py --quick at
#                the issue's shape through train's own step (every pattern fast, [*E] reference,
#                TE runs where TE is installed, [*E] with CUDA graphs); $MFU_ARGS come last
#                (e.g. --runs ... or --shape large)
#   perf         one GPU, about 8 minutes: the numerics of issue 33's changes (fused optimizer
#                step vs megatron's, the package's GatedDeltaNet dqkwg kernel vs float64 and fla,
#                graph-capture recovery and the [*E] capture diagnosis, the fast path vs the
#                reference with fla's backward on this Triton; fla one config each), then
#                benchmarks/mfu.py --quick through train's own step (every pattern fast, [*E]
#                reference, [*E] fast-graphs); prints the results and phase tables last
#                ($MFU_ARGS last, e.g. --data full or --packed)
#   train-perf   one GPU, about 6 minutes: the train command itself (torchrun, synthetic
#                variable-length data) at benchmarks/mfu.py's issue shape, [*E]{4} and then
#                [GE]{2}[*E]{2} on the image's own Triton (its first step autotunes fla: it
#                did not end within 110 s on one H200); the closing lines (median step,
#                tok/s, TFLOP/s, MFU) last ($TRAIN_PERF_ARGS last, e.g. --packed;
#                $TRAIN_PERF_TIMEOUT per run, default 240 s)
#   perf-ep4     all GPUs of the machine (4), up to 9 minutes: mfu.py --quick at EP = GPUs for
#                [*E] and [GE] fast, plain and --overlap (32 sequences per step on 4 GPUs);
#                $MFU_TIMEOUT per job, default 270 s ([GE]'s first step autotunes fla: 150 s
#                ended it on 4 x H200); $MFU_ARGS last, e.g. --packed (one token budget)
#   mfu-large    benchmarks/mfu.py --quick --shape large, fast runs only ($MFU_ARGS last)
#   mfu-fla      benchmarks/mfu.py --quick ge/fast and star_e/fast with fla's kernels on
#                /tmp/tsite's Triton (the triton part first), eager and with CUDA graphs, then
#                ge/fast with the package's dqkwg kernel forced (MEGATRON_HYBRID_FLA_DQKWG=package)
#   hybridep     DeepEP's HybridEP through megatron-core's flex dispatcher: install the carried
#                DeepEP wheel (.deepep/dist/deep_ep-*.whl, built once on a GPU machine, see
#                docs/padding.md §9), then tests/functional/test_hybridep_gpu.py on all GPUs and
#                its `train` launcher test; HybridEP compiles its kernels at first use with
#                $CUDA_HOME/bin/nvcc (exported here)
#   hybridep-probe  where DeepEP's HybridEPBuffer constructor dies: tests/functional/
#                hybridep_probe.py on all GPUs as is and with USE_MNNVL=0 (no fabric handles),
#                a cache dir of its own, the NVLink domain size given; then one rank under gdb
#                (native backtrace) where gdb is installed
#   bench-hybridep  benchmarks/hybridep.py (hybridep vs alltoall, padded vs real tokens) with
#                NVLink and with NCCL_P2P_DISABLE=1 ($HYBRIDEP_BENCH_ARGS; the DeepEP wheel as above)
#   mamba        build megatron-core's Mamba kernels from the carried .mamba/ sources
#                (scripts/stage_mamba.sh --device) unless present, then the Mamba kernel tests
#                (tests/functional/test_mamba_torch_gpu.py, Nemotron-H kernels vs torch vs
#                transformers on .hf_fixtures/) and benchmarks/mamba_torch.py
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# Once per machine: scripts/gpu_split.sh installs before its slices start (MH_WHEELS_INSTALLED=1),
# so that side-by-side sessions do not write into /tmp/site at the same time.
if [ "${MH_WHEELS_INSTALLED:-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# Every torchrun job runs --standalone: its rendezvous store listens on a port the OS gives it,
# so jobs side by side (gpu_split.sh's slices, the suite's lanes) never take each other's port.
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $NGPU ($(python3 -c 'import torch; print(torch.cuda.get_device_name())'))"
TSITE=/tmp/tsite
# Drops warnings and blank lines, line by line (a log cut off by a timeout keeps what came).
quiet() { grep --line-buffered -v 'Warning\|warnings.warn\|DEPRECATED\|^\s*$'; }
have_tsite() {
  [ -d $TSITE/triton ] || { echo "no Triton in $TSITE: run the triton part first"; return 1; }
}
with_tsite() { have_tsite && PYTHONPATH=$TSITE:$PYTHONPATH "$@"; }
# DeepEP (HybridEP) from the carried wheel, and the CUDA toolkit its kernel compiler calls.
have_deepep() {
  python3 -c 'import deep_ep' 2>/dev/null && return 0
  local wheel
  wheel=$(ls .deepep/dist/deep_ep-*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] || { echo "no DeepEP wheel in .deepep/dist/ (build it once: docs/padding.md)"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$wheel" >/dev/null 2>&1 || { echo "installing $wheel failed"; return 1; }
  python3 -c 'import deep_ep; print("DeepEP", deep_ep.__file__)' || return 1
}
if [ -z "${CUDA_HOME:-}" ]; then  # a toolkit with nvcc and its headers (HybridEP compiles both)
  for d in /usr/local/cuda /usr/local/cuda-13*; do
    [ -x "$d/bin/nvcc" ] && [ -f "$d/include/cuda_runtime.h" ] && { export CUDA_HOME=$d; break; }
  done
fi
status=0
for part in "$@"; do
  start=$(date +%s)
  case $part in
    suite)
      # One folder for both compile caches, at a fixed path: Triton's cache names its files by
      # absolute path. Cold unless a packed cache was carried (cold times are the ones counted).
      cache=${MH_CACHE_ROOT:-/tmp/mh-compile-cache}  # one per slice of scripts/gpu_split.sh
      export TRITON_CACHE_DIR=$cache/triton TORCHINDUCTOR_CACHE_DIR=$cache/inductor
      export MH_COMPILE_CACHE=cold
      if ls .compile_cache/compile_cache.tar.xz.* >/dev/null 2>&1; then
        mkdir -p $cache && cat .compile_cache/compile_cache.tar.xz.* | xz -dc | tar xf - -C $cache \
          && MH_COMPILE_CACHE=warm
      fi
      # The HybridEP tests run where the DeepEP wheel is carried (.deepep/dist/), else they skip.
      have_deepep >/dev/null 2>&1 || echo "no DeepEP: the HybridEP tests skip"
      python3 tests/functional/run_suite.py --out "$OUT" --budget "${SUITE_BUDGET:-450}" \
        ${SUITE_ARGS:-} 2>&1 | quiet
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      if [ -d $cache ]; then
        (cd $cache && tar cf - . | xz -T0 -6 | split -b 15M - "$OUT/compile_cache.tar.xz.")
        parts=$(ls "$OUT"/compile_cache.tar.xz.* | wc -l)
        if [ "$parts" -gt 3 ]; then
          rm -f "$OUT"/compile_cache.tar.xz.*
          echo "compile cache not kept: $(du -sh $cache | cut -f1), $parts parts of 15 MiB packed"
        else
          echo "compile cache: $(du -sh $cache | cut -f1) in $parts part(s) in \$OUT"
        fi
      fi ;;
    functional)
      MH_HF_FIXTURES=${MH_HF_FIXTURES:-$PWD/.hf_fixtures} torchrun --standalone --nproc_per_node "$NGPU" -m pytest -q -s -p no:cacheprovider -W ignore \
        tests/functional 2>&1 | quiet | tee "$OUT/functional.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    data)
      timeout "${DATA_TIMEOUT:-330}" python3 -m pytest -q -s -p no:cacheprovider -W ignore \
        -m launcher tests/functional/test_data_gpu.py 2>&1 | quiet | tee "$OUT/data.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    launcher)
      python3 -m pytest -q -s -p no:cacheprovider -W ignore -m launcher tests/functional 2>&1 \
        | quiet | tee "$OUT/launcher.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench)
      torchrun --standalone --nproc_per_node "$NGPU" benchmarks/ep_overlap.py --label nvlink --out "$OUT" \
        ${BENCH_ARGS:-} 2>&1 | quiet \
        | tee "$OUT/bench_nvlink.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench-nop2p)
      NCCL_P2P_DISABLE=1 torchrun --standalone --nproc_per_node "$NGPU" benchmarks/ep_overlap.py \
        --label no-p2p --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
        | quiet | tee "$OUT/bench_nop2p.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    triton)
      mkdir -p /tmp/tparts && cp .tparts/* /tmp/tparts/
      if (cd /tmp/tparts && sha256sum --quiet -c manifest 2>/dev/null); then
        mkdir -p $TSITE && cat /tmp/tparts/triton_part_* | xz -dc | tar xf - -C $TSITE
        # parts packed before stage_triton.sh made these two repairs itself
        sed -i '/amd/d' $TSITE/triton-*.dist-info/entry_points.txt
        ln -sf ptxas $TSITE/triton/backends/nvidia/bin/ptxas-blackwell
        with_tsite python3 -c 'import triton; print("Triton", triton.__version__, "in /tmp/tsite")'
      else
        echo "Triton parts so far: $(ls /tmp/tparts | tr '\n' ' ')"
      fi ;;
    gdn-fla)
      have_tsite || { status=1; continue; }
      # One process for the kernel tests: fla compiles and autotunes each kernel on first use
      # (minutes). A test still running after 300 s dumps every thread's stack into the log.
      PYTHONPATH=$TSITE:$PYTHONPATH timeout "${GDN_TIMEOUT:-480}" torchrun --standalone --nproc_per_node 1 \
        -m pytest -q -s -p no:cacheprovider -W ignore -o faulthandler_timeout=300 \
        tests/functional/test_gdn_kernels_gpu.py 2>&1 | tee "$OUT/gdn_kernels.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      TRITON_F32_DEFAULT=ieee with_tsite torchrun --standalone --nproc_per_node "$NGPU" -m pytest -q -s \
        -p no:cacheprovider -W ignore \
        tests/functional/test_gdn_gates_gpu.py \
        2>&1 | tee "$OUT/gdn_fla.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    bench-ge|bench-ge-nop2p)
      label=nvlink; p2p=0; [ $part = bench-ge-nop2p ] && { label=no-p2p; p2p=1; }
      NCCL_P2P_DISABLE=$p2p with_tsite torchrun --standalone --nproc_per_node "$NGPU" benchmarks/ep_overlap.py \
        --label $label --out "$OUT" --variants ge_plain ge_overlap --gdn-kernel fla --append \
        ${BENCH_ARGS:-} 2>&1 | quiet | tee "$OUT/$part.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    profile)
      p2ps=0; [ "${PROFILE_NOP2P:-0}" = 1 ] && p2ps="0 1"
      for p2p in $p2ps; do
        label=nvlink-profile; [ $p2p = 1 ] && label=no-p2p-profile
        NCCL_P2P_DISABLE=$p2p with_tsite torchrun --standalone --nproc_per_node "$NGPU" \
          benchmarks/ep_overlap.py --label $label --out "$OUT" --gdn-kernel fla --profile \
          --variants grouped_plain grouped_overlap ge_plain ge_overlap ${BENCH_ARGS:-} 2>&1 \
          | quiet | tee "$OUT/$label.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done ;;
    host)
      # Host cost per operator, phased vs interleaved forward/backward (one GPU), then bound to
      # one and to two cores.
      for pin in 0 1 2; do
        timeout 120 python3 benchmarks/host_overhead.py --out "$OUT" --pin $pin 2>&1 \
          | tee -a "$OUT/host.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done ;;
    ge-exp)
      # [GE] plain vs overlap with fla kernels, each configuration under its own label:
      # GE_EXPS="label|extra args;..." (default: as is, each rank bound to 4 cores, micro-batch 2).
      have_tsite || { status=1; continue; }
      nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
      default="nvlink-ge|;nvlink-ge-bind4|--bind-cores 4;nvlink-ge-mbs2|--mbs 2"
      IFS=';' read -ra exps <<< "${GE_EXPS:-$default}"
      for exp in "${exps[@]}"; do
        [[ $exp == *"|"* ]] || { echo "GE_EXPS: '$exp' is not 'label|args'"; status=2; continue; }
        label=${exp%%|*}; extra=${exp#*|}
        PYTHONPATH=$TSITE:$PYTHONPATH timeout "${GE_TIMEOUT:-240}" torchrun --standalone \
          --nproc_per_node "$NGPU" benchmarks/ep_overlap.py --label "$label" --out "$OUT" \
          --variants ge_plain ge_overlap --gdn-kernel fla $extra ${BENCH_ARGS:-} 2>&1 \
          | quiet | tee "$OUT/$label.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done ;;
    te)
      torchrun --standalone --nproc_per_node "$NGPU" -m pytest -q -s -p no:cacheprovider -W ignore \
        tests/functional/test_te_backend_gpu.py 2>&1 | quiet \
        | tee "$OUT/te.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    hf)
      NVIDIA_TF32_OVERRIDE=0 MH_HF_FIXTURES=${MH_HF_FIXTURES:-$PWD/.hf_fixtures} \
        torchrun --standalone --nproc_per_node "$NGPU" -m pytest -q -s -p no:cacheprovider -W ignore \
        tests/functional/test_hf_gpu.py 2>&1 | quiet | tee "$OUT/hf.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      python3 benchmarks/hf_export.py --out "$OUT" 2>&1 | quiet | tee "$OUT/hf_export.log" ;;
    hf-fp8)
      NVIDIA_TF32_OVERRIDE=0 MH_HF_FIXTURES=${MH_HF_FIXTURES:-$PWD/.hf_fixtures} \
        torchrun --standalone --nproc_per_node "$NGPU" -m pytest -q -s -p no:cacheprovider -W ignore \
        tests/functional/test_hf_fp8_gpu.py 2>&1 | quiet | tee "$OUT/hf_fp8.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      python3 benchmarks/hf_export.py --quantize fp8 --out "$OUT" 2>&1 | quiet \
        | tee "$OUT/hf_export_fp8.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    lora)
      NVIDIA_TF32_OVERRIDE=0 torchrun --standalone --nproc_per_node 1 -m pytest -q -s -p no:cacheprovider \
        -W ignore tests/functional/test_lora_gpu.py 2>&1 | quiet | tee "$OUT/lora.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      python3 benchmarks/lora.py --out "$OUT" ${LORA_BENCH_ARGS:-} 2>&1 | quiet \
        | tee "$OUT/lora_bench.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    packing)
      TRITON_F32_DEFAULT=ieee MH_TRITON_ONE_CONFIG=1 timeout "${PACKING_TIMEOUT:-420}" \
        torchrun --standalone --nproc_per_node "$NGPU" -m pytest -q -s -p no:cacheprovider -W ignore \
        tests/functional/test_packing_gpu.py 2>&1 | quiet | tee "$OUT/packing.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    gdn-gates)
      have_tsite || { status=1; continue; }
      TRITON_F32_DEFAULT=ieee MH_TRITON_ONE_CONFIG=1 PYTHONPATH=$TSITE:$PYTHONPATH \
        timeout "${GDN_TIMEOUT:-480}" torchrun --standalone --nproc_per_node 1 -m pytest -q -s \
        -p no:cacheprovider -W ignore -o faulthandler_timeout=300 \
        tests/functional/test_gdn_gates_gpu.py \
        2>&1 | quiet | tee "$OUT/gdn_gates.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    logprobs)
      timeout "${LOGPROBS_TIMEOUT:-420}" python3 benchmarks/logprobs.py --out "$OUT" \
        ${LOGPROBS_ARGS:-} 2>&1 | quiet | tee "$OUT/logprobs.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    grpo)
      timeout "${GRPO_TIMEOUT:-240}" python3 examples/grpo_toy.py --out "$OUT/grpo" \
        ${GRPO_ARGS:-} 2>&1 | quiet | tee "$OUT/grpo.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    mfu)
      timeout "${FAST_TEST_TIMEOUT:-180}" torchrun --standalone --nproc_per_node 1 -m pytest -q -s \
        -p no:cacheprovider -W ignore tests/functional/test_fast_path_gpu.py 2>&1 | quiet \
        | tee "$OUT/fast_path.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      timeout "${MFU_TIMEOUT:-300}" python3 benchmarks/mfu.py --out "$OUT" --quick \
        ${MFU_ARGS:-} 2>&1 | quiet | tee "$OUT/mfu.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    perf)
      MH_TRITON_ONE_CONFIG=1 timeout "${PERF_TEST_TIMEOUT:-240}" torchrun --standalone --nproc_per_node 1 \
        -m pytest -q -s -p no:cacheprovider -W ignore tests/functional/test_fused_step_gpu.py \
        tests/functional/test_fla_dqkwg_gpu.py \
        tests/functional/test_cuda_graphs_gpu.py::test_failed_capture_leaves_the_process_usable \
        tests/functional/test_cuda_graphs_gpu.py::test_fast_moe_pieces_capture_or_say_why \
        tests/functional/test_fast_path_gpu.py 2>&1 | quiet | tee "$OUT/perf_tests.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      timeout "${MFU_TIMEOUT:-330}" python3 benchmarks/mfu.py --out "$OUT/perf" --quick \
        ${MFU_ARGS:-} 2>&1 | quiet | tee "$OUT/perf_mfu.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      for f in "$OUT"/perf/mfu_*.md; do
        [ -f "$f" ] && { echo "== $f"; sed -n '/^| run |/,/^$/p;/^| target |/,/^$/p' "$f"; }
      done ;;
    train-perf)
      # benchmarks/mfu.py's "issue" shape (SHAPES, train_flags), one GPU.
      shape=(--hidden-size 2048 --num-attention-heads 16 --swiglu --disable-bias-linear
        --num-experts 64 --moe-router-topk 8 --moe-ffn-hidden-size 512
        --moe-token-dispatcher-type alltoall --seq-length 4096 --micro-batch-size 1
        --global-batch-size 8 --vocab-size 32768 --bf16 --moe-grouped-gemm --train-iters 16)
      for pattern in '[*E]{4}' '[GE]{2}[*E]{2}'; do
        echo "== train $pattern" | tee -a "$OUT/train_perf.log"
        timeout "${TRAIN_PERF_TIMEOUT:-240}" torchrun --standalone --nproc_per_node 1 -m megatron_hybrid \
          train --hybrid-layer-pattern "$pattern" "${shape[@]}" ${TRAIN_PERF_ARGS:-} 2>&1 \
          | quiet | tee -a "$OUT/train_perf.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done
      grep -E '^== train|^training |^done:' "$OUT/train_perf.log" ;;
    perf-ep4)
      for extra in "" "--overlap"; do
        timeout "${MFU_TIMEOUT:-270}" torchrun --standalone --nproc_per_node "$NGPU" benchmarks/mfu.py \
          --out "$OUT/ep$NGPU" --quick --ep "$NGPU" --runs star_e/fast ge/fast $extra \
          ${MFU_ARGS:-} 2>&1 | quiet | tee -a "$OUT/perf_ep.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done
      for f in "$OUT/ep$NGPU"/mfu_*.md; do
        [ -f "$f" ] && { echo "== $f"; sed -n '/^| run |/,/^$/p' "$f"; }
      done ;;
    mfu-large)
      timeout "${MFU_TIMEOUT:-420}" python3 benchmarks/mfu.py --out "$OUT" --quick --shape large \
        --runs star_e/fast ge/fast me/fast plus_e/fast ${MFU_ARGS:-} 2>&1 | quiet \
        | tee "$OUT/mfu_large.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    mfu-fla)
      have_tsite || { status=1; continue; }
      PYTHONPATH=$TSITE:$PYTHONPATH timeout "${MFU_TIMEOUT:-600}" python3 benchmarks/mfu.py \
        --out "$OUT/fla" --quick --runs ge/fast star_e/fast ge/fast-graphs \
        star_e/fast-graphs ${MFU_ARGS:-} 2>&1 \
        | quiet | tee "$OUT/mfu_fla.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      # The package's dqkwg kernel on the same Triton, against fla's own (the yardstick above).
      MEGATRON_HYBRID_FLA_DQKWG=package PYTHONPATH=$TSITE:$PYTHONPATH \
        timeout "${MFU_TIMEOUT:-600}" python3 benchmarks/mfu.py --out "$OUT/fla_package" \
        --quick --runs ge/fast ${MFU_ARGS:-} 2>&1 | quiet | tee "$OUT/mfu_fla_package.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    mamba)
      python3 -c 'from megatron.core.ssm import mamba_mixer as m; assert m.HAVE_MAMBA_SSM' \
        2>/dev/null || bash scripts/stage_mamba.sh --device 2>&1 | tail -20 | tee "$OUT/mamba_build.log"
      NVIDIA_TF32_OVERRIDE=0 MH_HF_FIXTURES=${MH_HF_FIXTURES:-$PWD/.hf_fixtures} \
        torchrun --standalone --nproc_per_node 1 -m pytest -q -s -p no:cacheprovider -W ignore \
        tests/functional/test_mamba_torch_gpu.py \
        tests/functional/test_hf_gpu.py::test_nemotron_h_mamba_kernels_torch_and_transformers \
        2>&1 | quiet | tee "$OUT/mamba.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      python3 benchmarks/mamba_torch.py --out "$OUT" ${MAMBA_BENCH_ARGS:-} 2>&1 | quiet \
        | tee "$OUT/mamba_bench.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    hybridep)
      have_deepep || { status=1; continue; }
      timeout "${HYBRIDEP_TIMEOUT:-290}" torchrun --standalone --nproc_per_node "$NGPU" -m pytest -q -s \
        -p no:cacheprovider -W ignore tests/functional/test_hybridep_gpu.py 2>&1 | quiet \
        | tee "$OUT/hybridep.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
      timeout "${HYBRIDEP_TIMEOUT:-290}" python3 -m pytest -q -s -p no:cacheprovider -W ignore \
        -m launcher tests/functional/test_hybridep_gpu.py 2>&1 | quiet \
        | tee "$OUT/hybridep_launcher.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    hybridep-probe)
      have_deepep || { status=1; continue; }
      probe=(tests/functional/hybridep_probe.py 128 512 4)
      for variant in "" "USE_MNNVL=0" "HYBRID_EP_CACHE_DIR=/tmp/hep-cache" \
          "USE_MNNVL=0 NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=$NGPU"; do
        echo "== probe on $NGPU GPU(s): ${variant:-as is}" | tee -a "$OUT/hybridep_probe.log"
        env $variant timeout 120 torchrun --standalone --nproc_per_node "$NGPU" "${probe[@]}" 2>&1 | quiet \
          | grep -v '^\[default[1-9]' | tail -25 | tee -a "$OUT/hybridep_probe.log"
      done
      if command -v gdb >/dev/null; then
        echo "== one rank under gdb" | tee -a "$OUT/hybridep_probe.log"
        RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 \
          MASTER_PORT=29531 timeout 180 gdb -batch -ex run -ex bt -ex 'info sharedlibrary' \
          --args python3 "${probe[@]}" 2>&1 | grep -v '^\[New Thread\|^\[Thread' | tail -80 \
          | tee -a "$OUT/hybridep_probe.log"
      else
        echo "(no gdb on this machine: Python frames only, above)" | tee -a "$OUT/hybridep_probe.log"
      fi ;;
    bench-hybridep)
      have_deepep || { status=1; continue; }
      for p2p in 0 1; do
        label=nvlink; [ $p2p = 1 ] && label=no-p2p
        NCCL_P2P_DISABLE=$p2p timeout "${HYBRIDEP_BENCH_TIMEOUT:-300}" torchrun --standalone \
          --nproc_per_node "$NGPU" benchmarks/hybridep.py --label $label --out "$OUT" \
          ${HYBRIDEP_BENCH_ARGS:-} 2>&1 | quiet | tee -a "$OUT/bench_hybridep.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done ;;
    *) echo "unknown part $part"; status=2 ;;
  esac
  echo "== $part took $(( $(date +%s) - start )) s"
done
exit $status
