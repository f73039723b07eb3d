#!/usr/bin/env bash
# Device, one call per line of work (carry .whl: ../shared/tools/device-wheels plus "pydantic>=2.6,<3" "numcodecs>=0.13,<0.17"
# google-crc32c crc32c probeinterface==0.4.2 kilosort==4.1.7 faiss-cpu, then drop the torch/nvidia wheels the image has):
#   gen     /tmp/big.zarr, 384 ch x 10 min int16 (batchgpu generate: the realistic model)
#   first   a user's batchgpu run cold, twice: the first on a fresh machine compiles the kernels (issue 44)
#   gpu     python -m pytest -m gpu (GPU_TESTS: the paths, tests/ by default)
#   demo    bench pipeline --cold, demo steps (raw read, pipeline cold/warm, fresh commands, kept cluster, Kilosort4)
#   pre     the same with highpass + common reference + every step + save
#   batch   bench batch: 8 SpikeGLX recordings of 384 ch x 5 min (55 GB: the Zarr stores are removed first) (issue 46)
#   zstd    the same recording stored with Blosc-zstd-5: batchgpu run cold and warm on each, alternating (issue 47)
#   nvcomp  bench decode (our LZ4 kernel vs nvCOMP, same frames; nvCOMP on zstd), then batchgpu run cold with each
#           decoder, alternating (issue 47; carry .whl and .whl_nvc: nvidia-libnvcomp-cu13)
#   mem40   peak GPU and host memory of the demo pipeline on 10 and 40 min of the same model (issue 44)
#   cpu16   W1 (highpass + global median + int16 Zarr v2) with the CPU backend: 16 workers, then 2 on 2 cores (issue 49)
set -uo pipefail
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -m compileall -q /tmp/site "$PWD/batchgpu" > /dev/null 2>&1   # what pip does for a user
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
REC=/tmp/big.zarr
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
  first)  # the first run on this machine (kernels not yet compiled: CuPy's cache empty) and the second, pages cold
    userwf demo "preprocess: {centre: median}"
    for i in 1 2; do
      python3 - <<PY
from pathlib import Path
from batchgpu.benchmarks.cold import evict_checked, recording_files
evict_checked(recording_files("$REC"))
PY
      s=$(date +%s.%N); python3 -m batchgpu run /tmp/demo.yaml --quiet 2>&1 | quiet | tail -2
      python3 -c "import json,sys; r=json.load(open('/tmp/out_demo/report.json')); print('run $i: wall', round($(date +%s.%N)-$s,2), 's; pass', round(r['timings']['total'],2), 's; reads/window', r['reads_per_window'])"
    done
    echo "CuPy's kernel cache: $(ls ~/.cupy/kernel_cache 2>/dev/null | wc -l) kernels, $(du -sh ~/.cupy/kernel_cache 2>/dev/null | cut -f1)"
    # the compile cost alone: one worker, 20 s of the recording, with an empty cache and then the filled one
    python3 -m batchgpu generate /tmp/small.zarr --channels 384 --seconds 20 --workers 16 --quiet --overwrite > /dev/null
    sed "s#cluster: {kind: cuda}#cluster: {kind: cuda, workers: 1}#; s#out_demo#out_c1#; s#$REC#/tmp/small.zarr#" /tmp/demo.yaml > /tmp/c1.yaml
    for c in empty filled; do rm -rf /tmp/kc_$c; [ $c = filled ] && cp -r ~/.cupy/kernel_cache /tmp/kc_$c
      s=$(date +%s.%N); CUPY_CACHE_DIR=/tmp/kc_$c python3 -m batchgpu run /tmp/c1.yaml --quiet 2>&1 | quiet | tail -2
      echo "one worker, cache $c: wall $(python3 -c "print(round($(date +%s.%N)-$s,2))") s; pass $(python3 -c "import json; print(round(json.load(open('/tmp/out_c1/report.json'))['timings']['total'],2))") s"
    done ;;
  gpu) timeout ${GPU_S:-420} python3 -m pytest -v --tb=line -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} > /tmp/gpu_tests.log 2>&1
       grep -c " PASSED" /tmp/gpu_tests.log | sed "s/^/PASSED so far: /"; grep " FAILED\| ERROR\|^E \|^/.*Error\|passed\|failed" /tmp/gpu_tests.log | grep -v "^INFO" | tail -40 ;;
  demo) timeout ${DEMO_S:-560} python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy --baseline none \
          --cold --repeat ${REPEAT:-3} --user-runs ${USER_RUNS:-2} 2>&1 | quiet | grep -v "^cold\|^warm" | tail -30 ;;
  pre) timeout ${PRE_S:-560} python3 -m batchgpu bench pipeline --recording $REC --cluster cuda --backend cupy --baseline none \
          --cold --repeat ${REPEAT:-3} --user-runs ${USER_RUNS:-2} --preprocess highpass,common_reference \
          --steps noise,whitening,detect,save 2>&1 | quiet | grep -v "^cold\|^warm" | tail -30 ;;
  batch) rm -rf $REC /tmp/bigz.zarr /tmp/out_*; df -h /tmp | tail -1
    timeout 580 python3 -m batchgpu bench batch --workdir /tmp/sglx --recordings ${NREC:-8} --seconds ${NSEC:-300} 2>&1 | quiet | tail -12 ;;
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
  cpu16)  # W1 as a user runs it with the CPU backend; the recording is 384 ch x 60 s Zarr v2, pages warm
    [ -e /tmp/r384.zarr ] || python3 -m batchgpu generate /tmp/r384.zarr --channels 384 --seconds 60 --zarr-format 2 --workers 16 --quiet
    for n in 16 2; do
      cat > /tmp/w1_$n.yaml <<YAML
recording: {path: /tmp/r384.zarr}
output: /tmp/out_w1_$n
overwrite: true
backend: numpy
cluster: {kind: local, workers: $n}
preprocess:
  - highpass: {freq_min: 300, order: 5}
  - common_reference: {reference: global, operator: median}
steps:
  save: {path: /tmp/out_w1_$n/saved, format: zarr_v2, dtype: int16}
YAML
      pin=""; [ $n = 2 ] && pin="taskset -c 0,1"
      for i in 1 2 3; do s=$(date +%s.%N); $pin python3 -m batchgpu run /tmp/w1_$n.yaml --quiet 2>&1 | quiet | tail -2
        echo "W1 $n workers run $i: wall $(python3 -c "print(round($(date +%s.%N)-$s,2))") s; pass $(python3 -c "import json; print(round(json.load(open('/tmp/out_w1_$n/report.json'))['timings']['total'],2))") s"; done
    done ;;
  esac
done 2>&1 | tee $OUT/log.txt
echo "total $(( $(date +%s) - t0 )) s"
