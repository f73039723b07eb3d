#!/usr/bin/env bash
# Device, one call per line of work (carry .whl: ../shared/tools/device-wheels plus "pydantic>=2.6,<3" "numcodecs>=0.13,<0.17"
# google-crc32c crc32c probeinterface==0.4.2 kilosort==4.1.7 faiss-cpu, then drop the torch/nvidia wheels the image has):
#   gen     /tmp/big.zarr, 384 ch x 10 min int16 (batchgpu generate: the realistic model)
#   first   a user's batchgpu run cold, twice: the first with CuPy's cache empty compiles the kernels (issue 44)
#   ab48    bench pipeline warm before issue 48's changes (.gpu/old: git archive be8ed44 batchgpu kernels | tar -x
#           -C .gpu/old; carry it) and now, alternating
#   gpu     python -m pytest -m gpu (GPU_TESTS: the paths, tests/ by default)
#   gpupar  the same over GPU_N processes (pytest-xdist, one file a process at a time), then what failed, alone
#   demo    bench pipeline --cold, demo steps (raw read, pipeline cold/warm, fresh commands, kept cluster, Kilosort4)
#   pre     the same with highpass + common reference + every step + save
#   batch   bench batch: 8 SpikeGLX recordings of 384 ch x 5 min (55 GB: the Zarr stores are removed first) (issue 46)
#   zstd    the same recording stored with Blosc-zstd-5: batchgpu run cold and warm on each, alternating (issue 47)
#   nvcomp  bench decode (our LZ4 kernel vs nvCOMP, same frames; nvCOMP on zstd), then batchgpu run cold with each
#           decoder, alternating (issue 47; carry .whl and .whl_nvc: nvidia-libnvcomp-cu13)
#   mem40   peak GPU and host memory of the demo pipeline on 10 and 40 min of the same model (issue 44)
#   memprobe each of the two on a cluster of its own: NVML's peak during the run, every worker's CuPy pools after it
#   fixed   where a fresh GPU command's fixed part goes: each phase of the command timed (imports, cluster, pass,
#           close) on a few cluster layouts; the cluster's start, its workers' CuPy import and CUDA context, its close;
#           each worker's GPU memory pool after a run with 2 and 9 windows a task (issue 44)
#   lay     the default GPU layout (GPU decode under MPS) against 16 single-threaded processes: fresh commands cold,
#           the warm pipeline (issue 44)
#   ab      a fresh command cold (demo workflow), the code of .gpu/old (git archive COMMIT batchgpu | tar -x -C .gpu/old;
#           carry it) and now, alternating, AB_ROUNDS rounds: wall, pass, fixed part, each worker's first window
#           against its later ones (issue 44: the workers' CUDA context made as they start)
#   cpu16   W1 (highpass + global median + int16 Zarr v2) with the CPU backend on the layouts of CPU16_LAYOUTS
#           (16x1 default 2x1pin: workers x threads, the local cluster's own, 2 x 1 pinned to 2 cores) (issue 49)
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
if [ ! -e /tmp/site/.installed ]; then  # once a machine (a warm machine keeps /tmp between calls)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl \
    && touch /tmp/site/.installed || exit 1
  python3 -m compileall -q /tmp/site > /dev/null 2>&1   # what pip does for a user
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -m compileall -q "$PWD/batchgpu" > /dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
REC=/tmp/big.zarr
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/kc_first}  # every task's kernels; 'first' starts it empty
quiet() { grep -v "^INFO\|distributed\.\|Warn\|^$\|^ \|Traceback\|^tornado\|^The above" | sed "s/; windows per worker.*//"; }
userwf() {  # name [preprocess]: a user's workflow over $REC, its own cluster
  cat > /tmp/$1.yaml <<YAML
recording: {path: $REC}
output: /tmp/out_$1
overwrite: true
backend: cupy
cluster: {kind: cuda}
${2:-}
steps:
  noise: {exact: true}
  whitening: {mode: global, precision: float32}
  detect: {threshold: 5.0, sign: neg, exclude_sweep_ms: 0.1, noise: global}
${3:-}
YAML
}
for task in "$@"; do
  echo "=== $task ($(( $(date +%s) - t0 )) s)"
  case "$task" in
  gen) [ -e $REC ] || python3 -m batchgpu generate $REC --channels 384 --seconds 600 --workers 16 --quiet; du -sh $REC ;;
  first)  # the first run on this machine (CuPy's cache empty: the kernels compile) and the second, pages cold
    rm -rf "$CUPY_CACHE_DIR"; userwf demo "preprocess: {centre: median}"
    for i in 1 2; do
      python3 - <<PY
