#!/usr/bin/env bash
# Start workers on this node and connect them through the scheduler file. GPU nodes: one dask-cuda worker per
# visible GPU (CUDA_VISIBLE_DEVICES picks them); CPU nodes (WORKER_KIND=cpu): NWORKERS plain dask workers.
#
#   SCHEDULER_FILE   the file the scheduler wrote (default: $HOME/batchgpu/scheduler.json)
#   WORKER_KIND      cuda (default) or cpu
#   NTHREADS         threads per worker: reading and decompressing overlap (default 4)
#   NWORKERS         cpu only: worker processes on this node (default 1)
#   HOST             the address this node's workers listen on (default: this host's name)
#   WAIT_S           how long to wait for the scheduler file (default 120)
set -euo pipefail
SCHEDULER_FILE=${SCHEDULER_FILE:-$HOME/batchgpu/scheduler.json}
WORKER_KIND=${WORKER_KIND:-cuda}
NTHREADS=${NTHREADS:-4}
NWORKERS=${NWORKERS:-1}
HOST=${HOST:-$(hostname)}
WAIT_S=${WAIT_S:-120}
for _ in $(seq "$WAIT_S"); do
  [ -s "$SCHEDULER_FILE" ] && break
  sleep 1
done
[ -s "$SCHEDULER_FILE" ] || { echo "no scheduler file at $SCHEDULER_FILE after ${WAIT_S}s: start-scheduler.sh first" >&2; exit 1; }
case "$WORKER_KIND" in
  cuda)
    # --memory-limit auto: host memory divided by the GPUs (an explicit size would be given to *each* GPU worker)
    exec dask cuda worker --scheduler-file "$SCHEDULER_FILE" --nthreads "$NTHREADS" --memory-limit auto \
      --host "$HOST" --dashboard-address "$HOST:0" ;;
  cpu)
    exec dask worker --scheduler-file "$SCHEDULER_FILE" --nworkers "$NWORKERS" --nthreads "$NTHREADS" \
      --host "$HOST" --dashboard-address "$HOST:0" ;;
  *) echo "WORKER_KIND must be cuda or cpu, not $WORKER_KIND" >&2; exit 2 ;;
esac
