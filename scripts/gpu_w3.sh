#!/usr/bin/env bash
# W3 with logprobs off and on, against one server: starts `python -m nanoserve.server --model m3-slice`, runs the
# closed-loop sweep without a logprobs field, with `logprobs=N` on every request, and without again (the two
# "off" sweeps bracket the run's noise), then stops the server. The server's packages come from .whl/ when they
# do not import (the GPU machine has none of them).
#   OUT=... [MODEL=m3-slice] [CONCURRENCY=1,64] [REQS=4] [LOGPROBS=5] [SWEEPS=off,logprobs,off2]
#       [SERVER_ARGS="--no-async-scheduling"] [TAG=label] bash scripts/gpu_w3.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ! python3 -c "import fastapi, uvicorn, prometheus_client" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
OUT=${OUT:-/tmp/w3-out}
MODEL=${MODEL:-m3-slice}
PORT=${PORT:-8123}
mkdir -p "$OUT"
TAG=${TAG:-}
python3 -m nanoserve.server --model "$MODEL" --port "$PORT" --served-model-name bench --max-model-len 4096 \
  --log-level warning ${SERVER_ARGS:-} > "$OUT/w3${TAG}_server_log.txt" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 150); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -20 "$OUT/w3${TAG}_server_log.txt"; exit 1; }
  sleep 2
done
sweep() {  # $1 = label, $2... = extra bench flags
  local label=$1; shift
  timeout 300 python3 -m nanoserve.bench --serve "http://127.0.0.1:$PORT" --served-model-name bench \
    --model "$MODEL" --concurrency "${CONCURRENCY:-1,64}" --requests-per-concurrency "${REQS:-4}" "$@" \
    --out "$OUT/w3${TAG}_$label" > "$OUT/w3${TAG}_$label.txt" 2>&1
  echo "W3${TAG} $label exit $?"
  grep -A8 "^W3 closed loop" "$OUT/w3${TAG}_$label.txt" | tail -9
}
for label in $(echo "${SWEEPS:-off,logprobs,off2}" | tr , ' '); do
  if [ "$label" = logprobs ]; then sweep logprobs --serve-logprobs "${LOGPROBS:-5}"; else sweep "$label"; fi
done
