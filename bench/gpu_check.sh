#!/usr/bin/env bash
# make gpu-check: the one prepared script for a lent GPU machine (an H200 with its own python3, torch+cu130,
# triton and nvcc; no network, so nothing is installed). Stages, each printed and saved as it ends:
#   1 env     GPU, driver, python / torch / triton / nvcc versions; fails when torch sees no GPU
#   2 build   the C++ extensions in place (CPU kernel + the CUDA NVFP4 grouped GEMM); fails unless the
#             CUDA extension was built and imports (setup.py skips it silently without CUDA_HOME)
#   3 tests   the CUDA-extension and cubin (cuda-python launch, CUDA-graph capture) tests first, then the Triton and CPU kernel tests (no -x: one failure
#             does not hide the rest); a skipped test is a failure here
#   4 graphs  bench/step_profile.py: CUDA-graph decode steps vs eager, device idle share per step
#   5 spec    bench/drafter_step.py in graph mode, float32: the shipped DFlash drafter vs speculation off at
#             batch 1 and 8 (same greedy answers checked), on held-out captured prompts when
#             GPU_CHECK_REQUESTS names a capture dir, else the corpus' valid split (skipped if neither)
#   6 engine  the engine's own tests on the GPU (device auto = cuda): CUDA-graph steps token-identical to
#             eager, no host sync in decode / mixed / verify steps, speculative decoding exact, the DFlash
#             drafter; informational (CPU-written tests may hold CPU-only assumptions: read the failures)
#   7 bench   bench/kernels.py on the GPU: namazu-tiny and Kimi-K2 shapes, rows saved as they are measured
#   4 cudatune bench/tune_cuda_moe.py: every CUDA NVFP4 decode variant checked against the torch reference,
#             the checked ones timed at Kimi-K2 shapes (1-64 tokens), the selection table recorded in
#             tune.json ("cuda_moe_table": commit it as namazu/kernels/tables/<device>.json); on a 10.x
#             (Blackwell) device the sm_100a W4A4 kernel instead (checked, timed, its table entry)
#   8 tune    (if time is left) bench/tune_triton.py: candidate Triton tiles at decode and mid sizes
#             (tune.json's "triton" list)
# One budget (BUDGET_S, 480 s: 8 minutes by construction, under the 600 s of one command):
# each stage gets min(its own cap, what is left of the budget), so the limits can never add up past it.
# GPU_CHECK_DRY_RUN=1 (on a CPU machine, PYTHON=a python with a CUDA build of torch): after env fails, run
# build and tests anyway, to see the CUDA extension build and the GPU tests fail loudly; run it on an
# exported copy of the repo (build writes the extensions in place, for that python's torch).
# Results go to $OUT (set by the device tool) or ./gpu-check-out, at most 8 files (the device tool returns
# no more): summary.txt (env + stage lines + graphs and spec tables + final table), build.txt, tests.txt
# (kernel and engine tests), bench.txt, bench.jsonl,
# RESULTS.md, tune.txt, tune.json. Every file is written as its stage runs, not at the end.
# GPU_CHECK_SKIP="bench tune" skips the named stages (a rerun after a fix, within the device's minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-gpu-check-out}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
BUDGET_S=${BUDGET_S:-480}
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
declare -A STATUS
T0=$(date +%s)

left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }

stage() {  # stage NAME CAP_S LOGFILE COMMAND...  (LOGFILE "-" appends to summary.txt)
  local name=$1 cap=$2 log=$3 limit
  shift 3
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    STATUS[$name]="skipped (GPU_CHECK_SKIP)"
    echo "=== stage $name: ${STATUS[$name]}" | tee -a "$SUMMARY"
    return
  fi
  limit=$(left)
  [ "$cap" -lt "$limit" ] && limit=$cap
  if [ "$limit" -lt 10 ]; then
    STATUS[$name]="not run (budget spent)"
    echo "=== stage $name: ${STATUS[$name]}" | tee -a "$SUMMARY"
    return
  fi
  local dest="$OUT_DIR/$log"
  [ "$log" = "-" ] && dest="$SUMMARY"
  echo "=== stage $name (limit ${limit}s) at +$(( $(date +%s) - T0 ))s" | tee -a "$SUMMARY"
  timeout "$limit" bash -c '"$@"' _ "$@" > >(tee -a "$dest") 2>&1
  local rc=$?
  STATUS[$name]=$([ $rc -eq 0 ] && echo ok || echo "failed (rc $rc)")
  echo "=== stage $name: ${STATUS[$name]} at +$(( $(date +%s) - T0 ))s" | tee -a "$SUMMARY"
}