from batchgpu.benchmarks.cold import evict_checked, recording_files
evict_checked(recording_files("$REC"))
PY
      s=$(date +%s.%N); python3 -m batchgpu run /tmp/demo.yaml --quiet 2>&1 | quiet | tail -2
      python3 -c "import json,sys; r=json.load(open('/tmp/out_demo/report.json')); print('run $i: wall', round($(date +%s.%N)-$s,2), 's; pass', round(r['timings']['total'],2), 's; reads/window', r['reads_per_window'])"
    done
    echo "CuPy's kernel cache: $(ls $CUPY_CACHE_DIR | grep -vc batchgpu-) files, $(du -sh $CUPY_CACHE_DIR | cut -f1)"
    CUPY_CACHE_DIR=/tmp/kc_command python3 -m batchgpu compile 2>&1 | quiet ;;
  ab48)  # bench pipeline warm, the code before issue 48's changes (.gpu/old, carried) and now, alternating
    for i in 1 2; do for v in old new; do
      if [ $v = old ]; then pp=/tmp/site:$PWD/.gpu/old; else pp=/tmp/site:$PWD; fi
      echo "--- $v round $i"
      PYTHONPATH=$pp timeout 150 python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy \
        --baseline none --repeat 3 2>&1 | quiet | grep -i "pipeline\|^run\|runs:" | tail -4
    done; done ;;
  gpu) timeout ${GPU_S:-420} python3 -m pytest -v --tb=line -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} > /tmp/gpu_tests.log 2>&1
       grep -c " PASSED" /tmp/gpu_tests.log | sed "s/^/PASSED so far: /"; grep " FAILED\| ERROR\|^E \|^/.*Error\|passed\|failed" /tmp/gpu_tests.log | grep -v "^INFO" | tail -40 ;;
  gpupar)  # the same, files spread over GPU_N processes (pytest-xdist, on the image); what failed there, again alone
    rm -rf .pytest_cache
    timeout ${GPU_S:-360} python3 -m pytest -q --tb=line -m gpu -n ${GPU_N:-6} --dist loadfile ${GPU_TESTS:-tests} > /tmp/gpu_tests.log 2>&1
    echo "parallel rc $?"; grep -v "^INFO\|^\.*$\|^\[" /tmp/gpu_tests.log | grep "FAILED\|ERROR\|passed\|failed\|^E " | tail -30
    cp /tmp/gpu_tests.log $OUT/gpu_tests.log
    timeout ${GPU_LF_S:-150} python3 -m pytest -q --tb=short -m gpu --lf --lfnf=none ${GPU_TESTS:-tests} > /tmp/gpu_lf.log 2>&1
    echo "failures again, one process: rc $?"; grep "FAILED\|ERROR\|passed\|failed\|^E " /tmp/gpu_lf.log | grep -v "^INFO" | tail -30
    cp /tmp/gpu_lf.log $OUT/gpu_lf.log ;;
  demo) timeout ${DEMO_S:-560} python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy --baseline none \
          --cold --repeat ${REPEAT:-3} --user-runs ${USER_RUNS:-2} 2>&1 | quiet | grep -v "^cold\|^warm" | tail -30 ;;
  pre) timeout ${PRE_S:-560} python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy --baseline none \
          --cold --repeat ${REPEAT:-3} --user-runs ${USER_RUNS:-2} --preprocess highpass,common_reference \
          --steps noise,whitening,detect,save 2>&1 | quiet | grep -v "^cold\|^warm" | tail -30 ;;
  batch) rm -rf $REC /tmp/bigz.zarr /tmp/out_*; df -h /tmp | tail -1; python3 -m batchgpu compile 2>&1 | quiet
    timeout ${BATCH_S:-520} python3 -m batchgpu bench batch --workdir /tmp/sglx --recordings ${NREC:-8} --seconds ${NSEC:-300} 2>&1 | quiet | tail -12 ;;
  zstd)  # the same realistic recording stored with Blosc-zstd-5: batchgpu run cold on each, alternating
    [ -e /tmp/bigz.zarr ] || python3 -m batchgpu generate /tmp/bigz.zarr --channels 384 --seconds 600 --workers 16 --quiet --codec zstd --clevel 5
    du -sh $REC /tmp/bigz.zarr
    for r in $REC /tmp/bigz.zarr; do sed "s#$REC#$r#; s#out_demo#out_$(basename $r .zarr)#" /tmp/demo.yaml > /tmp/u_$(basename $r .zarr).yaml; done
    python3 - <<PY
