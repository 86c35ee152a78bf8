"""The minimax_m3 reasoning parser, and the chat output chain (reasoning first, tool calls on the content), on
hand-written M3 outputs, whole and at every split."""

from __future__ import annotations

import json

import pytest

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
    # no block: a bare leading closer (the model declining to think) is dropped, a later one is text
    (False, f"{E}No thinking needed.", None, "No thinking needed."),
    (False, f"Plain answer, then a stray {E} stays.", None, f"Plain answer, then a stray {E} stays."),
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
    # a call written inside the reasoning is reasoning, not a call
    (True, f"maybe {CALL}? no.{E}No call.", f"maybe {CALL}? no.", "No call.", []),
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
    """tool_choice "none" (or no tools): the markup is the model's text."""
    parsed = choice(False, tools=False).parse(f"{E}{CALL}")
    assert parsed.content == CALL and parsed.tool_calls == [] and parsed.reasoning is None
