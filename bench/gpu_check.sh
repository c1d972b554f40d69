#!/usr/bin/env bash
# make gpu-check: the one prepared script for a lent GPU machine (an H200 with its own python3, torch+cu130,
# triton and nvcc; no network, so nothing is installed). Stages, each printed and saved as it ends:
#   1 env     GPU, driver, python / torch / triton / nvcc versions
#   2 build   the C++ extensions in place (CPU kernel + the CUDA NVFP4 grouped GEMM)
#   3 tests   the GPU kernel tests (and the CPU kernel tests) with pytest
#   4 bench   bench/kernels.py on the GPU: namazu-tiny and Kimi-K2 shapes, rows saved as they are measured
#   5 tune    (if time is left) bench/tune_triton.py: candidate Triton tiles at decode and mid sizes
# Whole run under 8 minutes; each stage has its own time limit so a hang cannot eat the rest.
# Results go to $OUT (set by the device tool) or ./gpu-check-out; the last lines are a short table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-gpu-check-out}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
declare -A STATUS
T0=$(date +%s)

stage() {  # stage NAME LIMIT_S LOGFILE COMMAND...
  local name=$1 limit=$2 log=$3
  shift 3
  echo "=== stage $name (limit ${limit}s) at +$(( $(date +%s) - T0 ))s"
  timeout "$limit" "$@" > >(tee "$OUT_DIR/$log") 2>&1
  local rc=$?
  STATUS[$name]=$([ $rc -eq 0 ] && echo ok || echo "failed (rc $rc)")
  echo "=== stage $name: ${STATUS[$name]} at +$(( $(date +%s) - T0 ))s" | tee -a "$OUT_DIR/summary.txt"
}

stage env 30 env.txt bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; \
  $PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
  $PY -c 'import triton; print(\"triton\", triton.__version__)'; nvcc --version | tail -1"

stage build 240 build.txt $PY setup.py build_ext --inplace

stage tests 150 tests.txt $PY -m pytest -q -p no:cacheprovider -x tests/test_kernels_gpu.py \
  tests/test_kernels_cpu.py tests/test_kernels_dispatch.py --junitxml="$OUT_DIR/tests.xml"

stage bench 300 bench.txt $PY bench/kernels.py --device cuda --shapes tiny k2 --write \
  --jsonl "$OUT_DIR/bench.jsonl" --plot "$OUT_DIR/kernels.png"
# --write updated this copy's bench/RESULTS.md (kernels-cuda section): bring it back to commit.
cp bench/RESULTS.md "$OUT_DIR/RESULTS.md" 2>/dev/null

# Whatever time is left (of 8 minutes) goes to an offline Triton tile search; its JSON is what a later
# commit of TILE_CONFIGS would be based on.
LEFT=$(( 450 - ($(date +%s) - T0) ))
if [ "$LEFT" -gt 90 ]; then
  stage tune "$LEFT" tune.txt $PY bench/tune_triton.py --buckets decode mid --budget $(( LEFT - 60 )) \
    --out "$OUT_DIR/tune.json"
fi

echo
echo "| stage | result |"
echo "|---|---|"
for s in env build tests bench tune; do echo "| $s | ${STATUS[$s]:-not run} |"; done
echo "total $(( $(date +%s) - T0 ))s; files in $OUT_DIR"
grep -E "NVFP4 .*best BF16" "$OUT_DIR/bench.txt" 2>/dev/null | head -12
grep -E "^(nvfp4|bf16) (decode|mid|prefill): best" "$OUT_DIR/tune.txt" 2>/dev/null
[ "${STATUS[build]}" = ok ] && [ "${STATUS[tests]}" = ok ] && [ "${STATUS[bench]}" = ok ]
