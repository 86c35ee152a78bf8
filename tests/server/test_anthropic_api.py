"""POST /v1/messages and /v1/messages/count_tokens end to end: the official anthropic client against a real
m3-tiny server started with the agent flags and an API key (sent as x-api-key, as Anthropic's clients do).

Served as a chat, the API is held to the chat endpoint: a request (system prompt, content blocks, thinking, tool
use and tool results) renders exactly the prompt of the equivalent chat request, and greedy output equals the
chat's. Known M3 output (thinking, text, two calls) goes through the serializers token by token, and the event
stream is read back with the anthropic SDK's own event types and accumulator.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import typing

import anthropic
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server import build_app
from nanoserve.server.anthropic import schema as A
from nanoserve.server.anthropic.convert import message_response, prepare_message
from nanoserve.server.anthropic.events import message_events
from nanoserve.server.state import ChatOptions
from tests.helpers.server_utils import engine_config
from tests.server.test_agent_api import CALL_TEXT, EXPECTED_CALLS, NS, ReplayStream, engine_outputs

MODEL = "m3-tiny-anthropic"
KEY = "sekret"
AGENT_FLAGS = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="minimax_m3", reasoning_parser="minimax_m3")
TOOLS = [
    {"name": "get_weather", "description": "Current weather of a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                      "required": ["city"]}},
    {"name": "book_trip", "description": "Book a trip",
     "input_schema": {"type": "object", "properties": {
         "legs": {"type": "array", "items": {"type": "object", "properties": {
             "from": {"type": "string"}, "to": {"type": "string"}, "nights": {"type": "integer"}}}},
         "budget": {"type": "number"}, "travellers": {"type": "array", "items": {"type": "string"}}}}},
]
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                "parameters": t["input_schema"]}} for t in TOOLS]
GREEDY = {"extra_body": {"temperature": 0.0}}  # this SDK no longer takes sampling arguments itself


@pytest.fixture(scope="module")
def app(tiny_dir):
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir, max_model_len=2048))
    return build_app(engine, MODEL, api_key=KEY, chat=AGENT_FLAGS)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_prompt_tokens(chat, messages, tools=None, **extra) -> int:
    kw = {"tools": tools} if tools else {}
    resp = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body=extra,
                                        **kw)
    return resp.usage.prompt_tokens


def prompt_size(message) -> int:
    u = message.usage
    return u.input_tokens + u.cache_read_input_tokens


# -- the prompt --------------------------------------------------------------------------------------------------
def test_text_answer_is_the_chat_answer(client, chat):
    msg = client.messages.create(model=MODEL, max_tokens=12, system="You are brief.",
                                 messages=[{"role": "user", "content": "Weather in Oslo?"}], **GREEDY)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    reply = chat.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == MODEL
    assert prompt_size(msg) == reply.usage.prompt_tokens and msg.usage.output_tokens == 12
    thinking = [b.thinking for b in msg.content if b.type == "thinking"]
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert (thinking[0] if thinking else None) == reply.choices[0].message.reasoning_content
    assert text == (reply.choices[0].message.content or "").strip() or text == reply.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    count = client.messages.count_tokens(model=MODEL, system="You are brief.",
                                         messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert count.input_tokens == reply.usage.prompt_tokens


def test_tool_loop_renders_as_chat_tool_calls(client, chat):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Rome?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two cities.", "signature": "abc"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Rome", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "4 C, snow"},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": [{"type": "text", "text": "no data"}],
             "is_error": True},
            {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]},
    ]
    chat_messages = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "toolu_a", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Oslo"}'}},
            {"id": "toolu_b", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_a", "content": "4 C, snow"},
        {"role": "tool", "tool_call_id": "toolu_b", "content": "Error: no data"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    expected = chat_prompt_tokens(chat, chat_messages, CHAT_TOOLS)
    assert client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS).input_tokens == expected
    msg = client.messages.create(model=MODEL, max_tokens=4, messages=messages, tools=TOOLS, **GREEDY)
    assert prompt_size(msg) == expected


def test_thinking_setting_is_the_templates_thinking_mode(client, chat):
    messages = [{"role": "user", "content": "Hi"}]
    for kind in ("enabled", "disabled", "adaptive"):
        count = client.messages.count_tokens(model=MODEL, messages=messages, thinking={"type": kind})
        assert count.input_tokens == chat_prompt_tokens(chat, messages,
                                                        chat_template_kwargs={"thinking_mode": kind}), kind
    off = client.messages.create(model=MODEL, max_tokens=8, messages=messages, thinking={"type": "disabled"},
                                 **GREEDY)
    assert all(b.type == "text" for b in off.content)


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather"}])
def test_forced_tool_choice_returns_tool_use(client, choice):
    msg = client.messages.create(model=MODEL, max_tokens=300, tools=TOOLS, tool_choice=choice,
                                 messages=[{"role": "user", "content": "Weather in Oslo?"}], **GREEDY)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert isinstance(uses[0].input, dict) and set(uses[0].input) <= {"city", "days"}
    assert msg.stop_reason in ("tool_use", "max_tokens")


def test_stop_sequence(client):
    kw = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Hi"}], thinking={"type": "disabled"})
    free = client.messages.create(**kw, **GREEDY)
    text = free.content[0].text
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3) if text[i:i + 3].strip() == text[i:i + 3]
                and text.find(text[i:i + 3]) == i)
    cut = client.messages.create(**kw, stop_sequences=[stop], **GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_streamed_message_matches_the_whole_one(client):
    kw = dict(model=MODEL, max_tokens=24, system="You are brief.",
              messages=[{"role": "user", "content": "Weather in Oslo?"}])
    whole = client.messages.create(**kw, **GREEDY)
    with client.messages.stream(**kw, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert [b.type for b in final.content] == [b.type for b in whole.content]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_cache_salt_reaches_the_prefix_cache(client):
    text = "Salted prompts share cached blocks only with requests that send the same salt. " * 2

    def cached(salt):
        msg = client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": text}],
                                     extra_body={"cache_salt": salt})
        return msg.usage.cache_read_input_tokens

    cached("m-a")
    assert cached("m-b") == 0 and cached("m-a") > 0


# -- refusals, errors in Anthropic's shape ------------------------------------------------------------------------
@pytest.mark.parametrize("extra, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]},
     "takes no images"),  # (a text model; m3-tiny-vl reads them: tests/server/test_vision_api.py)
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]},
     "no document blocks"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "belongs to a user message"),
    ({"max_tokens": 4000}, "max_tokens=4000 does not fit"),
    ({"max_tokens": 0}, "max_tokens: must be at least 1"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens: must be at least 1024"),
    ({"max_tokens": 1500, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "less than max_tokens"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice.name: required"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema.type: must be 'object'"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice.name: 'nope'"),
    ({"thinking": {"type": "disabled", "budget_tokens": 2000}, "max_tokens": 3000}, "only with thinking type"),
])
def test_bad_requests_are_anthropic_errors(client, extra, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **extra}
    with pytest.raises(anthropic.BadRequestError) as err:
        client.post("/v1/messages", cast_to=object, body=body)
    assert err.value.status_code == 400
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert words in err.value.body["error"]["message"], err.value.body


def test_auth_and_not_found(server, client):
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.body["error"]["type"] == "not_found_error" and "nope" in err.value.body["error"]["message"]


# -- known M3 output through the serializers ----------------------------------------------------------------------
SDK_EVENTS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
              for m in typing.get_args(typing.get_args(RawMessageStreamEvent)[0])}
"""The anthropic SDK's stream event classes, by their `type`."""


