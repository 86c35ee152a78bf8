"""The logprobs family over HTTP, as vLLM's OpenAI server answers it: prompt_logprobs (completions and chat, on
chunked prefills and past the prefix cache), echo, return_token_ids, return_tokens_as_token_ids, chat
top_logprobs, logprobs with n > 1 - each value checked against a reference forward of the model (transformers,
fp32), streaming against non-streaming. A real uvicorn server on a loopback port, driven by the openai client and
httpx."""

from __future__ import annotations

import math

import pytest
import torch

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from tests.helpers.server_utils import SERVED_MODEL, engine_config, post, stream_events

MODEL = SERVED_MODEL
LOGPROB_ATOL = 1e-4  # fp32: the engine (paged, chunked, batched) against one transformers forward
CHUNK = 32  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
PROMPT_IDS = [(37 * i + 11) % 400 + 9 for i in range(45)]  # 45 tokens: two chunks, then the rest
CHAT = [{"role": "user", "content": "Which tokens did the model expect here?"}]


@pytest.fixture(scope="module")
def engine(tiny_dir):  # (conftest's app, server and client around it)
    return AsyncLLMEngine.from_config(engine_config(tiny_dir, max_num_batched_tokens=CHUNK))


@pytest.fixture(scope="module")
def reference(tiny_hf):
    """token ids -> log_softmax of transformers' logits at every position (fp32)."""
    def forward(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(tiny_hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return forward


def check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, num: int) -> None:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}} holding
    the prompt token and its `num` best alternatives, equal to the reference's log-softmax."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        entry = {int(k): v for k, v in entries[i].items()}
        top = row.topk(num).indices.tolist() if num else []
        assert set(entry) == {ids[i]} | set(top)
        for t, lp in entry.items():
            assert lp["logprob"] == pytest.approx(row[t].item(), abs=LOGPROB_ATOL)
            # rank: 1 + the tokens more likely (tokens within the tolerance of it may fall either side)
            assert (int((row > row[t] + LOGPROB_ATOL).sum()) + 1 <= lp["rank"]
                    <= int((row > row[t] - LOGPROB_ATOL).sum()) + 1)
            assert isinstance(lp["decoded_token"], str)
        for j, t in enumerate(top):
            if t != ids[i]:
                assert entry[t]["rank"] == j + 1


# -- prompt_logprobs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num", [0, 3])
def test_completion_prompt_logprobs_equal_the_reference(server, reference, num):
    short = PROMPT_IDS[:9]
    resp = post(server, "/v1/completions", {"prompt": [PROMPT_IDS, short], "max_tokens": 2, "temperature": 0,
                                            "prompt_logprobs": num})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == 2
    check_prompt_logprobs(choices[0]["prompt_logprobs"], PROMPT_IDS, reference(PROMPT_IDS), num)  # chunked
    check_prompt_logprobs(choices[1]["prompt_logprobs"], short, reference(short), num)


def test_no_prompt_logprobs_unless_asked(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS[:5], max_tokens=2, temperature=0)
    assert out.choices[0].model_extra.get("prompt_logprobs") is None


def test_prompt_logprobs_past_the_prefix_cache(server, engine, reference):
    """A prompt whose blocks are cached has no logits there; such a request skips the cache (as vLLM does), so
    its prompt logprobs are whole and right, and usage reports no cached tokens for it."""
    ids = PROMPT_IDS[:40]
    for _ in range(2):  # the second run would hit the blocks the first one cached
        assert post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1}).status_code == 200
    plain = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    resp = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}).json()
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    check_prompt_logprobs(resp["choices"][0]["prompt_logprobs"], ids, reference(ids), 1)


def test_chat_prompt_logprobs_at_the_top_level(server, engine, reference):
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 2,
                                                 "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    ids = body["prompt_token_ids"]
    assert len(ids) == body["usage"]["prompt_tokens"]
    check_prompt_logprobs(body["prompt_logprobs"], ids, reference(ids), 2)


