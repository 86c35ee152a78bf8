"""The minimax_m3 reasoning parser, and the chat output chain (reasoning first, tool calls on the content), on
hand-written M3 outputs, whole and at every split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.parsers.chat_output import ChoiceText
from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser, get_reasoning_parser
from nanoserve.parsers.tool_calls import CallArguments, CallStart, MiniMaxM3ToolCallParser

NS = "]<]minimax[>["
S, E = "<mm:think>", "</mm:think>"


@pytest.mark.parametrize("opened, text, reasoning, content", [
    # the prompt opened the block (thinking_mode enabled): reasoning up to the closer
    (True, f"step 1, step 2{E}The answer.", "step 1, step 2", "The answer."),
    (True, "thinking until the tokens ran out", "thinking until the tokens ran out", ""),
    (True, f"{E}straight to it", "", "straight to it"),
    # the model opens the block itself (adaptive)
    (False, f"{S}let me see{E}\n\nIt is 4.", "let me see", "\n\nIt is 4."),
    (False, f"Intro {S}hmm{E} outro", "hmm", "Intro  outro"),
    (False, f"{S}never closed", "never closed", ""),
    # no block: a bare leading closer (the model declining to think) is dropped, and so is any later stray one
    (False, f"{E}No thinking needed.", None, "No thinking needed."),
    (False, f"Plain answer, then a stray {E} goes.", None, "Plain answer, then a stray  goes."),
    # markers repeated at the start of a reply (seen in multi-turn chats): never text
    (False, f"{E}{E}Twice closed.", None, "Twice closed."),
    (True, f"{S}opened twice{E}{E}done", "opened twice", "done"),
    (False, f"{S}{S}deep{E}x{E}", "deep", "x"),
    (True, f"{E}{S}second thoughts{E}answer", "second thoughts", "answer"),  # a later block is reasoning too
    (False, "Just text.", None, "Just text."),
    # an unfinished marker at the very end is text of its part
    (False, "ends with <mm:th", None, "ends with <mm:th"),
    (True, "thinks </mm:thi", "thinks </mm:thi", ""),
])
def test_split_whole_and_every_cut(opened, text, reasoning, content):
    assert MiniMaxM3ReasoningParser(opened).parse(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        p = MiniMaxM3ReasoningParser(opened)
        r1, c1 = p.feed(text[:cut])
        r2, c2 = p.feed(text[cut:])
        r3, c3 = p.finish()
        assert (r1 + r2 + r3 if p.saw_reasoning else None, c1 + c2 + c3) == (reasoning, content), cut
        # a marker cut in two never leaks its first half into either part (markers that are text stay text)
        for m in (S, E):
            if m in (reasoning or "") + content:
                continue
            for k in range(1, len(m)):
                if text[cut - k:cut - k + len(m)] == m and cut >= k:
                    assert not r1.endswith(m[:k]) and not c1.endswith(m[:k]), cut


def test_prompt_opens_reasoning():
    opens = MiniMaxM3ReasoningParser.prompt_opens_reasoning
    system = f"]~!b[]~b]system\nwrap your reasoning in {S}{E} tags[e~[\n"
    assert opens(system + f"]~b]user\nhi[e~[\n]~b]ai\n{S}")  # thinking_mode enabled
    assert not opens(system + f"]~b]user\nhi[e~[\n]~b]ai\n{E}")  # disabled
    assert not opens(system + "]~b]user\nhi[e~[\n]~b]ai\n")  # adaptive
    # a prior turn's block or the instructions' markers do not count: only the last turn
    assert not opens(f"]~b]ai\n{S}old{E}answer[e~[\n]~b]user\nmore[e~[\n]~b]ai\n")
    assert opens(f"]~b]ai\n{S}partial thoughts")  # continue_final_message inside a thinking block


def test_registry():
    assert get_reasoning_parser("minimax_m3") is MiniMaxM3ReasoningParser
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("deepseek_r9")


TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
CALL = (f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">{NS}<city>Paris{NS}</city>{NS}<days>2{NS}</days>"
        f"{NS}</invoke>\n{NS}</tool_call>")


def choice(opened: bool, tools: bool = True) -> ChoiceText:
    return ChoiceText(MiniMaxM3ReasoningParser(opened), MiniMaxM3ToolCallParser(TOOLS) if tools else None)


@pytest.mark.parametrize("opened, text, reasoning, content, calls", [
    (True, f"I should look it up.{E}{CALL}", "I should look it up.", None, [("get_weather", {"city": "Paris",
                                                                                             "days": 2})]),
    (False, f"{S}hm{E}Let me check.\n{CALL}", "hm", "Let me check.\n", [("get_weather", {"city": "Paris",
                                                                                       "days": 2})]),
    (False, f"{E}It is sunny.", None, "It is sunny.", []),
    # a call opened before the thinking closed is a call: the thinking ends where it opens, the closer after it
    # is dropped
    (True, f"maybe {CALL}{E}", "maybe ", None, [("get_weather", {"city": "Paris", "days": 2})]),
    (True, f"maybe {CALL}? no.{E}Done.", "maybe ", "? no.Done.", [("get_weather", {"city": "Paris", "days": 2})]),
    (False, f"{S}hmm {CALL}", "hmm ", None, [("get_weather", {"city": "Paris", "days": 2})]),
    # stray tool-call markers outside a block are dropped, in the content and in the reasoning
    (False, f"{E}a {NS} b </tool_call> c", None, "a  b  c", []),
    (True, f"a {NS}<tool_ b </tool_call>{E}c", "a <tool_ b ", "c", []),
])
def test_reasoning_then_tool_calls(opened, text, reasoning, content, calls):
    parsed = choice(opened).parse(text)
    assert parsed.reasoning == reasoning and parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    for cut in range(len(text) + 1):  # streamed: the same reasoning, content and argument fragments
        ch = choice(opened)
        pieces = [ch.feed(text[:cut]), ch.feed(text[cut:]), ch.finish()]
        assert "".join(p.reasoning for p in pieces) == (reasoning or "")
        assert "".join(p.content for p in pieces).strip() == (content or "").strip()
        events = [e for p in pieces for e in p.calls]
        assert [e.name for e in events if isinstance(e, CallStart)] == [c[0] for c in calls]
        args = "".join(e.fragment for e in events if isinstance(e, CallArguments))
        assert args == "".join(c.arguments for c in parsed.tool_calls)


def test_without_tool_parsing_calls_stay_content():
    """tool_choice "none" (or no tools): the markup is the model's text, and a call inside the thinking stays
    reasoning."""
    parsed = choice(False, tools=False).parse(f"{E}{CALL}")
    assert parsed.content == CALL and parsed.tool_calls == [] and parsed.reasoning is None
    parsed = choice(True, tools=False).parse(f"maybe {CALL}{E}no")
    assert parsed.reasoning == f"maybe {CALL}" and parsed.content == "no"


PIECES = [S, E, NS, "<tool_call>", "</tool_call>", '<invoke name="get_weather">', "</invoke>", "<city>", "</city>",
          "Paris", "\n", " ", "<", "/", "]", "x"]
MARKERS = (S, E, NS, "<tool_call>", "</tool_call>")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=40), st.booleans(), st.booleans(), st.data())
def test_no_marker_is_ever_text(pieces, opened, tools, data):
    """Any mix of marker fragments, whatever the thinking mode and split: no stream piece's reasoning or content
    ever holds a marker or ends with the start of a block, and the pieces join to the whole-text answer."""
    text = "".join(pieces)
    whole = choice(opened, tools).parse(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    ch, pieces_out, last = choice(opened, tools), [], 0
    for cut in cuts + [len(text)]:
        pieces_out.append(ch.feed(text[last:cut]))
        last = cut
    pieces_out.append(ch.finish())
    reasoning = "".join(p.reasoning for p in pieces_out)
    content = "".join(p.content for p in pieces_out)
    assert reasoning == (whole.reasoning or "")
    assert content.strip() == (whole.content or "").strip()
    for part in (reasoning, content) if tools else (reasoning,):
        assert not any(m in part for m in MARKERS if tools or m in (S, E)), (text, part)
