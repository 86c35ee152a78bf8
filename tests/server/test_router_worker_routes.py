"""What a router asks a replica besides generation: vLLM's render routes (POST /v1/chat/completions/render, POST
/v1/completions/render), through which vllm-router and llm-d tokenize a request to route it by prefix. Their token
ids must be the ones the generation routes run on, or a router's prefix index would never match the replica's
cache; their errors are the generation routes' errors. Against the shared served m3-tiny (tests/conftest.py).
"""

from __future__ import annotations

from tests.helpers.server_utils import SERVED_MODEL, post

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def test_chat_render_gives_the_ids_a_chat_completion_runs_on(server):
    resp = post(server, "/v1/chat/completions/render", {"messages": CHAT, "max_tokens": 5, "temperature": 0,
                                                        "cache_salt": "tenant-a"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                         "stream_options", "cache_salt", "priority", "kv_transfer_params"}
    assert body["request_id"].startswith("chatcmpl-") and body["model"] == SERVED_MODEL
    assert body["cache_salt"] == "tenant-a" and body["features"] is None and body["stream"] is False
    assert body["sampling_params"]["max_tokens"] == 5 and body["sampling_params"]["temperature"] == 0
    ran = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "return_token_ids": True}).json()
    assert body["token_ids"] == ran["prompt_token_ids"]
    tokenized = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": True}).json()["tokens"]
    assert body["token_ids"] == tokenized


def test_completion_render_gives_one_request_per_prompt(server):
    resp = post(server, "/v1/completions/render", {"prompt": ["Once upon", "a time"], "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    first, second = resp.json()
    assert first["request_id"] != second["request_id"] and first["token_ids"] != second["token_ids"]
    ran = post(server, "/v1/completions", {"prompt": "Once upon", "max_tokens": 1, "return_token_ids": True}).json()
    assert first["token_ids"] == ran["choices"][0]["prompt_token_ids"]


def test_render_refuses_what_generation_refuses(server):
    bad_model = post(server, "/v1/chat/completions/render", {"messages": CHAT, "model": "nope"})
    assert bad_model.status_code == 404 and bad_model.json()["error"]["param"] == "model"
    bad_field = post(server, "/v1/completions/render", {"prompt": "x", "max_tokens": -1})
    assert bad_field.status_code == 400 and bad_field.json()["error"]["param"] == "max_tokens"
