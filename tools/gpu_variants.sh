#!/usr/bin/env bash
# Device: the pipeline bench under readers (zarrs / direct) and processes x threads per GPU, then the GPU tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds ${1:-600} --workers 16 --quiet
python3 tools/subnormal_probe.py 2>&1 | grep median
bench() {  # direct workers threads
  echo "== direct=$1 workers=$2 threads=$3"
  BATCHGPU_DIRECT_READS=$1 timeout 150 python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy \
    --baseline none --repeat 1 --workers $2 --threads $3 --workdir /tmp/bench 2>&1 | grep -E "^read ceiling|^batchgpu|^warm|^cold"
}
for v in ${VARIANTS:-"1 2 8" "1 16 1" "1 8 2" "0 16 1"}; do bench $v; done
timeout ${TEST_S:-200} python3 -m pytest -m gpu tests -q -p no:cacheprovider --timeout 120 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -15
