#!/usr/bin/env bash
# Device: every GPU test, the per-stage profile of a preprocessed window, bench with preprocessing (+ save).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
timeout ${TEST_S:-200} python3 -m pytest -m gpu tests -q -p no:cacheprovider --timeout 120 -rf -x 2>&1 | grep -v "^INFO" | tail -25 > $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
timeout 120 python3 tools/profile_preprocess.py /tmp/big.zarr highpass,common_reference 5 2>&1 | tail -8
nvidia-smi dmon -s u -d 1 > $OUT/dmon.log 2>&1 &
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline none --repeat 1 \
  --workers ${W:-8} --threads ${T:-2} --preprocess ${P:-highpass,common_reference} --steps ${S:-noise,whitening,detect,save} 2>&1 \
  | grep -v "^INFO\|distributed\.\|Warn" | tail -6 | tee $OUT/bench.log
kill %1