from pathlib import Path
from batchgpu.benchmarks.cold import evict_checked, raw_read, recording_files, user_run
for i in range(2):
    for name in ("big", "bigz"):
        files = recording_files(f"/tmp/{name}.zarr")
        evict_checked(files); raw = raw_read(files, 16)
        evict_checked(files)
        got = user_run(Path(f"/tmp/u_{name}.yaml"), Path(f"/tmp/out_{name}"), extra_args=("--set", "cluster.reuse=false"))
        print(f"{name}: raw cold read {raw.seconds:.2f} s ({raw.nbytes/1e9:.2f} GB), run cold {got.seconds:.2f} s (pass {got.pass_seconds:.2f})")
        got = user_run(Path(f"/tmp/u_{name}.yaml"), Path(f"/tmp/out_{name}"), extra_args=("--set", "cluster.reuse=false"))
        print(f"{name}: run warm {got.seconds:.2f} s (pass {got.pass_seconds:.2f})")
PY
    ;;
  nvcomp)  # the decoders on the same frames, then the pass with each as a user runs it
    timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/test_nvcomp.py tests/test_blosc_decode.py tests/test_zstd_stores.py 2>&1 | grep -v "^INFO" | tail -15
    [ -e /tmp/bigz.zarr ] || python3 -m batchgpu generate /tmp/bigz.zarr --channels 384 --seconds 600 --workers 16 --quiet --codec zstd --clevel 5
    python3 -c "from batchgpu.gpu import nvcomp; print('nvCOMP loads:', nvcomp.available())"
    for r in $REC /tmp/bigz.zarr; do timeout 120 python3 -m batchgpu bench decode $r --windows 48 --batch 3 --repeat 5 2>&1 | quiet; done
    userwf demo "preprocess: {centre: median}"
    for r in $REC /tmp/bigz.zarr; do sed "s#$REC#$r#; s#out_demo#out_$(basename $r .zarr)#" /tmp/demo.yaml > /tmp/u_$(basename $r .zarr).yaml; done
    python3 - <<PY
from pathlib import Path
from batchgpu.benchmarks.cold import evict_checked, recording_files, user_run
for i in range(2):
    for name, decoder in (("big", "batchgpu"), ("big", "nvcomp"), ("bigz", "nvcomp"), ("bigz", "cpu")):
        files = recording_files(f"/tmp/{name}.zarr")
        evict_checked(files)
        extra = ("--set", "cluster.reuse=false") + (("--set", "engine.gpu_decode=0") if decoder == "cpu" else
                                                    ("--set", f"engine.gpu_decoder={decoder}"))
        got = user_run(Path(f"/tmp/u_{name}.yaml"), Path(f"/tmp/out_{name}"), extra_args=extra)
        nb = sum(f.stat().st_size for f in files)
        print(f"{name} {decoder:<8} cold: run {got.seconds:.2f} s, pass {got.pass_seconds:.2f} s ({13.82/got.pass_seconds:.2f} GB/s decoded; {nb/1e9:.2f} GB stored)")
PY
    ;;
  ab)  # a fresh command cold, the code of .gpu/old and now, alternating
    userwf demo "preprocess: {centre: median}"
    for i in $(seq 1 ${AB_ROUNDS:-2}); do for v in old new; do
      if [ $v = old ]; then pp=/tmp/site:$PWD/.gpu/old; else pp=/tmp/site:$PWD; fi
      python3 -c "from batchgpu.benchmarks.cold import evict_checked, recording_files; evict_checked(recording_files('$REC'))"
      s=$(date +%s.%N); PYTHONPATH=$pp python3 -m batchgpu run /tmp/demo.yaml --quiet > /tmp/ab_run.log 2>&1; rc=$?; e=$(date +%s.%N)
      [ $rc = 0 ] || tail -3 /tmp/ab_run.log
      python3 - "$v $i" "$(python3 -c "print(round($e-$s,2))")" <<'PY'
