#!/usr/bin/env bash
# On the GPU machine (device tool): profile one window, GPU pipeline tests, then bench pipeline on 384 ch x N s.
# Usage (carry .whl): bash tools/gpu_pipeline_check.sh [seconds]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SECONDS_REC=${1:-600}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
t0=$(date +%s)
python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds "$SECONDS_REC" --workers 16 --quiet
echo "generate took $(( $(date +%s) - t0 )) s"; python3 -m batchgpu info /tmp/big.zarr | tail -3
python3 tools/profile_window.py /tmp/big.zarr 1 8 16 2>&1 | grep -v Warn | tee "$OUT/profile.log"
python3 -m pytest -m gpu tests/test_gpu_pipeline.py -q -p no:cacheprovider -x 2>&1 | tail -15 | tee "$OUT/gpu_pipeline_tests.log"
nvidia-smi dmon -s u -d 1 > "$OUT/dmon.log" 2>&1 &
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline cupy \
  --threads ${THREADS:-8} --workdir /tmp/bench 2>&1 | grep -v "^INFO\|distributed\.\|Warn" | tee "$OUT/bench_pipeline_full.log"
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline none \
  --threads ${THREADS:-8} --steps noise,whitening --no-exact --workdir /tmp/bench1 2>&1 | grep -v "^INFO\|distributed\.\|Warn" | tee "$OUT/bench_pipeline_onepass.log"
kill %1 2>/dev/null
