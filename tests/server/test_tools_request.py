"""The request side of tool calling: tool definitions and tool_choice checked with errors that name the field, and
the structure a forced call must follow (checked with xgrammar against calls rendered by the chat template)."""

from __future__ import annotations

import json

import pytest

from nanoserve.chat_template import render_chat, template_messages
from nanoserve.parsers.tool_calls import MiniMaxM3ToolCallParser
from nanoserve.parsers.tools import ToolChoice, ToolError, arguments_schema, check_tools, resolve_tool_choice

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}


def fn(**function):
    return {"type": "function", "function": function}


@pytest.mark.parametrize("tools, param", [
    ([fn(description="no name")], "tools[0].function.name"),
    ([fn(name="")], "tools[0].function.name"),
    ([WEATHER, fn(name='bad "name"')], "tools[1].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([fn(name="f", parameters={"type": "string"})], "tools[0].function.parameters.type"),
    ([fn(name="f", parameters=["city"])], "tools[0].function.parameters"),
    ([fn(name="f", parameters={"type": "object", "properties": ["city"]})], "tools[0].function.parameters.properties"),
    ([fn(name="f", parameters={"type": "object", "properties": {"city": "string"}})],
     "tools[0].function.parameters.properties.city"),
    ([fn(name="f", parameters={"type": "object", "required": "city"})], "tools[0].function.parameters.required"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
])
def test_bad_tool_definitions_name_the_field(tools, param):
    with pytest.raises(ToolError) as err:
        check_tools(tools)
    assert err.value.param == param and str(err.value).startswith(param + ": ")


def test_good_tools():
    tools = check_tools([WEATHER, fn(name="ping"), fn(name="mcp.server:tool-1", parameters={"properties": {}})])
    assert list(tools) == ["get_weather", "ping", "mcp.server:tool-1"]
    assert tools["ping"] is None
    assert arguments_schema(None) == {"type": "object", "properties": {}, "additionalProperties": False}
    assert arguments_schema(tools["get_weather"])["required"] == ["city"]


def test_tool_choice_rules():
    tools = check_tools([WEATHER])
    assert resolve_tool_choice(None, None, False) == ToolChoice("none")
    assert resolve_tool_choice(None, tools, True) == ToolChoice("auto")  # tools given: auto by default
    assert resolve_tool_choice("none", tools, False) == ToolChoice("none")
    assert resolve_tool_choice("required", tools, False) == ToolChoice("required")
    assert resolve_tool_choice("required", {}, False) == ToolChoice("none")  # no tools: nothing to require
    named = resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, tools, False)
    assert named == ToolChoice("named", "get_weather") and named.forced and named.parses_calls
    with pytest.raises(ToolError, match="--enable-auto-tool-choice") as err:
        resolve_tool_choice(None, tools, False)
    assert err.value.param == "tool_choice"
    with pytest.raises(ToolError, match="'get_time' is not one of the request's tools") as err:
        resolve_tool_choice({"type": "function", "function": {"name": "get_time"}}, tools, True)
    assert err.value.param == "tool_choice.function.name"
    with pytest.raises(ToolError, match="tools must be set"):
        resolve_tool_choice("required", None, True)
    with pytest.raises(ToolError, match="must be"):
        resolve_tool_choice("sometimes", tools, True)
    with pytest.raises(ToolError, match="named tool choice"):
        resolve_tool_choice({"type": "function"}, tools, True)


ORDER = fn(name="create_order", parameters={
    "type": "object", "required": ["user_id", "items"],
    "properties": {"user_id": {"type": "integer"}, "note": {"type": "string"}, "express": {"type": "boolean"},
                   "size": {"type": "string", "enum": ["S", "M", "L"]},
                   "shipping": {"type": "object", "properties": {"city": {"type": "string"},
                                                                 "zip": {"type": "integer"}}, "required": ["city"]},
                   "items": {"type": "array", "items": {"type": "object", "properties": {
                       "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}},
                   "labels": {"type": "object", "additionalProperties": {"type": "string"}}}})
ARGS = {"user_id": 42, "note": "by the door", "express": True, "size": "M", "shipping": {"city": "Oslo", "zip": 150},
        "items": [{"sku": "a-1", "qty": 2}, {"sku": "b-2", "qty": 1}], "labels": {"gift": "yes"}}


def rendered_call(tokenizer, name: str, args: dict) -> str:
    """The tool-call block the chat template writes for a past assistant turn (what the model learned)."""
    messages = template_messages([
        {"role": "user", "content": "order"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}])
    text = render_chat(tokenizer, messages, tools=[ORDER, WEATHER], add_generation_prompt=False)
    ns = "]<]minimax[>["
    text = text[text.rindex("]~b]ai\n"):]
    return text[text.index(ns + "<tool_call>"):text.index(ns + "</tool_call>") + len(ns + "</tool_call>")]


def test_forced_call_structure_accepts_what_the_template_writes(tiny_tokenizer):
    """A call rendered by the chat template fits the structural tag for a forced choice, and the parser reads the
    arguments back; a call that breaks the schema does not fit."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tools = check_tools([ORDER, WEATHER])
    _, calls = MiniMaxM3ToolCallParser(tools).parse(rendered_call(tiny_tokenizer, "create_order", ARGS))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("create_order", ARGS)]
    # an object without declared properties (labels) is written as a JSON object: element names cannot be held
    # to match their closing tags by a grammar
    call = rendered_call(tiny_tokenizer, "create_order", {k: v for k, v in ARGS.items() if k != "labels"})
    labels = "]<]minimax[>[<labels>" + json.dumps(ARGS["labels"]) + "]<]minimax[>[</labels>"
    json_labels = call.replace("]<]minimax[>[</invoke>", labels + "]<]minimax[>[</invoke>")
    assert [json.loads(c.arguments) for c in MiniMaxM3ToolCallParser(tools).parse(json_labels)[1]] == [ARGS]
    for choice in (ToolChoice("named", "create_order"), ToolChoice("required")):
        grammar = xgr.Grammar.from_structural_tag(json.dumps(MiniMaxM3ToolCallParser.structural_tag(tools, choice)))
        assert accepts(grammar, call) and accepts(grammar, json_labels), choice
        assert not accepts(grammar, call.replace(">by the door]", ">by the <door>]")), choice  # no markup
        assert not accepts(grammar, call.replace(">42]", ">forty-two]")), choice  # user_id is an integer
        assert not accepts(grammar, call.replace(">M]", ">XL]")), choice  # size is an enum
    named_weather = xgr.Grammar.from_structural_tag(json.dumps(
        MiniMaxM3ToolCallParser.structural_tag(tools, ToolChoice("named", "get_weather"))))
    assert not accepts(named_weather, call)  # the named choice admits only that tool
    weather = rendered_call(tiny_tokenizer, "get_weather", {"city": "Lima"})
    assert accepts(named_weather, weather)
    required = xgr.Grammar.from_structural_tag(json.dumps(
        MiniMaxM3ToolCallParser.structural_tag(tools, ToolChoice("required"))))
    start, end = "]<]minimax[>[<tool_call>\n", "]<]minimax[>[</tool_call>"
    two = call[:-len(end)] + weather[len(start):]  # two invokes in one block
    assert accepts(required, two)
    single = xgr.Grammar.from_structural_tag(json.dumps(
        MiniMaxM3ToolCallParser.structural_tag(tools, ToolChoice("required"), parallel_tool_calls=False)))
    assert accepts(single, call) and not accepts(single, two)  # parallel_tool_calls false: one call
    assert not accepts(required, "No call at all.")
    for choice in (ToolChoice("required"), ToolChoice("named", "get_weather")):  # the call(s) only, then EOS
        grammar = xgr.Grammar.from_structural_tag(json.dumps(MiniMaxM3ToolCallParser.structural_tag(tools, choice)))
        assert accepts(grammar, weather), choice
        assert not accepts(grammar, "Sure. " + weather), choice
        assert not accepts(grammar, weather + " Done."), choice
        assert not accepts(grammar, weather + weather), choice  # one block


@pytest.mark.parametrize("state, good, bad", [
    ("open", ["I will book it.</mm:think>"], [""]),  # the prompt opened the block: close it first
    ("closed", [""], ["</mm:think>", "<mm:think>x</mm:think>"]),  # thinking is over: the call comes first
    ("none", ["", "</mm:think>", "<mm:think>Let me see.</mm:think>"], ["chatter "]),  # the model decides
])
def test_forced_call_after_the_thinking_the_prompt_allows(tiny_tokenizer, state, good, bad):
    """The forced-call format with the reasoning phase in front, for each way the prompt leaves thinking."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser as R

    tools = check_tools([ORDER, WEATHER])
    call = rendered_call(tiny_tokenizer, "get_weather", {"city": "Lima"})
    tag = R.wrap_structural_tag(MiniMaxM3ToolCallParser.structural_tag(tools, ToolChoice("named", "get_weather")),
                                state)
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    for prefix in good:
        assert accepts(grammar, prefix + call), prefix
    for prefix in bad:
        assert not accepts(grammar, prefix + call), prefix




def test_forced_call_markers_are_their_tokens(tiny_tokenizer):
    """token_markers: the template's call, tokenized as the tokenizer does (NS, <tool_call> and </tool_call> are
    one token each), is accepted token by token; the same text with NS spelled from smaller tokens is not."""
    xgr = pytest.importorskip("xgrammar")
    from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser as R

    tools = check_tools([ORDER, WEATHER])
    markers = frozenset(m for m in (*MiniMaxM3ToolCallParser.markers, *R.markers)
                        if len(tiny_tokenizer.encode(m, add_special_tokens=False)) == 1)
    assert "]<]minimax[>[" in markers and "</mm:think>" in markers
    info = xgr.TokenizerInfo.from_huggingface(tiny_tokenizer, vocab_size=len(tiny_tokenizer),
                                              stop_token_ids=[tiny_tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info)

    def accepts(tag, ids):
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tiny_tokenizer.eos_token_id)

    call = rendered_call(tiny_tokenizer, "create_order", {k: v for k, v in ARGS.items() if k != "labels"})
    ids = tiny_tokenizer.encode(call, add_special_tokens=False)
    ns = tiny_tokenizer.convert_tokens_to_ids("]<]minimax[>[")
    spelled = tiny_tokenizer.encode("]<]", add_special_tokens=False) + \
        tiny_tokenizer.encode("minimax[>[", add_special_tokens=False)
    assert ns in ids and tiny_tokenizer.decode(spelled, skip_special_tokens=False) == "]<]minimax[>["
    i = ids.index(ns, 1)  # the invoke's NS
    for choice in (ToolChoice("required"), ToolChoice("named", "create_order")):
        tag = MiniMaxM3ToolCallParser.structural_tag(tools, choice, True, markers)
        assert accepts(tag, ids), choice
        assert not accepts(tag, ids[:i] + spelled + ids[i + 1:]), choice
        thinking = R.wrap_structural_tag(tag, "open", None, markers)
        assert accepts(thinking, tiny_tokenizer.encode("Fine.</mm:think>", add_special_tokens=False) + ids)
        assert not accepts(thinking, tiny_tokenizer.encode("Fine.</mm:think", add_special_tokens=False)
                           + tiny_tokenizer.encode(">", add_special_tokens=False) + ids)

@pytest.mark.parametrize("state", ["open", "none"])
def test_forced_call_thinking_is_bounded_so_the_call_has_room(tiny_dir, tiny_tokenizer, state):
    """max_reasoning_tokens: a model that would think on is made to close its thinking after that many tokens and
    write the call. Random walks over the token masks (every allowed token equally likely, as a random model)
    never think longer and always end in a call the parser reads, with the schema's required parameter."""
    xgr = pytest.importorskip("xgrammar")
    import random

    from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser as R

    # values a random walk cannot run on in (an enum, a bounded integer), so that every walk ends
    tools = check_tools([fn(name="get_weather", parameters={"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                       "maximum": 9}}})])
    markers = frozenset(("]<]minimax[>[", "<tool_call>", "</tool_call>", "<mm:think>", "</mm:think>"))
    tag = R.wrap_structural_tag(MiniMaxM3ToolCallParser.structural_tag(tools, ToolChoice("required"), False,
                                                                       markers), state, 6, markers)
    info = xgr.TokenizerInfo.from_huggingface(tiny_tokenizer, vocab_size=len(tiny_tokenizer),
                                              stop_token_ids=[tiny_tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(tag))
    end = tiny_tokenizer.convert_tokens_to_ids(R.end)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for seed in range(6):
        rng, matcher, out = random.Random(seed), xgr.GrammarMatcher(compiled), []
        while not matcher.is_terminated():
            assert len(out) < 400, "the walk did not end"
            matcher.fill_next_token_bitmask(mask)
            allowed = [i for i in range(info.vocab_size) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
            # lean away from the end of thinking, as a model that would think on
            pick = [i for i in allowed if i != end] or allowed
            out.append(rng.choice(pick))
            assert matcher.accept_token(out[-1])
        text = tiny_tokenizer.decode(out[:-1], skip_special_tokens=False)  # the last token is EOS
        if end in out:  # the thinking: at most 6 tokens (and the <mm:think> that opens it, for "none")
            assert out.index(end) <= 6 + (state == "none"), text
        _, calls = MiniMaxM3ToolCallParser(tools).parse(text[text.index(R.end) + len(R.end):] if R.end in text
                                                        else text)
        assert calls and all("city" in json.loads(c.arguments) for c in calls), text

def test_prompt_state():
    from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser as R

    head = "]~!b[]~b]system\nthink in <mm:think></mm:think>[e~[\n]~b]user\nhi[e~[\n]~b]ai\n"
    assert [R.prompt_state(head + tail) for tail in ("<mm:think>", "</mm:think>", "")] == ["open", "closed", "none"]
