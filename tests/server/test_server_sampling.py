"""The sampling fields over HTTP, as vLLM's OpenAI server takes them: logit_bias, allowed_token_ids, bad_words,
min_tokens, stop_token_ids checked against the vocabulary, int64 seeds, integral floats for integer fields,
stream_options.continuous_usage_stats, best_of (and what use_beam_search cannot honour) refused by name, and
streaming n > 1 (one choice per chunk). A real uvicorn server driven by the openai client and httpx."""

from __future__ import annotations

import httpx
import pytest

from nanoserve.presets.tokenizer import EOS_ID
from tests.helpers.server_utils import SERVED_MODEL, post, stream_events

MODEL = SERVED_MODEL  # conftest's engine, app, server and client
PROMPT = "The scheduler admits"
CHAT = [{"role": "user", "content": "Name a cache."}]


@pytest.fixture(scope="module")
def vocab(engine) -> int:
    return engine.engine.model_config.vocab_size


def error_of(resp: httpx.Response, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


# -- logit_bias and the token-set fields ---------------------------------------------------------------------------

def test_logit_bias_plus_100_forces_the_token(client):
    forced = 345
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=1,
                                    logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == [forced] * 5
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                          logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == [forced] * 4


def test_logit_bias_minus_100_bans_the_greedy_token(server):
    greedy = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                              "return_token_ids": True}).json()["choices"][0]["token_ids"][0]
    banned = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                              "logit_bias": {str(greedy): -100}, "return_token_ids": True})
    assert banned.json()["choices"][0]["token_ids"][0] != greedy


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias(server, vocab, path):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    err = error_of(post(server, path, {**base, "logit_bias": {str(vocab + 1): 1.0}}))
    assert str(vocab + 1) in err["message"] and str(vocab) in err["message"] and err["param"] == "logit_bias"
    err = error_of(post(server, path, {**base, "logit_bias": {"bad1": 5, "bad2": 2}}))
    assert "bad1" in err["message"] and "bad2" in err["message"] and err["param"] == "logit_bias"
    err = error_of(post(server, path, {**base, "logit_bias": {"1": "not_a_number"}}))
    assert "logit_bias" in err["message"]
    err = error_of(post(server, path, {**base, "logit_bias": {"1": 100.5}}))
    assert "logit_bias" in err["message"] and "100" in err["message"]
    assert post(server, path, {**base, "max_tokens": 1, "logit_bias": {str(vocab - 1): -100}}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stop_token_ids_checked_against_the_vocabulary(server, vocab, path):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    err = error_of(post(server, path, {**base, "stop_token_ids": [vocab + 1]}))
    assert str(vocab + 1) in err["message"] and str(vocab) in err["message"] and err["param"] == "stop_token_ids"
    error_of(post(server, path, {**base, "stop_token_ids": [-1]}))
    assert post(server, path, {**base, "max_tokens": 1, "stop_token_ids": [vocab - 1]}).status_code == 200


def test_allowed_token_ids_bad_words_min_tokens(server, engine, vocab):
    allowed = [40, 41, 42, EOS_ID]
    out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 2,
                                           "allowed_token_ids": allowed, "ignore_eos": True,
                                           "return_token_ids": True}).json()["choices"][0]
    assert set(out["token_ids"]) <= set(allowed) and len(out["token_ids"]) == 8
    err = error_of(post(server, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [vocab]}))
    assert err["param"] == "allowed_token_ids" and str(vocab) in err["message"]
    error_of(post(server, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": []}))
    # a bad word from the greedy continuation never comes back: a token whose text is a word on its own (as
    # written, the first form vLLM bans) is banned wherever it would appear
    tok = engine.get_tokenizer()
    base = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                            "ignore_eos": True, "return_token_ids": True}).json()["choices"][0]
    word_token = next(t for t in base["token_ids"] if tok.decode([t]).isalpha()
                      and tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    again = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True,
                                             "bad_words": [tok.decode([word_token])]}).json()["choices"][0]
    first = base["token_ids"].index(word_token)
    assert word_token not in again["token_ids"] and again["token_ids"][:first] == base["token_ids"][:first]
    error_of(post(server, "/v1/completions", {"prompt": PROMPT, "bad_words": [""]}))
    # min_tokens: EOS held off (the EOS-only allowed set would otherwise end at once)
    held = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "min_tokens": 3,
                                            "allowed_token_ids": [EOS_ID, 40], "logit_bias": {str(EOS_ID): 50},
                                            "temperature": 0, "return_token_ids": True}).json()["choices"][0]
    assert held["token_ids"] == [40, 40, 40, EOS_ID] and held["finish_reason"] == "stop"