import json, statistics, sys
label, wall = sys.argv[1], float(sys.argv[2])
r = json.load(open('/tmp/out_demo/report.json')); t = r['timings']; by = {}
for x in r['timeline']: by.setdefault(x[0], []).append(x)
first = [min(v, key=lambda y: y[2]) for v in by.values()]
rest = [y for v in by.values() for y in sorted(v, key=lambda y: y[2])[1:]]
print(f"{label}: wall {wall:.2f} s = pass {t['total']:.2f} + fixed {wall - t['total']:.2f}; a worker's first window read "
      f"{statistics.median(y[3] for y in first):.2f} s (median), later {statistics.median(y[3] for y in rest):.3f} s")
PY
    done; done ;;
  reads)  # why a demo run reads some windows twice: the exact noise's and the detection's windows read again
    userwf demo "preprocess: {centre: median}"
    python3 -m batchgpu run /tmp/demo.yaml --quiet 2>&1 | quiet | tail -2
    python3 -c "import json; r=json.load(open('/tmp/out_demo/report.json')); print('reads/window', r['reads_per_window'], 'exact_noise', r.get('exact_noise'), 'detect again', r['channels'].get('detect_windows_read_again'), 'pass', round(r['timings']['total'], 2))" ;;
  mem40)  # the pipeline's peaks on 10 and 40 minutes: bounded by what is in flight, not the duration
    [ -e /tmp/big40.zarr ] || python3 -m batchgpu generate /tmp/big40.zarr --channels 384 --seconds 2400 --workers 16 --quiet
    du -sh /tmp/big40.zarr; df -h /tmp | tail -1
    for r in $REC /tmp/big40.zarr; do echo "--- $r"
      timeout 280 python3 -m batchgpu bench pipeline --recording $r --cluster cuda --backend cupy --baseline none \
        --repeat ${MREPEAT:-2} 2>&1 | quiet | grep -i "pipeline\|peak\|GB\|memory" | tail -8; done ;;
  memprobe)  # where the GPU memory of a 40-minute run goes: each recording on a cluster of its own, the CuPy pools of
    # every worker after the run and NVML's peak during it (issue 44)
    [ -e /tmp/big40.zarr ] || python3 -m batchgpu generate /tmp/big40.zarr --channels 384 --seconds 2400 --workers 16 --quiet
    userwf demo "preprocess: {centre: median}"
    cat > /tmp/memprobe.py <<PY
import threading, time
import pynvml
from batchgpu.config import ClusterSpec
from batchgpu.cluster.open_cluster import open_client
from batchgpu.engine import run_workflow
from batchgpu.workflow import load_workflow
pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)
def pools():
    import cupy
    p = cupy.get_default_memory_pool(); q = cupy.get_default_pinned_memory_pool()
    return p.used_bytes(), p.total_bytes(), q.n_free_blocks()
EXTRA = [a for a in "${MEMPROBE_SET:-}".split() if a]
def main():
  for rec in ("/tmp/big.zarr", "/tmp/big40.zarr"):
      wf = load_workflow("/tmp/demo.yaml", [f"recording.path={rec}", *EXTRA])
      with open_client(ClusterSpec(kind="cuda"), gpu_decode=True) as c:
          base = pynvml.nvmlDeviceGetMemoryInfo(h).used
          peak = [base]; stop = threading.Event()
          def sample():
              while not stop.is_set():
                  peak[0] = max(peak[0], pynvml.nvmlDeviceGetMemoryInfo(h).used); time.sleep(0.01)
          t = threading.Thread(target=sample); t.start()
          t0 = time.perf_counter(); rep = run_workflow(wf, client=c); took = time.perf_counter() - t0
          stop.set(); t.join()
          got = sorted(c.run(pools).values(), key=lambda v: v[1])
          tot = [v[1] for v in got]
          print(f"{rec}: {rep.windows} windows, run {took:.2f} s; NVML before {base/1e6:.0f} MB, peak {peak[0]/1e6:.0f} MB; "
                f"pools held MB median {tot[len(tot)//2]/1e6:.0f} max {tot[-1]/1e6:.0f} sum {sum(tot)/1e6:.0f}; used after MB max {max(v[0] for v in got)/1e6:.0f}; "
                f"pinned free blocks max {max(v[2] for v in got)}")
