"""Answer the held-out set through the chat path and grade it against m3-mini's targets.

    evaluate(llm, rows)          every request answered greedily by `LLM.chat` (the server's rendering: the request's
                                 messages, its tools, its thinking mode), graded by grade.py
    target_table(...)            target, measured (and the shipped weights' value) per row

Requests that share their tools and thinking mode go to `LLM.chat` together (it takes one tool list a call); the
questions about one long document go after its first question has been answered, so the engine's prefix cache
holds the document and the CPU prefills it once.

The constraint on auto tool calls (the `constrained_tool_calls` switch, where this build has it) is measured both
ways. With it on, a request that offers tools is held to the format the server holds it to: the tool-call
parser's auto structural tag for the offered tools (free text; a call, once opened, names an offered tool and keeps
to its parameters), started after the thinking as `LLM` starts any output format. `evaluate` answers those
requests once more with the switch's other value; the table shows the tool rows and the stray calls (to tools not
offered, or with keys their schema lacks, counted on the raw text) both ways.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from nanoserve.bench.heldout.grade import Answer, grade, read_answer, stray_calls

TASK_TOKENS = {"tool_call": 256, "no_call": 256, "tool_result": 192, "passage": 160, "arith": 320,
               "out_of_scope": 128}
"""max_tokens per task: room for thinking before a call, and for a scratchpad in the answer."""
RETRIEVAL_TOKENS = 32
CONSTRAINT = "constrained_tool_calls"
"""The switch that holds auto tool calls to the offered tools (Optimizations), when this build has it."""

# (row name, what it measures, how to read the measurement: ">=" fraction, "==" count, "<=" perplexity)
TARGETS: list[tuple[str, str, str, float | None]] = [
    ("tool_call", "tool calls exact (name and every argument)", ">=", 0.85),
    ("no_call", "no call when none is needed", ">=", 0.95),
    ("stray calls (constraint on)", "auto calls to an unoffered tool or with an unknown key", "==", 0),
    ("stray calls (constraint off)", "the same without the constraint", "==", None),
    ("tool_result", "a tool's result used in the final answer", ">=", None),
    ("tool_call (constraint off)", "tool calls exact, without the constraint", ">=", None),
    ("no_call (constraint off)", "no call when none is needed, without the constraint", ">=", None),
    ("tool_call (constraint on)", "tool calls exact, with the constraint", ">=", None),
    ("no_call (constraint on)", "no call when none is needed, with the constraint", ">=", None),
    ("passage", "answers from a passage in the prompt (exact or holding the gold span)", ">=", 0.80),
    ("passage (glossary)", "  of which: a glossary of invented words", ">=", None),
    ("passage (stdlib_docs)", "  of which: library reference entries", ">=", None),
    ("arith (thinking disabled)", "arithmetic, thinking disabled", ">=", 0.90),
    ("arith (thinking enabled)", "arithmetic, thinking enabled", ">=", 0.98),
    ("retrieval_8k", "a combination among 40 in 8k tokens of notes", ">=", 0.95),
    ("retrieval_16k", "the same in 16k tokens", ">=", 0.85),
    ("out_of_scope", "an honest \"I don't know\" to what it cannot know", ">=", 0.80),
    ("pictures (digits)", "a number of 1-4 digits in a picture", ">=", 0.90),
    ("pictures (word)", "a word in a picture", ">=", None),
    ("pictures (count)", "shapes of one kind counted among others", ">=", 0.90),
    ("pictures (sum)", "the sum of two numbers in a picture", ">=", 0.80),
    ("pictures (bars)", "a bar chart read (the tallest bar, a bar's value)", ">=", 0.80),
    ("well_formed", "every answer ended by the model, no marker in the content", ">=", None),
]


@dataclass
class HeldoutReport:
    """Accuracy per row (fraction, count), stray calls per constraint setting (bad, written), and per request what
    was answered (for the record)."""

    accuracy: dict[str, tuple[float, int]] = field(default_factory=dict)
    stray: dict[str, tuple[int, int]] = field(default_factory=dict)
    answers: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"accuracy": {k: {"value": v, "n": n} for k, (v, n) in self.accuracy.items()},
                "stray_calls": {k: {"bad": b, "written": w} for k, (b, w) in self.stray.items()},
                "answers": self.answers}


def select_rows(rows: list[dict], limit: int | None, retrieval_limit: int | None = None) -> list[dict]:
    """At most `limit` requests per task (`retrieval_limit` per retrieval task; default `limit`), in file order."""
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        cap = retrieval_limit if r["task"].startswith("retrieval") and retrieval_limit is not None else limit
        if cap is None or seen.get(r["task"], 0) < cap:
            out.append(r)
            seen[r["task"]] = seen.get(r["task"], 0) + 1
    return out


def _template_kwargs(row: dict) -> dict[str, Any] | None:
    return {"thinking_mode": row["thinking_mode"]} if row.get("thinking_mode") else None


def prompt_state(llm, row: dict) -> str:
    """How the rendered prompt leaves thinking (open / closed / none), as the server's reasoning parser sees it."""
    from nanoserve.chat_template import render_chat, template_messages
    from nanoserve.parsers.reasoning import get_reasoning_parser

    text = render_chat(llm.get_tokenizer(), template_messages(row["messages"]), tools=row.get("tools"),
                       add_generation_prompt=True, chat_template_kwargs=_template_kwargs(row))
    return get_reasoning_parser("minimax_m3").prompt_state(text)


