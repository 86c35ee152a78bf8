#!/usr/bin/env bash
# One device call for long-context TTFT and the MoE at large M (about five minutes on one H200):
#   1. scripts/tune_moe.py at 4,096 and 16,384 tokens (TMA descriptors as one coordinate), writing the winners into
#      this checkout's kernels/configs.py (copied to $OUT), plus the 1- and 16-token bandwidth of the table;
#   2. scripts/gpu_prefill18c.py: W4-128k TTFT after the earlier 16k warm-up vs warm, builds counted;
#   3. python -m nanoserve.bench --workloads W4 --w4-lens 32768,131072 --profile-prefill W4 (the bench as fixed).
#   OUT=... [TUNE_BUDGET=130] bash scripts/gpu_prefill18c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
W=/tmp/prefill18c; mkdir -p "$W"
pack() { tar czf "$OUT/prefill18c.tgz" -C "$W" . 2>/dev/null; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv | tee "$W/gpu.txt"
timeout 170 python3 scripts/tune_moe.py --tokens 4096,16384 --budget "${TUNE_BUDGET:-130}" --decode-check \
  --write-configs --out "$W/moe" 2>&1 | tee "$W/tune_moe.txt" | grep -v "skipped" | tail -8
cp nanoserve/kernels/configs.py "$W/configs.py"; pack
OUT=$W timeout 70 python3 scripts/gpu_prefill18c.py > "$W/warmup_cause.txt" 2>&1; echo "warmup_cause exit $?"
tail -5 "$W/warmup_cause.txt"; pack
timeout 110 python3 -m nanoserve.bench --workloads W4 --w4-lens 32768,131072 --profile-prefill W4 --out "$W/bench" \
  > "$W/bench.txt" 2>&1; echo "bench exit $?"; pack
grep -E "^W4-|warm-up \(cold\)|WARNING|^Prefill profile|^(dense attention|MoE GEMM|GEMMs|MSA sparse|MSA index)" \
  "$W/bench.txt" | cut -c1-230 | tail -22
echo "=== moe ==="; grep -E "T= *[0-9]+:|decode T=" "$W/tune_moe.txt"
