"""The benchmark workloads W1-W6 (docs/benchmarks.md), at full size or scaled down for CPU tests, and W2J.

Prompts are random token ids from a seeded generator (no tokenizer on the measured path), every request sets
ignore_eos so it produces exactly its max_tokens, and all requests of a workload arrive at once. W3 (the HTTP
server sweep) is described here but driven by bench/serve.py.

W2J is W2 (the same prompts) with every request constrained to `W2J_SCHEMA` by structured outputs: what the
grammar mask costs, as its output tok/s against W2's. The schema's last field is an array of at least 256
strings, so no request can complete the format (and stop) before its max_tokens: every request runs full
length, as in W2, with ignore_eos off. Run it with `--workloads W2,W2J`. The mask's cost grows with the
tokenizer's vocabulary: on a preset (m3-slice) the grammar sees the preset's 512-token tokenizer (the other ids
of the 200k-row embedding are never allowed, a cheap case), so W2J there measures the bitmask transfer and kernel
at full width but a small per-row fill; on a checkpoint it is the real tokenizer's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

OFFLINE = ("W1", "W2", "W4", "W5", "W6")
ALL = ("W1", "W2", "W2J", "W3", "W4", "W5", "W6")
W2J_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "title": {"type": "string"},
        "done": {"type": "boolean"},
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": 256},
    },
    "required": ["id", "title", "done", "notes"],
}
"""W2J's format: a few fields, then an array too long to finish within 256 tokens (each item is a token or more)."""
NANO_VLLM_MAX_TOKEN_ID = 10000
"""nano-vllm's bench.py draws prompt ids with randint(0, 10000)."""

FULL = {
    "W1": dict(num_requests=1, prompt_len=1024, output_len=128),
    "W2": dict(num_requests=64, prompt_len=1024, output_len=256),
    "W2J": dict(num_requests=64, prompt_len=1024, output_len=256),
    "W3": dict(concurrency=(1, 4, 16, 64), requests_per_concurrency=10, prompt_len=1024, output_len=256),
    "W4": dict(num_requests=1, prompt_lens=(32768, 131072), output_len=64),
    "W5": dict(num_requests=256, min_len=100, max_len=1024, temperature=0.6),
    "W6": dict(num_requests=32, prefix_len=4096, suffix_len=256, output_len=128),
}
SMALL = {
    "W1": dict(num_requests=1, prompt_len=48, output_len=8),
    "W2": dict(num_requests=4, prompt_len=48, output_len=8),
    "W2J": dict(num_requests=4, prompt_len=48, output_len=8),
    "W3": dict(concurrency=(1, 2), requests_per_concurrency=2, prompt_len=32, output_len=8),
    "W4": dict(num_requests=1, prompt_lens=(96, 192), output_len=4),
    "W5": dict(num_requests=6, min_len=8, max_len=40, temperature=0.6),
    "W6": dict(num_requests=4, prefix_len=48, suffix_len=16, output_len=6),
}
SCALES = {"full": FULL, "small": SMALL}


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    json_schema: dict | None = None  # structured outputs: the output must follow this JSON schema


