"""The agent API end to end: the official openai client against a real m3-tiny server started with
--enable-auto-tool-choice --tool-call-parser minimax_m3 --reasoning-parser minimax_m3.

m3-tiny has random weights, so what it generates is whatever it is. The tests take that honestly:
- the prompt side (tools, assistant tool calls, tool results, thinking_mode) is checked exactly: the server's
  prompt_tokens equal the tokens of the same conversation rendered by the chat template here;
- the output side compares the chat answer with the parsers applied to the raw text the same model generates for
  the same prompt through /v1/completions (greedy), so reasoning/content splitting is checked on real output;
- tool-call parsing and its streaming deltas, which need output in the tool-call format, are checked by feeding
  the server's serializers (responses.chat_response, streaming.chat_events) the engine's own output objects
  (RequestOutput) for known M3 text, token by token as the engine emits them, and reading the SSE back with the
  openai client's types.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys

import anthropic
import httpx
import jsonschema
import openai
import pytest

from nanoserve.chat_template import render_chat, template_messages
from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser
from nanoserve.server import build_app
from nanoserve.server.openai import schema as P
from nanoserve.server.openai.convert import chat_response
from nanoserve.server.openai.events import chat_events
from nanoserve.server.prepare import prepare_chat
from nanoserve.server.state import ChatOptions
from tests.helpers.server_utils import SWITCH_FLAGS, ServerThread, engine_config, free_port, wait_until

MODEL = "m3-tiny-agent"
AGENT_LEN = 2048  # prompts with tools are ~700 tokens with the tiny model's small vocabulary
NS = "]<]minimax[>["
AGENT_FLAGS = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="minimax_m3", reasoning_parser="minimax_m3")
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                        "hourly": {"type": "boolean"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "book_trip", "description": "Book a trip",
        "parameters": {"type": "object", "properties": {
            "legs": {"type": "array", "items": {"type": "object", "properties": {
                "from": {"type": "string"}, "to": {"type": "string"}, "nights": {"type": "integer"}}}},
            "budget": {"type": "number"}, "travellers": {"type": "array", "items": {"type": "string"}}}}}},
]
GREEDY = dict(temperature=0.0, max_tokens=12)
BRIEF = dict(temperature=0.0, max_tokens=2)  # for the tests that only look at the prompt


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return AsyncLLMEngine.from_config(engine_config(tiny_dir, max_model_len=AGENT_LEN))


@pytest.fixture(scope="module")
def app(engine):
    return build_app(engine, MODEL, chat=AGENT_FLAGS)


# `server` and `client` are the shared fixtures of tests/conftest.py, around this module's `app`


@pytest.fixture(scope="module")
def tok(engine):
    return engine.get_tokenizer()


def prompt_tokens(tok, messages, tools=None, **kw) -> int:
    text = render_chat(tok, template_messages(messages), tools=tools, **kw)
    return len(tok.encode(text, add_special_tokens=False))


def raw_completion(client, tok, messages, tools=None, **kw) -> str:
    """What the model generates for this conversation, markers and all (the completions endpoint, greedy)."""
    text = render_chat(tok, template_messages(messages), tools=tools, **kw)
    resp = client.completions.create(model=MODEL, prompt=text, extra_body={"skip_special_tokens": False}, **GREEDY)
    return resp.choices[0].text


# -- the prompt: an agent loop over several turns -----------------------------------------------------------------
def test_agent_loop_renders_every_turn(client, tok):
    """Tools, the assistant's tool calls (arguments as the JSON string the client got), tool results and a reply,
    over three requests: each prompt is exactly the chat template's rendering."""
    messages = [{"role": "system", "content": "You plan trips."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Rome?"}]}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **BRIEF)
    assert first.usage.prompt_tokens == prompt_tokens(tok, messages, TOOLS)
    assert first.choices[0].message.role == "assistant"
    # the agent got two calls (as the model would make them) and answers them
    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}},
             {"id": "call_b", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "hourly": True})}}]
    messages += [{"role": "assistant", "content": None, "tool_calls": calls,
                  "reasoning_content": "Two cities: two calls."},
                 {"role": "tool", "tool_call_id": "call_a", "content": "Oslo: 3C, snow"},
                 {"role": "tool", "tool_call_id": "call_b", "content": "Rome: 18C, sun"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **BRIEF)
    assert second.usage.prompt_tokens == prompt_tokens(tok, messages, TOOLS)
    rendered = render_chat(tok, template_messages(messages), tools=TOOLS)
    assert f'{NS}<invoke name="get_weather">{NS}<city>Rome{NS}</city>{NS}<hourly>true{NS}</hourly>' in rendered
    assert "]~b]tool\n<response>Oslo: 3C, snow</response>\n<response>Rome: 18C, sun</response>[e~[" in rendered
    messages += [{"role": "assistant", "content": "Snow in Oslo, sun in Rome."},
                 {"role": "user", "content": "Book Oslo to Rome, 2 nights, for Ann and Bo."}]
    third = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto",
                                           extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
                                           **BRIEF)
    assert third.usage.prompt_tokens == prompt_tokens(tok, messages, TOOLS,
                                                      chat_template_kwargs={"thinking_mode": "disabled"})
    # tool_choice "none": the tools are still in the prompt (as in vLLM), the output is not read for calls
    none = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", **BRIEF)
    assert none.usage.prompt_tokens == prompt_tokens(tok, messages, TOOLS)
    assert none.choices[0].message.tool_calls in (None, [])


