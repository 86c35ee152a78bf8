"""What an agent client relies on, checked with the openai SDK against `python -m nanoserve.server` as a process of
its own (m3-tiny, random weights, `--enable-auto-tool-choice --tool-call-parser minimax_m3 --reasoning-parser
minimax_m3`): forced tool calls whose arguments validate under the tool's schema within a bounded max_tokens,
streamed and not, with every thinking mode; no marker ever reaching content or reasoning; a json_schema request in
the default thinking mode ending with parseable JSON in content."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.server_utils import ServerProcess

MARKERS = ("]<]minimax[>[", "<tool_call>", "</tool_call>", "<mm:think>", "</mm:think>")
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "hourly": {"type": ["boolean", "null"]}},
    "required": ["city"], "additionalProperties": False}
TRIP = {"type": "object", "properties": {
    "legs": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
        "from": {"type": "string", "minLength": 3, "maxLength": 8}, "nights": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
        "required": ["from"]}},
    "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["legs", "code"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_trip", "description": "Book a trip", "parameters": TRIP}}]
SCHEMAS = {"get_weather": WEATHER, "book_trip": TRIP}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("agent-client") / "server.log"
    with ServerProcess(tiny_dir, log, "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser",
                       "minimax_m3", "--reasoning-parser", "minimax_m3", name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def no_marker(*texts: str | None) -> None:
    for text in texts:
        assert not any(m in (text or "") for m in MARKERS), text


def streamed(client, **kw):
    """A streamed chat answer put together as a client does: (reasoning, content, calls, finish_reason)."""
    reasoning, content, names, args, finish = "", "", {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            delta = c.delta
            piece = getattr(delta, "reasoning_content", None) or ""
            no_marker(piece, delta.content)  # no piece of a marker reaches a delta either
            reasoning += piece
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                args[d.index] = args.get(d.index, "") + ((d.function.arguments or "") if d.function else "")
    return reasoning, content, [(names[i], args[i]) for i in sorted(names)], finish


@pytest.mark.parametrize("thinking", ["enabled", "disabled", "adaptive"])
@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_validate_under_the_schema(client, thinking, choice, stream):
    """tool_choice named or "required", the model's default sampling, several seeds: every answer is one call
    whose arguments validate (jsonschema), finish_reason "tool_calls", no content, and no marker anywhere."""
    def ask(seed):
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo for two days?"}], tools=TOOLS,
                  tool_choice=NAMED if choice == "named" else "required", parallel_tool_calls=False, seed=seed,
                  max_tokens=320, extra_body={"chat_template_kwargs": {"thinking_mode": thinking}})
        if stream:
            return streamed(client, **kw)
        answer = client.chat.completions.create(**kw).choices[0]
        msg = answer.message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        return msg.reasoning_content, msg.content, calls, answer.finish_reason

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, range(3)))
    for seed, (reasoning, content, calls, finish) in enumerate(answers):
        assert finish == "tool_calls", (seed, reasoning, content, calls)
        assert not content, (seed, content)
        assert len(calls) == 1, (seed, calls)
        name, arguments = calls[0]
        assert choice == "required" or name == "get_weather"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        no_marker(reasoning, content, arguments)
        if thinking == "disabled":
            assert not reasoning, (seed, reasoning)