VLLM_CHAT = [{"role": "system", "content": "You are a helpful assistant."},
             {"role": "user", "content": "Who won the world series in 2020?"},
             {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
             {"role": "user", "content": "Where was it played?"}]
"""vLLM's test_more_than_one_prompt_logprobs_chat conversation."""


def test_prompt_logprobs_hold_the_prompt_token_and_the_top_k(server):
    """vLLM's rule (its LogprobsProcessor: the prompt token with its rank, then ranks 1..k, one dict): each entry
    has k keys when the prompt token is among the k most likely, k + 1 when it is not - so vLLM's test, which reads
    exactly k at position 3 of a chat, holds on a model that predicts that token (zephyr) and not on m3-tiny,
    under vLLM as here. The position a model predicts: the greedy token appended to the prompt has k keys."""
    for k in (1, 2):
        body = post(server, "/v1/chat/completions", {"messages": VLLM_CHAT, "max_tokens": 1, "prompt_logprobs": k,
                                                     "return_token_ids": True}).json()
        for i, (token, entry) in enumerate(zip(body["prompt_token_ids"], body["prompt_logprobs"])):
            if i == 0:
                assert entry is None
                continue
            first, rank = next(iter(entry)), entry[str(token)]["rank"]
            assert first == str(token) and len(entry) == (k if rank <= k else k + 1), (i, entry)
    greedy = post(server, "/v1/completions", {"prompt": PROMPT_IDS[:20], "max_tokens": 1, "temperature": 0,
                                              "return_token_ids": True}).json()["choices"][0]["token_ids"]
    last = post(server, "/v1/completions", {"prompt": PROMPT_IDS[:20] + greedy, "max_tokens": 1,
                                            "prompt_logprobs": 1}).json()["choices"][0]["prompt_logprobs"][-1]
    assert list(last) == [str(greedy[0])] and last[str(greedy[0])]["rank"] == 1


def test_completion_top_logprobs_name_every_token(server):
    """logprobs: 5 gives 5 entries, or 6 when the sampled token is not among the 5 (vLLM's test_some_logprobs):
    a token that is only part of a character is named by its bytes, as OpenAI's completions API names it, so the
    hundred-odd byte tokens of m3-tiny's vocabulary (all U+FFFD as text) do not overwrite one another."""
    named_by_bytes = []
    for prompt in ([0, 0, 0, 0, 0], PROMPT_IDS[:12]):
        for temperature in (0.0, 1.0):
            lp = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": temperature,
                                                  "logprobs": 5, "seed": 1}).json()["choices"][0]["logprobs"]
            for token, top in zip(lp["tokens"], lp["top_logprobs"]):
                assert 5 <= len(top) <= 6 and token in top, top
                named_by_bytes += [name for name in top if name.startswith("bytes:")]
    assert named_by_bytes, "no byte token among the top logprobs: the test shows nothing"
    for name in named_by_bytes:
        raw = bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
        assert "\\x" + "\\x".join(f"{b:02x}" for b in raw) == name[len("bytes:"):]
        with pytest.raises(UnicodeDecodeError):
            raw.decode("utf-8")


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "whole vocabulary"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "stream"),
])
def test_bad_prompt_logprobs(server, path, body, needle):
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "prompt_logprobs" and needle in err["message"] and err["code"] == 400


# -- echo --------------------------------------------------------------------------------------------------------

def test_echo_returns_the_prompt_and_its_logprobs(server, reference):
    prompt = "A serving engine turns"
    tok_ids = post(server, "/tokenize", {"prompt": prompt})
    ids = tok_ids.json()["tokens"]
    for logprobs in (0, 2):
        body = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 3, "temperature": 0,
                                                "logprobs": logprobs}).json()
        choice = body["choices"][0]
        assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
        lp = choice["logprobs"]
        n = len(ids) + 3
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        generated = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0,
                                                     "return_token_ids": True}).json()["choices"][0]["token_ids"]
        ref = reference(ids + generated)
        for i in range(1, n):
            token = (ids + generated)[i]
            assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, token].item(), abs=LOGPROB_ATOL)
            # keyed by token text, as OpenAI's format is: tokens that decode alike (pieces of one UTF-8
            # character all read '\ufffd') share a key
            top = lp["top_logprobs"][i]
            assert 1 <= len(top) <= logprobs + 1
            if not any("\ufffd" in k for k in top):
                assert len(top) >= max(logprobs, 1)
        # offsets walk the echoed text: each token starts where the previous one's text ended
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert lp["text_offset"][len(ids)] == len("".join(lp["tokens"][:len(ids)])) >= len(prompt)


def test_echo_of_token_ids_and_max_tokens_0(server):
    ids = PROMPT_IDS[:6]
    text = post(server, "/detokenize", {"tokens": ids}).json()["prompt"]
    body = post(server, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 0}).json()
    assert body["choices"][0]["text"] == text
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 6
    events = stream_events(server, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 2,
                                                       "temperature": 0})
    streamed = "".join(c["text"] for e in events[:-1] for c in e["choices"])
    whole = post(server, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 2, "temperature": 0})
    assert streamed == whole.json()["choices"][0]["text"] and streamed.startswith(text)


# -- token ids in responses ------------------------------------------------------------------------------------

