#!/usr/bin/env bash
# One GPU run, in order: the wheels, the GPU tests, the benchmark under a time budget, and (optionally) W3 against
# a server. What each step writes goes under $OUT (logs, the bench's results.json and tables), and everything is
# packed into $OUT/gpu_run.tgz after each step, so a run cut short still returns what it measured.
#
#   OUT=DIR [STEPS=tests,bench] [BUDGET=400] [BENCH_ARGS="--workloads W1,W2,W4 --w4-lens 131072"] \
#       [TESTS="-m gpu"] [W3_ARGS="--concurrency 1,64"] [BASE_DIR=DIR BASE_COMMIT=HASH] [WHEELS=.whl] \
#       bash scripts/gpu_run.sh
#
# Steps (STEPS, a comma list, run in the order given):
#   tests   python -m pytest $TESTS (default: -m gpu, every test marked gpu); log in tests.txt
#   bench   python -m nanoserve.bench $BENCH_ARGS --time-budget $BUDGET --out $OUT/bench (default args: the
#           offline workloads W1, W2, W4, W5, W6 on m3-slice); log in bench.txt
#   baseline  the bench step's command again from BASE_DIR (a checkout of the baseline commit, e.g. made with
#           `git worktree add /tmp/base <commit>`; BASE_COMMIT names it in its results), into $OUT/baseline, then
#           python -m nanoserve.bench --compare $OUT/baseline $OUT/bench: NEW / BASE run by run on this one
#           machine (compare.json and baseline.txt); run it beside bench, e.g. STEPS=bench,baseline. With
#           `--quantization a,b` the baseline runs one process per format (into $OUT/baseline/a, /b, the folders
#           the bench step writes), each under the whole BUDGET: older commits keep every format's model resident
#           and run out of memory on an 80 GB card when they build the second
#   w3      python -m nanoserve.server --model $MODEL (default m3-slice) on port 8123, then python -m
#           nanoserve.bench --serve with $W3_ARGS (add --serve-logprobs 5 for logprobs on every request); logs in
#           w3_server.txt and w3.txt
#
# A machine that cannot reach the package index takes the packages nanoserve needs beyond a CUDA PyTorch image
# from .whl/ (bash scripts/fetch_wheels.sh on a machine that can): they are installed once, into /tmp/site.
# NANOSERVE_GIT_COMMIT is set from git when the checkout has its history, so the results name their commit.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:?set OUT to a directory for the logs and results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WHEELS=${WHEELS:-.whl}  # the wheels' folder (an empty one: use the packages installed)
SITE=
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "installing $WHEELS/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  SITE=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
if [ -z "${NANOSERVE_GIT_COMMIT:-}" ] && git rev-parse HEAD >/dev/null 2>&1; then
  NANOSERVE_GIT_COMMIT=$(git rev-parse HEAD)
  export NANOSERVE_GIT_COMMIT
fi
pack() { tar czf /tmp/gpu_run.tgz -C "$OUT" --exclude gpu_run.tgz . 2>/dev/null && mv /tmp/gpu_run.tgz "$OUT/"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit ${NANOSERVE_GIT_COMMIT:-unknown}"; } | tee "$OUT/gpu.txt"

# the bench step's command, run in the current directory with the current environment: its results go to $1; $2
# replaces BENCH_ARGS where given
timed_bench() {
  # shellcheck disable=SC2086
  timeout "$(( ${BUDGET:-400} + 120 ))" python3 -m nanoserve.bench ${2-${BENCH_ARGS:-}} \
    --time-budget "${BUDGET:-400}" --out "$1"
}

# BENCH_ARGS split into the --quantization value (QUANT) and the other arguments (OTHER_ARGS)
split_quantization() {
  QUANT= OTHER_ARGS=
  # shellcheck disable=SC2086
  set -- ${BENCH_ARGS:-}
  while [ $# -gt 0 ]; do
    case $1 in
      --quantization) QUANT=${2:-}; shift 2 || shift;;
      --quantization=*) QUANT=${1#*=}; shift;;
      *) OTHER_ARGS="$OTHER_ARGS $1"; shift;;
    esac
  done
}

STEPS=${STEPS:-tests,bench}
for step in ${STEPS//,/ }; do
  case $step in
    tests)
      # shellcheck disable=SC2086
      timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest ${TESTS:--m gpu} -q -rs -p no:cacheprovider \
        > "$OUT/tests.txt" 2>&1
      echo "tests exit $?"; tail -5 "$OUT/tests.txt";;
    bench)
      timed_bench "$OUT/bench" > "$OUT/bench.txt" 2>&1
      echo "bench exit $?"; tail -c 6000 "$OUT/bench.txt";;
    baseline)
      base=${BASE_DIR:?set BASE_DIR to a checkout of the baseline commit}
      split_quantization
      (cd "$base" && export PYTHONPATH=${SITE:+$SITE:}$base NANOSERVE_GIT_COMMIT=${BASE_COMMIT:-unknown} \
        && if [ "${QUANT#*,}" = "$QUANT" ]; then timed_bench "$OUT/baseline"
           else rc=0
             for fmt in ${QUANT//,/ }; do timed_bench "$OUT/baseline/$fmt" "$OTHER_ARGS --quantization $fmt" || rc=$?; done
             exit $rc
           fi) > "$OUT/baseline.txt" 2>&1
      echo "baseline exit $?"
      python3 -m nanoserve.bench --compare "$OUT/baseline" "$OUT/bench" --out "$OUT" | tee -a "$OUT/baseline.txt";;
    w3)
      port=8123
      python3 -m nanoserve.server --model "${MODEL:-m3-slice}" --port $port --served-model-name bench --max-model-len 4096 \
        --log-level warning > "$OUT/w3_server.txt" 2>&1 &
      server=$!
      for _ in $(seq 1 150); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || break
        sleep 2
      done
      # shellcheck disable=SC2086
      timeout "${W3_TIMEOUT:-300}" python3 -m nanoserve.bench --serve "http://127.0.0.1:$port" \
        --served-model-name bench --model "${MODEL:-m3-slice}" ${W3_ARGS:-} --out "$OUT/w3" > "$OUT/w3.txt" 2>&1
      echo "w3 exit $?"; grep -A8 "^W3 closed loop" "$OUT/w3.txt" | tail -9
      kill -TERM $server 2>/dev/null; wait $server 2>/dev/null;;
    *) echo "unknown step $step (tests, bench, baseline, w3)" >&2;;
  esac
  pack
done
