"""How one answer to a held-out request is graded: the checks, each a plain function of the request and the text.

An answer is read the way a client reads the server's: the reasoning parser splits the thinking off, the tool-call
parser turns the call markup into `tool_calls` (parsers.chat_output.ChoiceText, the server's chain), and the
checks look at the content and the calls:

    tool_call      the first call names the expected tool and its arguments equal the expected ones (a key the
                   request did not mention counts only when its value is the schema's default)
    no_call        no call, and some content
    tool_result    no new call, and the content holds every value of the result the answer must report
    passage        the content holds the gold span (case, quotes, markup and spacing aside)
    arith          the last integer of the content is the answer (the thinking does not count)
    out_of_scope   a short reply (ended by the model, at most 60 words, no call) that says it does not know or
                   cannot tell
    retrieval_Nk   the content holds the asked combination
    well_formed    every answer: ended by the model, no chat marker in the content, one thinking block at most

`stray_calls` reads the raw text instead, not the parsed calls: how many calls the model itself wrote that name a
tool it was not offered or a key its schema does not have (what the constraint on auto tool calls prevents, and
what a parser that drops such calls would hide).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from nanoserve.parsers.chat_output import ChoiceText
from nanoserve.parsers.reasoning import get_reasoning_parser
from nanoserve.parsers.tool_calls import Incomplete, Malformed, get_tool_call_parser, parse_element

NS = "]<]minimax[>["
MARKERS = ("<mm:think>", "</mm:think>", NS, "<tool_call>", "</tool_call>", "[e~[", "]~b]")
HONEST = re.compile(
    r"\b(i don't know|i do not know|i'm not sure|i am not sure|i can't|i cannot|i can not|i'm unable|i am unable|"
    r"i'm not able|i am not able|i have no (?:access|way|information|data|means)|i don't have|i do not have|"
    r"no way (?:for me )?to (?:know|tell|check|see)|not something i can|unable to)\b")
"""Phrases of an honest "I don't know" (matched on the lower-cased content, curly apostrophes made straight)."""
MAX_HONEST_WORDS = 60


@dataclass
class Answer:
    """One answer as a client sees it."""

    reasoning: str | None
    content: str
    calls: list[tuple[str, dict[str, Any]]]  # (name, arguments)
    finish: str
    text: str  # the raw output, markers included


def read_answer(row: dict, text: str, finish: str, prompt_state: str) -> Answer:
    """Split `text` as the server does for this request (its tools, how its prompt leaves thinking)."""
    reasoning = get_reasoning_parser("minimax_m3")(prompt_state == "open")
    tools = {t["function"]["name"]: t["function"].get("parameters") for t in row.get("tools") or []}
    parser = get_tool_call_parser("minimax_m3")(tools) if tools else None
    parsed = ChoiceText(reasoning, parser).parse(text)
    calls = []
    for c in parsed.tool_calls:
        try:
            args = json.loads(c.arguments)
        except ValueError:
            args = {"<unparsable>": c.arguments}
        calls.append((c.name, args if isinstance(args, dict) else {"<not an object>": args}))
    return Answer(parsed.reasoning, parsed.content or "", calls, finish, text)


def normalize(s: str) -> str:
    s = s.replace("\u2019", "'").replace("\u2018", "'").replace("\u201c", '"').replace("\u201d", '"')
    s = re.sub(r"[`*\"]", "", s.casefold())
    return " ".join(s.split()).strip(" .;:!?")


def arguments_match(got: dict, want: dict, schema: dict | None) -> bool:
    """`got` equals `want`, except that a key the request did not ask for may be there with the schema's default."""
    props = (schema or {}).get("properties") or {}
    for k, v in got.items():
        if k in want:
            if not _same(v, want[k]):
                return False
        elif "default" not in props.get(k, {}) or not _same(v, props[k]["default"]):
            return False
    return all(k in got for k in want)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) < 1e-9
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def honest(content: str) -> bool:
    return bool(HONEST.search(normalize(content)))


def grade(row: dict, ans: Answer) -> dict[str, bool]:
    """The task's check and the format check of one answer (the module docstring)."""
    task, exp, content = row["task"], row["expected"], ans.content
    if task == "tool_call":
        schemas = {t["function"]["name"]: t["function"].get("parameters") for t in row["tools"]}
        ok = bool(ans.calls) and ans.calls[0][0] == exp["name"] and \
            arguments_match(ans.calls[0][1], exp["arguments"], schemas.get(exp["name"]))
    elif task == "no_call":
        ok = not ans.calls and bool(content.strip())
    elif task == "tool_result":
        ok = not ans.calls and all(normalize(v) in normalize(content) for v in exp["contains"])
    elif task == "passage":
        ok = normalize(exp["gold"]) in normalize(content)
    elif task == "arith":
        numbers = re.findall(r"-?\d+", content.replace(",", ""))
        ok = bool(numbers) and numbers[-1] == str(exp["answer"])
    elif task == "out_of_scope":
        ok = not ans.calls and ans.finish == "stop" and honest(content) and \
            len(content.split()) <= MAX_HONEST_WORDS
    elif task.startswith("retrieval"):
        ok = str(exp["value"]) in content
    else:
        raise ValueError(f"unknown held-out task {task!r}")
    well_formed = ans.finish == "stop" and not any(m in content for m in MARKERS) and \
        ans.text.count("<mm:think>") <= 1 and ans.text.count("</mm:think>") <= 1
    return {task: ok, "well_formed": well_formed}


def written_calls(text: str) -> list[tuple[str, list[str]]]:
    """Every invoke the raw output holds: (name, its top-level parameter names), read without any schema."""
    out = []
    header = re.compile(re.escape(NS) + r'<invoke name="([^"]*)">')
    for m in header.finditer(text):
        keys, pos = [], m.end()
        while True:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if not text.startswith(NS + "<", pos) or text.startswith(NS + "</", pos):
                break
            try:
                element, pos = parse_element(text, pos)
            except (Incomplete, Malformed):
                break
            keys.append(element.name)
        out.append((m.group(1).strip(), keys))
    return out


def stray_calls(row: dict, text: str) -> tuple[int, int]:
    """(calls written, of which name a tool not offered or a parameter its schema does not declare)."""
    tools = {t["function"]["name"]: ((t["function"].get("parameters") or {}).get("properties") or {})
             for t in row.get("tools") or []}
    calls = written_calls(text)
    bad = sum(1 for name, keys in calls if name not in tools or any(k not in tools[name] for k in keys))
    return len(calls), bad