def auto_call_format(llm, tools: list[dict]):
    """The output format the server's constrained_tool_calls applies with tool_choice auto: the tool parser's auto
    structural tag for `tools`, each parser marker the tokenizer has as one token matched as that token."""
    from nanoserve.parsers.reasoning import get_reasoning_parser
    from nanoserve.parsers.tool_calls import get_tool_call_parser
    from nanoserve.sampling import StructuredOutputsParams

    parser, reasoning = get_tool_call_parser("minimax_m3"), get_reasoning_parser("minimax_m3")
    tok = llm.get_tokenizer()
    markers = frozenset(m for m in (*parser.markers, *reasoning.markers)
                        if len(tok.encode(m, add_special_tokens=False)) == 1)
    offered = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    return StructuredOutputsParams(structural_tag=parser.auto_structural_tag(offered, True, markers))


def answer(llm, rows: list[dict], constrain: bool = False) -> list[Answer]:
    """Each request answered greedily through LLM.chat, in the order given; with `constrain`, a request that offers
    tools is held to auto_call_format."""
    from nanoserve.sampling import SamplingParams

    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        key = json.dumps([r.get("tools"), r.get("thinking_mode"), r.get("document")], sort_keys=True)
        groups.setdefault(key, []).append(i)
    out: list[Answer | None] = [None] * len(rows)
    for idx in groups.values():
        first = rows[idx[0]]
        fmt = auto_call_format(llm, first["tools"]) if constrain and first.get("tools") else None
        # a long document: its first question alone, so that the others find the document in the prefix cache
        batches = [idx[:1], idx[1:]] if first.get("document") else [idx]
        for batch in (b for b in batches if b):
            params = [SamplingParams(temperature=0.0, max_tokens=TASK_TOKENS.get(rows[i]["task"], RETRIEVAL_TOKENS),
                                     skip_special_tokens=False, structured_outputs=fmt) for i in batch]
            outs = llm.chat([rows[i]["messages"] for i in batch], params, use_tqdm=False,
                            tools=first.get("tools") or None, chat_template_kwargs=_template_kwargs(first))
            for i, o in zip(batch, outs):
                c = o.outputs[0]
                out[i] = read_answer(rows[i], c.text, c.finish_reason, prompt_state(llm, rows[i]))
    return out  # type: ignore[return-value]


def score(rows: list[dict], answers: list[Answer]) -> tuple[dict[str, list[bool]], list[dict[str, Any]]]:
    """Pass/fail lists per row name, and a record per request."""
    results: dict[str, list[bool]] = {}
    records = []
    for r, a in zip(rows, answers):
        checks = grade(r, a)
        for k, v in checks.items():
            results.setdefault(k, []).append(v)
        ok = checks[r["task"]]
        if r["task"] == "arith":
            results.setdefault(f"arith (thinking {r['thinking_mode']})", []).append(ok)
        if r["task"] == "passage":
            results.setdefault(f"passage ({r['source']})", []).append(ok)
        records.append({"id": r.get("id"), "task": r["task"], "ok": ok, "content": a.content,
                        "reasoning": a.reasoning, "calls": a.calls, "finish": a.finish})
    return results, records


def count_stray(rows: list[dict], answers: list[Answer]) -> tuple[int, int]:
    bad = written = 0
    for r, a in zip(rows, answers):
        if r.get("tools"):
            w, b = stray_calls(r, a.text)
            written, bad = written + w, bad + b
    return bad, written


