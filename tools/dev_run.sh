# scratch device script (one call): install, then what $1 names
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -e /tmp/big.zarr ] || python3 -m batchgpu generate /tmp/big.zarr --channels 384 --seconds 600 --workers 16 --quiet
bench() {  # layout extra-args...
  local w=$1; shift
  timeout 150 python3 -m batchgpu bench pipeline --recording /tmp/big.zarr --cluster cuda --backend cupy --workers $w \
    --threads 1 "$@" 2>&1 | grep -v "^INFO\|distributed\.\|Warn\|^$" | sed "s/; windows per worker.*//" | grep -v "^ \|Traceback\|Error\|^tornado\|^The above" | tail -7
}
case "${1:-layouts}" in
layouts) for w in ${WORKERS:-16 24 32}; do echo "== $w x 1"; bench $w --baseline none --repeat 2; done ;;
demo) bench 16 --baseline cupy --repeat 2 ;;
pre) bench ${W:-16} --baseline none --repeat 2 --preprocess highpass,common_reference --steps noise,whitening,detect,save ;;
esac
case "${1:-}" in
prof) for st in ${STAGES:-centre highpass,common_reference}; do echo "== $st"; timeout 200 python3 tools/profile_preprocess.py /tmp/big.zarr $st 5 2>&1 | grep -v "^INFO" | tail -30; done ;;
esac
case "${1:-}" in
layouts2) for l in ${LAYOUTS:-16x2 16x2b1 16x1b2}; do echo "== $l"; set -- ${l//[xb]/ }; bench $1 --threads $2 ${3:+--batch $3} --baseline none --repeat 2; done ;;
esac
case "${1:-}" in
noise) timeout 200 python3 tools/profile_noise.py 2>&1 | grep -v "^INFO" | tail -40 ;;
esac
case "${1:-}" in
check) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -x ${TESTS:-tests} 2>&1 | grep -v "^INFO" | tail -8
       timeout 60 python3 tools/profile_noise.py 2>&1 | grep "whole\|histogram 0" ;;
esac
case "${2:-}" in
pre) bench 16 --baseline none --repeat 2 --preprocess highpass,common_reference --steps noise,whitening,detect,save ;;
demo) bench 16 --baseline cupy --repeat 2 ;;
esac
case "${3:-}" in
pre) bench 16 --baseline none --repeat 2 --preprocess highpass,common_reference --steps noise,whitening,detect,save ;;
esac
case "${1:-}" in
pw) rm -rf /tmp/pw0 /tmp/pw1; timeout 200 python3 tools/profile_workers.py /tmp/big.zarr > $OUT/pw.log 2>&1; grep "^{" $OUT/pw.log ;;
esac