# CUDA_HOME: torch's build needs the toolkit root; `nvcc` on PATH may be a wrapper script, so resolve it
# and accept the directory only if it holds the CUDA headers.
find_cuda_home() {
  local cand nv
  nv=$(command -v nvcc 2>/dev/null) && nv=$(readlink -f "$nv")
  for cand in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "${nv:+$(dirname "$(dirname "$nv")")}" /usr/local/cuda \
              /usr/local/cuda-*; do
    [ -n "$cand" ] && [ -f "$cand/include/cuda_runtime.h" ] && [ -x "$cand/bin/nvcc" ] && { echo "$cand"; return 0; }
  done
  # A wrapper: ask nvcc itself where its toolkit is (`nvcc -v` prints TOP=... for a dry compile).
  [ -n "$nv" ] && cand=$(nvcc -v -E -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  [ -n "${cand:-}" ] && [ -f "$cand/include/cuda_runtime.h" ] && { echo "$cand"; return 0; }
  return 1
}

env_check() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || return 1
  $PY -c 'import sys, torch; assert torch.cuda.is_available(), f"torch {torch.__version__} sees no GPU"; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())' || return 1
  $PY -c 'import triton; print("triton", triton.__version__)' || return 1
  $PY -c 'import cuda.bindings; print("cuda-python (cuda.bindings)", cuda.bindings.__version__)' \
    || echo "cuda-python missing: the cubin path (tests/kernels/test_cubin_gpu.py) will fail"
  CUDA_HOME=$(find_cuda_home) || { echo "no CUDA toolkit found (nvcc on PATH: $(command -v nvcc))"; return 1; }
  echo "CUDA_HOME=$CUDA_HOME"; "$CUDA_HOME/bin/nvcc" --version | tail -1
}

build() {
  CUDA_HOME=$(find_cuda_home) || { echo "no CUDA toolkit found: the CUDA extension cannot be built"; return 1; }
  export CUDA_HOME
  $PY -c 'import torch; assert torch.version.cuda, f"torch {torch.__version__} is a CPU build: no CUDA extension"' \
    || return 1
  $PY setup.py build_ext --inplace || return 1
  # setup.py skips the CUDA extension without saying so when it finds no toolkit: it must import here
  # (after torch, which loads the libc10 and libtorch it links against).
  $PY -c 'import torch, namazu._nvfp4_cuda, namazu._nvfp4_cpu; print("built and imported: namazu._nvfp4_cuda, namazu._nvfp4_cpu")' \
    || return 1
  # The cubin of the same kernel, for the cuda-python launch path (kernels/cubin_loader.py).
  $PY -c 'from namazu.kernels.cubin_loader import compile_cubin; print("cubin:", compile_cubin())' || return 1
  # The split-K decode variants (kernels/cuda_decode.py), loaded the same way.
  $PY -c 'from namazu.kernels.cuda_decode import compile_decode_cubin as d, compile_prefill_cubin as p
print("decode cubin:", d()); print("large-batch cubin:", p())'
  # The Blackwell W4A4 kernel (kernels/cuda_sm100.py): compiled on every machine, run only on a 10.x one.
  $PY -c 'from namazu.kernels.cuda_sm100 import compile_sm100_cubin as b; print("sm_100a cubin:", b())' || return 1
}

