"""Prefill/decode disaggregation through vLLM's router: `vllm-router --vllm-pd-disaggregation` in front of m3-mini
server processes started with `--kv-transfer-config` (NixlConnector; NIXL's UCX backend held to TCP, as between two
machines without RDMA), on loopback.

The router sends each request to a prefill server with `max_tokens` 1 and `kv_transfer_params` asking for remote
decode; the prefill server computes the prompt, keeps its KV blocks and answers with the parameters that name them;
the router sends the original request to a decode server with those parameters; the decode server pulls the blocks
(only those its own prefix cache lacks), computes the prompt's last token and decodes. Held here:

- chats (a tool call, thinking, plain; streamed and not) and a completion give, greedy, the answers of one server;
- the decode server computes one prompt token per request (the last, in the last partial block: its
  vllm:prompt_tokens_by_source{source="local_compute"}), the rest comes from the transfer or its prefix cache;
- every block comes back: the prefill server's once the decode server has read them, the decode server's once
  its requests end (vllm:kv_cache_usage_perc 0 on both);
- a decode server killed after the prefill answered and before it read the blocks: the router answers an error,
  the prefill server keeps serving and frees the blocks at VLLM_NIXL_ABORT_REQUEST_TIMEOUT;
- a prefill server killed: the router's health check drops it, and the next requests are served by the other
  prefill server, with the same answers.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest

from tests.helpers.router_utils import RouterProcess
from tests.helpers.server_utils import AGENT_FLAGS, ServerProcess, free_port, metric, post, wait_until

MODEL = "m3-mini"
ABORT_TIMEOUT_S = 4
"""The prefill server's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: short, so that the test of a decode server killed before
its pull sees the blocks freed, and long enough for every decode server's pull to come first."""
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
WEATHER = {"messages": [{"role": "user", "content": "What's the weather like in Paris?"}], "tools": [WEATHER_TOOL],
           "tool_choice": "auto", "max_tokens": 36}
THINKING = {"messages": [{"role": "user", "content": "What is 48 + 37?"}], "max_tokens": 16,
            "chat_template_kwargs": {"thinking_mode": "enabled"}}
GREETING = {"messages": [{"role": "system", "content": "You are a helpful assistant. " * 20},
                         {"role": "user", "content": "Hello there, who are you?"}], "max_tokens": 8}
STORY = {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 8}
REQUESTS = [("chat", WEATHER, False), ("chat", WEATHER, True), ("chat", THINKING, False), ("chat", THINKING, True),
            ("chat", GREETING, True), ("completion", STORY, False), ("completion", STORY, True)]
"""(endpoint, body, stream): the requests every P/D run sends at once."""


