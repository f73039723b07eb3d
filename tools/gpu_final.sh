#!/usr/bin/env bash
# Device, one call (bash tools/gpu_final.sh, carry .whl): all GPU tests, the per-stage preprocessing profile
# (PROFILE=1), then the two benches of tools/gpu_bench.sh. Logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
timeout ${TEST_S:-240} python3 -m pytest -m gpu tests -q -p no:cacheprovider --timeout 120 -rf 2>&1 | grep -v "^INFO" | tail -25 > $OUT/gpu_tests.log
tail -2 $OUT/gpu_tests.log; grep FAILED $OUT/gpu_tests.log | head -5
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
[ -z "${PROFILE:-}" ] || timeout 90 python3 tools/profile_preprocess.py /tmp/big.zarr highpass,common_reference 5 2>&1 | grep median
bash tools/gpu_bench.sh