@dataclass
class Workload:
    name: str  # W1, W2, W4-32k, ...
    family: str  # W1 .. W6
    description: str
    requests: list[Request]
    shared_prefix_len: int = 0
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def greedy(self) -> bool:
        return all(r.temperature == 0.0 for r in self.requests)

    @property
    def uniform(self) -> bool:
        """Same prompt length and max_tokens everywhere (what a static batch, e.g. HF generate, can run)."""
        return len({(len(r.prompt_ids), r.max_tokens) for r in self.requests}) == 1

    @property
    def max_total_len(self) -> int:
        return max(len(r.prompt_ids) + r.max_tokens for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    def kv_tokens(self, block_size: int) -> int:
        """KV slots the workload holds at its peak if every request is resident at once."""
        return sum(-(-(len(r.prompt_ids) + r.max_tokens) // block_size) * block_size for r in self.requests)

    def scaled(self, max_tokens: int | None = None, max_requests: int | None = None, max_prompt: int | None = None,
               seed: int = 1) -> "Workload":
        """A same-shaped copy with fresh random prompts (a warm-up must not seed the prefix cache), optionally
        fewer output tokens, requests, or prompt tokens."""
        rng = np.random.default_rng(seed)
        vocab = max(max(r.prompt_ids) for r in self.requests) + 1
        prefix = rng.integers(0, vocab, self.shared_prefix_len).tolist()
        reqs = []
        for r in self.requests[: max_requests or None]:
            n = len(r.prompt_ids) if max_prompt is None else min(len(r.prompt_ids), max_prompt)
            ids = (prefix + rng.integers(0, vocab, max(n - len(prefix), 0)).tolist())[:n]
            reqs.append(Request(ids, r.max_tokens if max_tokens is None else min(max_tokens, r.max_tokens),
                                r.temperature, r.json_schema))
        return Workload(self.name, self.family, self.description, reqs, min(self.shared_prefix_len,
                        max(len(r.prompt_ids) for r in reqs)), dict(self.params))


def _random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(0, vocab, n).tolist()


def _short(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def build(names: list[str], vocab: int, scale: str = "full", prompt_len: int | None = None,
          output_len: int | None = None, num_requests: int | None = None, w4_lens: list[int] | None = None,
          seed: int = 0) -> list[Workload]:
    """The offline workloads among `names` (W3 is skipped: see bench/serve.py). Overrides apply where the
    workload has that dimension (prompt_len: W1/W2 prompts and W6's distinct suffix; output_len: every output
    length except W5's random ones; num_requests: W2/W5/W6)."""
    spec = SCALES[scale]
    out: list[Workload] = []
    for name in names:
        if name == "W3":
            continue
        if name not in spec:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(ALL)}")
        p = dict(spec[name])
        rng = np.random.default_rng(seed + int(name[1]))  # W2J: W2's seed, so W2's prompts
        if name in ("W1", "W2"):
            n = num_requests if (num_requests and name == "W2") else p["num_requests"]
            plen, olen = prompt_len or p["prompt_len"], output_len or p["output_len"]
            reqs = [Request(_random_ids(rng, plen, vocab), olen) for _ in range(n)]
            what = "decode latency (TTFT, TPOT)" if name == "W1" else "throughput (output tok/s)"
            out.append(Workload(name, name, f"{n} request(s), prompt {plen}, {olen} out, greedy, ignore_eos; {what}",
                                reqs, params=dict(num_requests=n, prompt_len=plen, output_len=olen)))
        elif name == "W2J":
            n = num_requests or p["num_requests"]
            plen, olen = prompt_len or p["prompt_len"], output_len or p["output_len"]
            reqs = [Request(_random_ids(rng, plen, vocab), olen, json_schema=W2J_SCHEMA) for _ in range(n)]
            out.append(Workload(name, "W2", f"{n} requests, prompt {plen}, {olen} out, greedy, every one "
                                f"JSON-schema constrained (W2J_SCHEMA); throughput vs W2", reqs,
                                params=dict(num_requests=n, prompt_len=plen, output_len=olen, structured=True)))
        elif name == "W4":
            olen = output_len or p["output_len"]
            for plen in (w4_lens or p["prompt_lens"]):
                reqs = [Request(_random_ids(rng, plen, vocab), olen)]
                out.append(Workload(f"W4-{_short(plen)}", "W4", f"1 request, prompt {plen}, {olen} out; long-context "
                                    f"TTFT and TPOT (MSA)", reqs, params=dict(prompt_len=plen, output_len=olen)))
        elif name == "W5":
            n = num_requests or p["num_requests"]
            # exactly nano-vllm's bench.py: random.seed(0); ids randint(0, 10000); lengths randint(100, 1024)
            r = random.Random(seed)
            lo, hi = p["min_len"], p["max_len"]
            top = min(NANO_VLLM_MAX_TOKEN_ID, vocab - 1)
            prompts = [[r.randint(0, top) for _ in range(r.randint(lo, hi))] for _ in range(n)]
            olens = [output_len or r.randint(lo, hi) for _ in range(n)]
            reqs = [Request(ids, o, p["temperature"]) for ids, o in zip(prompts, olens)]
            out.append(Workload("W5", "W5", f"{n} requests, in/out uniform {lo}-{hi}, temperature {p['temperature']}, "
                                f"seed {seed} (nano-vllm's bench.py); throughput", reqs,
                                params=dict(num_requests=n, min_len=lo, max_len=hi)))
        elif name == "W6":
            n = num_requests or p["num_requests"]
            prefix = _random_ids(rng, p["prefix_len"], vocab)
            suffix, olen = prompt_len or p["suffix_len"], output_len or p["output_len"]
            reqs = [Request(prefix + _random_ids(rng, suffix, vocab), olen) for _ in range(n)]
            out.append(Workload("W6", "W6", f"{n} requests sharing a {p['prefix_len']}-token prefix + {suffix} "
                                f"distinct tokens, {olen} out; prefix-cache effect", reqs,
                                shared_prefix_len=p["prefix_len"],
                                params=dict(num_requests=n, prefix_len=p["prefix_len"], suffix_len=suffix,
                                            output_len=olen)))
    return out


def serve_spec(scale: str = "full", prompt_len: int | None = None, output_len: int | None = None,
               concurrency: list[int] | None = None, requests_per_concurrency: int | None = None,
               logprobs: int | None = None) -> dict:
    p = dict(SCALES[scale]["W3"])
    p["logprobs"] = logprobs
    if prompt_len:
        p["prompt_len"] = prompt_len
    if output_len:
        p["output_len"] = output_len
    if concurrency:
        p["concurrency"] = tuple(concurrency)
    if requests_per_concurrency:
        p["requests_per_concurrency"] = requests_per_concurrency
    return p
