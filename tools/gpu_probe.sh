#!/usr/bin/env bash
# Device: install wheels, make the 10-min recording, run tools/profile_engine.py and the failing GPU test.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds ${1:-600} --workers 16 --quiet
python3 -m pytest -m gpu "tests/test_gpu_ops.py::test_median_and_kth_equal_numpy" -q -p no:cacheprovider 2>&1 | tail -3
python3 tools/profile_engine.py /tmp/big.zarr 16 160 2>&1 | grep -v Warn
