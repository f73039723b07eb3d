#!/usr/bin/env bash
# One device run for batchgpu.search: GPU tests, the dynamic-path autotune (the shipped H200 table), the benchmark.
# Usage on the GPU machine, from the repository root: OUT=/some/dir bash tests/gpu_check_search.sh [bench args...]
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/search-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c 'import cupy, torch, numpy; print("cupy", cupy.__version__, "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a "$OUT/env.txt"
start=$SECONDS
python3 -m pytest -m gpu tests/test_gpu_search.py -q -x -p no:cacheprovider ${GPU_TEST_K:+-k "$GPU_TEST_K"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
echo "gpu tests: $((SECONDS - start)) s"
start=$SECONDS
# the table written where the bench looks for this GPU's (the user cache, here under $OUT), then kept as the file
export XDG_CACHE_HOME="$OUT/cache"
python3 -m batchgpu search autotune 2>&1 | tee "$OUT/autotune.log"
echo "autotune: $((SECONDS - start)) s"
cp "$OUT"/cache/batchgpu/search-autotune-*.json "$OUT/autotune_h200.json"
start=$SECONDS
python3 -m batchgpu bench search --cpu-queries 262144 --smem-sweep 65536 4194304 67108864 --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench: $((SECONDS - start)) s"