def serialize(server, body: dict, text: str, finish_reason: str = "stop"):
    """(the whole message, the stream's events as the SDK types them, the SDK's accumulated message)."""
    req = A.MessagesRequest.model_validate(body)
    prepared, _ = prepare_message(server, req)
    outs = engine_outputs(server.tokenizer, text, finish_reason)
    whole = message_response(server, req, prepared, "msg_x", outs[-1])

    async def run():
        return [e async for e in message_events(server, req, prepared, "msg_x", ReplayStream(outs))]

    events, snapshot, json_bufs = [], None, {}
    for sse in asyncio.run(run()):
        head, data = sse.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        event = SDK_EVENTS[payload["type"]].model_validate(payload)  # every field the SDK's type has
        assert head == f"event: {event.type}"
        events.append(event)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return whole, events, snapshot


def test_known_output_becomes_thinking_text_and_tool_use(app):
    server = app.state.server
    body = {"model": MODEL, "max_tokens": 400, "tools": TOOLS, "messages": [{"role": "user", "content": "Book it"}]}
    whole, events, streamed = serialize(server, body, CALL_TEXT)
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, *uses = whole.content
    assert thinking.thinking == "Two legs; the budget is a number."
    assert thinking.signature == hashlib.sha256(thinking.thinking.encode()).hexdigest()
    assert text.text == "Booking it now.\n"
    assert [(u.name, u.input) for u in uses] == EXPECTED_CALLS
    assert whole.stop_reason == "tool_use"
    # streamed: the SDK's accumulator builds the same message (tool inputs from the input_json deltas; each
    # answer has ids of its own)
    def blocks(content):
        return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in content]
    assert blocks(streamed.content) == blocks(whole.content)
    assert all(b.id.startswith("toolu_") for b in streamed.content if b.type == "tool_use")
    assert streamed.stop_reason == "tool_use" and streamed.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert sum(d.type == "input_json_delta" for d in deltas) > 3  # incremental, not one blob
    assert all(NS not in (getattr(d, "text", "") or "") and "mm:think" not in (getattr(d, "text", "") or "")
               for d in deltas)


def test_known_output_caps_and_cut_calls(app):
    server = app.state.server
    body = {"model": MODEL, "max_tokens": 400, "tools": TOOLS, "messages": [{"role": "user", "content": "Book it"}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    whole, _, streamed = serialize(server, body, CALL_TEXT)
    assert [b.name for b in whole.content if b.type == "tool_use"] == ["book_trip"]
    assert [b.name for b in streamed.content if b.type == "tool_use"] == ["book_trip"]
    # cut by max_tokens inside the second call: stop_reason max_tokens, the calls so far
    del body["tool_choice"]
    cut = CALL_TEXT[:CALL_TEXT.index(f"{NS}<days>")]
    whole, _, streamed = serialize(server, body, cut, finish_reason="length")
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert [(u.name, u.input) for u in whole.content if u.type == "tool_use"] == \
        [EXPECTED_CALLS[0], ("get_weather", {"city": "Rome"})]
