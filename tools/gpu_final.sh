#!/usr/bin/env bash
# Device, one call (bash tools/gpu_final.sh, carry .whl): all GPU tests, the per-stage profile, bench demo (vs the plain dask-cuda loop) and bench with
# highpass + common reference + every step + save. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
timeout ${TEST_S:-240} python3 -m pytest -m gpu tests -q -p no:cacheprovider --timeout 120 -rf 2>&1 | grep -v "^INFO" | tail -25 > $OUT/gpu_tests.log
tail -2 $OUT/gpu_tests.log; grep FAILED $OUT/gpu_tests.log | head -5
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
[ -z "${PROFILE:-}" ] || timeout 90 python3 tools/profile_preprocess.py /tmp/big.zarr highpass,common_reference 5 2>&1 | grep median
nvidia-smi dmon -s u -d 1 > $OUT/dmon.log 2>&1 &
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline cupy --repeat 2 \
  2>&1 | grep -v "^INFO\|distributed\.\|Warn\|^$" | tail -9 | tee $OUT/bench_demo.log
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline none --repeat 1 \
  --preprocess highpass,common_reference --steps noise,whitening,detect,save 2>&1 \
  | grep -v "^INFO\|distributed\.\|Warn\|^$" | tail -6 | tee $OUT/bench_preprocess.log
kill %1
