#!/usr/bin/env bash
# One device call after the architecture step and the agent API: the GPU tests, then W1, W2, W2J (every request
# JSON-schema constrained), W4 (32k, 128k) and W5 on m3-slice in one bench run. xgrammar is not on the GPU
# machine: its wheels come in .whl/ (see docs/benchmarks.md).
#   OUT=... NANOSERVE_GIT_COMMIT=... bash scripts/gpu_final.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/xgrammar-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/xgrammar-*.whl .whl/apache_tvm_ffi-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl \
    .whl/annotated_types-*.whl .whl/typing_inspection-*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import xgrammar, torch; print('xgrammar', xgrammar.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
timeout 150 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests exit $?"; tail -3 "$OUT/gpu_tests.txt"
timeout "${BENCH_TIMEOUT:-390}" python3 -m nanoserve.bench --workloads "${WORKLOADS:-W1,W2,W2J,W4,W5}" \
  --w4-lens 32768,131072 --out "$OUT/bench" > "$OUT/bench_log.txt" 2>&1
echo "bench exit $?"; tail -c 6000 "$OUT/bench_log.txt"
if [ -n "${ABLATE_SWITCHES:-}" ]; then
  timeout "${ABLATE_TIMEOUT:-200}" python3 -m nanoserve.bench --workloads W1 --ablate --ablate-switches "$ABLATE_SWITCHES" \
    --out "$OUT/ablate" > "$OUT/ablate_log.txt" 2>&1
  echo "ablation exit $?"; tail -c 3000 "$OUT/ablate_log.txt"
fi