# -- the output: reasoning and content, whole and streamed, as the model really generated them ---------------------
@pytest.mark.parametrize("mode", ["enabled", "disabled", "adaptive"])
def test_reasoning_split_of_real_output(client, tok, mode):
    messages = [{"role": "user", "content": "Is 91 prime?"}]
    kwargs = {"chat_template_kwargs": {"thinking_mode": mode}}
    raw = raw_completion(client, tok, messages, chat_template_kwargs={"thinking_mode": mode})
    opened = mode == "enabled"
    reasoning, content = MiniMaxM3ReasoningParser(opened).parse(raw)
    resp = client.chat.completions.create(model=MODEL, messages=messages, extra_body=kwargs, **GREEDY)
    msg = resp.choices[0].message
    assert getattr(msg, "reasoning_content", None) == reasoning == getattr(msg, "reasoning", None)
    assert (msg.content or "") == content
    if opened:  # the prompt opened the block: the answer starts inside it
        assert reasoning is not None
    # streamed: the same pieces, in reasoning_content / reasoning / content deltas
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, extra_body=kwargs, stream=True,
                                                 **GREEDY))
    streamed_r = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    streamed_c = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed_r == (reasoning or "") and streamed_c == content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [resp.choices[0].finish_reason]
    hidden = client.chat.completions.create(model=MODEL, messages=messages,
                                            extra_body={**kwargs, "include_reasoning": False}, **GREEDY)
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
    assert (hidden.choices[0].message.content or "") == content


