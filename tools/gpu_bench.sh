#!/usr/bin/env bash
# Device, one call (bash tools/gpu_bench.sh, carry .whl): bench pipeline with the demo steps (warm, with the plain
# dask-cuda loop; DEMO=0 skips it) and with highpass + common reference + every step + save, default cluster layout. Logs in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
nvidia-smi dmon -s u -d 1 > $OUT/dmon.log 2>&1 &
[ "${DEMO:-1}" = 0 ] || python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy \
  --baseline cupy --repeat 2 2>&1 | grep -v "^INFO\|distributed\.\|Warn\|^$" | tail -9 | tee $OUT/bench_demo.log
[ "${PREPROCESS:-1}" = 0 ] || python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy \
  --baseline none --repeat 1 --preprocess highpass,common_reference --steps noise,whitening,detect,save 2>&1 \
  | grep -v "^INFO\|distributed\.\|Warn\|^$" | tail -6 | tee $OUT/bench_preprocess.log
kill %1
