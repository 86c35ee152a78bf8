"""Prefill/decode disaggregation through vLLM's router: `vllm-router --vllm-pd-disaggregation` in front of m3-mini
server processes started with `--kv-transfer-config` (NixlConnector; NIXL's UCX backend held to TCP, as between two
machines without RDMA), on loopback.

The router sends each request to a prefill server with `max_tokens` 1 and `kv_transfer_params` asking for remote
decode; the prefill server computes the prompt, keeps its KV blocks and answers with the parameters that name them;
the router sends the original request to a decode server with those parameters; the decode server pulls the blocks
(only those its own prefix cache lacks), computes the prompt's last token and decodes. Held here:

- 50 requests at once - chats with tool calls, thinking, a long shared system prompt, tools offered and not needed,
  and completions, half of them streamed - give, greedy, the answers of one server;
- the decode server computes one prompt token per request (the last, in the last partial block: its
  vllm:prompt_tokens_by_source{source="local_compute"}), the rest comes from the transfer or its prefix cache;
- every block comes back: the prefill server's once the decode server has read them, the decode server's once
  its requests end (vllm:kv_cache_usage_perc 0 on both);
- a decode server killed after the prefill answered and before it read the blocks: the router answers an error,
  the prefill server keeps serving and frees the blocks at VLLM_NIXL_ABORT_REQUEST_TIMEOUT, the router's health
  check drops the dead server and the client's retry is served by the other decode server;
- a prefill server killed: the router's health check drops it, and the next requests are served by the other
  prefill server, with the same answers;
- both servers with MTP speculative decoding: the same answers through the router, and the decode server's drafts
  accepted (the drafter's KV moved with the target's).
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
"""(endpoint, body, stream): the requests the failure tests send at once."""
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Madrid", "Seoul", "Nairobi", "Toronto"]
SUMS = [(48, 37), (12, 9), (305, 17), (64, 64), (7, 58), (250, 125), (99, 1), (13, 29), (420, 80), (6, 7)]
GREETINGS = ["Hello there, who are you?", "Hi! What can you do?", "Good morning.", "Can you help me?",
             "Who made you?", "Tell me about yourself.", "Hey, are you there?", "What is your name?",
             "Nice to meet you.", "How are you today?"]
OPENINGS = ["Once upon a time, in a small village by the sea,", "The train left the station at dawn and",
            "In the year 2150, the last library on Earth", "She opened the old wooden box and found",
            "def fibonacci(n):", "The recipe calls for two cups of flour,", "Dear diary, today was strange because",
            "The quick brown fox", "It was the best of times,", "Step one: unplug the device, then"]
MANY = ([("chat", {**WEATHER, "messages": [{"role": "user", "content": f"What's the weather like in {c}?"}]},
          i % 2 == 1) for i, c in enumerate(CITIES)]
        + [("chat", {**THINKING, "messages": [{"role": "user", "content": f"What is {a} + {b}?"}]}, i % 2 == 0)
           for i, (a, b) in enumerate(SUMS)]
        + [("chat", {**GREETING, "messages": [GREETING["messages"][0], {"role": "user", "content": g}]}, i % 2 == 1)
           for i, g in enumerate(GREETINGS)]
        + [("chat", {**WEATHER, "messages": [{"role": "user", "content": f"What is {a} times {b}?"}]}, i % 2 == 0)
           for i, (a, b) in enumerate(SUMS)]
        + [("completion", {**STORY, "prompt": o}, i % 2 == 1) for i, o in enumerate(OPENINGS)])
"""50 requests of five kinds (tool calls asked for, thinking, a long shared system prompt, tools offered and not
needed, completions), half streamed: what the router's P/D run sends at once."""


