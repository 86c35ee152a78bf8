"""Tool calls held to the tools a request offers (switch constrained_tool_calls): with tool_choice "auto", once the
model opens a call block the grammar admits only the offered tools' names and their declared parameters.

- The grammar the server prepares for a request, walked token by token on m3-tiny's vocabulary: free text passes,
  a call to an offered tool passes, an unoffered name or an undeclared key is refused at its first character; the
  thinking comes first, and a response_format is the answer's other branch.
- Through real servers and the openai SDK (streamed and not): m3-tiny, pushed to open a call (logit_bias on M3's
  namespace token), comes back with exactly one well-formed call to an offered tool with the switch on, and with
  none with it off (the same push then writes only stray markers).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import xgrammar as xgr

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.server import build_app
from nanoserve.server.openai import schema as P
from nanoserve.server.prepare import prepare_chat
from nanoserve.server.state import ChatOptions
from tests.helpers.server_utils import FAST_CPU, ServerThread, engine_config

MODEL = "m3-tiny-calls"
NS, NS_ID = "]<]minimax[>[", 5  # M3's namespace token (the preset tokenizer's id 5)
TOOL_CALL, TOOL_CALL_END, THINK, THINK_END = 6, 7, 3, 4  # the other marker tokens
AGENT_FLAGS = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="minimax_m3", reasoning_parser="minimax_m3")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return AsyncLLMEngine.from_config(engine_config(tiny_dir, max_model_len=2048))


@pytest.fixture(scope="module")
def app(engine):
    return build_app(engine, MODEL, chat=AGENT_FLAGS)


@pytest.fixture(scope="module")
def off_client(tiny_dir):
    """A second server, the same model with the switch off."""
    engine = AsyncLLMEngine.from_config(engine_config(
        tiny_dir, max_model_len=2048, optimizations=FAST_CPU.replace(constrained_tool_calls=False)))
    with ServerThread(build_app(engine, MODEL, chat=AGENT_FLAGS)) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)


# -- the grammar, token by token -----------------------------------------------------------------------------------
def matcher_for(app, engine, **body):
    """A GrammarMatcher at the start of the format the server prepares for this chat request."""
    req = P.ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, "tools": TOOLS, **body})
    params = prepare_chat(app.state.server, req).params
    assert params.structured_outputs is not None, "the request's output is not constrained"
    return xgr.GrammarMatcher(engine.engine.structured_output.compile(params.structured_outputs))


def walk(matcher, *pieces: int | str) -> bool:
    """Feed marker tokens (ids) and text (as the tokenizer writes it) in order, token by token, as the engine
    would; False at the first token refused. (The free text around calls is a token-level region of the format.)"""
    for piece in pieces:
        tokens = [piece] if isinstance(piece, int) else TOKENIZER[0].encode(piece, add_special_tokens=False)
        if not all(matcher.accept_token(t) for t in tokens):
            return False
    return True


TOKENIZER: list = []  # the engine's tokenizer, set by the `tok` fixture


@pytest.fixture(scope="module", autouse=True)
def tok(engine):
    TOKENIZER[:] = [engine.get_tokenizer()]
    return TOKENIZER[0]


def call(name: str, *params: tuple[str, str]) -> tuple[int | str, ...]:
    """A call block in M3's markup, as marker tokens and text."""
    pieces: list[int | str] = [NS_ID, TOOL_CALL, "\n", NS_ID, f'<invoke name="{name}">']
    for key, value in params:
        pieces += [NS_ID, f"<{key}>{value}", NS_ID, f"</{key}>"]
    return (*pieces, NS_ID, "</invoke>\n", NS_ID, TOOL_CALL_END)


