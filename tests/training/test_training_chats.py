"""training/chats.py, the synthetic M3-format chats m3-mini is trained on: every kind renders exactly as the server
renders the same request (so the model learns the format it is served with), the loss mask covers exactly the
assistant turns after the last user message and starts where the server's prompt ends, and what the model is
taught to write is what the server's parsers read back (the tool calls, the reasoning)."""

from __future__ import annotations

import collections
import json
import random
import re

import jsonschema
import pytest

from nanoserve.chat_template import render_chat, template_messages
from nanoserve.parsers import get_reasoning_parser, get_tool_call_parser
from nanoserve.presets.tokenizer import CHAT_TEMPLATE, write_tokenizer
from nanoserve.server.openai.schema.chat import ChatMessage, ChatTool
from training import chats
from training.chats import EOT, Chat, mixture, prompt, render, sample, scratchpad

N = 40  # chats of each kind per test
KINDS = sorted(chats.KINDS)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def draw(kind: str, seed: int = 0, n: int = N, **kw) -> list[Chat]:
    rng = random.Random(seed)
    return [sample(rng, kind, **kw) for _ in range(n)]


def server_render(tok, chat: Chat, messages: list[dict], add_generation_prompt: bool) -> str:
    """What the server renders for this request: its messages and tools through the request models, then
    template_messages and render_chat."""
    msgs = template_messages([ChatMessage.model_validate(m).to_template_dict() for m in messages])
    tools = [ChatTool.model_validate(t).model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
    kwargs = {"thinking_mode": chat.thinking_mode} if chat.thinking_mode is not None else None
    return render_chat(tok, msgs, tools=tools, add_generation_prompt=add_generation_prompt,
                       chat_template=CHAT_TEMPLATE, chat_template_kwargs=kwargs)


def last_user(chat: Chat) -> int:
    return max(i for i, m in enumerate(chat.messages) if m["role"] == "user")


def trained_turns(chat: Chat) -> list[tuple[dict, str]]:
    """(assistant message, the text the model generates for it: the trained segment without its end marker)."""
    texts = [text for text, trains in render(chat, CHAT_TEMPLATE) if trains]
    msgs = [m for m in chat.messages[last_user(chat) + 1:] if m["role"] == "assistant"]
    assert len(texts) == len(msgs) and all(t.endswith(EOT) for t in texts)
    return list(zip(msgs, (t[:-len(EOT)] for t in texts)))


@pytest.mark.parametrize("kind", KINDS)
def test_render_is_the_servers_render_and_the_prompt_its_prefix(tok, kind):
    for chat in draw(kind, n=N if kind != "retrieval" else 10):
        segments = render(chat, CHAT_TEMPLATE)
        full = "".join(text for text, _ in segments)
        assert full == server_render(tok, chat, chat.messages, add_generation_prompt=False)
        p = prompt(chat, CHAT_TEMPLATE)
        assert p == server_render(tok, chat, chat.messages[:last_user(chat) + 1], add_generation_prompt=True)
        # the loss mask: nothing of the prompt trains, and each trained turn starts right where the server's prompt
        # for it (the chat up to that turn, add_generation_prompt=True) ends
        assert full.startswith(p)
        starts, pos = [], 0
        for text, trains in segments:
            if trains:
                starts.append(pos)
            pos += len(text)
        turns = [j for j in range(last_user(chat) + 1, len(chat.messages)) if chat.messages[j]["role"] == "assistant"]
        assert len(starts) == len(turns) and starts[0] == len(p)
        for start, j in zip(starts, turns):
            assert full[:start] == server_render(tok, chat, chat.messages[:j], add_generation_prompt=True)


@pytest.mark.parametrize("kind", KINDS)
def test_reasoning_parser_reads_back_each_trained_turn(kind):
    parser = get_reasoning_parser("minimax_m3")
    modes = collections.Counter()
    for chat in draw(kind, seed=1):
        opens = parser.prompt_opens_reasoning(prompt(chat, CHAT_TEMPLATE))
        assert opens == (chat.thinking_mode == "enabled")
        modes[chat.thinking_mode or "adaptive"] += 1
        for msg, generated in trained_turns(chat):
            reasoning, content = parser(opens).parse(generated)
            assert reasoning == (msg.get("reasoning_content") or None)
            if chat.thinking_mode == "enabled":
                assert reasoning
            if chat.thinking_mode == "disabled":
                assert reasoning is None
            if not msg.get("tool_calls"):
                assert content == msg["content"] and content
    if kind != "retrieval":  # retrieval answers at once: disabled or adaptive
        assert set(modes) == {"enabled", "disabled", "adaptive"}, modes


@pytest.mark.parametrize("kind", ["tool", "multi_turn", "request"])
def test_tool_parser_reads_back_the_calls(kind):
    reasoning_parser = get_reasoning_parser("minimax_m3")
    checked = 0
    for chat in draw(kind, seed=2, n=150):
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in chat.tools or []}
        opens = reasoning_parser.prompt_opens_reasoning(prompt(chat, CHAT_TEMPLATE))
        for msg, generated in trained_turns(chat):
            _, content = reasoning_parser(opens).parse(generated)
            text, calls = get_tool_call_parser("minimax_m3")(schemas).parse(content)
            want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
            assert [(c.name, json.loads(c.arguments)) for c in calls] == want
            if want:
                assert not text.strip()
                checked += 1
        if chat.kind in ("tool", "request"):  # the grader's expectation is the first call the model makes
            call = chat.messages[last_user(chat) + 1]["tool_calls"][0]["function"]
            assert (call["name"], json.loads(call["arguments"])) == (chat.expected["name"], chat.expected["arguments"])
    assert checked > (5 if kind == "multi_turn" else 100)