run_tests() {  # pytest FILES...; fails on a failure, a crash or a skip (a GPU test that skips never ran)
  local xml rc
  xml=$(mktemp --suffix=.xml)
  $PY -m pytest -q -p no:cacheprovider -rsfE --tb=short "$@" --junitxml="$xml"
  rc=$?
  if [ $rc -gt 128 ]; then
    echo "pytest died (rc $rc): no junit report"
  else
    $PY - "$xml" <<'EOF_PY' || rc=1
import sys, xml.etree.ElementTree as ET
suites = ET.parse(sys.argv[1]).getroot()
skipped = sum(int(s.get("skipped", 0)) for s in suites.iter("testsuite"))
print(f"skipped tests: {skipped}")
sys.exit(1 if skipped else 0)
EOF_PY
  fi
  rm -f "$xml"
  return $rc
}

gpu_tests() {
  local rc=0 crc major deselect=()
  major=$($PY -c 'import torch; print(torch.cuda.get_device_capability()[0])' 2>/dev/null || echo 0)
  # The SASS test needs cuobjdump (a skip fails this stage): leave it out where the toolkit lacks it.
  command -v cuobjdump >/dev/null || [ -x "$(dirname "$(command -v nvcc)")/cuobjdump" ] || [ -n "${NAMAZU_CUOBJDUMP:-}" ] \
    || deselect=(--deselect tests/kernels/test_kernels_cuda_build.py::test_blackwell_sass_has_the_fp4_tensor_core_path)
  if [ "$major" = 10 ]; then
    # Blackwell: the sm_90a cubins do not load here; the sm_100a kernel's device test (before any table
    # can choose it) and its CPU half.
    run_tests tests/kernels/test_kernels_cuda_build.py tests/kernels/test_cuda_sm100.py \
      tests/kernels/test_cuda_sm100_gpu.py tests/kernels/test_kernels_dispatch.py "${deselect[@]}" || rc=1
    return $rc
  fi
  run_tests tests/kernels/test_kernels_cuda_build.py tests/kernels/test_cubin_loader.py tests/kernels/test_cubin_gpu.py \
    tests/kernels/test_cuda_decode.py tests/kernels/test_cuda_decode_gpu.py tests/kernels/test_kernels_gpu.py \
    tests/kernels/test_cuda_sm100.py tests/kernels/test_kernels_dispatch.py "${deselect[@]}" || rc=1
  # The C++ CPU kernel built with this machine's compiler, in its own process: a crash there must not
  # hide the GPU tests' report. On a crash, the native backtrace (cuda-gdb also debugs host code).
  run_tests tests/kernels/test_kernels_cpu.py; crc=$?
  if [ $crc -ne 0 ]; then
    rc=1
    if [ $crc -gt 128 ] && command -v cuda-gdb >/dev/null; then
      echo "--- native backtrace of the crash (cuda-gdb)"
      timeout 90 cuda-gdb -q -batch -ex run -ex "bt 25" --args $PY -m pytest -q -p no:cacheprovider -x \
        tests/kernels/test_kernels_cpu.py 2>&1 | grep -vE "^\[(New|Thread|Detaching)" | tail -45
    fi
  fi
  return $rc
}

engine_tests() {
  # The CPU suite's engine tests, now on the GPU: graph mode captures CUDA graphs here instead of
  # compiling, and the no-host-sync guard checks the code that would stall the device queue.
  $PY -m pytest -q -p no:cacheprovider -rs tests/worker/test_graph_mode.py tests/worker/test_host_sync_guard.py \
    tests/spec/test_engine_spec.py tests/spec/test_dflash.py
}

spec_bench() {
  local req=()
  if [ -n "${GPU_CHECK_REQUESTS:-}" ]; then
    req=(--requests "$GPU_CHECK_REQUESTS")
  elif ! $PY -c 'import sys; from namazu.tiny.corpus import default_corpus_dir as d; sys.exit(not d().is_dir())'; then
    echo "no GPU_CHECK_REQUESTS capture dir and no corpus: no prompts for the drafter benchmark"; return 1
  fi
  $PY bench/drafter_step.py "${req[@]}" --modes graph --dtype float32 --batch 1 8 --rounds 2 --groups 4 \
    --output-len 64
}

