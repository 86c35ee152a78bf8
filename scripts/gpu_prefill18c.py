"""W4-128k TTFT with the benchmark's earlier warm-up (prompts cut to 16,384 tokens) against a warm engine, in one
process on m3-slice, with the Triton kernel builds counted inside each timed run (bench/compile_watch.py).

    OUT=/tmp/out python scripts/gpu_prefill18c.py

1. warm-up as the benchmark did before: the W4-128k requests with prompts cut to 16,384 tokens, decode graphs
   captured; then the timed W4-128k run (what the closing run of 2026-12-04 reported);
2. the same timed run again (every kernel built now): the steady-state TTFT;
3. the benchmark's warm-up as it is now (full prompt length) on a fresh prompt, then one more timed run.
Writes $OUT/warmup_cause.json and prints a short table.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoserve.bench import workloads as W  # noqa: E402
from nanoserve.bench.session import BenchSession, SessionConfig  # noqa: E402

OUT = os.environ.get("OUT", "prefill18c-out")


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    t0 = time.perf_counter()
    session = BenchSession(SessionConfig(model="m3-slice"))
    wl = W.build(["W4"], session.model_cfg.vocab_size, "full", w4_lens=[131072])[0]
    nano = session.build_nano([wl])
    rows = []

    def timed(tag: str) -> None:
        res = nano.run(wl, keep_tokens=False)
        rows.append({"tag": tag, "ttft_ms": res.ttft_ms["mean"], "tpot_ms": res.tpot_ms["mean"],
                     "builds": res.extra.get("triton_builds"), "kernels": res.extra.get("triton_builds_kernels"),
                     "steps": res.extra.get("steps"), "preemptions": res.extra.get("preemptions")})
        print(f"[{time.perf_counter() - t0:6.1f} s] {tag}: TTFT {rows[-1]['ttft_ms']:.1f} ms, TPOT "
              f"{rows[-1]['tpot_ms']:.3f} ms, builds {rows[-1]['builds']} {rows[-1]['kernels'] or ''}", flush=True)

    warm = nano.warmup(wl, max_prompt=16384)
    rows.append({"tag": "warm-up cut to 16,384 tokens", "ttft_ms": warm.ttft_ms["mean"],
                 "builds": warm.extra.get("triton_builds"), "kernels": warm.extra.get("triton_builds_kernels")})
    timed("timed after the 16k warm-up (the bench before)")
    timed("timed again (steady state)")
    warm = nano.warmup(wl)
    rows.append({"tag": "warm-up at full length (the bench now)", "ttft_ms": warm.ttft_ms["mean"],
                 "builds": warm.extra.get("triton_builds")})
    timed("timed after the full warm-up")
    meta = dict(session.meta, kv_blocks=nano.num_blocks)
    with open(os.path.join(OUT, "warmup_cause.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    print("\n=== W4-128k TTFT and the kernel builds inside each run ===")
    for r in rows:
        print(f"{r['tag']:48s} TTFT {r['ttft_ms']:8.1f} ms  builds {r['builds']}  {r.get('kernels') or ''}")
    session.close_nano()
    return 0


if __name__ == "__main__":
    sys.exit(main())