def test_tool_arguments_follow_the_schema_and_appear_in_the_question():
    weather = 0
    chats_ = draw("tool", seed=3, n=400)
    for chat in chats_:
        user = chat.messages[last_user(chat)]["content"]
        tools = {t["function"]["name"]: t["function"] for t in chat.tools}
        assert 1 <= len(tools) <= 4 and len(tools) == len(chat.tools)
        for call in chat.expected["calls"]:
            fn = tools[call["name"]]
            params = fn["parameters"]
            assert 1 <= len(params["properties"]) <= 4
            jsonschema.validate(call["arguments"], {**params, "additionalProperties": False})
            for name, value in call["arguments"].items():
                if isinstance(value, bool):
                    assert any(w in user for w in (("true", "yes") if value else ("false", "no")))
                else:
                    assert str(value) in user, (name, value, user)
        weather += any(n in chats.WEATHER_NAMES for n in tools)
        # the final answer uses the tool's result
        results = [json.loads(m["content"]) for m in chat.messages if m["role"] == "tool"]
        answer = chat.messages[-1]["content"]
        assert all(str(v) in answer for r in results for k, v in r.items() if k not in ("city", "unit"))
    assert 0.03 * len(chats_) <= weather <= 0.12 * len(chats_)
    # names vary: the held-out tools of another seed are mostly new
    names = lambda cs: {n for c in cs for n in (t["function"]["name"] for t in c.tools)}  # noqa: E731
    assert len(names(draw("tool", seed=4, n=200)) - names(chats_)) > 100


def test_weather_question_names_the_city():
    for chat in draw("tool", seed=5, n=20, weather=True):
        if chat.expected["name"] in chats.WEATHER_NAMES:
            city = chat.expected["arguments"].get("city", chat.expected["arguments"].get("location"))
            assert city in chats.CITIES and city in chat.messages[last_user(chat)]["content"]
            assert "weather" in chat.messages[last_user(chat)]["content"].lower() or "temperature" in \
                chat.messages[last_user(chat)]["content"]


def test_no_tool_chats_offer_tools_and_answer_directly():
    for chat in draw("no_tool", seed=6):
        assert chat.tools and not any(m.get("tool_calls") for m in chat.messages)
        assert chat.messages[-1]["role"] == "assistant" and chat.messages[-1]["content"]
        assert chat.expected["calls"] == []


