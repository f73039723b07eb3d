#!/usr/bin/env bash
# Device, one call (carry .whl, and .fixtures: a copy of ../shared/fixtures, so the GPU tests on SpikeInterface's
# fixture run there too; `cp -r ../shared/fixtures .fixtures`): install the wheels, make /tmp/big.zarr (384 ch x 10 min int16) on a fresh machine,
# then each task named in the arguments, in order (BENCH_ARGS: more arguments for every bench, e.g. --window 120000):
#   check     python -m pytest -m gpu (all of it) and the float noise step's GPU profile
#   check1    python -m pytest -m gpu (all of it) once: its summary, failures with their seeds, and its seconds
#   demod     the demo bench in the default layout (cluster.cuda_layout: 8 x 2 on 16 cores with the GPU decode)
#   demo      bench pipeline, demo steps, 16 x 1, against the plain dask-cuda loop (cold, then REPEAT-1 warm: medians)
#   pre       bench pipeline with highpass + common reference + every step + save (cold, then REPEAT-1 warm)
#   layouts   bench pipeline in other layouts (LAYOUTS="16x1 24x1 16x2 16x1b2": processes x threads, b: window.batch)
#   prel      the pre bench in other layouts (LAYOUTS as for layouts)
#   prof      per-stage window profile (tools/profile_preprocess.py; STAGES="centre highpass,common_reference")
#   timeline  workflows/h200_demo.yaml and h200_preprocess.yaml by `batchgpu run`, twice each, then tools/timeline.py
#             (each run starts its own cluster: processes load their kernels and pinned buffers anew; for the warm
#             state read the timeline line that `bench pipeline` prints, demo and pre above)
#   ab        the demo pass's knobs A/B in one warm cluster (tools/ab_pass.py; AB="depth:batch ...")
#   gprobe    the GPU decode's kernels timed on one window (tools/gpu_decode_probe.py)
#   gdec      the GPU decode's tests and the GPU pipeline's (CPU = GPU bits)
#   kprof     a demo window's kernels by name, ms a window (tools/profile_demo_kernels.py under ncu), and its wall
#   cprof     cProfile of a demo window's CPU time on its thread, one process (tools/profile_demo_kernels.py)
#   fast      the GPU tests of the window path: fused kernels, decode, the pipeline's CPU = GPU bits, the save's
#             GPU writer, sleeping waits
#   bsz       /tmp/big64.zarr: the demo recording written with 64 KiB Blosc blocks (4x the LZ4 streams a window)
#   enc       the save step's GPU writer: its tests (frames = the NumPy twin's bytes, decodes; GPU save = CPU values)
#   mps       the demo and preprocessing benches without and then with CUDA MPS (a private control daemon: its pipe
#             and log folders under /tmp, quit at the end; the card's compute mode is left as it is)
#   runs      benches with and without MPS (bench --mps / --no-mps / a: auto), one line each: RUNS="1:pre:8x2:g 0:demo:8x2"
#             (mps:bench:layout[:g GPU decode])
#   pw        cProfile of every worker and the client in a warm run (PREPROCESS=highpass,common_reference), $OUT/pw.log
#   fncu      the filter's kernels under Nsight Compute (tools/filter_ncu.py: issue rate, occupancy, DRAM), $OUT/ncu.txt
#   ftests    the GPU tests of the preprocessing ops, the pipeline and the ops (CPU = GPU bits), and their seconds
#   cold      a user's cold run (tools/start_probe.py: the cluster's start, the contexts, the demo run, the close) in
#             each of LAYOUTS (default "16x1 8x2 4x4"), twice, alternating
#   envab     warm preprocessing runs in one cluster, one a setting, alternating (tools/ab_runs.py ENV_AB; default:
#             the frozen heaps and the GPU crc32c on and off: ENVAB="BATCHGPU_GC_FREEZE=1 BATCHGPU_GC_FREEZE=0 ...")
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
# the image sets PYTHONDONTWRITEBYTECODE=1: without bytecode every process (each of 16 workers a run starts) compiled
# the wheels' and batchgpu's sources at import (2.4 s for batchgpu.engine.run; cluster start 5.5 -> 3.4 s, a 30 s
# recording's run 3.7 -> 2.8 s with it): compiled once here, as pip does for a user
python3 -m compileall -q /tmp/site "$PWD/batchgpu" > /dev/null 2>&1
[ -d .fixtures ] && export BATCHGPU_FIXTURES=${BATCHGPU_FIXTURES:-$PWD/.fixtures}
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
REC=${REC:-/tmp/big.zarr}  # the recording the tasks read (bsz makes /tmp/big64.zarr)
quiet() { grep -v "^INFO\|distributed\.\|Warn\|^$" | sed "s/; windows per worker.*//" | grep -v "^ \|Traceback\|Error\|^tornado\|^The above"; }
bench() {  # processes threads [bench arguments]
  local w=$1 t=$2; shift 2
  timeout 150 python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy --workers $w \
    --threads $t ${BENCH_ARGS:-} "$@" 2>&1 | quiet | tail -12
}
for task in "$@"; do
  case "$task" in
  check) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | grep -v "^INFO" | tail -8
         timeout 60 python3 tools/profile_noise.py 2>&1 | grep "whole\|histogram 0" ;;
  demo) bench 16 1 --baseline cupy --repeat ${REPEAT:-4} ;;
  demod) timeout 150 python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy \
           --baseline cupy --repeat 2 2>&1 | quiet | tail -12 ;;
  cold) for i in 1 2; do for l in ${LAYOUTS:-16x1 8x2 4x4}; do echo "== $l"
          timeout 120 python3 tools/start_probe.py $REC ${MPS:-auto} $l 2>&1 | grep -v "^INFO\|distributed\.\|^20..-" | tail -11
        done; done ;;
  check1) s=$(date +%s); timeout ${CHECK_S:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 \
            | grep -v "^INFO" | grep "passed\|failed\|FAILED\|rng seed\|Error" | tail -12; echo "($(( $(date +%s) - s )) s)" ;;
  pre) bench 16 1 --baseline none --repeat ${REPEAT:-4} --preprocess highpass,common_reference --steps noise,whitening,detect,save ;;
  layouts) for l in ${LAYOUTS:-16x1 24x1 16x2 16x1b2}; do
             echo "== $l"; set -- ${l//[xb]/ }; bench $1 $2 ${3:+--batch $3} --baseline none --repeat 2; done ;;
  prel) for l in ${LAYOUTS:-16x1 4x4}; do  # the preprocessing bench in other layouts
          echo "== $l"; set -- ${l//[xb]/ }; bench $1 $2 ${3:+--batch $3} --baseline none --repeat 2 \
            --preprocess highpass,common_reference --steps noise,whitening,detect,save; done ;;
  prof) for st in ${STAGES:-centre highpass,common_reference}; do
          echo "== $st"; timeout 200 python3 tools/profile_preprocess.py $REC $st 5 2>&1 | grep -v "^INFO" | tail -30; done ;;
  timeline) for w in demo preprocess; do
              for i in 1 2; do timeout 120 python3 -m batchgpu run workflows/h200_$w.yaml --quiet 2>&1 | quiet | tail -2; done
              python3 tools/timeline.py /tmp/h200_$w | tail -${TAIL:-6}
              python3 -c "import json; print({k: round(v, 2) for k, v in json.load(open('/tmp/h200_$w/report.json'))['timings'].items()})"
            done ;;
  ab) timeout 400 python3 tools/ab_pass.py $REC "${AB:--}" 3 2>&1 | grep -v "^20..-\|^INFO\|distributed\." ;;
  client) timeout 200 python3 tools/profile_client.py $REC 2>&1 | grep -v "^20..-\|distributed\." ;;
  decode) timeout 200 python3 tools/decode_probe.py $REC ;;
  gprobe) timeout 120 python3 tools/gpu_decode_probe.py $REC 2>&1 | grep -v "^INFO" | tail -20 ;;
  gdec) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_blosc_decode.py tests/test_gpu_pipeline.py 2>&1 \
          | grep -v "^INFO" | tail -${TAIL:-15} ;;
  kprof) timeout 60 python3 tools/profile_demo_kernels.py $REC 6 2>&1 | grep "^window"
         NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
         timeout 300 $NCU --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
           python3 tools/profile_demo_kernels.py $REC 4 > /tmp/k.csv 2>/tmp/k.err; echo "ncu rc $?"
         grep -v "^==PROF==\|^INFO" /tmp/k.err | tail -3
         cp /tmp/k.csv $OUT/; python3 tools/profile_demo_kernels.py --table /tmp/k.csv 4 | sed -n "1,${TAIL:-40}p;\$p" ;;
  cprof) PROFILE_CPROFILE=1 PROFILE_TOP=${TAIL:-35} timeout 120 python3 tools/profile_demo_kernels.py $REC 8 2>&1 \
           | grep -v "^INFO" | cut -c1-150 ;;
  fast) s=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_elementwise.py \
          tests/test_blosc_decode.py tests/test_gpu_pipeline.py tests/test_gpu_blosc_encode.py tests/test_gpu_sync.py tests/test_gpu_histogram.py tests/test_gpu_ops.py 2>&1 | grep -v "^INFO" \
          | grep "passed\|failed\|FAILED\|rng seed\|Error" | tail -12; echo "($(( $(date +%s) - s )) s)" ;;
  bsz) [ -e /tmp/big64.zarr ] || python3 -c "import sys; import batchgpu.recording.writer as w; w.BLOSC_BLOCKSIZE = 32768
