"""The endpoints around the OpenAI API that vLLM's server has: /tokenize and /detokenize, /version, SageMaker's
/ping and /invocations, /load, several served model names, the CORS flags, 405s with an Allow header, the
OpenAPI document, the content-type check and the error object (also as a stream's error event). A real uvicorn
server on a loopback port."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import openai
import pytest

import nanoserve
from nanoserve.chat_template import render_chat, template_messages
from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server import build_app
from nanoserve.server.__main__ import build_parser
from tests.helpers.server_utils import MAX_MODEL_LEN, ServerThread, engine_config, wait_until

NAMES = ["m3-tiny-test", "alias"]
PROMPT = "vllm1 This is a test prompt."
CHAT = [{"role": "user", "content": "Hi there!"}, {"role": "assistant", "content": "Nice to meet you!"},
        {"role": "user", "content": "Can I ask a question?"}]
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return AsyncLLMEngine.from_config(engine_config(tiny_dir))


@pytest.fixture(scope="module")
def server(engine):
    app = build_app(engine, NAMES, allowed_origins=[ORIGIN], allowed_methods=["GET", "POST"],
                    allowed_headers=["Content-Type", "Authorization"], enable_server_load_tracking=True)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def tok(engine):
    return engine.get_tokenizer()


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kw)


# -- /tokenize and /detokenize -------------------------------------------------------------------------------------

@pytest.mark.parametrize("add_special", [False, True])
def test_tokenize_prompt(server, tok, add_special):
    resp = post(server, "/tokenize", {"model": NAMES[0], "prompt": PROMPT, "add_special_tokens": add_special})
    assert resp.status_code == 200, resp.text
    ids = tok.encode(PROMPT, add_special_tokens=add_special)
    assert resp.json() == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}


def test_tokenize_token_strs(server, tok):
    body = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["token_strs"] == tok.convert_ids_to_tokens(tok.encode(PROMPT))


@pytest.mark.parametrize("add_generation", [False, True])
def test_tokenize_messages(server, tok, add_generation):
    body = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": add_generation}).json()
    text = render_chat(tok, template_messages(CHAT), add_generation_prompt=add_generation)
    assert body["tokens"] == tok.encode(text, add_special_tokens=False) and body["count"] == len(body["tokens"])
    # the ids a chat completion is run on are these
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                 "return_token_ids": True}).json()
    if add_generation:
        assert chat["prompt_token_ids"] == body["tokens"]


def test_tokenize_detokenize_round_trip(server):
    for text in (PROMPT, "héllo 世界 🙂 naïve — ok", "  spaces\tand\nlines  "):
        ids = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert post(server, "/detokenize", {"model": NAMES[1], "tokens": ids}).json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_requests(server, path, body, param):
    resp = post(server, path, body)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


# -- small endpoints ---------------------------------------------------------------------------------------------

def test_version_ping_health(server):
    assert httpx.get(f"{server.url}/version").json() == {"version": nanoserve.__version__}
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_invocations_route_by_body(server):
    chat = post(server, "/invocations", {"messages": CHAT, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = post(server, "/invocations", {"prompt": PROMPT, "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    bad = post(server, "/invocations", {"neither": 1})
    assert bad.status_code == 400 and "ChatCompletionRequest" in bad.json()["error"]["message"]


def test_server_load_counts_requests_in_flight(server):
    assert httpx.get(f"{server.url}/load").json() == {"server_load": 0}
    # a request in flight, held open deterministically: its body is still arriving
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        wait_until(lambda: httpx.get(f"{server.url}/load").json() == {"server_load": 1}, what="the load to rise")
        assert httpx.get(f"{server.url}/tokenize", params={}).status_code == 405  # other routes are not counted
        assert httpx.get(f"{server.url}/load").json() == {"server_load": 1}
        sock.sendall(body[5:])
        assert b"200 OK" in sock.recv(65536)
    wait_until(lambda: httpx.get(f"{server.url}/load").json() == {"server_load": 0}, what="the load to drop")


def test_several_served_model_names(server):
    listed = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == NAMES
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    for name in NAMES:
        assert client.completions.create(model=name, prompt=PROMPT, max_tokens=1).model == name
    resp = post(server, "/v1/completions", {"model": "other", "prompt": PROMPT})
    assert resp.status_code == 404 and resp.json()["error"] == {
        "message": resp.json()["error"]["message"], "type": "NotFoundError", "param": "model", "code": 404}
    assert "other" in resp.json()["error"]["message"]


def test_cors(server):
    pre = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    other = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    simple = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_cors_flags_parse_as_vllm_does():
    args = build_parser().parse_args(["--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET"]',
                                      "--allowed-headers", '["X-Key"]', "--allow-credentials",
                                      "--served-model-name", "a", "b", "--enable-server-load-tracking"])
    assert args.allowed_origins == ["https://a.example"] and args.allowed_methods == ["GET"]
    assert args.allowed_headers == ["X-Key"] and args.allow_credentials
    assert args.served_model_name == ["a", "b"] and args.enable_server_load_tracking
    defaults = build_parser().parse_args([])
    assert defaults.allowed_origins == defaults.allowed_methods == defaults.allowed_headers == ["*"]


def test_a_vllm_command_line_parses(capsys):
    """The flags a `vllm serve` command for M3 carries: accepted (--trust-remote-code, --disable-log-requests,
    --disable-log-stats, --kv-cache-dtype auto, --uvicorn-log-level) or refused with a clear message when this
    server cannot do what they ask (an e5m2 fp8 KV cache; contradictory request logging)."""
    from nanoserve.server.__main__ import main

    args = build_parser().parse_args(["--model", "/ckpt", "--trust-remote-code", "--tensor-parallel-size", "8",
                                      "--disable-log-requests", "--disable-log-stats", "--kv-cache-dtype", "auto",
                                      "--uvicorn-log-level", "warning", "--enable-expert-parallel"])
    assert args.trust_remote_code and args.tensor_parallel_size == 8 and args.uvicorn_log_level == "warning"
    assert not args.enable_log_requests
    for argv, words in ((["--kv-cache-dtype", "fp8_e5m2"], "invalid choice: 'fp8_e5m2'"),
                        (["--enable-log-requests", "--disable-log-requests"], "contradicts"),
                        (["--max-log-len", "-1"], "--max-log-len must be >= 0")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err, argv


def test_enable_log_requests_logs_each_request(tiny_dir, caplog):
    """--enable-log-requests: one line per queued request with its id, prompt size and parameters, and with
    --max-log-len the start of its prompt; without it, nothing."""
    app = build_app(AsyncLLMEngine.from_config(engine_config(tiny_dir)), NAMES, log_requests=12)
    with ServerThread(app) as srv, caplog.at_level(logging.INFO, logger="nanoserve.server.submit"):
        for log_requests in (12, None):
            app.state.server.log_requests = log_requests
            caplog.clear()
            httpx.post(f"{srv.url}/v1/completions", json={"prompt": "A long prompt to log", "max_tokens": 1},
                       timeout=60).raise_for_status()
            lines = [r.getMessage() for r in caplog.records if "Received request" in r.getMessage()]
            if log_requests is None:
                assert lines == []
            else:
                [line] = lines
                assert line.startswith("Received request cmpl-") and "prompt_tokens=" in line
                assert "prompt: 'A long promp'" in line and "max_tokens=1" in line


def test_wrong_method_gets_405_with_allow(server):
    resp = httpx.get(f"{server.url}/v1/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert resp.json()["error"]["code"] == 405
    assert httpx.put(f"{server.url}/tokenize").headers["allow"] == "POST"


def test_openapi_describes_every_post_body(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
                 "/invocations"):
        assert path in posts, sorted(posts)
    for path, op in posts.items():
        if path in ("/ping", "/v1/responses/{response_id}/cancel"):  # no body
            continue
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema.get("properties") or schema.get("anyOf"), path
    props = posts["/v1/completions"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    for field in ("prompt_logprobs", "echo", "logit_bias", "allowed_token_ids", "bad_words", "return_token_ids"):
        assert field in props


def test_non_json_content_type_is_refused(server):
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps({"messages": CHAT}),
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 400
    assert "Unsupported Media Type: Only 'application/json' is allowed" in resp.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps({"messages": CHAT, "max_tokens": 1}),
                    headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_error_object(server):
    resp = post(server, "/v1/completions", {"prompt": PROMPT, "temperature": -1})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == "temperature"


def test_help_and_docs_list_every_endpoint_and_field():
    """--help and docs/server_api.md name every route the app serves, and the docs every request field."""
    from pathlib import Path

    from nanoserve.server.anthropic.schema import MessagesRequest
    from nanoserve.server.app import ROUTERS
    from nanoserve.server.openai import schema as P
    from nanoserve.server.responses.schema import ResponsesRequest

    docs = (Path(__file__).resolve().parents[2] / "docs" / "server_api.md").read_text()
    helptext = build_parser().format_help()
    for router in ROUTERS:
        for route in router.routes:
            assert f"`{sorted(route.methods)[-1]} {route.path}" in docs or f"{route.path}`" in docs, route.path
            assert route.path in helptext, route.path
    root = Path(__file__).resolve().parents[2] / "docs"
    for page, model in (("responses_api.md", ResponsesRequest), ("anthropic_api.md", MessagesRequest)):
        text = (root / page).read_text()
        for field in model.model_fields:
            assert f"`{field}`" in text, (page, field)
    for model in (P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest, P.DetokenizeRequest):
        for field in model.model_fields:
            assert f"`{field}`" in docs, (model.__name__, field)
