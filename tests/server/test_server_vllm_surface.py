"""vLLM's server surface that its own tests read, against `python -m nanoserve.server` as a process of its own:
GET /tokenizer_info behind --enable-tokenizer-info-endpoint, the --return-tokens-as-token-ids flag, custom message
roles passed to the chat template, service_tier and system_fingerprint (null) in chat responses,
prompt_logprobs_temperature."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.helpers.server_utils import ServerProcess


@pytest.fixture(scope="module")
def flagged(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("surface") / "server.log"
    with ServerProcess(tiny_dir, log, "--enable-tokenizer-info-endpoint", "--return-tokens-as-token-ids",
                       "--max-logprobs", "512", name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def plain(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("surface-plain") / "server.log"
    with ServerProcess(tiny_dir, log, name="tiny") as srv:
        yield srv


def test_tokenizer_info_only_with_its_flag(flagged, plain):
    assert httpx.get(f"{plain.url}/tokenizer_info").status_code == 404
    info = httpx.get(f"{flagged.url}/tokenizer_info").json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert isinstance(info["chat_template"], str) and "]~b]" in info["chat_template"]
    added = info["added_tokens_decoder"]
    assert added and all(isinstance(k, str) and isinstance(v["content"], str) and isinstance(v["special"], bool)
                         for k, v in added.items())
    assert added["2"]["content"] == info["eos_token"] == "[e~["  # the same token, by id and by name
    tokenized = httpx.post(f"{flagged.url}/tokenize", json={"model": "tiny", "prompt": "Hello"}).json()
    assert info["model_max_length"] >= tokenized["max_model_len"]


def test_return_tokens_as_token_ids_flag(flagged, plain):
    """The flag makes token ids the default; a request's own field still decides for it."""
    client = openai.OpenAI(base_url=f"{flagged.url}/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=2, temperature=0)
    lp = out.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    own = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=2, temperature=0,
                                    extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in own.choices[0].logprobs.tokens)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=1, temperature=0)
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)
    base = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none", max_retries=0)
    out = base.completions.create(model="tiny", prompt="Hello", max_tokens=3, logprobs=2, temperature=0)
    assert not any(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)


def test_custom_roles_go_to_the_template(plain):
    """vLLM passes any role to the chat template; M3's format gives it a turn of its own. Text and text-part
    content render the same."""
    client = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="none", max_retries=0)
    answers = [client.chat.completions.create(model="tiny", messages=[{"role": "my-custom-role", "content": c}],
                                              temperature=0, seed=0, max_tokens=4)
               for c in ("what is 1+1?", [{"type": "text", "text": "what is 1+1?"}])]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    ids = httpx.post(f"{plain.url}/tokenize", json={"model": "tiny", "messages": [
        {"role": "my-custom-role", "content": "what is 1+1?"}]}).json()["tokens"]
    text = httpx.post(f"{plain.url}/detokenize", json={"model": "tiny", "tokens": ids}).json()["prompt"]
    assert "my-custom-role\nwhat is 1+1?" in text
    assert answers[0].usage.prompt_tokens == len(ids)


def test_chat_response_has_service_tier_and_system_fingerprint(plain):
    body = httpx.post(f"{plain.url}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).json()
    assert "service_tier" in body and body["service_tier"] is None
    assert "system_fingerprint" in body and body["system_fingerprint"] is None


def test_prompt_logprobs_temperature(flagged):
    """The prompt logprobs of logits / T: each equals log_softmax(l / T) of the whole-vocabulary logprobs l at
    T = 1 (a shift of the logits changes nothing); a lower T puts the most likely token nearer 0 (what vLLM's
    test reads); T <= 0 is a 400 naming the field."""
    def prompt_logprobs(**extra) -> list[dict]:
        body = {"model": "tiny", "prompt": "A serving engine turns a model", "max_tokens": 1, "temperature": 0,
                "prompt_logprobs": -1, **extra}
        r = httpx.post(f"{flagged.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["prompt_logprobs"][1:]

    raw = prompt_logprobs()
    for temperature in (0.5, 2.0):
        held = prompt_logprobs(prompt_logprobs_temperature=temperature)
        for pos, (base, scaled) in enumerate(zip(raw, held)):
            scaled_all = {t: v["logprob"] / temperature for t, v in base.items()}
            norm = math.log(sum(math.exp(x) for x in scaled_all.values()))
            for t, v in scaled.items():
                assert v["logprob"] == pytest.approx(scaled_all[t] - norm, abs=1e-3), (temperature, pos, t)
    top = [max(v["logprob"] for v in d.values()) for d in raw]
    sharp = [max(v["logprob"] for v in d.values()) for d in prompt_logprobs(prompt_logprobs_temperature=0.25)]
    assert all(s >= t for s, t in zip(sharp, top)) and sum(sharp) > sum(top)
    for bad in (0, -1):
        r = httpx.post(f"{flagged.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1,
                                                               "prompt_logprobs": 1,
                                                               "prompt_logprobs_temperature": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs_temperature", r.text