def test_echo_continues_the_final_message(client, tok):
    messages = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "One, two,"}]
    body = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    resp = client.chat.completions.create(model=MODEL, messages=messages, extra_body=body, **GREEDY)
    assert resp.usage.prompt_tokens == prompt_tokens(tok, messages, add_generation_prompt=False,
                                                     continue_final_message=True)
    raw = raw_completion(client, tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert resp.choices[0].message.content == "One, two," + MiniMaxM3ReasoningParser(False).parse(raw)[1]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, extra_body=body, stream=True,
                                                 **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == resp.choices[0].message.content


# -- tool calls through the server's serializers, fed the engine's output objects -------------------------------
CALL_TEXT = ("<mm:think>Two legs; the budget is a number.</mm:think>Booking it now.\n"
             f"{NS}<tool_call>\n"
             f'{NS}<invoke name="book_trip">{NS}<legs>{NS}<item>{NS}<from>Oslo{NS}</from>{NS}<to>Rome{NS}</to>'
             f"{NS}<nights>2{NS}</nights>{NS}</item>{NS}</legs>{NS}<budget>1250.50{NS}</budget>"
             f"{NS}<travellers>{NS}<item>Ann{NS}</item>{NS}<item>Bo{NS}</item>{NS}</travellers>{NS}</invoke>\n"
             f'{NS}<invoke name="get_weather">{NS}<city>Rome{NS}</city>{NS}<days>3{NS}</days>{NS}</invoke>\n'
             f"{NS}</tool_call>")
EXPECTED_CALLS = [("book_trip", {"legs": [{"from": "Oslo", "to": "Rome", "nights": 2}], "budget": 1250.5,
                                 "travellers": ["Ann", "Bo"]}),
                  ("get_weather", {"city": "Rome", "days": 3})]


def engine_outputs(tok, text: str, finish_reason: str = "stop") -> list[RequestOutput]:
    """The RequestOutputs the engine streams for a completion of `text`: one token more each step, the text
    decoded from the tokens so far (markers kept, as with skip_special_tokens=False)."""
    ids = tok.encode(text, add_special_tokens=False)
    outs = []
    for k in range(1, len(ids) + 1):
        done = k == len(ids)
        piece = tok.decode(ids[:k], skip_special_tokens=False)
        outs.append(RequestOutput("r-0", None, [1, 2, 3], [CompletionOutput(
            0, piece.rstrip("\ufffd"), ids[:k], None, None, finish_reason if done else None)], done))
    return outs


class ReplayStream:
    """An engine stream replaying given outputs (what RequestStream yields)."""

    def __init__(self, outputs):
        self.outputs = outputs

    def __aiter__(self):
        async def gen():
            for out in self.outputs:
                yield out
        return gen()


def serialize(server_state, body: dict, text: str, finish_reason: str = "stop"):
    """(the non-streaming response, the stream's chunks) for `text` as this request's output."""
    req = P.ChatCompletionRequest.model_validate(body)
    prepared = prepare_chat(server_state, req)
    outs = engine_outputs(server_state.tokenizer, text, finish_reason)
    whole = chat_response(server_state, "chatcmpl-x", req, prepared, outs[-1])

    async def run():
        return [e async for e in chat_events(server_state, "chatcmpl-x", req, prepared, ReplayStream(outs))]
    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [openai.types.chat.ChatCompletionChunk.model_validate_json(e[len("data: "):]) for e in events[:-1]]
    return prepared, whole, chunks


def accumulate(chunks):
    """What an agent builds from the stream: reasoning, content, and each call from its deltas."""
    reasoning, content, calls, finish = "", "", {}, None
    for c in chunks:
        for ch in c.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                if tc.index not in calls:  # the first delta of a call carries its id, type and name
                    assert tc.id and tc.type == "function" and tc.function.name and tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index]["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_tool_calls_in_responses_and_streams(app, tok):
    state = app.state.server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Book it"}], "tools": TOOLS}
    prepared, whole, chunks = serialize(state, body, CALL_TEXT)
    assert prepared.params.skip_special_tokens is False  # the markers are special tokens of this tokenizer
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == msg.reasoning == "Two legs; the budget is a number."
    assert msg.content == "Booking it now.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == EXPECTED_CALLS
    # the stream: no marker ever reaches content, the deltas build the same calls
    reasoning, content, calls, finish = accumulate(chunks)
    assert (reasoning, content, finish) == (msg.reasoning, msg.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                             for c in msg.tool_calls]
    assert all(NS not in (ch.delta.content or "") and "<tool" not in (ch.delta.content or "")
               for c in chunks for ch in c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.tool_calls]) > 3  # incremental, not one blob
    # parallel_tool_calls false: the first call only
    _, one, one_chunks = serialize(state, {**body, "parallel_tool_calls": False}, CALL_TEXT)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["book_trip"]
    assert [c["name"] for c in accumulate(one_chunks)[2]] == ["book_trip"]
    # tool_choice none: the markup is content, untouched
    _, none, _ = serialize(state, {**body, "tool_choice": "none"}, CALL_TEXT)
    assert none.choices[0].message.tool_calls == [] and NS in none.choices[0].message.content
    # cut off by max_tokens inside the second call: the calls made so far, finish_reason stays "length"
    cut = CALL_TEXT[:CALL_TEXT.index(f"{NS}<days>")]
    _, cut_whole, cut_chunks = serialize(state, body, cut, finish_reason="length")
    assert cut_whole.choices[0].finish_reason == "length"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in cut_whole.choices[0].message.tool_calls] \
        == [EXPECTED_CALLS[0], ("get_weather", {"city": "Rome"})]
    assert accumulate(cut_chunks)[3] == "length"


# -- refusals -------------------------------------------------------------------------------------------------------
def error_of(fn) -> dict:
    with pytest.raises(openai.BadRequestError) as err:
        fn()
    return err.value.body