def test_grammar_admits_only_offered_tools_and_declared_keys(app, engine):
    def fresh():
        return matcher_for(app, engine)

    offered = call("get_weather", ("city", "Paris"))
    assert walk(fresh(), "Let me check. ", *offered, " Done.")  # free text around a call
    assert walk(fresh(), "No call needed here.")
    assert walk(fresh(), *call("get_time", ("zone", "UTC")), *offered)  # parallel calls: blocks one after another
    # an unoffered name: refused at its first character that no offered name continues with
    m = fresh()
    assert walk(m, NS_ID, TOOL_CALL, "\n", NS_ID, '<invoke name="get_')
    assert not walk(m, "s") and walk(m, "weather")
    assert not walk(fresh(), NS_ID, TOOL_CALL, "\n", NS_ID, '<invoke name="edit_game">')
    # an undeclared key, and a call that leaves out a required one
    assert not walk(fresh(), NS_ID, TOOL_CALL, "\n", NS_ID, '<invoke name="get_weather">', NS_ID, "<town>")
    assert not walk(fresh(), NS_ID, TOOL_CALL, "\n", NS_ID, '<invoke name="get_weather">', NS_ID, "</invoke>")


def test_grammar_thinks_first_and_keeps_the_response_format_as_the_other_branch(app, engine):
    # thinking first (the prompt leaves the choice to the model), unconstrained but for the markers
    thought = (THINK, "The user wants the weather.", THINK_END)
    assert walk(matcher_for(app, engine), *thought, *call("get_weather", ("city", "Oslo")))
    # a call opened inside the thinking (which the parsers read as a call) is held to the tools too
    assert walk(matcher_for(app, engine), THINK, "Hmm ", *call("get_time", ("zone", "UTC")))
    assert not walk(matcher_for(app, engine), THINK, "Hmm ", NS_ID, TOOL_CALL, "\n", NS_ID, '<invoke name="edit')
    # thinking_mode enabled: the prompt opens the thinking, the call comes after its end
    kwargs = {"chat_template_kwargs": {"thinking_mode": "enabled"}}
    assert walk(matcher_for(app, engine, **kwargs), "Weather: a call.", THINK_END, *call("get_time", ("zone", "CET")))
    # a response_format beside the tools: the answer is that format, or a call
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}}
    assert walk(matcher_for(app, engine, **fmt), '{"answer": "sunny"}')
    assert walk(matcher_for(app, engine, **fmt), *call("get_weather", ("city", "Rome")))
    assert not walk(matcher_for(app, engine, **fmt), "It is sunny.")
    # parallel_tool_calls false: one call, then the output ends
    m = matcher_for(app, engine, parallel_tool_calls=False)
    assert walk(m, *call("get_weather", ("city", "Lima"))) and not m.is_terminated()
    assert not walk(m, "x") and m.accept_token(engine.engine.eos_token_id) and m.is_terminated()


# -- through the server ------------------------------------------------------------------------------------------
PUSH = dict(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, temperature=0.0, max_tokens=96,
            logit_bias={str(NS_ID): 100})
"""A request that pushes the model to write the namespace token wherever it may (the grammar masks come first,
so the push never overrides them): with the constraint that opens a call block at once."""


def check_calls(calls: list[tuple[str, str]]) -> None:
    [(name, arguments)] = calls
    assert name in PARAMETERS
    jsonschema.validate(json.loads(arguments), {**PARAMETERS[name], "additionalProperties": False})


def streamed(client, **body) -> tuple[list[tuple[str, str]], str | None, str]:
    calls: dict[int, list[str]] = {}
    content, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **body):
        choice = chunk.choices[0]
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        content.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
    return [tuple(c) for c in calls.values()], finish, "".join(content)


def test_a_call_the_model_opens_names_an_offered_tool(client):
    whole = client.chat.completions.create(**PUSH).choices[0]
    assert whole.finish_reason == "tool_calls"
    check_calls([(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls])
    calls, finish, content = streamed(client, **PUSH)
    assert finish == "tool_calls" and not content.strip()
    assert calls == [(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls]


def test_without_the_switch_the_same_push_makes_no_call(off_client):
    whole = off_client.chat.completions.create(**PUSH).choices[0]
    assert whole.finish_reason != "tool_calls" and not whole.message.tool_calls
    calls, finish, content = streamed(off_client, **PUSH)
    assert calls == [] and finish == whole.finish_reason and NS not in content