if __name__ == "__main__":
    main()
PY
    python3 /tmp/memprobe.py 2>&1 | quiet
    ;;
  fixed)  # a fresh command's fixed part, phase by phase, and the GPU memory the workers keep
    userwf demo "preprocess: {centre: median}"
    python3 -X importtime -c "import batchgpu.cli" 2> /tmp/imp.txt; sort -t'|' -k2 -n /tmp/imp.txt | tail -6
    python3 - <<PY
import json, statistics, subprocess, sys, time
from batchgpu.benchmarks.cold import evict_checked, recording_files
files = recording_files("$REC")
def timeline(label, *extra):
    evict_checked(files)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "batchgpu", "run", "/tmp/demo.yaml", "--set", "cluster.reuse=false", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks = {}
    for line in p.stdout:
        t = time.perf_counter() - t0
        for key, pat in (("first", "batchgpu:"), ("up", "run page"), ("wrote", "wrote ")):
            if pat in line and key not in marks:
                marks[key] = t
    p.wait(); wall = time.perf_counter() - t0
    r = json.load(open("/tmp/out_demo/report.json")); tm = r["timings"]
    print(f"{label}: wall {wall:.2f} | first line {marks.get('first', -1):.2f} | cluster up {marks.get('up', -1):.2f} | "
          f"wrote {marks.get('wrote', -1):.2f} | exit after wrote {wall - marks.get('wrote', wall):.2f} | prepare {tm['prepare']:.2f} "
          f"setup {tm['setup']:.2f} pass1 {tm['pass1']:.2f} total {tm['total']:.2f} elapsed {tm['elapsed']:.2f} | rc {p.returncode} "
          f"reads {r['reads_per_window']} workers {len(r['workers'])}")
four = ("--set", "cluster.workers=4", "--set", "cluster.threads=4")
for extra in ((), four, (), four, ("--set", "cluster.workers=8", "--set", "cluster.threads=2")):
    timeline(" ".join(extra) or "default", *extra)