# -- numbers as vLLM's pydantic models take them --------------------------------------------------------------------

def test_int64_seeds(server):
    for seed in (-(2**63), -1, 2**63 - 1):
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        first, second = (post(server, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(2))
        assert first == second
    assert error_of(post(server, "/v1/completions", {"prompt": PROMPT, "seed": 2**63}))["param"] == "seed"


def test_integral_floats_are_integers(server):
    body = post(server, "/v1/completions", {"prompt": PROMPT, "n": 2.0, "max_tokens": 3.0, "temperature": 0})
    assert body.status_code == 200 and len(body.json()["choices"]) == 2
    assert body.json()["usage"]["completion_tokens"] == 6
    assert error_of(post(server, "/v1/completions", {"prompt": PROMPT, "n": 1.5}))["param"] == "n"
    assert error_of(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": "3"}))["param"] == "max_tokens"


@pytest.mark.parametrize("body, param", [({"best_of": 2}, "best_of"), ({"use_beam_search": True, "stop": "x"}, "stop"),
                                         ({"suffix": "x"}, "suffix")])
def test_unsupported_fields_are_refused_by_name(server, body, param):
    err = error_of(post(server, "/v1/completions", {"prompt": PROMPT, **body}))
    assert err["param"] == param and param in err["message"]
    assert post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "best_of": 1}).status_code == 200


def test_model_may_be_left_out(server):
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200 and resp.json()["model"] == MODEL


# -- streaming ---------------------------------------------------------------------------------------------------

def test_streaming_n_sends_one_choice_per_chunk(server):
    body = {"prompt": [PROMPT, "Another prompt"], "n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 5,
            "ignore_eos": True}
    whole = post(server, "/v1/completions", body).json()["choices"]
    events = stream_events(server, "/v1/completions", body)
    texts: dict[int, str] = {}
    finished = []
    for e in events[:-1]:
        assert len(e["choices"]) == 1
        c = e["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            finished.append(c["index"])
    assert sorted(finished) == [0, 1, 2, 3]
    assert texts == {c["index"]: c["text"] for c in whole}
    chat = stream_events(server, "/v1/chat/completions", {"messages": CHAT, "n": 3, "max_tokens": 3,
                                                          "temperature": 1.0, "seed": 4})
    assert all(len(e["choices"]) == 1 for e in chat[:-1])
    assert sorted({e["choices"][0]["index"] for e in chat[:-1]}) == [0, 1, 2]
    roles = [e["choices"][0]["index"] for e in chat[:-1] if e["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1, 2]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(server, path):
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    events = stream_events(server, path, {**base, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                          "stream_options": {"include_usage": True,
                                                             "continuous_usage_stats": True}})
    chunks = events[:-1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    seen = []
    for e in chunks[:-1]:
        u = e["usage"]
        assert u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
        seen.append(u["completion_tokens"])
    assert seen == sorted(seen) and seen[-1] == 4
    # without include_usage there is no usage anywhere, continuous or not
    quiet = stream_events(server, path, {**base, "max_tokens": 2, "stream_options": {"continuous_usage_stats": True}})
    assert all(e.get("usage") is None for e in quiet[:-1])
    err = error_of(post(server, path, {**base, "stream_options": {"continuous_usage_stats": True}}))
    assert err["param"] == "stream_options"
