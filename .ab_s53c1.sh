set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MH_TRITON_ONE_CONFIG=1 TRITON_F32_DEFAULT=ieee
nvidia-smi --query-gpu=name,memory.used --format=csv
date
timeout 180 torchrun --nproc_per_node 1 -m pytest -q -s -p no:cacheprovider tests/functional/test_fast_path_gpu.py -k "gather_sum or grouped" tests/functional/test_wgrad_fusion_gpu.py > $OUT/func.log 2>&1; echo "func rc $?"
date
timeout 200 torchrun --nproc_per_node 1 -m pytest -q -s -p no:cacheprovider tests/functional/test_cuda_graphs_gpu.py > $OUT/graphs.log 2>&1; echo "graphs rc $?"
date
timeout 150 python3 benchmarks/mfu.py --quick --packed --data documents --no-profile --runs star_e/fast-graphs star_e/fast plus_e/fast-graphs --out $OUT/bench > $OUT/bench.log 2>&1; echo "bench rc $?"
date
timeout 80 python3 benchmarks/mfu.py --quick --packed --data documents --runs star_e/fast-graphs --out $OUT/prof > $OUT/prof.log 2>&1; echo "prof rc $?"
date
tail -5 $OUT/func.log; tail -5 $OUT/graphs.log
grep -A8 "^| run" $OUT/bench/*.md | head -30
rm -rf $OUT/compile_cache*
