#!/usr/bin/env bash
# One device call: validate the fused MoE on the GPU (falling back to the reference MoE in the engine run if its
# checks fail), then the engine benchmark parts given in $PARTS under $BUDGET seconds. Everything written goes
# into one tarball in $OUT (the device tool brings back at most 8 files).
#   OUT=... NANOSERVE_GIT_COMMIT=... [ATTN_ARGS=--quick] [MOE_ARGS="..."] PARTS=W1,W2 BUDGET=400 \
#     [BENCH_ARGS="--with-w3 --wheels .whl"] bash scripts/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WORK=/tmp/nanoserve-gpu
mkdir -p "$WORK/bench"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$WORK/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" >> "$WORK/gpu.txt" 2>&1
cat "$WORK/gpu.txt"

if [ -n "${ATTN_ARGS+x}" ]; then
  timeout "${ATTN_TIMEOUT:-120}" python3 scripts/gpu_attention_bench.py ${ATTN_ARGS} > "$WORK/attention_bench.txt" 2>&1
  echo "attention bench exit $?"; tail -25 "$WORK/attention_bench.txt"
fi
SWITCH=()
if [ -n "${MOE_ARGS+x}" ]; then
  timeout "${MOE_TIMEOUT:-170}" python3 scripts/gpu_moe_bench.py ${MOE_ARGS} > "$WORK/moe_bench.txt" 2>&1
  echo "moe bench exit $?"; tail -45 "$WORK/moe_bench.txt"
  if ! grep -q "checks: [0-9]* ok, 0 failed" "$WORK/moe_bench.txt"; then
    echo "!! fused MoE checks did not pass: the engine run uses the reference MoE"; SWITCH=(--switch fused_moe=off)
  fi
fi
if [ -n "${PARTS:-}" ]; then
  OUT="$WORK/bench" bash scripts/gpu_bench_all.sh --budget "${BUDGET:-400}" --parts "$PARTS" "${SWITCH[@]}" ${BENCH_ARGS:-} > /dev/null 2>&1
  echo "bench exit $?"
  tail -c 9000 "$WORK/bench/log.txt"
fi
tar czf "$OUT/gpu_session.tgz" -C "$WORK" .
