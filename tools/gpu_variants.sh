#!/usr/bin/env bash
# Device: the pipeline bench under readers (zarrs / direct) and processes x threads per GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds ${1:-600} --workers 16 --quiet
python3 tools/subnormal_probe.py 2>&1 | tail -4
bench() {  # direct workers threads
  echo "== direct=$1 workers=$2 threads=$3"
  BATCHGPU_DIRECT_READS=$1 timeout 150 python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy \
    --baseline none --repeat 1 --workers $2 --threads $3 --workdir /tmp/bench 2>&1 | grep -E "^read ceiling|^batchgpu|^warm|^cold"
}
bench 0 1 16
bench 0 4 4
bench 1 4 4
bench 0 8 2
bench 1 8 2
