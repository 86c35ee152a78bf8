"""POST /v1/responses end to end: the official openai client (responses.create / stream / parse / retrieve /
delete) against a real m3-tiny server started with the agent flags (--enable-auto-tool-choice --tool-call-parser
minimax_m3 --reasoning-parser minimax_m3).

The Responses API is served as a chat, so the tests hold it to the chat endpoint:
- the prompt side: a Responses request (instructions, input items, a stored earlier turn, function calls and
  their outputs) must render exactly the prompt of the equivalent chat request (the servers' token counts agree);
- the output side: greedy output equals the chat endpoint's for the same conversation, and the items carry the
  parsers' reasoning / text / calls;
- known M3 output (reasoning, text, two calls) goes through the serializers token by token, as the engine emits
  it, and the event stream is read back with the openai SDK's own stream accumulator.
"""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Literal

import openai
import pydantic
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server import build_app
from nanoserve.server.errors import APIError
from nanoserve.server.responses import schema as R
from nanoserve.server.responses.convert import (
    OutputBuilder,
    prepare_response,
    reasoning_tokens,
    whole_response,
)
from nanoserve.server.responses.events import response_events
from nanoserve.server.responses.store import ResponseStore, StoredResponse
from nanoserve.server.state import ChatOptions
from tests.helpers.server_utils import ServerThread, engine_config
from tests.server.test_agent_api import CALL_TEXT, EXPECTED_CALLS, NS, ReplayStream, engine_outputs

MODEL = "m3-tiny-responses"
AGENT_FLAGS = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="minimax_m3", reasoning_parser="minimax_m3")
FLAT_TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather of a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"]}},
    {"type": "function", "name": "book_trip", "description": "Book a trip",
     "parameters": {"type": "object", "properties": {
         "legs": {"type": "array", "items": {"type": "object", "properties": {
             "from": {"type": "string"}, "to": {"type": "string"}, "nights": {"type": "integer"}}}},
         "budget": {"type": "number"}, "travellers": {"type": "array", "items": {"type": "string"}}}}},
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in FLAT_TOOLS]
GREEDY = dict(temperature=0.0, max_output_tokens=12)


@pytest.fixture(scope="module")
def app(tiny_dir):
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir, max_model_len=2048))
    return build_app(engine, MODEL, chat=AGENT_FLAGS, responses_store_size=8)


@pytest.fixture(scope="module")
def client(app):
    with ServerThread(app) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


def chat_prompt_tokens(client, messages, tools=None, **kw) -> int:
    """The prompt size of the equivalent chat request, as the chat endpoint counts it."""
    extra = {"tools": tools} if tools else {}
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0, **extra,
                                          **kw)
    return resp.usage.prompt_tokens


# -- the prompt: instructions, input items, stored turns ----------------------------------------------------------
def test_text_input_is_a_chat_and_answers_as_the_chat_does(client):
    resp = client.responses.create(model=MODEL, input="Weather in Oslo?", instructions="You are brief.", **GREEDY)
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12)
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.input_tokens + 12
    # the same parsers split the same greedy text
    message = chat.choices[0].message
    reasoning = [o for o in resp.output if o.type == "reasoning"]
    assert (reasoning[0].content[0].text if reasoning else None) == message.reasoning_content
    assert resp.output_text == (message.content or "").strip() and not resp.output_text.isspace()
    # cut by max_output_tokens: incomplete, as vLLM says it
    assert chat.choices[0].finish_reason == "length"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.max_output_tokens == 12 and resp.temperature == 0.0 and resp.instructions == "You are brief."


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(model=MODEL, input="Plan a trip.", instructions="Old instructions.", **GREEDY)
    second = client.responses.create(model=MODEL, input="And the budget?", previous_response_id=first.id,
                                     instructions="New instructions.", **GREEDY)
    assert second.previous_response_id == first.id
    # the earlier turn's instructions do not carry over; its answer does (thinking and text)
    answer = {"role": "assistant", "content": first.output_text or None}
    reasoning = [o.content[0].text for o in first.output if o.type == "reasoning"]
    if reasoning:
        answer["reasoning_content"] = reasoning[0]
    messages = [{"role": "system", "content": "New instructions."}, {"role": "user", "content": "Plan a trip."},
                answer, {"role": "user", "content": "And the budget?"}]
    assert second.usage.input_tokens == chat_prompt_tokens(client, messages)
    # the same conversation sent whole, as input items, renders the same prompt
    items = [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                              "text": reasoning[0]}]}] \
        if reasoning else []
    items = [{"role": "user", "content": "Plan a trip."}] + items + \
        ([{"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]}]
         if first.output_text else []) + [{"role": "user", "content": "And the budget?"}]
    stateless = client.responses.create(model=MODEL, input=items, instructions="New instructions.", store=False,
                                        **GREEDY)
    assert stateless.usage.input_tokens == second.usage.input_tokens
    assert stateless.output_text == second.output_text


def test_function_call_round_trip_renders_as_chat_tool_calls(client):
    items = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo and Rome?"}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "4 C, snow"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "19 C"}]},
    ]
    resp = client.responses.create(model=MODEL, input=items, tools=FLAT_TOOLS, **GREEDY)
    messages = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": "4 C, snow"},
        {"role": "tool", "tool_call_id": "call_b", "content": "19 C"},
    ]
    assert resp.usage.input_tokens == chat_prompt_tokens(client, messages, CHAT_TOOLS)
    assert resp.tools[0].name == "get_weather" and resp.tool_choice == "auto"


