"""W3: a closed-loop client against a running OpenAI-compatible server, measured as `vllm bench serve` measures.

For each concurrency C: 10 x C requests (1024-token text prompts, 256 output tokens, ignore_eos, streaming
/v1/completions), at most C in flight, a new one starting as soon as one finishes (request rate infinite). Per
request, from the SSE stream: TTFT = first chunk - start; ITL = the gaps between consecutive chunks; E2E latency =
last chunk - start; TPOT = (latency - TTFT) / (output tokens - 1), output tokens from the final usage chunk.
Reported per level: mean / median / std / p99 of each (ITL pooled over all requests), request and token
throughputs over the level's duration. C warm-up requests precede each level, untimed.

The HTTP client is aiohttp if installed (the GPU machine has it), else httpx; both are imported only here, so the
offline workloads never need them (nor the server's packages).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

WARMUP_MAX_TOKENS = 16


@dataclass
class RequestRecord:
    ok: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def metric(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "std": float("nan")}
    a = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "std": float(a.std())}


def summarize(records: list[RequestRecord], duration: float, concurrency: int) -> dict:
    """A level's metrics, vllm bench serve's definitions (times in ms)."""
    ok = [r for r in records if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "concurrency": concurrency, "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "output_tokens": out_tokens, "prompt_tokens": in_tokens,
        "ttft_ms": metric([r.ttft for r in ok]), "tpot_ms": metric(tpot),
        "itl_ms": metric([g for r in ok for g in r.itl]), "e2el_ms": metric([r.latency for r in ok]),
    }


def parse_sse_line(line: str) -> dict | None:
    """One 'data: {...}' line -> the JSON chunk; None for blank lines, comments and [DONE]."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


class _Stream:
    """Feeds SSE lines of one response into a RequestRecord, stamping chunk arrival times."""

    def __init__(self, start: float):
        self.start = start
        self.last = start
        self.rec = RequestRecord()
        self.chunks = 0

    def feed(self, line: str) -> None:
        chunk = parse_sse_line(line)
        if chunk is None:
            return
        now = time.perf_counter()
        if chunk.get("choices"):
            if self.chunks == 0:
                self.rec.ttft = now - self.start
            else:
                self.rec.itl.append(now - self.last)
            self.last = now
            self.chunks += 1
        usage = chunk.get("usage")
        if usage:
            self.rec.output_tokens = int(usage.get("completion_tokens") or 0)
            self.rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)

    def finish(self, prompt_tokens: int) -> RequestRecord:
        self.rec.latency = self.last - self.start
        self.rec.output_tokens = self.rec.output_tokens or self.chunks
        self.rec.prompt_tokens = self.rec.prompt_tokens or prompt_tokens
        self.rec.ok = self.chunks > 0
        if not self.rec.ok:
            self.rec.error = "no chunks received"
        return self.rec


CLIENTS = ("aiohttp", "httpx")


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


