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

from tests.helpers.server_utils import AGENT_FLAGS, ServerProcess

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
    with ServerProcess(tiny_dir, log, "--max-model-len", "2048", *AGENT_FLAGS, name="tiny") as srv:
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


# -- markers never leak ----------------------------------------------------------------------------------------
NS, S, E = "]<]minimax[>[", "<mm:think>", "</mm:think>"
CALL = [NS, "<tool_call>", "\n", NS, '<invoke name="get_weather">', NS, "<city>Oslo", NS, "</city>", NS,
        "</invoke>", "\n", NS, "</tool_call>"]


def forced(parts: list[str]) -> dict:
    """A structural tag that makes the model write exactly `parts`, each marker as its own token (what a model
    that emits these markers writes)."""
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": p} if p in MARKERS else {"type": "const_string", "value": p} for p in parts]}}


MULTI_TURN = [{"role": "user", "content": "Weather in Rome?"},
              {"role": "assistant", "content": "", "reasoning_content": "Rome, then.", "tool_calls": [
                  {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                "arguments": '{"city": "Rome"}'}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
              {"role": "assistant", "content": "Sunny in Rome."}]


def answer(client, tok_end: int, thinking: str, parts: list[str], stream: bool, max_tokens: int = 200,
           history: list[dict] = ()):
    """The chat answer when the model writes `parts` after the thinking the mode allows (a logit_bias makes it
    close that thinking at once: the format holds only what follows the first </mm:think>, as with any format
    under --reasoning-parser), after the turns of `history`: (reasoning, content, calls, finish_reason)."""
    kw = dict(model="tiny", messages=[*history, {"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
              max_tokens=max_tokens, seed=0, logit_bias={str(tok_end): 100},
              extra_body={"chat_template_kwargs": {"thinking_mode": thinking},
                          "structured_outputs": {"structural_tag": forced(parts)}})
    if stream:
        return streamed(client, **kw)
    choice = client.chat.completions.create(**kw).choices[0]
    msg = choice.message
    return (msg.reasoning_content, msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls or []],
            choice.finish_reason)


@pytest.fixture(scope="module")
def end_token(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids(E)


@pytest.mark.parametrize("thinking", ["enabled", "disabled", "adaptive"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("history", [[], MULTI_TURN], ids=["one-turn", "multi-turn"])
def test_markers_never_leak(client, end_token, thinking, stream, history):
    """Stray, leading and repeated thinking markers are never content; a call opened before the thinking closed
    is a call; whatever the thinking mode, streamed or not, in a first turn and after earlier turns (calls, tool
    results, reasoning shown)."""
    first = [] if thinking == "disabled" else [E]  # the biased closer the other modes start with
    # a stray closer in the content, closers repeated at the start (as seen at the start of multi-turn replies)
    reasoning, content, calls, finish = answer(client, end_token, thinking, first + [E, E, "Hello", E, " there"],
                                               stream, history=history)
    no_marker(reasoning, content)
    assert content == "Hello there" and calls == [] and finish == "stop"
    assert not reasoning
    # a block opened twice, then a tool call opened inside it before it closes
    reasoning, content, calls, finish = answer(client, end_token, thinking, first + [S, S, "plan ", *CALL, E],
                                               stream, history=history)
    no_marker(reasoning, content, *(a for _, a in calls))
    assert reasoning == "plan " and not content, (reasoning, content)
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"})] and finish == "tool_calls"


@pytest.fixture(scope="module")
def unconstrained(tiny_dir, tmp_path_factory):
    """The same server with --no-constrained-tool-calls: there the model may write a call the offered tools do not
    allow (with the switch on, a request's own format is one branch of the answer and a call held to the tools the
    other, so no format can make it write an undeclared value)."""
    log = tmp_path_factory.mktemp("agent-client-off") / "server.log"
    with ServerProcess(tiny_dir, log, "--max-model-len", "2048", *AGENT_FLAGS, "--no-constrained-tool-calls",
                       name="tiny") as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_ends_cleanly(unconstrained, end_token, stream):
    """max_tokens inside a call's second parameter: the answer (and the stream, to its end) holds the call with
    the parameter that was complete, finish_reason "length", and nothing of the cut markup."""
    parts = CALL[:9] + [NS, "<unit>" + "x" * 300, NS, "</unit>"] + CALL[9:]
    reasoning, content, calls, finish = answer(unconstrained, end_token, "disabled", parts, stream, max_tokens=120)
    no_marker(reasoning, content)
    assert not content and finish == "length"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"})]


# -- a format in the default thinking mode ---------------------------------------------------------------------
FORECAST = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                             "raining": {"type": "boolean"},
                                             "note": {"type": "string", "pattern": "^[a-z ]{0,12}$"}},
            "required": ["city", "days", "raining"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("opens", [False, True])
def test_json_schema_in_the_default_thinking_mode_ends_in_json(client, tiny_dir, stream, opens):
    """response_format json_schema with no thinking_mode (a LangChain with_structured_output call): whatever the
    model thinks is reasoning, and content is JSON that validates, within max_tokens - also when the model opens a
    thinking block it would never close (a logit_bias on <mm:think>: the thinking is bounded)."""
    from transformers import AutoTokenizer

    start = AutoTokenizer.from_pretrained(tiny_dir).convert_tokens_to_ids(S)
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
    for seed in range(2):
        # compact JSON: a random model would otherwise write whitespace for as long as the grammar lets it
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Will it rain in Oslo?"}], response_format=fmt,
                  max_tokens=200, seed=seed, logit_bias={str(start): 100} if opens else None,
                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
        if stream:
            reasoning, content, _, finish = streamed(client, **kw)
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            reasoning, content, finish = choice.message.reasoning_content, choice.message.content, \
                choice.finish_reason
        no_marker(reasoning, content)
        assert finish == "stop", (seed, reasoning, content)
        jsonschema.validate(json.loads(content), FORECAST)
        if opens:
            assert reasoning, (seed, content)