def answer_message(response) -> dict:
    """A finished response as the assistant message of a chat (what the next turn's prompt shows)."""
    message = {"role": "assistant", "content": None}
    for item in response.output:
        if item.type == "reasoning":
            message["reasoning_content"] = item.content[0].text
        elif item.type == "message":
            message["content"] = item.content[0].text
        else:
            message.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
    return message


def test_tool_loop_over_previous_response_id(client):
    """A call made in a stored turn, answered by its output only (or with the call sent back again, as some
    clients do): the prompt is the chat's with the assistant's tool_calls and the tool message."""
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=FLAT_TOOLS, temperature=0.0,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    parallel_tool_calls=False, max_output_tokens=300)
    [call] = [o for o in first.output if o.type == "function_call"]
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "4 C, snow"}]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=FLAT_TOOLS, input=result,
                                     **GREEDY)
    resent = client.responses.create(model=MODEL, previous_response_id=first.id, tools=FLAT_TOOLS, input=[
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}] + result,
        **GREEDY)
    messages = [{"role": "user", "content": "Weather in Oslo?"}, answer_message(first),
                {"role": "tool", "tool_call_id": call.call_id, "content": "4 C, snow"}]
    assert second.usage.input_tokens == resent.usage.input_tokens == chat_prompt_tokens(client, messages,
                                                                                         CHAT_TOOLS)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_tool_choice_returns_a_function_call_item(client, choice):
    resp = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=FLAT_TOOLS, tool_choice=choice,
                                   parallel_tool_calls=False, temperature=0.0, max_output_tokens=300)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    assert set(json.loads(calls[0].arguments)) <= {"city", "days"}
    assert all(o.type != "message" for o in resp.output[resp.output.index(calls[0]):])


class Forecast(pydantic.BaseModel):
    city: Literal["Oslo", "Rome"]  # enums: a random model's free strings would run past max_output_tokens
    days: Literal[1, 2, 3]


def test_text_format_json_schema_parses(client):
    parsed = client.responses.parse(model=MODEL, input="Forecast as JSON", text_format=Forecast, temperature=0.0,
                                    max_output_tokens=200, extra_body={
                                        "chat_template_kwargs": {"thinking_mode": "disabled"},
                                        "structured_outputs": {"disable_any_whitespace": True}})
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Forecast)
    assert parsed.text.format.type == "json_schema" and parsed.text.format.name == "Forecast"


def test_logprobs_on_the_output_text(client):
    resp = client.responses.create(model=MODEL, input="Hi", include=["message.output_text.logprobs"],
                                   top_logprobs=2, extra_body={"chat_template_kwargs": {"thinking_mode": "disabled"}},
                                   **GREEDY)
    [message] = [o for o in resp.output if o.type == "message"]
    lps = message.content[0].logprobs
    assert len(lps) == resp.usage.output_tokens  # every generated token (as vLLM)
    for lp in lps:
        assert len(lp.top_logprobs) == 2 and lp.logprob <= 0 and bytes(lp.bytes).decode() == lp.token
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)  # greedy: the pick is the best
    assert resp.top_logprobs == 2


