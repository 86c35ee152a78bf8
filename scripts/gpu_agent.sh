#!/usr/bin/env bash
# One device call: an agent session against `python -m nanoserve.server --model m3-slice --enable-auto-tool-choice
# --tool-call-parser minimax_m3 --reasoning-parser minimax_m3`, driven by the openai SDK (scripts/gpu_agent.py).
# The server's and the client's wheels (fastapi, uvicorn, xgrammar, openai, httpx, ...) are not on the GPU machine:
# they come in .whl/ (docs/benchmarks.md), every one installed here.
#   OUT=... bash scripts/gpu_agent.sh [gpu_agent.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout "${AGENT_TIMEOUT:-540}" python3 scripts/gpu_agent.py --out "$OUT" "$@" > "$OUT/agent_log.txt" 2>&1
echo "agent exit $?"; tail -c 5000 "$OUT/agent_log.txt"