def _check_call(call, tools_by_name) -> dict:
    assert call.type == "function" and call.id
    schema = tools_by_name[call.function.name]["parameters"]
    args = json.loads(call.function.arguments)
    assert isinstance(args, dict) and set(args) <= set(schema["properties"])
    types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
    for key, value in args.items():
        assert isinstance(value, types[schema["properties"][key]["type"]]), (key, value)
    return args


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_emits_a_valid_call(client, choice, stream):
    """A random-weight model would never choose a tool: structured decoding holds its output to M3's tool-call
    markup, and the parser turns it into OpenAI tool_calls whose arguments follow the tool's schema."""
    # finite arguments (a boolean and an enum), so the random model's call must close within max_tokens
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"hourly": {"type": "boolean"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["hourly", "unit"], "additionalProperties": False}}}, TOOLS[1]]
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
              tool_choice=choice if isinstance(choice, dict) else choice, temperature=0.0, max_tokens=300,
              parallel_tool_calls=False,
              extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}})
    if not stream:
        resp = client.chat.completions.create(**kw)
        msg, finish = resp.choices[0].message, resp.choices[0].finish_reason
        calls = msg.tool_calls
    else:
        names, args, finish = {}, {}, None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    if d.function and d.function.name:
                        names[d.index] = (d.id, d.function.name)
                    args[d.index] = args.get(d.index, "") + ((d.function.arguments or "") if d.function else "")
        calls = [openai.types.chat.ChatCompletionMessageToolCall(
            id=names[i][0], type="function", function={"name": names[i][1], "arguments": args[i]})
            for i in sorted(names)]
    assert finish in ("tool_calls", "length")
    if finish == "length":
        pytest.fail("the forced call did not close within max_tokens")
    assert calls, "a forced tool_choice must produce a tool call"
    for call in calls:
        _check_call(call, by_name)
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"