def test_streamed_response_matches_the_whole_one(client):
    kw = dict(model=MODEL, input="Weather in Oslo?", instructions="You are brief.", temperature=0.0,
              max_output_tokens=24)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type == "response.completed"
    assert final.id == events[0].response.id and final.status == whole.status
    assert [o.type for o in final.output] == [o.type for o in whole.output]
    assert final.output_text == whole.output_text and final.usage == whole.usage
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    # stored like a whole response
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_cache_salt_reaches_the_prefix_cache(client):
    text = "Salted prompts share cached blocks only with requests that send the same salt. " * 2

    def cached(salt):
        resp = client.responses.create(model=MODEL, input=text, max_output_tokens=1, extra_body={"cache_salt": salt})
        return resp.usage.input_tokens_details.cached_tokens

    cached("r-a")
    assert cached("r-b") == 0 and cached("r-a") > 0


# -- the store ------------------------------------------------------------------------------------------------------
def test_retrieve_delete_cancel_and_store_false(client):
    resp = client.responses.create(model=MODEL, input="Hi", metadata={"run": "7"}, **GREEDY)
    again = client.responses.retrieve(resp.id)
    assert again.model_dump() == resp.model_dump() and again.metadata == {"run": "7"}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(resp.id)
    assert err.value.body["param"] == "response_id"
    deleted = client.responses.delete(resp.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="Go on", previous_response_id=unstored.id, **GREEDY)
    assert err.value.body["param"] == "previous_response_id"


def test_store_keeps_the_most_recent():
    store = ResponseStore(2)
    for i in range(3):
        store.put(StoredResponse(R.Response(id=f"r{i}", status="completed", model="m"), []))
    with pytest.raises(APIError) as err:
        store.get("r0")
    assert err.value.status == 404
    assert [store.get(f"r{i}").response.id for i in (1, 2)] == ["r1", "r2"]
    off = ResponseStore(0)
    off.put(StoredResponse(R.Response(id="x", status="completed", model="m"), []))
    with pytest.raises(APIError):
        off.get("x")
    with pytest.raises(ValueError, match="responses-store-size"):
        ResponseStore(-1)


# -- refusals ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", "never truncated"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "takes no images"),  # (a text model; m3-tiny-vl reads them: tests/server/test_vision_api.py)
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item references"),
    ({"max_output_tokens": 4000}, "max_output_tokens", "max_model_len"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"top_logprobs": 3}, "top_logprobs", "include"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "token ids"),
    ({"service_tier": "priority"}, "service_tier", "auto"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": FLAT_TOOLS}, "tool_choice.name", "nope"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     "tools[0].parameters.type", "tools[0].parameters.type: must be 'object'"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]}, "input", "gave out"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, "text", "structured"),
])
def test_bad_requests_name_the_field(client, extra, param, words):
    body = {"model": MODEL, "input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.post("/responses", cast_to=object, body=body)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    assert words in err.value.body["message"], err.value.body


def test_cli_refuses_a_negative_store_size(capsys):
    from nanoserve.server.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["--responses-store-size", "-1"])
    assert exit_.value.code == 2 and "--responses-store-size must be >= 0" in capsys.readouterr().err


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="nope", input="Hi")
    assert err.value.body["param"] == "model"


# -- known M3 output through the serializers --------------------------------------------------------------------------
SDK_EVENTS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
              for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}
"""The openai SDK's stream event classes, by their `type`."""


def serialize(server, body: dict, text: str, finish_reason: str = "stop"):
    """(the whole response, the stream's events as the SDK types them, the SDK's final response) for `text` as
    this request's output, token by token as the engine emits it."""
    req = R.ResponsesRequest.model_validate(body)
    prepared, _, messages = prepare_response(server, req)
    outs = engine_outputs(server.tokenizer, text, finish_reason)
    whole = whole_response(server, req, prepared, "resp_whole", 0, outs[-1], messages)

    async def run():
        return [e async for e in response_events(server, req, prepared, "resp_stream", 0, ReplayStream(outs),
                                                 messages)]

    raw = asyncio.run(run())
    events = []
    for sse in raw:
        head, data = sse.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        event = SDK_EVENTS[payload["type"]].model_validate(payload)  # strict: every field the SDK's type has
        assert head == f"event: {event.type}"
        events.append(event)
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:  # the SDK's own accumulator: it checks indices and identities as it goes
        state.handle_event(event)
    return whole, events, state._completed_response


