"""use_beam_search on a real server process, through the openai SDK (vLLM's fields: `n` is the beam width,
`length_penalty`): the choices are the beams LLM.beam_search finds for the same prompt, best first, on
/v1/completions and /v1/chat/completions, streamed or not; fields beam search cannot honour are 400s naming them;
no request leaves a KV block behind."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from nanoserve import LLM
from nanoserve.presets.tokenizer import EOS_ID
from nanoserve.sampling import BeamSearchParams
from tests.helpers.server_utils import FAST_CPU, KV_CACHE_TOKENS, ServerProcess, metric

MODEL = "tiny"
MAX_MODEL_LEN = 1024  # a chat with a tool fits


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(9, 500) for _ in range(n)]


IDS = prompt_ids(3, 4)  # m3-tiny's beams end in EOS here (tests/engine/test_beam_search.py)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("beam") / "server.log"
    with ServerProcess(tiny_dir, log, "--enable-auto-tool-choice", "--tool-call-parser", "minimax_m3",
                       "--max-model-len", str(MAX_MODEL_LEN), name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_dir):
    with LLM(tiny_dir, optimizations=FAST_CPU, max_model_len=MAX_MODEL_LEN, kv_cache_tokens=KV_CACHE_TOKENS) as llm:
        yield llm


def beams(llm: LLM, ids: list[int], **params):
    return llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(**params))[0].sequences


def error_of(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    return e.value.body if "param" in e.value.body else e.value.body["error"]


def assert_pool_free(server) -> None:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert metric(text, "vllm:num_requests_running", model_name=MODEL) == 0
    assert metric(text, "vllm:kv_cache_usage_perc", model_name=MODEL) == 0


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_completions_return_the_beams_best_first(client, server, offline, length_penalty):
    want = beams(offline, IDS, beam_width=3, max_tokens=10, length_penalty=length_penalty)
    resp = client.completions.create(model=MODEL, prompt=IDS, n=3, max_tokens=10, temperature=0, logprobs=1,
                                     extra_body={"use_beam_search": True, "length_penalty": length_penalty,
                                                 "include_stop_str_in_output": True, "return_token_ids": True})
    assert len(resp.choices) == 3
    scores = []
    for i, (choice, beam) in enumerate(zip(resp.choices, want)):
        generated = beam.tokens[len(IDS):]
        assert choice.index == i and choice.finish_reason == beam.finish_reason
        assert choice.token_ids == generated  # include_stop_str_in_output: an ending EOS is kept
        # each token's logprob, the EOS's too, adds up to the beam's cumulative logprob
        cum = sum(choice.logprobs.token_logprobs)
        assert cum == pytest.approx(beam.cum_logprob, abs=1e-3)
        scores.append(cum / (len(IDS) + len(generated) - (generated[-1] == EOS_ID)) ** length_penalty)
    assert scores == sorted(scores, reverse=True)
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in resp.choices)
    assert_pool_free(server)


def test_the_length_penalty_reorders_the_choices(client):
    def first(lp):
        resp = client.completions.create(model=MODEL, prompt=IDS, n=4, max_tokens=10, temperature=0,
                                         extra_body={"use_beam_search": True, "length_penalty": lp})
        return resp.choices[0]

    by_logprob, by_mean = first(0.0), first(1.0)
    assert by_logprob.finish_reason == "stop" and by_mean.finish_reason == "length"  # as offline (test_beam_search)


def test_text_and_stop_as_vllm(client, offline):
    want = beams(offline, IDS, beam_width=2, max_tokens=10, length_penalty=0.0)
    resp = client.completions.create(model=MODEL, prompt=IDS, n=2, max_tokens=10, temperature=0,
                                     extra_body={"use_beam_search": True, "length_penalty": 0.0,
                                                 "return_token_ids": True, "skip_special_tokens": False})
    tok = offline.get_tokenizer()
    for choice, beam in zip(resp.choices, want):
        generated = beam.tokens[len(IDS):]
        if beam.finish_reason == "stop":  # the EOS is not returned without include_stop_str_in_output
            assert choice.token_ids == generated[:-1] and choice.stop_reason == EOS_ID
        assert choice.text == tok.decode(choice.token_ids, skip_special_tokens=False)


def test_a_streamed_beam_search_sends_the_same_choices(client):
    plain = client.completions.create(model=MODEL, prompt=IDS, n=3, max_tokens=8, temperature=0,
                                      extra_body={"use_beam_search": True})
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in client.completions.create(model=MODEL, prompt=IDS, n=3, max_tokens=8, temperature=0, stream=True,
                                           extra_body={"use_beam_search": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in plain.choices]
    assert finish == [c.finish_reason for c in plain.choices]


def test_chat_with_use_beam_search_returns_n_choices(client, server, offline):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}], n=3,
                                          max_tokens=6, temperature=0,
                                          extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    prompt = resp.model_extra["prompt_token_ids"]
    want = beams(offline, prompt, beam_width=3, max_tokens=6)
    for choice, beam in zip(resp.choices, want):
        generated = beam.tokens[len(prompt):]
        assert choice.model_extra["token_ids"] == (generated[:-1] if beam.finish_reason == "stop" else generated)
        assert choice.finish_reason == beam.finish_reason and isinstance(choice.message.content, str)
    assert resp.choices[0].logprobs is None  # not asked for
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                                n=3, max_tokens=6, temperature=0, stream=True,
                                                extra_body={"use_beam_search": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in resp.choices]
    assert_pool_free(server)


@pytest.mark.parametrize("extra, param", [
    ({"stop": ["x"]}, "stop"), ({"top_p": 0.5}, "top_p"), ({"seed": 1}, "seed"), ({"logit_bias": {"5": 1}},
                                                                                     "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"min_tokens": 2}, "min_tokens"),
    ({"n": 11}, "n"), ({"logprobs": 9, "n": 4}, "logprobs"),
])
def test_what_beam_search_cannot_honour_is_refused_by_name(client, server, extra, param):
    body = {"use_beam_search": True, **extra}
    n = body.pop("n", 2)
    logprobs = body.pop("logprobs", None)
    err = error_of(lambda: client.completions.create(model=MODEL, prompt=IDS, n=n, max_tokens=4, logprobs=logprobs,
                                                     extra_body=body))
    assert err["param"] == param and param in err["message"], err
    assert_pool_free(server)


def test_length_penalty_without_beam_search_and_forced_tools_are_refused(client):
    err = error_of(lambda: client.completions.create(model=MODEL, prompt=IDS, max_tokens=2,
                                                     extra_body={"length_penalty": 2.0}))
    assert err["param"] == "length_penalty" and "use_beam_search" in err["message"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    err = error_of(lambda: client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, tools=[tool],
        tool_choice="required", extra_body={"use_beam_search": True}))
    assert err["param"] == "use_beam_search" and "tool_choice" in err["message"], err
