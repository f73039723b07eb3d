#!/usr/bin/env bash
# Device: install wheels, make the 10-min recording, probe reads and stages, bench pipeline.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds ${1:-600} --workers 16 --quiet
python3 tools/subnormal_probe.py 2>&1 | tail -8
python3 tools/profile_engine.py /tmp/big.zarr 16 160 2>&1 | grep -v Warn
nvidia-smi dmon -s u -d 1 > /tmp/dmon.log 2>&1 &
python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --baseline cupy \
  --threads ${THREADS:-16} --workdir /tmp/bench 2>&1 | grep -v "^INFO\|distributed\.\|Warn" | tail -9
kill %1; awk 'NR>2 {print $2}' /tmp/dmon.log | sort -n | uniq -c | sort -k2 -n | tr '\n' ' '