def test_return_token_ids_completions(server):
    ids = PROMPT_IDS[:7]
    body = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                            "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 4
    events = stream_events(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                       "return_token_ids": True})
    choices = [c for e in events[:-1] for c in e["choices"]]
    assert choices[0]["prompt_token_ids"] == ids
    assert all(c.get("prompt_token_ids") is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"] or []] == choice["token_ids"]
    plain = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()["choices"][0]
    assert plain.get("token_ids") is None and plain.get("prompt_token_ids") is None


def test_return_token_ids_chat(server):
    body = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                 "return_token_ids": True}).json()
    rendered = post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert body["prompt_token_ids"] == rendered and len(body["choices"][0]["token_ids"]) == 4
    events = stream_events(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                            "return_token_ids": True})
    assert events[0]["prompt_token_ids"] == rendered
    assert all(e.get("prompt_token_ids") is None for e in events[1:-1])
    streamed = [t for e in events[:-1] for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed == body["choices"][0]["token_ids"]


def test_return_tokens_as_token_ids(server):
    ids = PROMPT_IDS[:5]
    body = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2,
                                            "return_tokens_as_token_ids": True, "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for d in choice["logprobs"]["top_logprobs"] for k in d)
    chat = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                 "logprobs": True, "top_logprobs": 2,
                                                 "return_tokens_as_token_ids": True,
                                                 "return_token_ids": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


# -- chat top_logprobs, logprobs with n > 1, streaming against not ---------------------------------------------------

@pytest.mark.parametrize("top", [0, 5, 20])
def test_chat_top_logprobs(server, reference, top):
    body = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                 "logprobs": True, "top_logprobs": top,
                                                 "return_token_ids": True}).json()
    ids, out = body["prompt_token_ids"], body["choices"][0]
    ref = reference(ids + out["token_ids"])
    for j, (t, entry) in enumerate(zip(out["token_ids"], out["logprobs"]["content"])):
        row = ref[len(ids) - 1 + j]
        assert entry["logprob"] == pytest.approx(row[t].item(), abs=LOGPROB_ATOL)
        assert len(entry["top_logprobs"]) == top
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(row.topk(top).values.tolist(),
                                                                              abs=LOGPROB_ATOL)


@pytest.mark.parametrize("body, needle", [({"logprobs": True, "top_logprobs": 21}, "20"),
                                          ({"top_logprobs": 2}, "logprobs"),
                                          ({"logprobs": True, "top_logprobs": -2}, "top_logprobs")])
def test_bad_chat_top_logprobs(server, body, needle):
    resp = post(server, "/v1/chat/completions", {"messages": CHAT, **body})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"
    assert needle in resp.json()["error"]["message"]


def test_logprobs_with_n_streaming_equals_non_streaming(server):
    req = {"prompt": PROMPT_IDS[:8], "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 7, "logprobs": 2,
           "ignore_eos": True}
    whole = post(server, "/v1/completions", req).json()["choices"]
    assert [c["index"] for c in whole] == [0, 1, 2]
    events = stream_events(server, "/v1/completions", req)
    per_choice: dict[int, dict] = {}
    for e in events[:-1]:
        assert len(e["choices"]) == 1  # one choice per chunk, as OpenAI and vLLM send
        c = e["choices"][0]
        acc = per_choice.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": []})
        acc["text"] += c["text"]
        acc["tokens"] += c["logprobs"]["tokens"]
        acc["token_logprobs"] += c["logprobs"]["token_logprobs"]
    assert sorted(per_choice) == [0, 1, 2]
    for c in whole:
        got = per_choice[c["index"]]
        assert got["text"] == c["text"] and got["tokens"] == c["logprobs"]["tokens"]
        assert got["token_logprobs"] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-6)
        assert not any(math.isnan(v) for v in got["token_logprobs"])
    assert len({c["text"] for c in whole}) > 1


def test_chat_logprobs_streaming_equals_non_streaming(server):
    req = {"messages": CHAT, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3, "logprobs": True,
           "top_logprobs": 2}
    whole = post(server, "/v1/chat/completions", req).json()["choices"]
    events = stream_events(server, "/v1/chat/completions", req)
    content: dict[int, list] = {0: [], 1: []}
    for e in events[:-1]:
        assert len(e["choices"]) == 1
        c = e["choices"][0]
        if c.get("logprobs"):
            content[c["index"]] += c["logprobs"]["content"]
    for c in whole:
        assert [x["token"] for x in content[c["index"]]] == [x["token"] for x in c["logprobs"]["content"]]
        assert [x["logprob"] for x in content[c["index"]]] == \
            pytest.approx([x["logprob"] for x in c["logprobs"]["content"]], abs=1e-6)
