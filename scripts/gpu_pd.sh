#!/usr/bin/env bash
# Prefill/decode disaggregation on one GPU, against one server, in one run:
#   1. one server with the GPU (--gpu-memory-utilization 0.9): W2's requests (1024 tokens in, 256 out, greedy,
#      ignore_eos; 64 at once, and one at a time) through the W3 closed-loop client, and the greedy answers of 8
#      completions (32 tokens each) sent one at a time;
#   2. a prefill server and a decode server on the same GPU at half its memory each (the prefill server takes
#      0.45 of it; the decode server's 0.9 counts the prefill server's share: nanoserve's utilization is of the whole
#      card, others' memory included), NixlConnector between them (UCX picks CUDA IPC on one GPU), behind
#      vllm-router --vllm-pd-disaggregation: the same requests and answers.
# Then a table: TTFT and TPOT (p50, mean) and output tok/s of each at each concurrency, the answers that match (and,
# as their control, the one server's answers to the same 8 asked again, their prompts then from its prefix cache),
# where the decode server's prompt tokens came from (vllm:prompt_tokens_by_source) and the blocks each server still
# holds. Everything goes under $OUT as it is made; the table is printed last and kept in $OUT/table.txt, and all of
# $OUT is packed into $OUT/pd_run.tgz at the end.
#
#   bash scripts/pd_bundle.sh                          # here, with the package index: .pd/pd-a.tar.xz
#   OUT=DIR [MODEL=m3-slice] [QUANT=mxfp8] [CONCURRENCY=1,64] [WARMUP_S=60] bash scripts/gpu_pd.sh
#
# with .pd carried (the GPU tool's `carry`); m3-slice in MXFP8 (26 GiB of weights) fits twice on an 80 GB card.
# On a CPU machine with the packages installed (and no .pd), `MODEL=m3-mini QUANT=bf16 CONCURRENCY=1,4 WARMUP_S=0`
# runs the same steps in a few minutes: a check of the script, not a measurement.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:?set OUT to a directory for the logs and results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
if ls .pd/pd-*.tar.xz >/dev/null 2>&1; then
  mkdir -p /tmp/pdsite
  for f in .pd/pd-*.tar.xz; do tar xJf "$f" -C /tmp/pdsite || exit 1; done
  export PYTHONPATH=/tmp/pdsite:$PWD
fi
python3 -c "import nixl, zmq, msgpack, fastapi, uvicorn, vllm_router.launch_router" 2>"$OUT/imports.txt" \
  || { cat "$OUT/imports.txt"; echo "packages missing: carry .pd (bash scripts/pd_bundle.sh makes it)" >&2; exit 1; }
MODEL=${MODEL:-m3-slice}
QUANT=${QUANT:-mxfp8}
CONCURRENCY=${CONCURRENCY:-1,64}
SERVER=(python3 -m nanoserve.server --model "$MODEL" --quantization "$QUANT" --served-model-name bench
        --max-model-len 4096 --warmup-budget-s "${WARMUP_S:-60}" --log-level warning)
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait 2>/dev/null' EXIT

wait_up() {  # port pid: until GET /health answers 200, while the process lives
  python3 - "$1" "$2" <<'EOF'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(900):
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"the process on port {port} exited")
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(f"port {port} never answered")
EOF
}

measure() {  # url name: the W3 client at each concurrency (W2's shape), then the greedy answers
  timeout 300 python3 -m nanoserve.bench --serve "$1" --served-model-name bench --model "$MODEL" \
    --concurrency "$CONCURRENCY" --requests-per-concurrency 1 --prompt-len 1024 --output-len 256 \
    --out "$OUT/$2" > "$OUT/$2.txt" 2>&1
  echo "$2 sweep exit $?"
  answers "$1" "$OUT/$2_answers.json"
}

answers() {  # url file: 8 greedy completions, one at a time
  python3 - "$1" "$2" <<'EOF'
import json, sys, urllib.request
url, path = sys.argv[1], sys.argv[2]
answers = []
for i in range(8):
    body = {"model": "bench", "prompt": f"Request {i}: " + "a quick brown fox jumps over the lazy dog " * (20 + 9 * i),
            "max_tokens": 32, "temperature": 0, "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        answers.append(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["token_ids"])
    except Exception as exc:  # noqa: BLE001
        answers.append(f"error: {exc}")
json.dump(answers, open(path, "w"))
EOF
}

metrics() {  # port file
  python3 -c "import sys, urllib.request; open(sys.argv[2], 'w').write(urllib.request.urlopen('http://127.0.0.1:' + sys.argv[1] + '/metrics').read().decode())" "$1" "$2"
}

# -- 1. one server ----------------------------------------------------------------------------------------------------
"${SERVER[@]}" --port 8123 --gpu-memory-utilization 0.9 > "$OUT/single_server.txt" 2>&1 &
single=$!
PIDS+=("$single")
wait_up 8123 "$single" || { tail -20 "$OUT/single_server.txt"; exit 1; }
measure http://127.0.0.1:8123 single
# the same 8 again: their prompts' full blocks now come from the prefix cache and only the rest is computed, as on
# a decode server - the control for the answers' comparison (a difference here is the model's rounding, not P/D's)
answers http://127.0.0.1:8123 "$OUT/single_again_answers.json"
kill -TERM "$single"; wait "$single" 2>/dev/null

# -- 2. prefill + decode on the same GPU, behind the router --------------------------------------------------------------
VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=5600 "${SERVER[@]}" --port 8100 \
  --gpu-memory-utilization 0.45 --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}' \
  > "$OUT/prefill_server.txt" 2>&1 &