def pd_server(logs, name: str, role: str) -> ServerProcess:
    """An m3-mini server with the agent flags and a NIXL connector in `role`, its side channel on a free port."""
    env = {"UCX_TLS": "tcp", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(ABORT_TIMEOUT_S)}
    config = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": name}
    return ServerProcess(MODEL, logs / f"{name}.log", *AGENT_FLAGS, "--max-model-len", "2048",
                         "--kv-transfer-config", json.dumps(config), name=MODEL, env=env)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Started together: prefill (also the one-server reference), decode, and a second prefill server. The
    failure tests kill servers, so they come last, in this order: the second prefill server, then the decode
    server."""
    logs = tmp_path_factory.mktemp("pd")
    procs = {"prefill": pd_server(logs, "prefill", "kv_producer"),
             "decode": pd_server(logs, "decode", "kv_consumer"), "prefill2": pd_server(logs, "prefill2", "kv_producer")}
    try:
        for p in procs.values():
            p.__enter__()
        yield procs
    finally:
        for p in procs.values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)  # (a stopped process is killed all the same, but be tidy)
            p.__exit__()


def pd_router(tmp_path, prefill: list[ServerProcess], decode: list[ServerProcess], *args: str) -> RouterProcess:
    urls = [a for p in prefill for a in ("--prefill", p.url)] + [a for d in decode for a in ("--decode", d.url)]
    return RouterProcess(tmp_path / "router.log", [], "--vllm-pd-disaggregation", *urls, "--policy", "round_robin",
                         *args)


def send_all(base_url: str, requests=REQUESTS) -> list:
    """Every request at once, greedy; each answer as (text, reasoning, tool calls, finish reason)."""
    from openai import AsyncOpenAI

    async def one(client, endpoint: str, body: dict, stream: bool):
        kwargs = dict(model=MODEL, temperature=0, stream=stream,
                      **{k: v for k, v in body.items() if k != "chat_template_kwargs"})
        if "chat_template_kwargs" in body:
            kwargs["extra_body"] = {"chat_template_kwargs": body["chat_template_kwargs"]}
        if endpoint == "completion":
            out = await client.completions.create(**kwargs)
            if not stream:
                return out.choices[0].text, out.choices[0].finish_reason
            text, finish = "", None
            async for chunk in out:
                text += chunk.choices[0].text if chunk.choices else ""
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            return text, finish
        out = await client.chat.completions.create(**kwargs)
        if not stream:
            m = out.choices[0].message
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
            return m.content or "", getattr(m, "reasoning_content", None) or "", calls, out.choices[0].finish_reason
        text, reasoning, names, args, finish = "", "", [], "", None
        async for chunk in out:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                names += [call.function.name] if call.function.name else []
                args += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, reasoning, [(n, json.loads(args)) for n in names], finish

    async def run() -> list:
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, *r) for r in requests))
        finally:
            await client.close()

    return asyncio.run(run())


def scrape(s: ServerProcess) -> str:
    return httpx.get(f"{s.url}/metrics", timeout=10).text


def by_source(s: ServerProcess) -> dict[str, float]:
    text = scrape(s)
    return {src: metric(text, "vllm:prompt_tokens_by_source_total", source=src)
            for src in ("local_compute", "local_cache_hit", "external_kv_transfer")}


def blocks_in_use(s: ServerProcess) -> float:
    return metric(scrape(s), "vllm:kv_cache_usage_perc")


def test_pd_through_the_router_gives_one_servers_answers(servers, tmp_path):
    prefill, decode = servers["prefill"], servers["decode"]
    single = send_all(prefill.url)  # one server: the prefill server itself, asked plainly
    assert [a[-1] for a in single[:2]] == ["tool_calls", "tool_calls"] and single[2][1], single  # a call, thinking
    before = by_source(decode)
    with pd_router(tmp_path, [prefill], [decode]) as router:
        assert send_all(router.url) == single
        # again, some: the decode server's prefix cache holds their prompts now, it pulls only the last block
        assert send_all(router.url, REQUESTS[::2]) == single[::2]
    moved = {k: v - before[k] for k, v in by_source(decode).items()}
    # the decode server computed each prompt's last token only; the rest was pulled or found in its prefix cache
    assert moved["local_compute"] == len(REQUESTS) + len(REQUESTS[::2]), moved
    assert moved["external_kv_transfer"] > 0 and moved["local_cache_hit"] > 0, moved
    wait_until(lambda: blocks_in_use(prefill) == 0 and blocks_in_use(decode) == 0, timeout=10,
               what="every KV block to come back on both servers")


@pytest.mark.parametrize("body, message", [
    ({"prompt": "Hi", "kv_transfer_params": "yes"}, "Input should be an object"),
    ({"prompt": "Hi", "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p"}},
     "remote_request_id must be a non-empty string"),
    ({"prompt": "Hi", "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "only with n 1"),
    ({"prompt": ["Hi", "Ho"], "kv_transfer_params": {"do_remote_decode": True}}, "only with one prompt"),
    ({"prompt": "Hi", "stream": True, "kv_transfer_params": {"do_remote_decode": True}}, "needs stream false"),
    ({"prompt": "Hi", "kv_transfer_params": {"do_remote_decode": True}}, "this server transfers no KV"),
])
def test_kv_transfer_params_the_server_cannot_honour_are_a_400_naming_them(server, body, message):
    """On the shared m3-tiny server, which has no connector."""
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params", resp.text
    assert message in resp.json()["error"]["message"], resp.text


def test_a_server_refuses_the_role_it_does_not_have(servers):
    resp = httpx.post(f"{servers['decode'].url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": GREETING["messages"], "kv_transfer_params": {"do_remote_decode": True}})
    assert resp.status_code == 400 and "do_remote_decode needs kv_role kv_producer" in resp.text, resp.text


def test_a_prefill_server_killed_is_dropped_by_the_routers_health_check(servers, tmp_path):
    doomed, prefill, decode = servers["prefill2"], servers["prefill"], servers["decode"]
    single = send_all(prefill.url, REQUESTS[:3])
    with pd_router(tmp_path, [doomed, prefill], [decode], "--health-check-interval-secs", "1",
                   "--health-failure-threshold", "1") as router:
        doomed.proc.kill()
        doomed.proc.wait()
        wait_until(lambda: metric(router.metrics(), "vllm_router_worker_health", worker=doomed.url) == 0,
                   timeout=30, what="the router's health check to drop the killed prefill server")
        assert send_all(router.url, REQUESTS[:3] * 2) == single * 2  # round robin: each would have met it once
    wait_until(lambda: blocks_in_use(prefill) == 0 and blocks_in_use(decode) == 0, timeout=10,
               what="every KV block to come back on both servers")


def test_a_decode_server_killed_before_it_reads_the_blocks(servers, tmp_path):
    """The decode server is stopped, so the router's decode request waits in its socket while the prefill server
    holds the prompt's blocks (and serves other requests meanwhile); then it is killed. The router answers the
    client with an error, and the prefill server frees the blocks once its abort timeout has passed."""
    prefill, decode = servers["prefill"], servers["decode"]
    with pd_router(tmp_path, [prefill], [decode]) as router:
        decode.proc.send_signal(signal.SIGSTOP)
        answer: list = []

        def client() -> None:
            try:
                answer.append(httpx.post(f"{router.url}/v1/chat/completions", timeout=60, json={
                    "model": MODEL, "messages": GREETING["messages"], "max_tokens": 8, "temperature": 0}))
            except httpx.HTTPError as exc:
                answer.append(exc)

        thread = threading.Thread(target=client)
        thread.start()
        wait_until(lambda: blocks_in_use(prefill) > 0, timeout=30, what="the prefill server to hold the blocks")
        # not stalled: a plain request is served while the blocks wait
        plain = httpx.post(f"{prefill.url}/v1/completions", timeout=30,
                           json={"model": MODEL, **STORY, "temperature": 0})
        assert plain.status_code == 200, plain.text
        decode.proc.kill()
        decode.proc.wait()
        thread.join(60)
        [got] = answer
        assert isinstance(got, httpx.HTTPError) or got.status_code >= 500, got.text
    wait_until(lambda: blocks_in_use(prefill) == 0, timeout=ABORT_TIMEOUT_S + 10,
               what="the prefill server to free the unread blocks at its timeout")