def test_known_output_becomes_reasoning_message_and_calls(app):
    server = app.state.server
    body = {"model": MODEL, "input": "Book it", "tools": FLAT_TOOLS}
    whole, events, final = serialize(server, body, CALL_TEXT)
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, *calls = whole.output
    assert reasoning.content[0].text == "Two legs; the budget is a number." and reasoning.summary == []
    assert message.content[0].text == "Booking it now.\n" and message.status == "completed"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED_CALLS
    assert whole.status == "completed"
    # streamed: the same items, the SDK's accumulator agrees, nothing of the markup leaks into a delta
    assert [o.type for o in final.output] == [o.type for o in whole.output]
    assert [(c.name, c.arguments) for c in final.output[2:]] == [(c.name, c.arguments) for c in calls]
    assert final.output[0].content[0].text == reasoning.content[0].text
    assert final.output_text == message.content[0].text
    for e in events:
        delta = getattr(e, "delta", "")
        assert NS not in delta and "<tool_call>" not in delta and "mm:think" not in delta
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    args = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(args) > 3  # incremental, not one blob
    done = {e.item.id: e.item for e in events if e.type == "response.output_item.done"}
    assert [done[o.id].type for o in final.output] == added  # every item closed, with the final ids


def test_tool_call_caps_and_whitespace(app):
    server = app.state.server
    body = {"model": MODEL, "input": "Book it", "tools": FLAT_TOOLS}
    for cap in ({"parallel_tool_calls": False}, {"max_tool_calls": 1}):
        whole, _, final = serialize(server, {**body, **cap}, CALL_TEXT)
        assert [c.name for c in whole.output if c.type == "function_call"] == ["book_trip"]
        assert [c.name for c in final.output if c.type == "function_call"] == ["book_trip"]
    # whitespace before a call is not a message of its own
    text = CALL_TEXT.replace("Booking it now.\n", "\n\n")
    whole, _, final = serialize(server, body, text)
    assert [o.type for o in whole.output] == ["reasoning", "function_call", "function_call"]
    assert [o.type for o in final.output] == ["reasoning", "function_call", "function_call"]
    # tool_choice none: the markup is the message's text
    whole, _, _ = serialize(server, {**body, "tool_choice": "none"}, CALL_TEXT)
    assert [o.type for o in whole.output] == ["reasoning", "message"] and NS in whole.output[1].content[0].text


def test_reasoning_tokens_and_encrypted_reasoning_round_trip(app, client):
    server = app.state.server
    body = {"model": MODEL, "input": "Book it", "tools": FLAT_TOOLS, "include": ["reasoning.encrypted_content"]}
    whole, _, final = serialize(server, body, CALL_TEXT)
    tok = server.tokenizer
    thinking = len(tok.encode("Two legs; the budget is a number.", add_special_tokens=False))
    assert whole.usage.output_tokens_details.reasoning_tokens == thinking
    blob = whole.output[0].encrypted_content
    assert blob and final.output[0].encrypted_content == blob
    # sent back without its text, the blob renders the same prompt as the text itself
    reasoning_text = whole.output[0].content[0].text
    turn = [{"role": "user", "content": "Book it"}]
    with_text = turn + [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                         "text": reasoning_text}]}]
    with_blob = turn + [{"type": "reasoning", "summary": [], "encrypted_content": blob}]
    a = client.responses.create(model=MODEL, input=with_text + [{"role": "user", "content": "ok"}], **GREEDY)
    b = client.responses.create(model=MODEL, input=with_blob + [{"role": "user", "content": "ok"}], **GREEDY)
    assert a.usage.input_tokens == b.usage.input_tokens and a.output_text == b.output_text


def test_reasoning_tokens_count_ids_between_the_markers(app):
    server = app.state.server
    req = R.ResponsesRequest.model_validate({"model": MODEL, "input": "Hi"})
    prepared, _, _ = prepare_response(server, req)
    tok = server.tokenizer
    ids = tok.encode("<mm:think>a b c</mm:think>done", add_special_tokens=False)
    out = engine_outputs(tok, "<mm:think>a b c</mm:think>done")[-1].outputs[0]
    assert list(out.token_ids) == ids
    expected = len(tok.encode("a b c", add_special_tokens=False))
    state = prepared.chat.reasoning_state
    assert reasoning_tokens(server, prepared, out) == (expected if state == "none" else
                                                       ids.index(server.reasoning_end_id))


def test_builder_without_parsers_passes_text_through(app):
    server = app.state.server
    req = R.ResponsesRequest.model_validate({"model": MODEL, "input": "Hi", "tool_choice": "none"})
    prepared, _, _ = prepare_response(server, req)
    prepared.chat.reasoning_parser = None
    builder = OutputBuilder(prepared)
    events = builder.feed("Hello", False) + builder.feed(" world", True)
    assert [o.type for o in builder.items] == ["message"] and builder.items[0].content[0].text == "Hello world"
    assert [e.type for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]