prefill=$!
PIDS+=("$prefill")
wait_up 8100 "$prefill" || { tail -20 "$OUT/prefill_server.txt"; exit 1; }
"${SERVER[@]}" --port 8200 --gpu-memory-utilization 0.9 \
  --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}' > "$OUT/decode_server.txt" 2>&1 &
decode=$!
PIDS+=("$decode")
wait_up 8200 "$decode" || { tail -20 "$OUT/decode_server.txt"; exit 1; }
python3 -m vllm_router.launch_router --host 127.0.0.1 --port 8000 --vllm-pd-disaggregation \
  --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --policy round_robin --log-level warning \
  > "$OUT/router.txt" 2>&1 &
router=$!
PIDS+=("$router")
wait_up 8000 "$router" || { tail -20 "$OUT/router.txt"; exit 1; }
measure http://127.0.0.1:8000 pd
sleep 2  # the prefill server frees each request's blocks once the decode server has read them
metrics 8100 "$OUT/prefill_metrics.txt"
metrics 8200 "$OUT/decode_metrics.txt"

# -- the table --------------------------------------------------------------------------------------------------------
python3 - "$OUT" > "$OUT/table.txt" <<'EOF'
import json, os, re, sys
out = sys.argv[1]

def levels(name):
    for root, _, files in os.walk(os.path.join(out, name)):
        if "results.json" in files:
            text = json.load(open(os.path.join(root, "results.json")))
            found = []
            def walk(v):
                if isinstance(v, dict):
                    if "levels" in v and isinstance(v["levels"], list):
                        found.extend(v["levels"])
                    for x in v.values():
                        walk(x)
                elif isinstance(v, list):
                    for x in v:
                        walk(x)
            walk(text)
            return {lv["concurrency"]: lv for lv in found}
    return {}

def metric(path, name, **labels):
    total = 0.0
    for line in open(path):
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})? (\S+)$", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total

single, pd = levels("single"), levels("pd")
print("\nP/D on one GPU (prefill + decode at half memory each, vllm-router) against one server")
print(f"{'':<10}{'C':>4}{'ok':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TTFT mean':>11}{'TPOT p50':>10}{'TPOT mean':>11}  (ms)")
for c in sorted(set(single) | set(pd)):
    for name, lv in (("single", single.get(c)), ("P/D", pd.get(c))):
        if lv:
            print(f"{name:<10}{c:>4}{lv['completed']:>5}{lv['output_throughput']:>11.0f}{lv['ttft_ms']['p50']:>10.1f}"
                  f"{lv['ttft_ms']['mean']:>11.1f}{lv['tpot_ms']['p50']:>10.2f}{lv['tpot_ms']['mean']:>11.2f}")
def compare(label, a, b):
    same = sum(x == y for x, y in zip(a, b))
    firsts = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
              for x, y in zip(a, b) if x != y and isinstance(x, list) and isinstance(y, list)]
    print(f"{label}: {same}/{len(a)}" + (f" (the others part at tokens {firsts})" if firsts else ""))

single_a, pd_a, again = (json.load(open(os.path.join(out, f"{n}_answers.json"))) for n in ("single", "pd", "single_again"))
compare("greedy answers identical, P/D against one server", single_a, pd_a)
compare("control: one server asked again, prompts from its prefix cache", single_a, again)
d, p = os.path.join(out, "decode_metrics.txt"), os.path.join(out, "prefill_metrics.txt")
print("decode server's prompt tokens: " + ", ".join(
    f"{s} {metric(d, 'vllm:prompt_tokens_by_source_total', source=s):.0f}"
    for s in ("local_compute", "local_cache_hit", "external_kv_transfer")))
print(f"KV blocks in use after the run: prefill {metric(p, 'vllm:kv_cache_usage_perc'):.3f}, "
      f"decode {metric(d, 'vllm:kv_cache_usage_perc'):.3f}")
EOF
cat "$OUT/table.txt"
# everything in one file as well (a file transfer may return only a few files: the sweeps' JSON is in here)
tar czf /tmp/pd_run.tgz -C "$OUT" . 2>/dev/null && mv /tmp/pd_run.tgz "$OUT/"