class _Client:
    """aiohttp if importable, else httpx: post a JSON body and iterate the response's lines."""

    def __init__(self, timeout_s: float, kind: str = "auto"):
        self.timeout_s = timeout_s
        self.kind = kind if kind != "auto" else next((k for k in CLIENTS if _importable(k)), None)
        if self.kind is None:
            raise RuntimeError("W3 needs aiohttp or httpx (pip install aiohttp)")
        if self.kind not in CLIENTS or not _importable(self.kind):
            raise RuntimeError(f"HTTP client {kind!r} is not available (choose from {CLIENTS})")
        self.session = None

    async def __aenter__(self) -> "_Client":
        if self.kind == "aiohttp":
            import aiohttp

            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                                 connector=aiohttp.TCPConnector(limit=0))
        else:
            import httpx

            self.session = httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(max_connections=None))
        return self

    async def __aexit__(self, *exc) -> None:
        if self.kind == "aiohttp":
            await self.session.close()
        else:
            await self.session.aclose()

    async def get_json(self, url: str) -> dict:
        if self.kind == "aiohttp":
            async with self.session.get(url) as r:
                r.raise_for_status()
                return await r.json()
        r = await self.session.get(url)
        r.raise_for_status()
        return r.json()

    async def stream(self, url: str, body: dict, prompt_tokens: int) -> RequestRecord:
        start = time.perf_counter()
        s = _Stream(start)
        try:
            if self.kind == "aiohttp":
                async with self.session.post(url, json=body) as r:
                    if r.status != 200:
                        return RequestRecord(error=f"HTTP {r.status}: {(await r.text())[:200]}")
                    buf = b""
                    async for piece in r.content.iter_any():
                        buf += piece
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            s.feed(line.decode("utf-8", "replace"))
                    if buf:
                        s.feed(buf.decode("utf-8", "replace"))
            else:
                async with self.session.stream("POST", url, json=body) as r:
                    if r.status_code != 200:
                        return RequestRecord(error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    async for line in r.aiter_lines():
                        s.feed(line)
        except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
            return RequestRecord(error=f"{type(e).__name__}: {e}")
        return s.finish(prompt_tokens)


def make_prompts(n: int, prompt_len: int, tokenizer=None, seed: int = 0) -> list[tuple[str | list[int], int]]:
    """n prompts of about prompt_len tokens: text decoded from random token ids (re-encoded and cut to length,
    as vllm's random dataset does) if a tokenizer is given, else the token ids themselves."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if tokenizer is None:
            ids = rng.integers(0, 1000, prompt_len).tolist()
            out.append((ids, prompt_len))
            continue
        vocab = len(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [int(t) for t in rng.integers(0, vocab, prompt_len * 2) if int(t) not in special][:prompt_len]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ids = tokenizer.encode(text, add_special_tokens=False)[:prompt_len]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        out.append((text, len(ids)))
    return out


async def _level(client: _Client, url: str, model: str, warm: list, prompts: list, output_len: int,
                 concurrency: int, logprobs: int | None = None) -> dict:
    def body(prompt, max_tokens: int) -> dict:
        b = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}}
        if logprobs is not None:  # the chosen token's logprob and `logprobs` alternatives with every token
            b["logprobs"] = logprobs
        return b

    # warm-up prompts are distinct from the timed ones, so they seed no prefix-cache hits
    await asyncio.gather(*(client.stream(url, body(p, WARMUP_MAX_TOKENS), n) for p, n in warm))
    queue: asyncio.Queue = asyncio.Queue()
    for item in prompts:
        queue.put_nowait(item)
    records: list[RequestRecord] = []

    async def worker() -> None:
        while True:
            try:
                prompt, n = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records.append(await client.stream(url, body(prompt, output_len), n))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(records, time.perf_counter() - start, concurrency)


async def _sweep(base_url: str, model: str | None, concurrency: list[int], requests_per_concurrency: int,
                 prompt_len: int, output_len: int, tokenizer, seed: int, timeout_s: float, on_level=None,
                 client_kind: str = "auto", logprobs: int | None = None) -> dict:
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    async with _Client(timeout_s, client_kind) as client:
        if model is None:
            models = await client.get_json(f"{base}/v1/models")
            model = models["data"][0]["id"]
        levels = []
        for c in concurrency:
            prompts = make_prompts(requests_per_concurrency * c + c, prompt_len, tokenizer, seed + c)
            lv = await _level(client, f"{base}/v1/completions", model, prompts[:c], prompts[c:], output_len, c,
                              logprobs)
            levels.append(lv)
            if on_level is not None:
                on_level(lv)
    return {"url": base_url, "model": model, "client": client.kind, "prompt_len": prompt_len, "output_len": output_len,
            "requests_per_concurrency": requests_per_concurrency, "logprobs": logprobs, "levels": levels}


def run_sweep(base_url: str, model: str | None = None, concurrency: list[int] = (1, 4, 16, 64),
              requests_per_concurrency: int = 10, prompt_len: int = 1024, output_len: int = 256, tokenizer=None,
              seed: int = 0, timeout_s: float = 3600.0, on_level=None, client: str = "auto",
              logprobs: int | None = None) -> dict:
    """The W3 sweep against `base_url` (http://host:port). `model`: the served name (None = the first listed).
    `client`: "aiohttp", "httpx" or "auto" (the first of those importable). `logprobs`: None sends no logprobs
    field; N asks every request for the chosen token's logprob and N alternatives per token (what logprobs cost
    is the sweep with N against the sweep without)."""
    return asyncio.run(_sweep(base_url, model, list(concurrency), requests_per_concurrency, prompt_len, output_len,
                              tokenizer, seed, timeout_s, on_level, client, logprobs))


def sweep_table(sweep: dict) -> str:
    from nanoserve.bench.report import table

    rows = []
    for lv in sweep["levels"]:
        rows.append([lv["concurrency"], lv["completed"], lv["failed"], lv["output_throughput"],
                     lv["ttft_ms"]["mean"], lv["ttft_ms"]["p50"], lv["ttft_ms"]["p99"], lv["tpot_ms"]["mean"],
                     lv["tpot_ms"]["p50"], lv["tpot_ms"]["p99"], lv["itl_ms"]["p50"], lv["itl_ms"]["p99"],
                     lv["e2el_ms"]["p50"], lv["e2el_ms"]["p99"]])
    title = (f"W3 closed loop: {sweep['url']} model {sweep['model']}, {sweep['prompt_len']} in / "
             f"{sweep['output_len']} out, {sweep['requests_per_concurrency']} x C requests, client {sweep['client']}"
             + (f", logprobs={sweep['logprobs']}" if sweep.get("logprobs") is not None else ""))
    return table(("C", "ok", "fail", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99", "TPOT mean", "TPOT p50",
                  "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "E2E p99"), rows, title)