def test_arith_scratchpad_and_answer():
    assert scratchpad(347, "+", 589) == (
        "347 + 589: digits 3 4 7 and 5 8 9, right to left.\n"
        "7 + 9 + 0 = 16, write 6, carry 1.\n4 + 8 + 1 = 13, write 3, carry 1.\n3 + 5 + 1 = 9, write 9, carry 0.\n"
        "Result: 936.")
    assert scratchpad(52, "-", 407) == (
        "407 is larger than 52, so compute 407 - 52 and negate.\n"
        "407 - 52: digits 4 0 7 and 5 2, right to left.\n"
        "7 - 2 - 0 = 5, write 5, borrow 0.\n0 - 5 - 0 = -5, add 10: write 5, borrow 1.\n"
        "4 - 0 - 1 = 3, write 3, borrow 0.\nResult: -355.")
    assert scratchpad(95, "+", 7).endswith("Write the last carry 1.\nResult: 102.")
    assert scratchpad(42, "+", 299).endswith("0 + 2 + 1 = 3, write 3, carry 0.\nResult: 341.")
    negative = 0
    for chat in draw("arith", seed=7, n=300):
        answer = chat.expected["answer"]
        msg = chat.messages[-1]
        assert answer in msg["content"]
        if msg.get("reasoning_content"):
            lines = msg["reasoning_content"].split("\n")
            assert lines[-1] == f"Result: {answer}."
            digits = "".join(line.split("write ")[1][0] for line in lines if "write " in line and "last" not in line)
            carry = [line for line in lines if "last carry" in line]
            assert int((carry[0][-2] if carry else "") + digits[::-1]) == abs(int(answer))
        negative += answer.startswith("-")
        if chat.thinking_mode in ("enabled", "disabled"):
            assert bool(msg.get("reasoning_content")) == (chat.thinking_mode == "enabled")
    assert negative > 30


def test_retrieval_hides_the_asked_value_once():
    kinds = collections.Counter()
    for n_chars in (2000, 8000, 30000, 48000):
        for chat in draw("retrieval", seed=8, n=8, n_chars=n_chars, needle=None):
            user = chat.messages[last_user(chat)]["content"]
            assert 0.8 * n_chars <= len(user) <= 1.3 * n_chars + 2000
            name, key = chat.expected["name"], chat.expected["value"]
            statement = next(s for s, _, _ in chats.NEEDLES if s.format(e=name, v=key) in user)
            kinds[statement] += 1
            head = statement.split("{v}")[0].format(e=name)
            assert user.count(head) == 1  # the asked holder's value appears once, and no other holder contains it
            pattern = re.escape(statement).replace(re.escape("{e}"), r"[\w -]+?").replace(re.escape("{v}"), r"\d+")
            assert 8 <= len(re.findall(pattern, user)) <= 64
            assert key in chat.messages[-1]["content"] and chat.thinking_mode in ("disabled", "adaptive", None)
    assert len(kinds) >= 4  # the needle's wording varies
    # by default a pass key, drawn as before the other kinds existed: a seed gives the chat it always gave
    chat = sample(random.Random(20261205), "retrieval", n_chars=12_000)
    assert chat.messages[-1]["content"] == "The pass key of Bob Sato is 027233."


def test_callers_texts_are_used():
    glosses = [("zebra", 'an African wild horse with black and white stripes; "the zebra ran"')]
    chat = sample(random.Random(0), "define", glosses=glosses)
    assert chat.expected == {"value": "an African wild horse with black and white stripes"}
    assert "zebra" in chat.messages[last_user(chat)]["content"]
    chat = sample(random.Random(0), "retrieval", sentences=["Lorem ipsum dolor."], n_chars=3000)
    assert "Lorem ipsum dolor." in chat.messages[last_user(chat)]["content"]


def test_mixture_is_deterministic_and_weighted():
    draws = [mixture(random.Random(11)) for _ in range(2)]
    assert draws[0] == draws[1]
    assert mixture(random.Random(12)) != draws[0]
    rng = random.Random(13)
    counts = collections.Counter(mixture(rng).kind for _ in range(3000))
    assert set(counts) == set(chats.MIXTURE)
    for kind, weight in chats.MIXTURE.items():
        assert abs(counts[kind] / 3000 - weight) < 0.03, (kind, counts)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown chat kind"):
        sample(random.Random(0), "poetry")
    with pytest.raises(TypeError):
        sample(random.Random(0), "arith", n_chars=100)
    # enabled mode makes the model open a thinking block: a trained turn without reasoning cannot be rendered
    chat = Chat([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None, "enabled",
                "chat", {})
    with pytest.raises(ValueError, match="thinking_mode enabled"):
        render(chat, CHAT_TEMPLATE)