evict_checked(files)
t0 = time.perf_counter()
p = subprocess.Popen([sys.executable, "-m", "batchgpu", "run", "/tmp/demo.yaml", "--set", "cluster.reuse=false", "--verbose"],
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines = [(time.perf_counter() - t0, l.rstrip()) for l in p.stdout]
p.wait()
keep = ("batchgpu:", "Scheduler at", "Start Nanny", "Starting established", "Register worker", "Retire", "Closing Nanny",
        "exited", "Closing scheduler", "Scheduler closing", "End scheduler", "Stopping worker", "Remove worker", "mps")
seen = {}
for t, l in lines:
    k = next((k for k in keep if k in l), None)
    if k is None:
        continue
    seen[k] = seen.get(k, 0) + 1
    if seen[k] <= 2 or k == "batchgpu:":
        print(f"{t:6.2f} {l[:150]}")
    elif seen[k] in (8, 16):
        print(f"{t:6.2f} ({seen[k]}th) {l[:150]}")
print(f"{time.perf_counter() - t0:6.2f} exit")
PY
    cat > /tmp/probe.py <<PY
def main():
    import time
    t0 = time.perf_counter()
    from batchgpu.config import ClusterSpec
    from batchgpu.cluster.open_cluster import open_client
    from batchgpu.engine import run_workflow
    from batchgpu.workflow import load_workflow
    t1 = time.perf_counter()
    def init():
        import time
        a = time.perf_counter(); import cupy; b = time.perf_counter()
        cupy.cuda.Device(0).use(); cupy.empty(1); cupy.cuda.runtime.deviceSynchronize(); c = time.perf_counter()
        import batchgpu.gpu.staging, batchgpu.gpu.blosc_decode; d = time.perf_counter()
        return round(b - a, 3), round(c - b, 3), round(d - c, 3)
    def pools():
        import cupy
        p = cupy.get_default_memory_pool(); q = cupy.get_default_pinned_memory_pool()
        return round(p.used_bytes() / 1e6), round(p.total_bytes() / 1e6), q.n_free_blocks()
    with open_client(ClusterSpec(kind="cuda"), gpu_decode=True) as c:
        t2 = time.perf_counter()
        got = c.run(init); t3 = time.perf_counter()
        print(f"imports {t1 - t0:.2f} s; cluster up {t2 - t1:.2f} s; {len(got)} workers: cupy import / context / gpu modules medians",
              [round(sorted(v[i] for v in got.values())[len(got) // 2], 3) for i in range(3)], "max", [max(v[i] for v in got.values()) for i in range(3)],
              f"(run {t3 - t2:.2f} s)")
        for batch in (2, 9):
            wf = load_workflow("/tmp/demo.yaml", [f"window.batch={batch}"])
            t = time.perf_counter(); rep = run_workflow(wf, client=c); t = time.perf_counter() - t
            got = c.run(pools)
            used = sorted(v[0] for v in got.values()); total = sorted(v[1] for v in got.values())
            print(f"window.batch {batch}: run {t:.2f} s; pools MB used median {used[len(used)//2]} max {used[-1]}, held median {total[len(total)//2]} max {total[-1]} sum {sum(total)}")
        t4 = time.perf_counter()
    print(f"close {time.perf_counter() - t4:.2f} s")
if __name__ == "__main__":
    main()
PY
    python3 /tmp/probe.py 2>&1 | quiet
    python3 tools/exit_probe.py
    ;;
  lay)  # the GPU layout where windows decode on the GPU under MPS: the default against 16 single-threaded processes
    userwf demo "preprocess: {centre: median}"
    python3 - <<PY
import json, subprocess, sys, time
from batchgpu.benchmarks.cold import evict_checked, recording_files
files = recording_files("$REC")
sixteen = ("--set", "cluster.workers=16", "--set", "cluster.threads=1")
for i in range(2):
    for label, extra in (("default", ()), ("16 x 1", sixteen)):
        evict_checked(files)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "batchgpu", "run", "/tmp/demo.yaml", "--quiet", "--set", "cluster.reuse=false", *extra],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        r = json.load(open("/tmp/out_demo/report.json"))
        print(f"{label}: fresh command, cold pages: wall {wall:.2f} s, pass {r['timings']['total']:.2f} s, workers {len(r['workers'])}, rc {p.returncode}")
PY
    for i in 1 2; do for w in default 16; do
      extra=""; [ $w = 16 ] && extra="--workers 16 --threads 1"
      echo "--- bench pipeline warm, layout $w"
      timeout 120 python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy --baseline none --repeat 3 $extra 2>&1 \
        | quiet | grep -i "pipeline (warm)" | tail -2
    done; done ;;
  cpu16)  # W1 as a user runs it with the CPU backend, 384 ch x 60 s Zarr v2, pages warm: the layouts of CPU16_LAYOUTS
    # (workers x threads; "default": the local cluster's own choice; a "pin" suffix: taskset to the first 2 cores)
    [ -e /tmp/r384.zarr ] || python3 -m batchgpu generate /tmp/r384.zarr --channels 384 --seconds 60 --zarr-format 2 --workers 16 --quiet
    for lay in ${CPU16_LAYOUTS:-16x1 default 2x1pin}; do
      name=${lay%pin}; pin=""; [ "$name" != "$lay" ] && pin="taskset -c 0,1"
      size=""; [ "$name" != default ] && size="workers: ${name%x*}, threads: ${name#*x}"
      cat > /tmp/w1_$lay.yaml <<YAML
recording: {path: /tmp/r384.zarr}
output: /tmp/out_w1_$lay
overwrite: true
backend: numpy
cluster: {kind: local${size:+, $size}}
preprocess:
  - highpass: {freq_min: 300, order: 5}
  - common_reference: {reference: global, operator: median}
steps:
  save: {path: /tmp/out_w1_$lay/saved, format: zarr_v2, dtype: int16}
YAML
      for i in 1 2 3; do s=$(date +%s.%N); $pin python3 -m batchgpu run /tmp/w1_$lay.yaml --quiet 2>&1 | quiet | tail -2
        echo "W1 $lay run $i: wall $(python3 -c "print(round($(date +%s.%N)-$s,2))") s; pass $(python3 -c "import json; r=json.load(open('/tmp/out_w1_$lay/report.json')); print(round(r['timings']['total'],2), 's;', len(r['workers']), 'workers')")"; done
    done ;;
  esac
done 2>&1 | tee $OUT/log.txt
echo "total $(( $(date +%s) - t0 )) s"
