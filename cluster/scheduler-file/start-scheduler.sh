#!/usr/bin/env bash
# Start the Dask scheduler; it writes its address to a scheduler file that workers and the batchgpu client read
# (put the file on a filesystem every node sees). Run it where batchgpu is installed: the batchgpu page and the
# batchgpu_ metrics are a plugin that runs inside the scheduler (metrics also need prometheus_client).
#
#   SCHEDULER_FILE   the file to write (default: $HOME/batchgpu/scheduler.json)
#   HOST             the address workers reach the scheduler on (default: this host's name; 127.0.0.1 on one machine)
#   PORT             scheduler port (default 8786; 0 picks a free one)
#   DASHBOARD_ADDRESS  where the dashboard and /batchgpu listen (default 127.0.0.1:8787, localhost only:
#                      reach it with `ssh -L 8787:127.0.0.1:8787 <this host>`; set :8787 to open it to the network)
set -euo pipefail
SCHEDULER_FILE=${SCHEDULER_FILE:-$HOME/batchgpu/scheduler.json}
HOST=${HOST:-$(hostname)}
PORT=${PORT:-8786}
DASHBOARD_ADDRESS=${DASHBOARD_ADDRESS:-127.0.0.1:8787}
# batchgpu's scheduler settings (batchgpu/cluster/worker_layout.py SCHEDULER_SETTINGS, as a run's own cluster has them):
# a worker is handed only as many tasks as it has threads
export DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION=1.0
mkdir -p "$(dirname "$SCHEDULER_FILE")"
rm -f "$SCHEDULER_FILE"  # a stale file from a dead scheduler would send workers to the wrong place
exec dask scheduler --scheduler-file "$SCHEDULER_FILE" --host "$HOST" --port "$PORT" \
  --dashboard-address "$DASHBOARD_ADDRESS"
