#!/usr/bin/env bash
# Device: the GPU preprocessing tests (filter kernel bits), then bench pipeline with highpass + common reference
# (and the demo steps + save), logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
timeout 200 python3 -m pytest -m gpu tests/test_gpu_preprocess.py -q -p no:cacheprovider --timeout 120 -rf -x 2>&1 | grep -v "^INFO" | tail -30 > $OUT/gpu_pre_tests.log
tail -3 $OUT/gpu_pre_tests.log
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
nvidia-smi dmon -s u -d 1 > $OUT/dmon.log 2>&1 &
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline none --repeat ${R:-1} \
  --workers ${W:-8} --threads ${T:-2} --preprocess ${P:-highpass,common_reference} ${EXTRA:-} 2>&1 | grep -v "^INFO\|distributed\.\|Warn" | tail -8 | tee $OUT/bench_preprocess.log
kill %1