def pd_server(logs, name: str, role: str, *flags: str) -> ServerProcess:
    """An m3-mini server with the agent flags and a NIXL connector in `role`, its side channel on a free port."""
    env = {"UCX_TLS": "tcp", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(ABORT_TIMEOUT_S)}
    config = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": name}
    return ServerProcess(MODEL, logs / f"{name}.log", *AGENT_FLAGS, "--max-model-len", "2048",
                         "--kv-transfer-config", json.dumps(config), *flags, name=MODEL, env=env)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Started together: prefill (also the one-server reference), decode, and a second prefill and a second decode
    server. The failure tests kill the second ones, so they come last."""
    logs = tmp_path_factory.mktemp("pd")
    procs = {name: pd_server(logs, name, "kv_producer" if name.startswith("prefill") else "kv_consumer")
             for name in ("prefill", "decode", "prefill2", "decode2")}
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
    single = send_all(prefill.url, MANY)  # one server: the prefill server itself, asked plainly
    finish = [a[-1] for a in single]
    assert finish[:10].count("tool_calls") >= 8 and all(a[1] for a in single[10:20]), single  # calls, thinking
    again = MANY[::5]
    before = by_source(decode)
    with pd_router(tmp_path, [prefill], [decode]) as router:
        assert send_all(router.url, MANY) == single
        # again, some: the decode server's prefix cache holds their prompts now, it pulls only the last block
        assert send_all(router.url, again) == single[::5]
    moved = {k: v - before[k] for k, v in by_source(decode).items()}
    # the decode server computed each prompt's last token only; the rest was pulled or found in its prefix cache
    assert moved["local_compute"] == len(MANY) + len(again), moved
    assert moved["external_kv_transfer"] > 0 and moved["local_cache_hit"] > 0, moved
    wait_until(lambda: blocks_in_use(prefill) == 0 and blocks_in_use(decode) == 0, timeout=10,
               what="every KV block to come back on both servers")


def test_pd_with_mtp_on_both_servers_gives_one_servers_answers(tmp_path):
    """Both servers started with MTP k=3 (the drafter's KV pools move with the target's): through the router, the
    answers of the prefill server asked plainly, and the decode server's drafts are accepted."""
    mtp = ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3}))
    requests = MANY[10:20]  # the sums, with thinking: long answers, where drafts pay
    with pd_server(tmp_path, "mtp-prefill", "kv_producer", *mtp) as prefill, \
            pd_server(tmp_path, "mtp-decode", "kv_consumer", *mtp) as decode:
        single = send_all(prefill.url, requests)
        with pd_router(tmp_path, [prefill], [decode]) as router:
            assert send_all(router.url, requests) == single
        assert by_source(decode)["local_compute"] == len(requests)  # the prompts' last tokens only
        assert metric(scrape(decode), "vllm:spec_decode_num_accepted_tokens_total") > 0
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
    """Two decode servers; one is stopped, so the router's decode request waits in its socket while the prefill server
    holds the prompt's blocks (and serves other requests meanwhile); then it is killed. The router answers that
    request with an error (vllm-router does not retry a failed decode itself), the prefill server frees the blocks
    once its abort timeout has passed, the router's health check drops the dead server, and the client's retry is
    served by the other decode server with one server's answer."""
    prefill, doomed, decode = servers["prefill"], servers["decode2"], servers["decode"]
    body = {"model": MODEL, "messages": GREETING["messages"], "max_tokens": 8, "temperature": 0}
    single = httpx.post(f"{prefill.url}/v1/chat/completions", timeout=60, json=body).json()["choices"][0]["message"]
    with pd_router(tmp_path, [prefill], [doomed, decode], "--health-check-interval-secs", "1",
                   "--health-failure-threshold", "1") as router:
        doomed.proc.send_signal(signal.SIGSTOP)
        answers: list = []

        def client() -> None:
            try:
                answers.append(httpx.post(f"{router.url}/v1/chat/completions", timeout=60, json=body))
            except httpx.HTTPError as exc:
                answers.append(exc)

        # round robin: of two requests at once, one goes to each decode server
        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        held: list[bool] = []  # (seen at any poll: the blocks go back at the abort timeout)
        wait_until(lambda: held.append(blocks_in_use(prefill) > 0) or (len(answers) == 1 and any(held)), timeout=30,
                   what="one answer, and the prefill server holding the other request's blocks")
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["message"] == single
        # not stalled: a plain request is served while the blocks wait
        plain = httpx.post(f"{prefill.url}/v1/completions", timeout=30,
                           json={"model": MODEL, **STORY, "temperature": 0})
        assert plain.status_code == 200, plain.text
        doomed.proc.kill()
        doomed.proc.wait()
        for t in threads:
            t.join(60)
        failed = answers[1]
        assert isinstance(failed, httpx.HTTPError) or failed.status_code >= 500, failed.text
        wait_until(lambda: metric(router.metrics(), "vllm_router_worker_health", worker=doomed.url) == 0,
                   timeout=30, what="the router's health check to drop the killed decode server")
        before = by_source(decode)["local_compute"]
        retry = httpx.post(f"{router.url}/v1/chat/completions", timeout=60, json=body)
        assert retry.status_code == 200 and retry.json()["choices"][0]["message"] == single, retry.text
        assert by_source(decode)["local_compute"] == before + 1  # the other decode server served it
    wait_until(lambda: blocks_in_use(prefill) == 0 and blocks_in_use(decode) == 0, timeout=ABORT_TIMEOUT_S + 10,
               what="the prefill server to free the unread blocks at its timeout, and every block to come back")
