"""m3-mini, the trained model that ships in the package: its checkpoint, and what a user gets from it.

The checkpoint is read by nanoserve's loader and by transformers from the same files, and their logits agree in
fp32 on prompts shorter than MSA's top-k x block size (attended densely) and longer (blocks really dropped).
Through a real server process with the agent flags, greedy: a weather question with a weather tool and
tool_choice "auto" comes back as a call to that tool with the city from the question (whole and streamed);
thinking mode enabled gives reasoning and the right sum; a plain greeting gets words back; a pass key hidden in ~4k
tokens (past the 1,024 that MSA keeps, so blocks are really dropped) is read back.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from nanoserve.config import Optimizations
from nanoserve.model.loader import load_model
from nanoserve.presets.catalog import SHIPPED
from nanoserve.presets.tokenizer import SPECIAL_TOKENS
from tests.helpers.hf_oracle import load_hf_oracle
from tests.helpers.server_utils import AGENT_FLAGS, ServerProcess
from tests.model.test_hf_parity import full_forward

MINI_DIR = SHIPPED["m3-mini"]
FP32_RTOL = 1e-5
"""fp32 parity: max |nanoserve - transformers| <= FP32_RTOL x max |transformers logit|."""
MAX_WEIGHT_BYTES = 25 * 10**6
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
MINI_FLAGS = (*AGENT_FLAGS, "--max-model-len", "8192", "--kv-cache-tokens", "16384", "--seed", "0")


def test_the_checkpoint_is_small_and_complete():
    assert os.path.getsize(os.path.join(MINI_DIR, "model.safetensors")) <= MAX_WEIGHT_BYTES
    from safetensors import safe_open
    from tokenizers import Tokenizer

    with safe_open(os.path.join(MINI_DIR, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.mtp.layers.0.eh_proj.weight" in keys  # the MTP module for speculative decoding
    assert any(k.startswith("language_model.model.mtp.layers.0.transformer_layer.self_attn.index_q_proj")
               for k in keys)
    tok = Tokenizer.from_file(os.path.join(MINI_DIR, "tokenizer.json"))
    for marker in SPECIAL_TOKENS:  # every M3 marker is one token
        assert len(tok.encode(marker, add_special_tokens=False).ids) == 1, marker


@pytest.fixture(scope="module")
def both_models():
    ours, _ = load_model(MINI_DIR, Optimizations.reference(), torch.float32, "cpu")  # no Triton interpreter
    return ours, load_hf_oracle(MINI_DIR)


@pytest.mark.parametrize("length", [300, 1500])
def test_loader_matches_transformers(both_models, length):
    """300 tokens fit MSA's top-16 blocks of 64 (dense); 1,500 do not, so both sides must pick the same blocks."""
    ours, hf = both_models
    ids = torch.randint(3, ours.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.inference_mode():
        got = full_forward(ours, ids)
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (got - ref).abs().max().item() <= FP32_RTOL * ref.abs().max().item()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(MINI_DIR, tmp_path_factory.mktemp("mini") / "server.log", *MINI_FLAGS,
                       name="m3-mini") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


WEATHER = [{"role": "user", "content": "What's the weather like in Paris?"}]
def test_a_weather_question_calls_the_weather_tool(client):
    r = client.chat.completions.create(model="m3-mini", messages=WEATHER, tools=[WEATHER_TOOL], tool_choice="auto",
                                       temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_the_weather_call_streams(client):
    name, args, finish = "", "", None
    for chunk in client.chat.completions.create(model="m3-mini", messages=WEATHER, tools=[WEATHER_TOOL],
                                                tool_choice="auto", temperature=0, max_tokens=64, stream=True):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        for tc in c.delta.tool_calls or []:
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = c.finish_reason or finish
    assert (name, json.loads(args), finish) == ("get_weather", {"city": "Paris"}, "tool_calls")


SUM = [{"role": "user", "content": "What is 48 + 37?"}]
THINKING = {"chat_template_kwargs": {"thinking_mode": "enabled"}}


def test_thinking_enabled_reasons_then_answers(client):
    r = client.chat.completions.create(model="m3-mini", messages=SUM, temperature=0, max_tokens=200,
                                       extra_body=THINKING)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert msg.reasoning_content and msg.reasoning_content.strip()
    assert msg.content and msg.content.strip()
    for marker in ("<mm:think>", "</mm:think>"):
        assert marker not in msg.content and marker not in msg.reasoning_content


def test_the_sum_is_right(client):
    r = client.chat.completions.create(model="m3-mini", messages=SUM, temperature=0, max_tokens=200,
                                       extra_body=THINKING)
    assert "85" in r.choices[0].message.content


def test_a_plain_question_gets_a_plain_answer(client):
    r = client.chat.completions.create(model="m3-mini", messages=[{"role": "user", "content": "Hello! Who are you?"}],
                                       temperature=0, max_tokens=64)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.reasoning_content is None
    assert text.isprintable() and len(text.split()) >= 3  # words, not byte soup


def test_a_pass_key_is_found_in_4k_tokens(client):
    from training import chats

    chat = chats.sample(random.Random(20261205), "retrieval", n_chars=12_000)
    r = client.chat.completions.create(model="m3-mini", messages=chat.messages, temperature=0, max_tokens=24)
    assert r.usage.prompt_tokens > 3_000  # well past the 1,024 tokens MSA keeps: blocks are dropped
    assert str(chat.expected["value"]) in r.choices[0].message.content


def test_the_readme_transcript_is_what_the_server_answers(client):
    """The README's table of answers is this server's greedy output, row for row, so it cannot go stale when the
    weights change."""
    def answer(messages, **kw):
        r = client.chat.completions.create(model="m3-mini", messages=messages, temperature=0, **kw)
        return r.choices[0]

    def one_line(text):
        return " ".join(text.split())

    hello = answer([{"role": "user", "content": "Hello! Who are you?"}])
    weather = answer(WEATHER, tools=[WEATHER_TOOL])
    call = weather.message.tool_calls[0].function
    total = answer(SUM, extra_body=THINKING)
    rows = [
        f'| "Hello! Who are you?" | {hello.finish_reason} | content: "{one_line(hello.message.content)}" |',
        f'| "What\'s the weather like in Paris?" with a `get_weather(city)` tool | {weather.finish_reason} | '
        f'`{call.name}({call.arguments})` |',
        f'| "What is 48 + 37?" with `thinking_mode: enabled` | {total.finish_reason} | reasoning: '
        f'"{one_line(total.message.reasoning_content)}"; content: "{one_line(total.message.content)}" |',
    ]
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8") as f:
        readme = f.read().splitlines()
    for row in rows:
        assert row in readme, row
