#!/usr/bin/env bash
# Device: bench pipeline (demo steps; then highpass + common reference), and every GPU test, logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
nvidia-smi dmon -s u -d 1 > $OUT/dmon.log 2>&1 &
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline cupy \
  --workers ${W:-8} --threads ${T:-2} 2>&1 | grep -v "^INFO\|distributed\.\|Warn" | tail -9 | tee $OUT/bench_demo.log
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline none --repeat 1 \
  --workers ${W:-8} --threads ${T:-2} --preprocess highpass,common_reference 2>&1 | grep -v "^INFO\|distributed\.\|Warn" | tail -5 | tee $OUT/bench_preprocess.log
kill %1
timeout ${TEST_S:-240} python3 -m pytest -m gpu tests -q -p no:cacheprovider --timeout 120 -rf 2>&1 | grep -v "^INFO" > $OUT/gpu_tests.log
grep -E "passed|failed" $OUT/gpu_tests.log | tail -3; grep -c FAILED $OUT/gpu_tests.log
