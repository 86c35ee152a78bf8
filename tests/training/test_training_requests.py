"""The plain-request kinds of m3-mini's training chats (training/requests.py, passages.py, honesty.py) and the
arithmetic answer without thinking: what each teaches is what a grader reading the server's answer accepts.

- a `request` call holds values the schema accepts, converted from the user's words (a time said "7:30 pm" is
  "19:30", a date said "March 3, 2026" is "2026-03-03", "twelve" is 12, "$45" is 45 and USD), among distractor
  tools, and the final answer reports the tool's result;
- `request_no_call` offers tools and calls none;
- a `passage` answer copies the entry it was asked about (or says the passage does not have it);
- an `unknown` reply is what nanoserve.bench.heldout.grade calls honest;
- with thinking disabled, an arithmetic answer carries its scratchpad and ends with the result.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema

from nanoserve.bench.heldout.grade import honest
from training import chats, passages, requests

MONTHS = {m.lower(): i + 1 for i, m in enumerate(chats.MONTHS)}
WORDS = {v: k for k, v in requests.NUM_WORDS.items()}


def draw(kind: str, seed: int, n: int) -> list[chats.Chat]:
    rng = random.Random(seed)
    return [chats.sample(rng, kind) for _ in range(n)]


def last_user(chat: chats.Chat) -> str:
    return [m for m in chat.messages if m["role"] == "user"][-1]["content"]


# an independent reading of the spoken forms, to check the generator's conversions against
def read_time(said: str) -> str:
    if said == "noon":
        return "12:00"
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", said)
    if m:
        return f"{int(m[1]):02d}:{m[2]}"
    half = re.fullmatch(r"half past (\d{1,2}) (am|pm)", said)
    m = half or re.fullmatch(r"(\d{1,2})(?::(\d{2}))? ?(am|pm|o'clock in the morning|o'clock in the evening|"
                             r"in the afternoon)", said)
    h = int(m[1]) % 12
    minutes = 30 if half else int(m[2] or 0)
    ampm = m[2] if half else m[3]
    if ampm in ("pm", "o'clock in the evening", "in the afternoon"):
        h += 12
    return f"{h:02d}:{minutes:02d}"


def read_date(said: str) -> str:
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", said):
        return said
    said = said.replace(",", "").replace("the ", "").replace(" of", "")
    parts = said.split()
    day = next(int(re.sub(r"\D", "", p)) for p in parts if re.match(r"\d{1,2}(st|nd|rd|th)?$", p))
    month = next(i for name, i in MONTHS.items() for p in parts if p.lower() in (name, name[:3]))
    year = next(int(p) for p in parts if re.fullmatch(r"\d{4}", p))
    return f"{year}-{month:02d}-{day:02d}"


def test_spoken_values_convert_to_the_schema_values():
    rng = random.Random(0)
    forms = set()
    for _ in range(2000):
        hhmm, said = requests.say_time(rng)
        assert read_time(said) == hhmm, said
        iso, day = requests.say_date(rng)
        assert read_date(day) == iso, day
        n = rng.randint(1, 100)
        word = requests.say_int(rng, n)
        assert (12 if word == "a dozen" else WORDS.get(word, None) or int(word)) == n
        amount, cur, money = requests.say_money(rng)
        sym, name = requests.CURRENCY[cur]
        assert float(re.search(r"\d+(\.\d+)?", money)[0]) == amount
        assert money.startswith(sym) or money.endswith((f" {name}", f" {cur}"))
        forms.add(re.sub(r"\d", "#", said))
    assert len(forms) >= 8  # times come in many shapes


def test_request_calls_follow_the_schema_and_the_answer_reports_the_result():
    chats_ = draw("request", seed=1, n=400)
    reported = offered_many = 0
    for chat in chats_:
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in chat.tools}
        offered_many += len(tools) > 1
        for call in chat.expected["calls"]:
            assert call["name"] in tools
            jsonschema.validate(call["arguments"], {**tools[call["name"]], "additionalProperties": False})
        results = [json.loads(m["content"]) for m in chat.messages if m["role"] == "tool"]
        answer = chat.messages[-1]["content"]
        scalars = [x for r in results for v in r.values() for x in (v if isinstance(v, list) else [v])
                   if isinstance(x, (str, int, float)) and not isinstance(x, bool)]
        reported += any(x in answer if isinstance(x, str) else str(x) in answer or requests._num(x) in answer
                        for x in scalars)
        assert chat.messages[-1]["role"] == "assistant" and not chat.messages[-1].get("tool_calls")
    assert reported >= 0.97 * len(chats_)
    assert offered_many >= 0.6 * len(chats_)  # most requests pick their tool among distractors
    names = {c.expected["name"] for c in chats_}
    assert len(names) >= 30  # every family is asked for
    assert len({last_user(c) for c in chats_}) >= 0.97 * len(chats_)


def test_request_wording_varies():
    users = [last_user(c) for c in draw("request", seed=2, n=300)]
    assert sum(u.startswith(tuple(requests.LEAD_INS)) for u in users) > 20
    assert sum(u[:1].islower() for u in users) > 10
    assert sum(u.endswith(("Thanks!", "Thank you.")) for u in users) > 3
    assert sum(any(w in u for w in ("two", "three", "four", "five", "six")) for u in users) > 4  # counts in words


def test_request_no_call_offers_tools_and_calls_none():
    for chat in draw("request_no_call", seed=3, n=60):
        assert chat.tools and not any(m.get("tool_calls") for m in chat.messages)
        assert chat.messages[-1]["content"] and chat.expected["calls"] == []


def test_arithmetic_without_thinking_writes_its_scratchpad():
    seen = 0
    for chat in draw("arith", seed=4, n=300):
        msg = chat.messages[-1]
        if msg.get("reasoning_content"):
            continue
        seen += 1
        content, answer = msg["content"], chat.expected["answer"]
        assert "right to left" in content and f"Result: {answer}." in content
        assert re.findall(r"-?\d+", content)[-1] == answer  # what the grader reads: the last number
    assert seen > 20


def test_passage_answers_copy_the_entry_asked_about():
    absent = 0
    sources = chats.Sources(docs=passages.DOCS)
    rng = random.Random(5)
    for _ in range(200):
        ex = passages.passage_exchange(rng, "disabled", sources)
        answer = ex.replies[-1]["content"]
        gold = ex.expected["value"]
        if gold is None:
            absent += 1
            assert honest(answer)
        else:
            assert gold in ex.user and gold.casefold() in answer.casefold()
    assert 5 <= absent <= 40


def test_pseudo_words_are_not_words():
    rng = random.Random(6)
    words = {passages.pseudo_word(rng) for _ in range(500)}
    assert len(words) > 450 and all(len(w) >= 5 and w.isalpha() for w in words)


def test_unknown_replies_are_honest_and_short():
    for chat in draw("unknown", seed=7, n=200):
        reply = chat.messages[-1]["content"]
        assert honest(reply) and len(reply.split()) <= 30, reply


def test_library_entries_leave_the_reserved_modules_out():
    entries = passages.stdlib_entries()
    assert len(entries) > 1000
    names = [name for name, *_ in entries]
    for module in ("statistics", "shlex", "heapq", "calendar", "glob"):  # reserved: an evaluation's
        assert passages.reserved_module(module) and not any(n.startswith(module + ".") for n in names)
    assert "json.dumps" not in names and "json.encoder.JSONEncoder.encode" in names  # json is, json.encoder not
    for module in ("collections", "functools", "textwrap", "ftplib"):
        assert not passages.reserved_module(module) and any(n.startswith(module + ".") for n in names)
    for name, sig, para, s in entries[:200]:
        assert sig.startswith("(") and para.startswith(s)


def test_generation_config_bounds_a_reply():
    """The shipped m3-mini's defaults (and every export's) cap a reply, thinking included, so a request without
    max_tokens cannot run for minutes on a CPU; the server reads max_new_tokens as the default max_tokens."""
    from nanoserve.generation_config import load_generation_defaults
    from nanoserve.presets.catalog import SHIPPED
    from training.export import GENERATION_CONFIG

    shipped = load_generation_defaults("auto", SHIPPED["m3-mini"], model_eos_token_id=2)
    assert shipped.sampling["max_tokens"] == GENERATION_CONFIG["max_new_tokens"] <= 1024
    assert shipped.sampling["temperature"] == GENERATION_CONFIG["temperature"]


def test_lookup_tools_are_told_apart_by_the_words_of_the_request():
    """A lookup tool (training/lookup_tools.py) is offered beside others of the same subject: the call names the
    tool whose attribute the request says, copies the request's value exactly, and keeps to the tool's schema."""
    from training import lookup_tools

    rng = random.Random(11)
    said = 0
    for _ in range(200):
        fams = lookup_tools.lookup_toolset(rng, rng.randint(2, 4))
        assert len({f.name for f in fams}) == len(fams) and len({f.topic for f in fams}) == len(fams)
        target = rng.choice(fams)
        ex = requests.request_exchange(rng, "disabled", fams, [target])
        call = ex.replies[0]["tool_calls"][0]["function"]
        args = json.loads(call["arguments"])
        assert call["name"] == target.name
        jsonschema.validate(args, target.spec["function"]["parameters"])
        key = target.spec["function"]["parameters"]["required"][0]
        assert args[key] in ex.user  # the value is copied as said
        attr = target.topic.removeprefix("the ").split(" of a ")[0]
        said += attr in ex.user.lower()
        assert str(json.loads(ex.replies[1]["content"])[attr.replace(" ", "_")]) in ex.replies[2]["content"]
    assert said > 150  # the attribute's words are the cue (a typo may hit one of them)


def test_toolsets_mix_named_families_lookup_tools_and_new_names():
    from training import lookup_tools

    rng = random.Random(3)
    names = [f.name for _ in range(400) for f in requests.toolset(rng)]
    lookups = lookup_tools.lookup_names()
    named = requests.family_names() - lookups
    assert sum(n in lookups for n in names) > 0.3 * len(names)
    assert sum(n in named for n in names) > 0.3 * len(names)
    assert any(n != n.lower() and n in named for n in names)  # a named family renamed to camelCase
    assert set(names) <= requests.family_names()  # the held-out check covers every name offered


def test_no_call_chats_include_requests_for_tools_not_offered_and_conversation():
    """request_no_call also holds requests phrased like those that need a call but for a tool that is not offered
    (the reply names the tools there are and calls nothing), and conversation that asks for nothing."""
    rng = random.Random(21)
    fams = requests.toolset(rng, 2)
    for _ in range(100):
        ex = requests.unmatched_exchange(rng, "disabled", fams)
        assert len(ex.replies) == 1 and "tool_calls" not in ex.replies[0]
        assert all(f.name in ex.replies[0]["content"] for f in fams)
        assert ex.user.strip()
    said = [requests.conversation_exchange(rng, "disabled") for _ in range(200)]
    assert len({e.user for e in said}) > 100 and all("tool_calls" not in e.replies[0] for e in said)
    chats_ = draw("request_no_call", seed=5, n=300)
    assert not any(m.get("tool_calls") for c in chats_ for m in c.messages)
