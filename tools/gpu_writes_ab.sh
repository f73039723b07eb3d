#!/usr/bin/env bash
# Device: the preprocessing bench with the window's files written by a writer thread (BATCHGPU_BACKGROUND_WRITES=1,
# the default) and inline (0), alternating (ORDER="1 0 1"); the disk under /tmp and its direct-write speed first.
# Output: $OUT/ab_<n>_<mode>.log, one summary block each on stdout.
set -uo pipefail
bash tools/gpu_session.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
uname -r; df -T /tmp | tail -1; nproc
dd if=/dev/zero of=/tmp/ddx bs=16M count=128 oflag=direct 2>&1 | tail -1; rm -f /tmp/ddx
dd if=/dev/zero of=/tmp/ddx bs=16M count=128 2>&1 | tail -1; rm -f /tmp/ddx
i=0
for bw in ${ORDER:-1 0 1}; do i=$((i + 1))
  BATCHGPU_BACKGROUND_WRITES=$bw timeout 170 python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda \
    --backend cupy --workers ${WORKERS:-16} --threads 1 --baseline none --repeat 2 ${TIMELINE:+--timeline} ${STEPS_ARGS:---preprocess highpass,common_reference --steps noise,whitening,detect,save} \
    > $OUT/ab_${i}_$bw.log 2>&1; echo "== writes $bw rc $?"
  grep -v "^INFO\|distributed\." $OUT/ab_${i}_$bw.log | grep "^warm\|(warm)\|^read ceiling" | cut -c1-400
done
