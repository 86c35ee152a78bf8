"""Bad input gets a 400 that names the field, never a 500, checked against `python -m nanoserve.server` as a process
of its own (with --reasoning-parser, whose prompt handling once decoded token ids before checking them): every
numeric sampling field at and past the ends of its range (vLLM's ranges), token ids outside the vocabulary,
content blocks and input items whose type is not a string, the messages vLLM's own tests read."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server_utils import AGENT_FLAGS, ServerProcess

I64 = 2**63
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]

# (endpoint, field, value, accepted?); a refused value must be a 400 naming the field
RANGES = [
    (COMPLETIONS, "max_tokens", -1, False), (COMPLETIONS, "max_tokens", 0, False), (COMPLETIONS, "max_tokens", 1, True),
    (CHAT, "max_tokens", -1, False), (CHAT, "max_tokens", 0, False), (CHAT, "max_completion_tokens", -1, False),
    (CHAT, "max_completion_tokens", 1, True),
    (COMPLETIONS, "n", 0, False), (COMPLETIONS, "n", -1, False), (CHAT, "n", 0, False), (CHAT, "n", 2, True),
    (COMPLETIONS, "best_of", 0, False), (COMPLETIONS, "best_of", 3, False), (COMPLETIONS, "best_of", 1, True),
    (COMPLETIONS, "logprobs", -2, False), (COMPLETIONS, "logprobs", 21, False), (COMPLETIONS, "logprobs", 0, True),
    (COMPLETIONS, "logprobs", 20, True), (CHAT, "top_logprobs", -2, False), (CHAT, "top_logprobs", 21, False),
    (COMPLETIONS, "temperature", -0.01, False), (COMPLETIONS, "temperature", 0, True),
    (COMPLETIONS, "temperature", 150.0, True), (CHAT, "temperature", -1, False),
    (COMPLETIONS, "top_p", 0, False), (COMPLETIONS, "top_p", 1.01, False), (COMPLETIONS, "top_p", -0.5, False),
    (COMPLETIONS, "top_p", 1, True), (CHAT, "top_p", 0, False),
    (COMPLETIONS, "top_k", -2, False), (COMPLETIONS, "top_k", -1, True), (COMPLETIONS, "top_k", 0, True),
    (COMPLETIONS, "top_k", 5, True), (CHAT, "top_k", -3, False),
    (COMPLETIONS, "min_p", -0.01, False), (COMPLETIONS, "min_p", 1.01, False), (COMPLETIONS, "min_p", 1, True),
    (CHAT, "min_p", 2, False),
    (COMPLETIONS, "presence_penalty", -2.01, False), (COMPLETIONS, "presence_penalty", 2.01, False),
    (COMPLETIONS, "presence_penalty", -2, True), (COMPLETIONS, "frequency_penalty", 2.5, False),
    (COMPLETIONS, "frequency_penalty", 2, True), (CHAT, "presence_penalty", 3, False),
    (COMPLETIONS, "repetition_penalty", 0, False), (COMPLETIONS, "repetition_penalty", -1, False),
    (COMPLETIONS, "repetition_penalty", 20.0, True), (CHAT, "repetition_penalty", 0, False),
    (COMPLETIONS, "seed", I64, False), (COMPLETIONS, "seed", -I64 - 1, False), (COMPLETIONS, "seed", I64 - 1, True),
    (COMPLETIONS, "seed", -I64, True), (CHAT, "seed", I64, False), (CHAT, "seed", -I64 - 1, False),
    (COMPLETIONS, "min_tokens", -1, False), (CHAT, "min_tokens", -1, False),
]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("validation") / "server.log"
    with ServerProcess(tiny_dir, log, *AGENT_FLAGS, name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def body(endpoint: str, **fields) -> dict:
    base = {"model": "tiny", "max_tokens": 1}
    base.update({"prompt": "Hi"} if endpoint == COMPLETIONS else {"messages": MESSAGES})
    if "max_completion_tokens" in fields:
        base.pop("max_tokens")
    if fields.get("top_logprobs") is not None:
        base["logprobs"] = True
    base.update(fields)
    return base


@pytest.mark.parametrize("endpoint, field, value, accepted", RANGES)
def test_numeric_ranges(http, endpoint, field, value, accepted):
    r = http.post(endpoint, json=body(endpoint, **{field: value}))
    if accepted:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error
    if field == "seed":  # what vLLM's tests read: pydantic's error type
        assert ("greater_than_equal" if value < 0 else "less_than_equal") in error["message"], error


@pytest.mark.parametrize("path", [COMPLETIONS, "/invocations"])
@pytest.mark.parametrize("prompt", [[-1], [4294967296], [5, 512], [[1, 2], [-7]]])
def test_token_ids_outside_the_vocabulary(http, path, prompt):
    """Checked before anything reads the ids (the reasoning parser decodes a prompt to find its thinking)."""
    r = http.post(path, json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and "is out of vocabulary" in error["message"], error


def test_empty_prompt_has_vllms_message(http):
    for extra in ({"prompt": None}, {}, {"prompt": []}, {"prompt": None, "prompt_embeds": []}):
        r = http.post(COMPLETIONS, json={"model": "tiny", "max_tokens": 1, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert "Either prompt or prompt_embeds must be provided and non-empty." in r.json()["error"]["message"]
    r = http.post(COMPLETIONS, json={"model": "tiny", "max_tokens": 1, "prompt": "Hi", "prompt_embeds": "AAAA"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds", r.text


@pytest.mark.parametrize("path, payload", [
    ("/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": {}}]}]}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [{"type": 3}]}]}),
    ("/v1/messages/count_tokens", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": {}}]}]}),
    ("/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [{"type": {}}]}),
    ("/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [{"type": ["message"], "role": "user",
                                                                            "content": "Hi"}]}),
])
def test_a_type_that_is_not_a_string_is_a_400(http, path, payload):
    r = http.post(path, json=payload)
    assert r.status_code == 400, r.text