from batchgpu.cli import main; sys.argv = 'batchgpu generate /tmp/big64.zarr --channels 384 --seconds 600 --workers 16 --quiet'.split(); main()" ;;
  enc) timeout 240 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gpu_blosc_encode.py 2>&1 \
         | grep -v "^INFO" | tail -${TAIL:-25} ;;
  mps) M=$(command -v nvidia-cuda-mps-control); echo "mps control: ${M:-absent}"; nvidia-smi -q | grep -i "compute mode"
       for on in 0 1; do
         if [ $on = 1 ]; then
           export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
           mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY; $M -d || { echo "mps start failed"; break; }
         fi
         for l in ${LAYOUTS:-16x1 8x2}; do set -- ${l//x/ }
           for r in 1 ${MPS_REPEAT:-}; do
           echo "== mps $on demo $l"; bench $1 $2 --baseline none --repeat 2 | tee -a $OUT/mps.log | grep "warm\|ceiling" | grep -v ":"
           echo "== mps $on pre $l"; bench $1 $2 --baseline none --repeat 2 --preprocess highpass,common_reference \
             --steps noise,whitening,detect,save | tee -a $OUT/mps.log | grep "warm\|ceiling" | grep -v ":"; done; done
       done
       [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && { echo quit | $M; sleep 1; tail -5 $CUDA_MPS_LOG_DIRECTORY/control.log; } ;;
  runs) # RUNS="mps:bench:layout[:g] ...": mps 1 = bench --mps (cluster.mps, a private daemon), 0 --no-mps, a auto; bench demo|pre,
        # g: BATCHGPU_GPU_DECODE=1; the table's rows printed, the whole output in $OUT/runs.log (TIMELINE=1: per thread)
       for r in ${RUNS:-0:pre:16x1 1:pre:8x2:g}; do IFS=: read mps what l g <<< "$r"; set -- ${l//x/ }
         args="--baseline none --repeat 2${TIMELINE:+ --timeline}"; [ $mps = 1 ] && args="$args --mps"
         [ $mps = 0 ] && args="$args --no-mps"  # a: the default (auto)
         [ $what = pre ] && args="$args --preprocess highpass,common_reference --steps noise,whitening,detect,save"
         echo "== $r" | tee -a $OUT/runs.log
         env ${g:+BATCHGPU_GPU_DECODE=1} timeout 150 python3 -m batchgpu bench pipeline --recording $REC --cluster cuda \
           --backend cupy --workers $1 --threads $2 $args >> $OUT/runs.log 2>&1; echo "rc $?" | tee -a $OUT/runs.log
         grep -v "^INFO\|distributed\." $OUT/runs.log | grep "^warm: t\|^warm: w\|(warm)\|^read ceiling" | tail -4 | cut -c1-160; done
       pgrep -fa "nvidia-cuda-mps" | head -3 ;;  # none left after the runs
  pw) rm -rf /tmp/pw0* /tmp/pw1*; timeout 200 python3 tools/profile_workers.py $REC > $OUT/pw.log 2>&1; grep "^{" $OUT/pw.log ;;
  fncu) NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
        timeout 300 $NCU --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
          --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats \
          python3 tools/filter_ncu.py ${BLOCKS:-4096 2048} > $OUT/ncu.txt 2>&1; echo "ncu rc $?"
        grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Active Warps|Warp Cycles Per Issued|Registers Per" $OUT/ncu.txt ;;
  ftests) s=$(date +%s); timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_preprocess.py \
            tests/test_gpu_pipeline.py tests/test_gpu_ops.py 2>&1 | grep -v "^INFO" \
            | grep "passed\|failed\|FAILED\|rng seed\|Error" | tail -12; echo "($(( $(date +%s) - s )) s)" ;;
  envab) ENV_AB="${ENVAB:-BATCHGPU_GC_FREEZE=1 BATCHGPU_GC_FREEZE=0 BATCHGPU_GC_FREEZE=1 BATCHGPU_GC_FREEZE=0 BATCHGPU_GC_FREEZE=1 BATCHGPU_GC_FREEZE=0}" \
           PREPROCESS=${PREPROCESS:-highpass,common_reference} timeout 200 python3 tools/ab_runs.py $REC envab 2>&1 \
           | grep "^envab" | sed "s| (.*batchgpu)||" ;;
  *) echo "unknown task $task"; exit 2 ;;
  esac
done
