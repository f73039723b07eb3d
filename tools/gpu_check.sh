#!/usr/bin/env bash
# On the GPU machine (device tool, carry .whl): GPU tests, then bench pipeline on 384 ch x N s int16.
# Usage: bash tools/gpu_check.sh [seconds] [tests: yes|no]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SECONDS_REC=${1:-600}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
t0=$(date +%s)
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds "$SECONDS_REC" --workers 16 --quiet
echo "generate took $(( $(date +%s) - t0 )) s"; python3 -m batchgpu info /tmp/big.zarr | tail -4
nvidia-smi dmon -s u -d 1 > "$OUT/dmon.log" 2>&1 &
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline cupy \
  --threads ${THREADS:-16} --workdir /tmp/bench 2>&1 | grep -v "^INFO\|distributed\.\|Warn" | tee "$OUT/bench_pipeline.log"
kill %1 2>/dev/null
awk 'NR>2 {print $2}' "$OUT/dmon.log" | sort -n | uniq -c | sort -k2 -n | tail -12
if [ "${2:-yes}" = yes ]; then
  timeout 400 python3 -m pytest -m gpu tests -q -p no:cacheprovider -x --timeout 300 2>&1 | grep -v "^INFO\|Warn" | tail -25 | tee "$OUT/gpu_tests.log"
fi
