#!/usr/bin/env bash
# One device call for async scheduling (switch async_scheduling): the GPU tests of the decode graphs and of the
# engine's three step orders on CUDA, the W1 / W2 ablation of async_scheduling and overlap_scheduling, and MXFP8
# W1 / W2. Wheels for the engine's packages come in .whl/ (scripts/fetch_wheels.sh). Logs and results in
# $OUT/async.tgz (re-packed after each step), the steps' summaries on stdout.
#   OUT=... NANOSERVE_GIT_COMMIT=<hash> [STEPS=tests,ablation,profile,mxfp8] bash scripts/gpu_async.sh
# TESTS (test files) and ABLATE (switches for --ablate-switches) name other decode-step work, e.g.
#   TESTS="tests/test_kernel_moe_route.py tests/test_cuda_graphs.py" ABLATE=fused_routing STEPS=tests,ablation ...
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
W=/tmp/async; mkdir -p "$W"
pack() { tar czf "$OUT/async.tgz" -C "$W" . 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$W/gpu.txt"
STEPS=${STEPS:-tests,ablation,mxfp8}
ABLATE=${ABLATE:-async_scheduling,overlap_scheduling}
for step in ${STEPS//,/ }; do
  case $step in
    tests) timeout ${TESTS_TIMEOUT:-150} python3 -m pytest \
             ${TESTS:-tests/test_cuda_graphs.py tests/test_decode_step.py tests/test_overlap.py} \
             -q -p no:cacheprovider > "$W/gpu_tests.txt" 2>&1
           echo "tests exit $?"; tail -3 "$W/gpu_tests.txt";;
    ablation) timeout ${ABLATION_TIMEOUT:-240} python3 -m nanoserve.bench --ablate --workloads W1,W2 \
             --ablate-switches $ABLATE --out "$W/ablation" \
             > "$W/ablation.txt" 2>&1
           echo "ablation exit $?"; grep -E "^(Ablation|switch|\(all\)|${ABLATE//,/|}) " \
             "$W/ablation.txt";;
    profile) timeout ${PROFILE_TIMEOUT:-150} python3 -m nanoserve.bench --profile W1,W2 --out "$W/profile" \
             > "$W/profile.txt" 2>&1
           echo "profile exit $?"; grep -iE "step|host|gap|kernels" "$W/profile.txt" | head -30;;
    mxfp8) timeout ${MXFP8_TIMEOUT:-170} python3 -m nanoserve.bench --quantization mxfp8 --workloads W1,W2 \
             --out "$W/mxfp8" > "$W/mxfp8.txt" 2>&1
           echo "mxfp8 exit $?"; grep -E "^\| W|W[0-9]+ .*tok/s" "$W/mxfp8.txt" | tail -8;;
  esac
  pack
done
