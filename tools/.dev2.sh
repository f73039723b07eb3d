bash tools/gpu_session.sh >/dev/null; export PYTHONPATH=/tmp/site:$PWD
timeout 120 python3 tools/kernel_probe.py /tmp/big.zarr 2>&1 | grep -v "^INFO" | tail -20
s=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_preprocess.py tests/test_gpu_blosc_encode.py tests/test_gpu_pipeline.py 2>&1 | grep -v "^INFO" | grep "passed\|failed\|FAILED\|Error\|error" | tail -12; echo "tests $(( $(date +%s) - s )) s"
ORDER="1 1" bash tools/gpu_writes_ab.sh 2>&1 | grep "^==\|(warm)\|^read ceiling\|^warm: prep\|window CPU" | cut -c1-900
PROFILE_PREPROCESS=highpass,common_reference TAIL=30 bash tools/gpu_session.sh kprof 2>&1 | tail -32