# bounded values (enums, a bounded integer, a boolean): a random model's call cannot run on past max_tokens
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                         "hourly": {"type": "boolean"}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "book_trip", "parameters": {
        "type": "object", "properties": {"from": {"type": "string", "enum": ["Oslo", "Rome"]},
                                         "to": {"type": "string", "enum": ["Oslo", "Rome"]},
                                         "class": {"type": "string", "enum": ["economy", "business"]}},
        "required": ["from", "to", "class"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("thinking", ["enabled", "disabled", "adaptive"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_is_the_whole_answer_and_fits_the_schema(client, tok, thinking, choice):
    """tool_choice "required" or named, sampled at temperature 1 over several seeds, with thinking on (the
    prompt opens the block), off and left to the model: the answer is exactly one call (the thinking aside) that
    validates against the tool's schema, finish_reason "tool_calls", no content. A logit_bias against
    </mm:think> makes the model one that would think on: the format closes its thinking in time (at most
    max_tokens less the call's room) for the call to fit; temperature 2 makes it one that would chatter on."""
    from concurrent.futures import ThreadPoolExecutor

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORCED_TOOLS}
    end = tok.convert_tokens_to_ids("</mm:think>")

    def ask(seed):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo for two days?"}],
            tools=FORCED_TOOLS, tool_choice=choice, parallel_tool_calls=False, temperature=2.0, seed=seed,
            logit_bias={str(end): -100}, max_tokens=240,
            extra_body={"chat_template_kwargs": {"thinking_mode": thinking}}).choices[0]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for seed, answer in enumerate(answers):
        msg = answer.message
        assert answer.finish_reason == "tool_calls", (seed, answer)
        assert msg.content is None, (seed, msg)
        assert len(msg.tool_calls) == 1, (seed, msg.tool_calls)
        call = msg.tool_calls[0]
        assert isinstance(choice, str) or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if thinking == "enabled":
            assert isinstance(msg.reasoning_content, str), (seed, msg)
        if thinking == "disabled":
            assert msg.reasoning_content is None, (seed, msg)


# -- response_format with thinking: the format holds the answer after </mm:think>, not the thinking ----------------
ANSWER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "hourly": {"type": "boolean"}},
          "required": ["city", "days", "hourly"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": ANSWER}}


def test_response_format_holds_the_answer_not_the_thinking(client, tok):
    """--reasoning-parser: with thinking on, the reasoning is sampled unconstrained and the content after
    </mm:think> follows the schema; with thinking off the whole answer does. m3-tiny rarely closes its thinking by
    itself, so a logit_bias on </mm:think> and a seed (the same on the request without a format) make it close
    after a few tokens; the constrained request's reasoning must be exactly the unconstrained one's (a seeded
    request draws the same tokens while nothing is masked)."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    end = tok.convert_tokens_to_ids("</mm:think>")

    def ask(mode, seed=None, max_tokens=160, stream=False, **kw):
        extra = {"chat_template_kwargs": {"thinking_mode": mode}}
        if "response_format" in kw:
            extra["structured_outputs"] = {"disable_any_whitespace": True}
        sampling = dict(temperature=1.0, seed=seed, logit_bias={str(end): 4}) if seed is not None else \
            dict(temperature=0.0)
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, stream=stream,
                                              extra_body=extra, **sampling, **kw)
    # a seed whose unconstrained thinking closes after some text, within 24 tokens
    for seed in range(40):
        free = ask("enabled", seed, max_tokens=24).choices[0].message
        if free.content is not None and free.reasoning_content:
            break
    else:
        pytest.fail("no seed closes the thinking after a few tokens")
    held = ask("enabled", seed, response_format=ANSWER_FORMAT).choices[0]
    assert held.message.reasoning_content == free.reasoning_content
    assert held.finish_reason == "stop", held
    jsonschema.validate(json.loads(held.message.content), ANSWER)
    off = ask("disabled", response_format=ANSWER_FORMAT).choices[0]
    assert off.message.reasoning_content is None and off.finish_reason == "stop"
    jsonschema.validate(json.loads(off.message.content), ANSWER)
    # streamed, thinking on: the same reasoning and answer in the deltas
    chunks = list(ask("enabled", seed, stream=True, response_format=ANSWER_FORMAT))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) == \
        held.message.reasoning_content
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == held.message.content


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_token_budget_closes_the_thinking(client, tok, stream):
    """vLLM's thinking_token_budget: after that many thinking tokens the end-of-thinking marker is forced. With a
    logit_bias of -100 on </mm:think> the model never closes its thinking by itself; with a budget of 4 it
    closes it after exactly 4 tokens, and the answer after it is free (streamed or not) - or, with a
    response_format, held to it."""
    end = tok.convert_tokens_to_ids("</mm:think>")
    messages = [{"role": "user", "content": "Weather in Oslo?"}]

    def ask(max_tokens=16, **extra):
        body = {"chat_template_kwargs": {"thinking_mode": "enabled"}, "return_token_ids": True, **extra}
        kw = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=1.0, seed=5,
                  logit_bias={str(end): -100}, extra_body=body)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].model_extra["token_ids"]
        chunks = client.chat.completions.create(stream=True, **kw)
        return [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]

    assert end not in ask()
    ids = ask(thinking_token_budget=4)
    assert ids.index(end) == 4 and len(ids) > 5
    assert ask(thinking_token_budget=0).index(end) == 0
    # with an output format: the bounded thinking, then the answer held to the schema
    held = ask(thinking_token_budget=3, response_format=ANSWER_FORMAT, max_tokens=64,
               structured_outputs={"disable_any_whitespace": True})
    assert held.index(end) == 3
    jsonschema.validate(json.loads(tok.decode(held[4:], skip_special_tokens=True)), ANSWER)


@pytest.mark.parametrize("extra, param, words", [
    ({"thinking_token_budget": -1}, "thinking_token_budget", ">= 0"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters.type", "must be 'object'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name", "'get_time' is not one of the request's tools"),
    ({"tool_choice": "required"}, "tool_choice", "tools must be set"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments: not valid JSON"),
    ({"continue_final_message": True}, "continue_final_message", "cannot be combined with add_generation_prompt"),
    ({"chat_template_kwargs": {"thinking_mode": "maybe"}}, "messages", "thinking_mode must be"),
    ({"use_beam_search": True, "seed": 3}, "seed", "not supported with use_beam_search"),
    ({"priority": 1}, "priority", "first come, first served"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "not available when stream is true"),
    ({"structured_outputs": {"regex": "[0-9]+", "reasoning_end_token_id": 5}}, "structured_outputs",
     "unknown field(s): reasoning_end_token_id"),
])
def test_bad_requests_name_the_field(client, extra, param, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    messages = body.pop("messages")
    err = error_of(lambda: client.chat.completions.create(model=MODEL, messages=messages, extra_body=body))
    assert err["param"] == param and words in err["message"], err


def test_unknown_fields_are_ignored_and_logged(client, caplog):
    with caplog.at_level(logging.WARNING):
        resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                              extra_body={"frobnicate": 1, "store": False})
    assert resp.choices[0].message.role == "assistant"
    assert "present in the request but ignored: ['frobnicate', 'store']" in caplog.text


# -- a server without the flags, and generation-config defaults ----------------------------------------------------
def test_plain_server_refuses_auto_and_applies_generation_defaults(tiny_dir):
    """No --enable-auto-tool-choice: tools (default tool_choice auto) are a 400, as in vLLM; without
    --reasoning-parser, so is a thinking_token_budget. The model's generation
    config supplies defaults: here temperature 0 (so a request without one is greedy) and a second EOS id, a
    token the model greedily emits, where generation now stops."""
    from nanoserve import LLM, SamplingParams
    from tests.helpers.server_utils import FAST_CPU

    llm = LLM(model=tiny_dir, optimizations=FAST_CPU, max_model_len=AGENT_LEN, kv_cache_tokens=4096, device="cpu")
    ids = llm.generate("The engine", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    del llm
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i] and 2 not in ids[:i + 1])  # 2: the EOS id
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir, max_model_len=AGENT_LEN))
    options = ChatOptions(override_generation_config={"temperature": 0.0, "eos_token_id": [2, ids[k]]})
    messages = [{"role": "user", "content": "Name a colour."}]
    with ServerThread(build_app(engine, MODEL, chat=options)) as srv:
        plain = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
        err = error_of(lambda: plain.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS))
        assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]
        err = error_of(lambda: plain.chat.completions.create(model=MODEL, messages=messages,
                                                             extra_body={"thinking_token_budget": 8}))
        assert err["param"] == "thinking_token_budget" and "--reasoning-parser" in err["message"]
        out = plain.completions.create(model=MODEL, prompt="The engine", max_tokens=8)  # no temperature: greedy
        assert (out.choices[0].finish_reason, out.choices[0].stop_reason) == ("stop", ids[k])
        assert out.usage.completion_tokens == k + 1
        a = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        b = plain.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0)
        assert a.choices[0].message.content == b.choices[0].message.content


# -- the command line ------------------------------------------------------------------------------------------------
def test_cli_refuses_bad_flag_combinations(capsys):
    from nanoserve.server.__main__ import main

    for argv, words in ((["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
                        (["--tool-call-parser", "hermes"], "invalid choice: 'hermes'"),
                        (["--reasoning-parser", "deepseek_r1"], "invalid choice: 'deepseek_r1'")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.slow
def test_cli_serves_tools_and_reasoning(tiny_dir, tmp_path):
    """`python -m nanoserve.server` with vLLM's flags, as a process of its own: chat, the Responses API with its
    store, Anthropic's Messages API; SIGTERM then stops it with exit code 0."""
    base = [sys.executable, "-m", "nanoserve.server", "--model", tiny_dir, "--device", "cpu", *SWITCH_FLAGS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(base + ["--port", str(port), "--max-model-len", str(AGENT_LEN), "--kv-cache-tokens",
                                    "4096", "--enable-auto-tool-choice", "--tool-call-parser", "minimax_m3",
                                    "--reasoning-parser", "minimax_m3", "--responses-store-size", "4"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(lambda: up() or proc.poll() is not None, timeout=120, what="the server to start")
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        cli = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        resp = cli.chat.completions.create(model=tiny_dir, messages=[{"role": "user", "content": "Weather?"}],
                                           tools=TOOLS, max_tokens=4,
                                           extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
        assert resp.choices[0].message.reasoning_content is not None  # the template opened the thinking block
        assert "default sampling parameters from the model's generation config" in (tmp_path / "server.log"
                                                                                    ).read_text()
        # the same server answers the Responses API (and keeps what it answered) and Anthropic's Messages API
        first = cli.responses.create(model=tiny_dir, input="Weather?", max_output_tokens=4)
        assert cli.responses.retrieve(first.id).output_text == first.output_text
        with cli.responses.stream(model=tiny_dir, input="And tomorrow?", previous_response_id=first.id,
                                  max_output_tokens=4) as stream:
            assert stream.get_final_response().usage.input_tokens > first.usage.input_tokens
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0, timeout=120)
        msg = claude.messages.create(model=tiny_dir, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                     thinking={"type": "disabled"})
        assert msg.usage.output_tokens == 4 and msg.stop_reason == "max_tokens"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        log.close()
    assert code == 0, (tmp_path / "server.log").read_text()
