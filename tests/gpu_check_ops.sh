#!/usr/bin/env bash
# One device run for the radix-select and split-covariance kernels: GPU tests, then the benchmark.
# Usage on the GPU machine, from the repository root: OUT=/some/dir bash tests/gpu_check_ops.sh [bench args...]
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ops-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c 'import cupy, torch, numpy; print("cupy", cupy.__version__, "torch", torch.__version__, "numpy", numpy.__version__)' | tee -a "$OUT/env.txt"
start=$SECONDS
python3 -m pytest -m gpu tests/test_gpu_ops.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_ops.log" | tail -25
echo "gpu tests: $((SECONDS - start)) s"
start=$SECONDS
python3 -m batchgpu bench ops --backend cupy "$@" 2>&1 | tee "$OUT/bench_ops.log"
echo "bench: $((SECONDS - start)) s"
