"""The HTTP server end to end: a real uvicorn server on a loopback port, driven by the official openai client,
httpx and raw sockets. One module-scoped server (with an API key) serves every test here."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.chat_template import render_chat, template_messages
from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server import build_app
from tests.helpers.server_utils import (
    FAST_CPU,
    KV_CACHE_TOKENS,
    MAX_MODEL_LEN,
    ServerThread,
    engine_config,
    metric,
    wait_until,
)

API_KEY = "sk-test"
MODEL = "m3-tiny-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The attention layers need"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a KV cache?"}]
GREEDY = dict(temperature=0.0, max_tokens=16, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return AsyncLLMEngine.from_config(engine_config(tiny_dir))


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(build_app(engine, MODEL, api_key=API_KEY)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(model=tiny_dir, optimizations=FAST_CPU, max_model_len=MAX_MODEL_LEN, kv_cache_tokens=KV_CACHE_TOKENS,
               device="cpu")


def assert_idle_and_free(engine: AsyncLLMEngine) -> None:
    """No request left in the engine, every KV block back in the pool, the block manager consistent."""
    eng = engine.engine
    wait_until(lambda: not eng.requests and not engine.num_in_flight, what="the engine to go idle")
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


# -- the openai client: completions and chat, streaming and not --------------------------------------------
def test_completion_matches_offline_generate(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    ref = offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == "length"
    assert resp.model == MODEL and resp.object == "text_completion"
    tok = offline.get_tokenizer()
    assert resp.usage.prompt_tokens == len(tok.encode(PROMPT, add_special_tokens=False)) == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 16
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 16


def test_completion_streaming_equals_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_offline_chat(client, offline):
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    ref = offline.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    tok = offline.get_tokenizer()
    rendered = render_chat(tok, template_messages(CHAT))
    assert rendered.startswith("]~!b[]~b]system\n") and rendered.endswith(
        "]~b]developer\nYou are terse.[e~[\n]~b]user\nWhat is a KV cache?[e~[\n]~b]ai\n")
    assert resp.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert resp.usage.completion_tokens == 16


def test_chat_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12,
                                                 temperature=0.0, extra_body={"ignore_eos": True}, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12 == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_template_kwargs_pass_through(client, offline):
    tok = offline.get_tokenizer()
    for mode in ("enabled", "disabled"):
        resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"thinking_mode": mode}})
        rendered = render_chat(tok, template_messages(CHAT), chat_template_kwargs={"thinking_mode": mode})
        assert rendered.endswith("<mm:think>" if mode == "enabled" else "</mm:think>")
        assert resp.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError, match="thinking_mode must be"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"thinking_mode": "sometimes"}})


def test_n_seed_and_logprobs(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7, logprobs=2,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1  # the n completions differ
    assert a.usage.completion_tokens == 18
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in content)
    assert all(t.logprob <= t.top_logprobs[0].logprob + 1e-6 for t in content)


def test_prompt_lists_and_token_ids(client, offline):
    ids = offline.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    resp = client.completions.create(model=MODEL, prompt=[PROMPT, "Prefix caching"], n=2, **GREEDY)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text  # greedy: both completions alike
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == resp.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    streamed = list(client.completions.create(model=MODEL, prompt=[ids, [5, 6, 7]], stream=True, **GREEDY))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}
    assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == 0) == \
        resp.choices[0].text


def test_stop_string_streamed_and_not(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    stop = text[5:8]
    assert len(stop) == 3 and text.find(stop) >= 1
    expected = text[:text.find(stop)]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop], **GREEDY)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected  # held back, never sent then cut


def test_models_and_health(server):
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_openapi_lists_every_post_body(server):
    """/openapi.json describes the request body of every POST route: its fields, which are required, and the
    nested models written out (no reference left dangling)."""
    from nanoserve.server.anthropic.schema import CountTokensRequest, MessagesRequest
    from nanoserve.server.app import ROUTERS
    from nanoserve.server.openai import schema as P
    from nanoserve.server.responses.schema import ResponsesRequest

    doc = httpx.get(f"{server.url}/openapi.json").json()
    posts = {r.path for router in ROUTERS for r in router.routes if "POST" in r.methods}
    assert posts == {p for p, ops in doc["paths"].items() if "post" in ops} >= {"/v1/completions",
                                                                               "/v1/chat/completions"}
    models = {"/v1/completions": P.CompletionRequest, "/v1/chat/completions": P.ChatCompletionRequest,
              "/tokenize": P.TokenizeRequest, "/detokenize": P.DetokenizeRequest, "/v1/responses": ResponsesRequest,
              "/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest}
    for path in posts - {"/ping", "/v1/responses/{response_id}/cancel"}:  # these two take no body
        body = doc["paths"][path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        variants = schema["anyOf"] if path == "/invocations" else [schema]  # a chat or a completion body
        assert body["required"] is True and all(v["type"] == "object" for v in variants), path
        if path in models:
            assert set(schema["properties"]) == set(models[path].model_fields), path
        assert "$ref" not in json.dumps(schema), path
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert set(chat["required"]) == {"messages"}  # the model may be left out (the first served name)
    # any role is passed to the chat template (vLLM's rule: custom roles are the template's business)
    assert chat["properties"]["messages"]["items"]["properties"]["role"]["type"] == "string"
    completion = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    # vLLM's: prompt is optional in the schema (prompt or prompt_embeds); one left out is a 400 with its message
    assert "prompt" in completion["properties"] and not completion.get("required")


# -- concurrency, disconnects, KV blocks -------------------------------------------------------------------
def test_32_concurrent_streams_then_pool_free(server, engine):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int]:
        stream = await aclient.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=12 + i % 5,
                                                  temperature=0.8, seed=i, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        text, finish, usage = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for i, (text, finish, usage) in enumerate(results):
        assert finish == "length" and usage == 12 + i % 5 and text
    assert_idle_and_free(engine)


def _stream_request(body: dict) -> dict:
    return dict(url="/v1/completions", json=dict(model=MODEL, prompt=PROMPT, stream=True, ignore_eos=True,
                                                 max_tokens=MAX_MODEL_LEN - 20, **body), headers=AUTH)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, engine):
    stats = engine.engine.stats
    aborted = stats.num_aborted
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", **_stream_request({})) as resp:
            assert resp.status_code == 200
            events = (line for line in resp.iter_lines() if line.startswith("data: {"))
            assert len([next(events) for _ in range(3)]) == 3
            assert engine.engine.requests  # still generating when the client leaves
    wait_until(lambda: stats.num_aborted == aborted + 1, what="the abort")
    assert stats.num_generation_tokens < 10**6
    assert_idle_and_free(engine)


def test_disconnect_while_waiting_for_a_non_streaming_answer(server, engine):
    stats = engine.engine.stats
    aborted = stats.num_aborted
    body = json.dumps(dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True)).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: engine.engine.requests, what="the request to start")
    wait_until(lambda: stats.num_aborted == aborted + 1, what="the abort")
    assert_idle_and_free(engine)


# -- bad input: the right status and a message naming the problem; the server keeps serving ------------------
def _c(**body):  # a completion body, with a valid default for what a row does not set
    return {"model": MODEL, "prompt": PROMPT, **body}


def _chat(**body):
    return {"model": MODEL, "messages": CHAT, **body}


BAD_INPUTS = [
    # (id, path, body (dict, or raw bytes), headers, status, substrings of the message, param)
    ("malformed-json", "/v1/completions", b'{"model": "x", "prompt": ', AUTH, 400, ["malformed JSON"], None),
    ("body-not-object", "/v1/completions", b"[1, 2]", AUTH, 400, ["JSON object"], None),
    ("unknown-model", "/v1/completions", _c(model="gpt-4"), AUTH, 404, ["gpt-4", "does not exist"], "model"),
    ("missing-prompt", "/v1/completions", {"model": MODEL}, AUTH, 400,
     ["Either prompt or prompt_embeds must be provided and non-empty."], "prompt"),
    ("empty-prompt", "/v1/completions", _c(prompt=""), AUTH, 400, ["prompt is empty"], "prompt"),
    ("empty-prompt-list", "/v1/completions", _c(prompt=[]), AUTH, 400, ["prompt", "empty"], "prompt"),
    ("prompt-too-long", "/v1/completions", _c(prompt=[7] * 600), AUTH, 400, ["too long", "600", "512"], "prompt"),
    ("max-tokens-does-not-fit", "/v1/completions", _c(prompt=[7] * 500, max_tokens=50), AUTH, 400,
     ["max_tokens", "500", "512", "12"], "max_tokens"),
    ("token-id-out-of-vocab", "/v1/completions", _c(prompt=[7, 10**6]), AUTH, 400,
     ["Token id 1000000 is out of vocabulary"], "prompt"),
    ("temperature-negative", "/v1/completions", _c(temperature=-1), AUTH, 400, ["temperature", "-1"],
     "temperature"),
    ("top-p-zero", "/v1/completions", _c(top_p=0), AUTH, 400, ["top_p"], "top_p"),
    ("n-zero", "/v1/completions", _c(n=0), AUTH, 400, ["n must be"], "n"),
    ("max-tokens-zero", "/v1/completions", _c(max_tokens=0), AUTH, 400, ["max_tokens"], "max_tokens"),
    ("logprobs-too-many", "/v1/completions", _c(logprobs=50), AUTH, 400, ["logprobs", "20"], "logprobs"),
    ("presence-penalty-range", "/v1/completions", _c(presence_penalty=5), AUTH, 400, ["presence_penalty"],
     "presence_penalty"),
    ("min-tokens-over-max", "/v1/completions", _c(min_tokens=9, max_tokens=3), AUTH, 400, ["min_tokens"],
     "min_tokens"),
    ("temperature-wrong-type", "/v1/completions", _c(temperature="hot"), AUTH, 400, ["temperature", "number"],
     "temperature"),
    ("max-tokens-float", "/v1/completions", _c(max_tokens=1.5), AUTH, 400, ["max_tokens", "integer"], "max_tokens"),
    ("prompt-wrong-type", "/v1/completions", _c(prompt=123), AUTH, 400, ["prompt", "string"], "prompt"),
    ("stop-wrong-type", "/v1/completions", _c(stop=5), AUTH, 400, ["stop"], "stop"),
    ("stream-options-without-stream", "/v1/completions", _c(stream_options={"include_usage": True}), AUTH, 400,
     ["stream_options"], "stream_options"),
    ("suffix-unsupported", "/v1/completions", _c(suffix="x"), AUTH, 400, ["suffix"], "suffix"),
    ("chat-empty-messages", "/v1/chat/completions", _chat(messages=[]), AUTH, 400, ["messages", "at least 1"],
     "messages"),
    ("chat-bad-role", "/v1/chat/completions", _chat(messages=[{"role": 5, "content": "hi"}]), AUTH, 400,
     ["messages[0].role", "string"], "messages"),
    ("chat-empty-role", "/v1/chat/completions", _chat(messages=[{"role": "", "content": "hi"}]), AUTH, 400,
     ["messages[0].role"], "messages"),
    ("chat-messages-wrong-type", "/v1/chat/completions", _chat(messages="hello"), AUTH, 400, ["messages"],
     "messages"),
    ("chat-top-logprobs-too-many", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), AUTH, 400,
     ["top_logprobs", "20"], "top_logprobs"),
    ("chat-max-completion-tokens-does-not-fit", "/v1/chat/completions", _chat(max_completion_tokens=600), AUTH,
     400, ["max_completion_tokens", "512"], "max_completion_tokens"),
    ("chat-unknown-model", "/v1/chat/completions", _chat(model="nope"), AUTH, 404, ["nope"], "model"),
    ("missing-api-key", "/v1/completions", _c(), {}, 401, ["missing API key"], None),
    ("wrong-api-key", "/v1/completions", _c(), {"Authorization": "Bearer sk-wrong"}, 401, ["invalid API key"],
     None),
    ("unknown-route", "/v1/nope", _c(), AUTH, 404, ["Not Found"], None),
]


@pytest.mark.parametrize("path,body,headers,status,needles,param", [row[1:] for row in BAD_INPUTS],
                         ids=[row[0] for row in BAD_INPUTS])
def test_bad_input(server, path, body, headers, status, needles, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{server.url}{path}", content=content,
                      headers={"Content-Type": "application/json", **headers}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], (needle, error["message"])
    assert error["param"] == param, error
    assert error["type"] == {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}[status]
    assert error["code"] == status  # vLLM's code: the HTTP status


def test_bad_inputs_table_is_big_enough_and_server_keeps_serving(client, engine):
    assert len(BAD_INPUTS) >= 15
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens >= 1
    assert_idle_and_free(engine)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="bad", max_retries=0).models.list()


# -- metrics -----------------------------------------------------------------------------------------------
def test_metrics_move(server, client):
    def scrape() -> str:
        resp = httpx.get(f"{server.url}/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        return resp.text

    before = scrape()
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total"]:
        assert name in before, name
    prompt = "Prefix caching hashes full blocks only, chained on the previous block's hash. " * 2
    for _ in range(2):  # the second run hits the prefix cache
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == 2 * resp.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:time_per_output_token_seconds_count") == 2
    assert delta("vllm:prefix_cache_queries_total") >= 2 * resp.usage.prompt_tokens
    assert delta("vllm:prefix_cache_hits_total") > 0
    assert resp.usage.prompt_tokens_details.cached_tokens > 0
    assert metric(after, "vllm:num_requests_running") == 0


def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(client):
    """vLLM's cache_salt: a prompt served under one salt is a prefix-cache hit only for the same salt - never for
    another salt or for none - on completions and chat alike; an empty salt is a 400 naming the field."""
    prompt = "Tenants share one server but never one another's cached prompt blocks, whatever they send. " * 2

    def cached(salt: str | None, chat: bool = False) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        if chat:
            resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=1, extra_body=extra)
        else:
            resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        return resp.usage.prompt_tokens_details.cached_tokens

    cached("tenant-a")  # fills the cache under tenant-a's salt
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached("tenant-a") > 0
    cached("tenant-a", chat=True)
    assert cached("tenant-c", chat=True) == 0 and cached("tenant-a", chat=True) > 0
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})
    assert err.value.body["param"] == "cache_salt"


def test_priority_needs_the_priority_policy(tiny_dir, client):
    """`priority` (vLLM's): a 400 naming it under first come, first served; served on a server started with
    --scheduling-policy priority, through chat, completions and the Responses API."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 2})
    assert err.value.body["param"] == "priority" and "--scheduling-policy priority" in err.value.body["message"]
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir, scheduling_policy="priority"))
    with ServerThread(build_app(engine, MODEL)) as srv:
        cli = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        out = cli.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": -3})
        chat = cli.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           extra_body={"priority": 7})
        resp = cli.responses.create(model=MODEL, input="x", max_output_tokens=2, extra_body={"priority": 1})
        assert out.usage.completion_tokens == chat.usage.completion_tokens == resp.usage.output_tokens == 2


def test_metrics_count_aborts(server, engine):
    before = metric(httpx.get(f"{server.url}/metrics").text, "vllm:request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", **_stream_request({})) as resp:
            next(ln for ln in resp.iter_lines() if ln.startswith("data: {"))
    wait_until(lambda: not engine.engine.requests, what="the abort")
    time.sleep(0.05)
    after = metric(httpx.get(f"{server.url}/metrics").text, "vllm:request_success_total", finished_reason="abort")
    assert after == before + 1