def evaluate(llm, rows: list[dict], constraint_on: bool | None = None) -> HeldoutReport:
    """Grade `rows` on `llm`. `constraint_on`: the constrained_tool_calls switch's value, with which the rows are
    answered (the requests that offer tools are then answered again with the other value); None: this build has no
    such switch, nothing is constrained."""
    # the parser warns of every call it drops (a tool not offered, an undeclared key); here they are counted instead
    parser_log = logging.getLogger("nanoserve.parsers.tool_calls")
    level = parser_log.level
    parser_log.setLevel(logging.ERROR)
    try:
        answers = answer(llm, rows, bool(constraint_on))
        results, records = score(rows, answers)
        report = HeldoutReport(answers=records)
        for k, oks in results.items():
            report.accuracy[k] = (sum(oks) / len(oks), len(oks))
        report.stray["constraint on" if constraint_on else "constraint off"] = count_stray(rows, answers)
        if constraint_on is not None:
            tooled = [r for r in rows if r.get("tools")]
            flipped = answer(llm, tooled, not constraint_on)
            other = "constraint off" if constraint_on else "constraint on"
            for k, oks in score(tooled, flipped)[0].items():
                if k in ("tool_call", "no_call", "tool_result"):
                    report.accuracy[f"{k} ({other})"] = (sum(oks) / len(oks), len(oks))
            report.stray[other] = count_stray(tooled, flipped)
    finally:
        parser_log.setLevel(level)
    return report


def _fmt(kind: str, value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * 100:.1f} %" if kind == ">=" else f"{value:.2f}" if kind == "<=" else str(int(value))


def target_table(report: HeldoutReport, perplexity: dict[str, float], before: dict[str, Any] | None = None,
                 constraint_present: bool = True) -> str:
    """Markdown: every target row with the measurement (and the shipped weights' one, if known)."""
    before = before or {}
    b_acc = before.get("accuracy", {})
    b_stray = before.get("stray_calls", {})
    b_ppl = before.get("perplexity", {})
    lines = ["| task | target | measured | n | shipped weights | met |", "|---|---|---|---|---|---|"]
    for key, label, kind, target in TARGETS:
        if key.startswith("stray calls"):
            setting = key[len("stray calls ("):-1]
            got = report.stray.get(setting)
            was = b_stray.get(setting)
            if got is None:
                why = "n/a: this build has no `constrained_tool_calls` switch" if not constraint_present else "-"
                lines.append(f"| {label} | {'0' if target == 0 else '-'} | {why} | | "
                             f"{was['bad'] if was else '-'} | |")
                continue
            bad, written = got
            met = "" if target is None else ("yes" if bad == target else "no")
            lines.append(f"| {label} | {'0' if target == 0 else '-'} | {bad} of {written} calls | | "
                         f"{str(was['bad']) + ' of ' + str(was['written']) if was else '-'} | {met} |")
            continue
        if key not in report.accuracy:
            continue
        value, n = report.accuracy[key]
        was = b_acc.get(key, {}).get("value")
        met = "" if target is None else ("yes" if value >= target else "no")
        lines.append(f"| {label} | {_fmt(kind, target) if target is not None else '-'} | {_fmt(kind, value)} | {n} "
                     f"| {_fmt(kind, was)} | {met} |")
    for corpus, ppl in perplexity.items():
        was = b_ppl.get(corpus)
        met = "" if was is None else ("yes" if round(ppl, 2) <= round(was, 2) else "no")
        lines.append(f"| perplexity {corpus} | <= shipped | {ppl:.2f} | | {_fmt('<=', was)} | {met} |")
    return "\n".join(lines)


PICTURE_TOKENS = 16
"""max_tokens of a picture question: the answer is a word or a number."""


def first_word(text: str) -> str | None:
    """The first number or word of an answer, lower-cased."""
    found = re.search(r"[A-Za-z]+|\d+", text)
    return found.group(0).lower() if found else None


def evaluate_pictures(llm, rows: list[dict]) -> tuple[dict[str, tuple[float, int]], list[dict[str, Any]]]:
    """The picture questions (heldout.PICTURES rows) answered greedily through LLM.chat, an image_url part and the
    question in one user message, read as the server's reasoning parser reads the answer; right when its first
    number or word is the expected one. (accuracy per `pictures (<task>)` row, a record per question)."""
    from nanoserve.sampling import SamplingParams

    messages = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": r["image"]}},
                                              {"type": "text", "text": r["question"]}]}] for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=PICTURE_TOKENS, skip_special_tokens=False)
    outs = llm.chat(messages, params, use_tqdm=False)
    # every question is rendered in the default thinking mode, so one prompt tells how they all leave thinking
    state = prompt_state(llm, {"messages": [{"role": "user", "content": rows[0]["question"]}]}) if rows else "none"
    right: dict[str, list[bool]] = {}
    records = []
    for r, o in zip(rows, outs):
        c = o.outputs[0]
        ans = read_answer({"task": "pictures"}, c.text, c.finish_reason, state)
        ok = first_word(ans.content) == r["answer"].lower()
        right.setdefault(f"pictures ({r['task']})", []).append(ok)
        records.append({"task": f"pictures ({r['task']})", "ok": ok, "content": ans.content, "expected": r["answer"]})
    return {k: (sum(v) / len(v), len(v)) for k, v in right.items()}, records