export PY BUDGET_S
export -f find_cuda_home env_check build run_tests gpu_tests engine_tests spec_bench
stage env 30 - env_check
if [ "${STATUS[env]}" != ok ] && [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
  # Dry run on a machine without a GPU (a CUDA build of torch and nvcc installed): the build stage must
  # still build and import the CUDA extension; the GPU tests must fail (not skip); nothing after them runs.
  echo "dry run: env failed as it must without a GPU; build and tests run, then the check stops" | tee -a "$SUMMARY"
  stage build 200 build.txt build
  stage tests 150 tests.txt gpu_tests
elif [ "${STATUS[env]}" != ok ]; then
  # No GPU (or no toolkit): everything after would fail slowly or, worse, skip; stop loudly now.
  echo "env failed: no GPU stage can run" | tee -a "$SUMMARY"
else
  stage build 200 build.txt build
  stage tests 150 tests.txt gpu_tests
  # The decode variants' device check and timing; its table lands in tune.json (< 2 minutes).
  stage cudatune 110 tune.txt $PY bench/tune_cuda_moe.py --budget 60 --out "$OUT_DIR/tune.json"
  # Graph mode on the GPU: CUDA graphs captured at start-up, decode steps eager vs replayed (alternated in
  # one engine), device idle share per step from CUDA events; its table goes to summary.txt.
  stage graphs 90 - $PY bench/step_profile.py --batch 1 32 --output-len 32 --interleave 2
  stage spec 100 - spec_bench
  stage engine 150 tests.txt engine_tests
  # The `cuda` rows run what the table just recorded picks (cuda-gemm16: the default, side by side).
  [ -f "$OUT_DIR/tune.json" ] && export NAMAZU_CUDA_MOE_TABLE="$OUT_DIR/tune.json"
  stage bench 150 bench.txt $PY bench/kernels.py --device cuda --shapes tiny k2 --write \
    --jsonl "$OUT_DIR/bench.jsonl"
  # --write updated this copy's bench/RESULTS.md (kernels-cuda section): bring it back to commit.
  cp bench/RESULTS.md "$OUT_DIR/RESULTS.md" 2>/dev/null
  # What is left of the budget goes to an offline Triton tile search; its JSON is what a later commit of
  # TILE_CONFIGS would be based on.
  if [ "$(left)" -gt 90 ]; then
    TRITON_JSON=$(mktemp --suffix=.json)
    stage tune "$(left)" tune.txt $PY bench/tune_triton.py --buckets decode mid --budget $(( $(left) - 60 )) \
      --out "$TRITON_JSON"
    # One tune.json (the device tool returns at most 8 files): the CUDA table and the Triton list side by side.
    $PY - "$OUT_DIR/tune.json" "$TRITON_JSON" <<'EOF_PY'
import json, os, sys
out, triton = sys.argv[1:]
data = json.load(open(out)) if os.path.exists(out) else {}
if os.path.getsize(triton):
    data["triton"] = json.load(open(triton))
json.dump(data, open(out, "w"), indent=1)
EOF_PY
    rm -f "$TRITON_JSON"
  fi
fi

{
  echo
  echo "| stage | result |"
  echo "|---|---|"
  for s in env build tests cudatune engine graphs spec bench tune; do echo "| $s | ${STATUS[$s]:-not run} |"; done
  echo "total $(( $(date +%s) - T0 ))s of a ${BUDGET_S}s budget; files in $OUT_DIR"
  grep -E "^(FAILED|ERROR) |( passed| failed| errors?)(,| in )" "$OUT_DIR/tests.txt" 2>/dev/null | head -30
  grep -E "NVFP4 .*best BF16" "$OUT_DIR/bench.txt" 2>/dev/null | head -12
  grep -E "^(cuda decode .* tokens: best|variants checked:)" "$OUT_DIR/tune.txt" 2>/dev/null
  grep -E "^(nvfp4|bf16) (decode|mid|prefill): best" "$OUT_DIR/tune.txt" 2>/dev/null
} | tee -a "$SUMMARY"
[ "${STATUS[env]}" = ok ] && [ "${STATUS[build]:-}" = ok ] && [ "${STATUS[tests]:-}" = ok ] && [ "${STATUS[bench]:-}" = ok ]
