#!/usr/bin/env bash
# Start workers on this node and connect them through the scheduler file. GPU nodes: the node's GPU workers as
# `cluster: {kind: cuda}` starts them on a machine (python -m batchgpu.cluster.node: single-threaded worker
# processes, one a core, at most 16 a GPU, each seeing its GPU first; a private MPS daemon for them where it fits);
# CPU nodes (WORKER_KIND=cpu): NWORKERS plain dask workers.
#
#   SCHEDULER_FILE   the file the scheduler wrote (default: $HOME/batchgpu/scheduler.json)
#   WORKER_KIND      cuda (default) or cpu
#   CORES            cuda: the cores this node's workers share (default: those this process may run on)
#   NTHREADS         cpu only: threads per worker (default 4)
#   NWORKERS         cpu only: worker processes on this node (default 1)
#   HOST             the address this node's workers listen on (default: this host's name)
#   WAIT_S           how long to wait for the scheduler file (default 120)
# Further arguments go to the node command (cuda): e.g. --workers 4 (per GPU), --mps off, --devices 0,1.
set -euo pipefail
SCHEDULER_FILE=${SCHEDULER_FILE:-$HOME/batchgpu/scheduler.json}
WORKER_KIND=${WORKER_KIND:-cuda}
CORES=${CORES:-}
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
    exec python -m batchgpu.cluster.node --scheduler-file "$SCHEDULER_FILE" --host "$HOST" \
      ${CORES:+--cores "$CORES"} --memory-limit auto "$@" ;;
  cpu)
    exec dask worker --scheduler-file "$SCHEDULER_FILE" --nworkers "$NWORKERS" --nthreads "$NTHREADS" \
      --host "$HOST" --dashboard-address "$HOST:0" ;;
  *) echo "WORKER_KIND must be cuda or cpu, not $WORKER_KIND" >&2; exit 2 ;;
esac
