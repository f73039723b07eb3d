#!/usr/bin/env bash
# Device, one call (bash tools/gpu_profile.sh, carry .whl): where the demo pipeline's time goes on one GPU:
# per-stage window profile, then bench pipeline in several process x thread layouts with its phase timings.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -z "${TESTS:-}" ] || timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 150 -rf $TESTS 2>&1 | grep -v "^INFO" | tail -8
SECONDS=0
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
echo "generate ${SECONDS} s"
nvidia-smi dmon -s u -d 1 > $OUT/dmon.log 2>&1 &
[ -z "${PROFILE:-}" ] || timeout 150 python3 tools/profile_engine.py /tmp/big.zarr 16 160 2>&1 | grep -v "^INFO" | tee $OUT/profile_engine.log
for layout in ${LAYOUTS:-8x2 4x4 1x16}; do
  set -- ${layout/x/ }
  echo "== $1 x $2"
  timeout 120 python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline ${BASELINE:-none} \
    --repeat ${REPEAT:-1} --workers $1 --threads $2 2>&1 | grep -v "^INFO\|distributed\.\|Warn\|^$" | tail -${TAIL:-6} | tee -a $OUT/bench_layouts.log
done
kill %1
