#!/usr/bin/env bash
# The closing device call: GPU kernel tests, then bf16 W1/W2/W2J/W4-128k, MXFP8 W1/W2, W3 with logprobs off/on,
# the decode-sized MXFP8 linear sweep (fp8dec: its winners are written into kernels/fp8_configs.py before the
# mxfp8 step runs), and the agent session on m3-slice; everything lands in $OUT/closing.tgz (re-packed after each step).
#   OUT=... [STEPS=tests,fp8dec,bench,mxfp8,w3,agent] [BENCH_WORKLOADS=W1,W2,W2J,W4] [TESTS_TIMEOUT=240] bash scripts/gpu_closing.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
W=/tmp/closing; mkdir -p "$W"
pack() { tar czf "$OUT/closing.tgz" -C "$W" . 2>/dev/null; }
STEPS=${STEPS:-tests,bench,mxfp8,w3,agent}
for step in ${STEPS//,/ }; do
  case $step in
    tests) timeout ${TESTS_TIMEOUT:-240} python3 -m pytest tests/test_cuda_graphs.py tests/test_kernel_*.py \
             -q -p no:cacheprovider > "$W/gpu_tests.txt" 2>&1; echo "tests exit $?"; tail -2 "$W/gpu_tests.txt";;
    fp8dec) mkdir -p "$W/fp8dec"; OUT=$W/fp8dec timeout 240 python3 scripts/gpu_fp8dec.py --budget 170 --write-configs \
             > "$W/fp8dec.txt" 2>&1; echo "fp8dec exit $?"; tail -25 "$W/fp8dec.txt";;
    bench) timeout 260 python3 -m nanoserve.bench --workloads ${BENCH_WORKLOADS:-W1,W2,W2J,W4} --w4-lens 131072 --out "$W/bf16" \
             > "$W/bf16.txt" 2>&1; echo "bf16 exit $?"; grep -E "^\| W|W[0-9J]+ .*tok/s|TTFT" "$W/bf16.txt" | tail -12;;
    mxfp8) timeout 120 python3 -m nanoserve.bench --quantization mxfp8 --workloads W1,W2 --out "$W/mxfp8" \
             > "$W/mxfp8.txt" 2>&1; echo "mxfp8 exit $?"; grep -E "^\| W|W[0-9]+ .*tok/s" "$W/mxfp8.txt" | tail -8;;
    w3) OUT=$W/w3 CONCURRENCY=64 REQS=4 timeout 170 bash scripts/gpu_w3.sh;;
    agent) mkdir -p "$W/agent"; OUT=$W/agent AGENT_TIMEOUT=150 bash scripts/gpu_agent.sh | tail -25;;
  esac
  pack
done
