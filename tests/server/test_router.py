"""Replicas behind vLLM's router: two m3-mini server processes and the real `vllm-router` binary (the
`vllm-router` wheel, a Rust router) on loopback.

The workload of a service with long shared system prompts: 8 system prompts x 16 questions each, sent
interleaved (prompt 0, 1, ..., 7, 0, 1, ...) by 16 concurrent clients. With `--policy cache_aware` the router keeps
a prefix tree of the texts it sent to each replica and sends a request to the replica that saw the longest prefix
of it, so each system prompt lives on one replica: the replicas split the prompts between them and together hit
their prefix caches as often as one server does. `--policy round_robin` is the control: every replica sees every
prompt, and computes each one once more.

What the router asks a replica for (read from its source and seen in these tests' server logs): GET /health
(before it starts, then every --health-check-interval-secs), and per chat request POST /v1/chat/completions/render
(vLLM's render route; a 404 makes it fall back to) POST /tokenize. In this (regular) mode it asks no model or
load endpoint: its cache_aware tree is keyed by model "unknown" and its load is its own count of requests in
flight. docs/scale_out.md has the commands.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.helpers.router_utils import RouterProcess
from tests.helpers.server_utils import ServerProcess, free_port, metric

MODEL = "m3-mini"
SERVER_FLAGS = ("--max-model-len", "2048", "--kv-cache-tokens", "16384")  # after ServerProcess's own: these win
TOPICS = ("astronomy", "cooking", "contract law", "chess openings", "gardening", "bond markets", "jazz harmony",
          "ocean sailing")
NUM_PROMPTS, PER_PROMPT, CONCURRENCY, MAX_TOKENS = 8, 16, 16, 4


def system_prompt(topic: str) -> str:
    """A long system prompt (about 260 tokens) that differs from the others from its first words on."""
    rules = " ".join(f"Rule {k}: when asked about {topic}, answer briefly, stay on {topic} and be kind." for k in
                     range(10))
    return f"{topic.capitalize()} desk. You are a careful assistant for questions about {topic}. {rules}"


def workload() -> list[list[dict]]:
    """128 chats in the order they are sent: the system prompts interleaved, a different question each time."""
    return [[{"role": "system", "content": system_prompt(TOPICS[j % NUM_PROMPTS])},
             {"role": "user", "content": f"Question {j}: tell me one fact."}]
            for j in range(NUM_PROMPTS * PER_PROMPT)]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two m3-mini server processes, started together, each publishing its KV events (PYTHONHASHSEED fixed, as
    a KV-aware router needs) on its own port, with a replay port beside it."""
    logs = tmp_path_factory.mktemp("replicas")
    servers = []
    for i in range(2):
        events, replay = free_port(), free_port()
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events}",
                  "replay_endpoint": f"tcp://*:{replay}"}
        server = ServerProcess(MODEL, logs / f"replica{i}.log", *SERVER_FLAGS, "--kv-events-config",
                               json.dumps(config), name=MODEL, env={"PYTHONHASHSEED": "0"})
        server.kv_events, server.kv_replay = f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"
        servers.append(server)
    try:
        for s in servers:
            s.__enter__()
        yield servers
    finally:
        for s in servers:
            s.__exit__()


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {"requests": sum(metric(text, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length")),
            "queries": metric(text, "vllm:prefix_cache_queries_total"),
            "hits": metric(text, "vllm:prefix_cache_hits_total")}


def run(base_url: str, replicas: list[ServerProcess], salt: str | None) -> tuple[list[str], list[dict[str, float]]]:
    """Send the workload to `base_url` (greedy; `salt` as every request's cache_salt, so that each run starts from
    cold caches: one run may go unsalted); the answers in workload order and what each replica's counters moved
    by."""
    from openai import AsyncOpenAI

    before = [counters(r.url) for r in replicas]

    async def send_all() -> list[str]:
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(messages: list[dict]) -> str:
            async with gate:
                out = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                                           temperature=0,
                                                           extra_body={"cache_salt": salt} if salt else None)
                return out.choices[0].message.content

        try:
            return await asyncio.gather(*(one(m) for m in workload()))
        finally:
            await client.close()

    answers = asyncio.run(send_all())
    moved = [{k: after[k] - b[k] for k in b} for b, after in zip(before, (counters(r.url) for r in replicas))]
    return answers, moved


def hit_rate(moved: list[dict[str, float]]) -> float:
    return sum(m["hits"] for m in moved) / sum(m["queries"] for m in moved)


def kv_aware_args(replicas: list[ServerProcess]) -> list[str]:
    """vllm-router's kv_aware policy fed by the replicas' KV events (nanoserve's block size is 64, not 16)."""
    args = ["--kv-event-block-size", "64", "--kv-event-model", MODEL]
    for r in replicas:
        args += ["--kv-event-source", f"{r.url}={r.kv_events}", "--kv-event-replay-source", f"{r.url}={r.kv_replay}"]
    return args


def test_routers_spread_prompts_and_keep_the_prefix_cache(replicas, tmp_path):
    """Through the router with cache_aware (its own prefix tree of the texts it sent): every request answered, each
    replica carries at least a quarter of them, the replicas' summed prefix-cache hit rate is at least 90 % of one
    server's on the same requests, and the greedy answers are one server's, token for token. With kv_aware (an
    index of the blocks the replicas' KV events say they hold) the same, but for the hit rate: the router found
    the prompts in its index. round_robin, printed beside them, is the control."""
    single_answers, single = run(replicas[0].url, replicas[:1], salt="single")
    results, index_hits = {}, 0.0
    for policy in ("cache_aware", "kv_aware", "round_robin"):
        args = ["--policy", policy] + (kv_aware_args(replicas) if policy == "kv_aware" else [])
        with RouterProcess(tmp_path / f"{policy}.log", [r.url for r in replicas], *args) as router:
            t0 = time.perf_counter()
            # kv_aware's index leaves requests with a cache_salt to load balancing: its run is the unsalted one
            answers, moved = run(router.url, replicas, salt=None if policy == "kv_aware" else policy)
            results[policy] = (answers, moved, time.perf_counter() - t0)
            if policy == "kv_aware":  # the router's own count of prompts it found in its index of our events
                index_hits = metric(router.metrics(), "vllm_router_kv_placement_lookups_total", result="hit")
    total = NUM_PROMPTS * PER_PROMPT
    print(f"\n{'':<14}{'requests per replica':>22}{'prefix-cache hit rate':>24}")
    print(f"{'one server':<14}{int(single[0]['requests']):>22}{hit_rate(single):>24.1%}")
    for policy, (_, moved, seconds) in results.items():
        split = " / ".join(str(int(m["requests"])) for m in moved)
        extra = f", router index hits {int(index_hits)}/{total}" if policy == "kv_aware" else ""
        print(f"{policy:<14}{split:>22}{hit_rate(moved):>24.1%}   ({seconds:.1f} s{extra})")

    assert single[0]["requests"] == total
    for policy in ("cache_aware", "kv_aware"):
        answers, moved, _ = results[policy]
        assert sum(m["requests"] for m in moved) == total, policy  # every request answered, once
        assert min(m["requests"] for m in moved) >= total / 4, (policy, moved)
        assert answers == single_answers, policy
    moved = results["cache_aware"][1]
    assert hit_rate(moved) >= 0.9 * hit_rate(single), (hit_rate(moved), hit_rate(single))
    # kv_aware found most prompts in its index of the blocks our events published (it weighs that against the
    # replicas' load, so its hit rate is printed, not held to cache_aware's)
    assert index_hits >= total / 2
    rr_answers, rr_moved, _ = results["round_robin"]
    assert rr_answers == single_answers
    assert [m["requests"] for m in rr_moved] == [total / 2, total / 2]
    # the control: with every prompt on both replicas, round_robin computes each system prompt twice
    assert hit_rate(rr_moved) < hit_rate(moved)
