"""W3's closed loop without HTTP: C asyncio clients drive an AsyncLLMEngine in this process (1024-token prompts,
256 output tokens, ignore_eos, greedy), so a difference between async_scheduling on and off here is the engine's,
and one seen only through the server is the HTTP side's. Prints per-setting throughput, TTFT and E2E percentiles,
and where the slowest requests waited (steps until admission, preemptions).

    python scripts/gpu_async_loop.py --async-scheduling on|off [--model m3-slice] [--concurrency 64] [--requests 256]

One setting per process (a second engine in the same process would not fit beside the first's KV pool).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from nanoserve.config import EngineConfig, Optimizations
from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.sampling import SamplingParams


async def closed_loop(engine: AsyncLLMEngine, concurrency: int, total: int, prompt_len: int, out_len: int,
                      vocab: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    ttft, e2e, counter = [], [], iter(range(total))

    async def client() -> None:
        for i in counter:
            prompt = rng.integers(10, vocab, prompt_len).tolist()
            t0 = time.perf_counter()
            first = None
            async for _ in engine.generate(f"r{seed}-{i}", {"prompt_token_ids": prompt}, params):
                if first is None:
                    first = time.perf_counter() - t0
            ttft.append(first)
            e2e.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    pct = lambda xs, q: float(np.percentile(np.asarray(xs) * 1e3, q))  # noqa: E731
    return {"out_tok_s": total * out_len / wall, "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "ttft_mean_ms": float(np.mean(ttft) * 1e3), "e2e_p50_ms": pct(e2e, 50), "e2e_p99_ms": pct(e2e, 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--async-scheduling", choices=["on", "off"], default="on")
    args = ap.parse_args()
    for setting in (args.async_scheduling,):
        opts = Optimizations(async_scheduling=setting == "on")
        config = EngineConfig(model=args.model, max_model_len=args.max_model_len, optimizations=opts)
        engine = AsyncLLMEngine.from_config(config)
        steps: list[tuple[int, int, int]] = []  # per step: decodes, prefill tokens, waiting
        engine.engine.add_observer(lambda name, scheduled=None, **_: steps.append(
            (sum(1 for s in scheduled if s.is_decode), sum(s.num_new_tokens for s in scheduled if not s.is_decode),
             engine.engine.num_waiting)) if name == "step" else None)

        async def run() -> list[dict]:
            await engine.start()
            try:
                warm = await closed_loop(engine, args.concurrency, args.concurrency, args.prompt_len,
                                         args.output_len, engine.engine.model_config.vocab_size, 1)
                steps.clear()
                timed = await closed_loop(engine, args.concurrency, args.requests, args.prompt_len,
                                          args.output_len, engine.engine.model_config.vocab_size, 2)
                return [warm, timed]
            finally:
                await engine.shutdown()

        warm, timed = asyncio.run(run())
        timed["steps"] = len(steps)
        timed["max_waiting"] = max((w for *_, w in steps), default=0)
        timed["steps_with_waiting"] = sum(1 for *_, w in steps if w)
        timed["preemptions"] = engine.engine.stats.num_preemptions
        print(f"async_scheduling {setting}: {json.dumps({k: round(v, 1) for k, v in timed.items()})}", flush=True)


if __name__ == "__main__":
    main()
