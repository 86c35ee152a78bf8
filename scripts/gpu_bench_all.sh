#!/usr/bin/env bash
# One command for the GPU run: every workload, the HF baseline, the ablations and the profiles, within ~9 minutes.
# Results (results.json, summary.txt, ablation/profile tables, PNG plots) go to $OUT (default ./bench-out).
#   NANOSERVE_GIT_COMMIT=<hash> bash scripts/gpu_bench_all.sh [--budget 540] [--parts W1,W2,...]
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-bench-out}"
mkdir -p "$OUT"
if [ -z "${NANOSERVE_GIT_COMMIT:-}" ] && git rev-parse HEAD >/dev/null 2>&1; then
  export NANOSERVE_GIT_COMMIT="$(git rev-parse HEAD)"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>/dev/null || true
exec python3 scripts/gpu_bench_all.py --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
