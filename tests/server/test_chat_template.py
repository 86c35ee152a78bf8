"""M3's chat format through the tokenizer's own apply_chat_template: roles, tools, assistant tool calls, tool
results, thinking_mode, continue_final_message; --chat-template; generation_config.json defaults."""

from __future__ import annotations

import json

import pytest

from nanoserve.chat_template import load_chat_template, render_chat, template_messages
from nanoserve.generation_config import load_generation_defaults

NS = "]<]minimax[>["
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
AGENT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "I need the tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "hourly": true, '
                                                                      '"fields": ["temp", "wind"], "skip": null}'}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]


def render(tok, messages, **kw):
    return render_chat(tok, template_messages(messages), **kw)


def test_agent_conversation_renders_in_m3_format(tiny_tokenizer):
    text = render(tiny_tokenizer, AGENT, tools=[WEATHER])
    system, developer, user, ai, tool, prompt = text.split("[e~[\n")
    assert system.startswith("]~!b[]~b]system\n") and "<thinking_instructions>" in system
    assert "Current thinking mode: adaptive." in system  # thinking_mode not given: adaptive
    assert developer.startswith("]~b]developer\nYou are terse.\n\n# Tools\n")
    assert f'<tool>{json.dumps(WEATHER["function"])}</tool>' in developer
    assert user == "]~b]user\nWeather in Paris?"
    # the reasoning of the turn after the last user message is kept; arguments become namespaced elements
    assert ai == ("]~b]ai\n<mm:think>I need the tool.</mm:think>"
                  f"{NS}<tool_call>\n"
                  f'{NS}<invoke name="get_weather">{NS}<city>Paris{NS}</city>{NS}<days>2{NS}</days>'
                  f"{NS}<hourly>true{NS}</hourly>{NS}<fields>{NS}<item>temp{NS}</item>{NS}<item>wind{NS}</item>"
                  f"{NS}</fields>{NS}</invoke>\n"
                  f'{NS}<invoke name="get_weather">{NS}<city>Lyon{NS}</city>{NS}</invoke>\n'
                  f"{NS}</tool_call>")
    assert tool == "]~b]tool\n<response>sunny, 21C</response>\n<response>rain</response>"  # grouped
    assert prompt == "]~b]ai\n"


@pytest.mark.parametrize("mode, tail", [("enabled", "]~b]ai\n<mm:think>"), ("disabled", "]~b]ai\n</mm:think>"),
                                        ("adaptive", "]~b]ai\n")])
def test_thinking_mode(tiny_tokenizer, mode, tail):
    text = render(tiny_tokenizer, AGENT[:2], chat_template_kwargs={"thinking_mode": mode})
    assert text.endswith(tail) and f"Current thinking mode: {mode}." in text


def test_earlier_turns_drop_their_reasoning(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello.", "reasoning": "greet back"},
                {"role": "user", "content": "bye"}]
    text = render(tiny_tokenizer, messages)
    assert "]~b]ai\n</mm:think>Hello.[e~[\n" in text and "greet back" not in text
    # the newest assistant turn keeps it (either field name)
    assert "<mm:think>greet back</mm:think>Hello." in render(tiny_tokenizer, messages[:2], add_generation_prompt=False)


def test_no_system_message_gets_the_default_developer_turn(tiny_tokenizer):
    text = render(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    assert "]~b]developer\nYou are a helpful assistant.[e~[\n]~b]user\nhi" in text


def test_continue_final_message(tiny_tokenizer):
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    text = render(tiny_tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("]~b]ai\n</mm:think>1, 2,")
    with pytest.raises(ValueError, match="^continue_final_message: cannot be combined"):
        render(tiny_tokenizer, messages, add_generation_prompt=True, continue_final_message=True)
    # any final message can be continued (vLLM passes it to the template): here the user's
    assert render(tiny_tokenizer, messages[:1], add_generation_prompt=False, continue_final_message=True).endswith(
        "]~b]user\nCount")


def test_request_errors_name_the_field(tiny_tokenizer):
    bad_args = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(ValueError, match=r"^messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        template_messages(bad_args)
    with pytest.raises(ValueError, match="^messages: could not render the chat template: thinking_mode must be"):
        render(tiny_tokenizer, AGENT[:2], chat_template_kwargs={"thinking_mode": "sometimes"})
    with pytest.raises(ValueError, match="^chat_template_kwargs.tools: set by the request itself"):
        render(tiny_tokenizer, AGENT[:2], chat_template_kwargs={"tools": []})


def test_chat_template_override(tiny_tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    for value in (str(path), path.read_text()):
        template = load_chat_template(value)
        assert render(tiny_tokenizer, AGENT[:2], chat_template=template) == \
            "<system>You are terse.<user>Weather in Paris?"
    with pytest.raises(ValueError, match="neither a file nor a jinja template"):
        load_chat_template("/no/such/template.jinja")


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "max_new_tokens": 512, "do_sample": True,
         "eos_token_id": [2, 7], "bos_token_id": 1}))
    auto = load_generation_defaults("auto", str(tmp_path), model_eos_token_id=2)
    assert auto.sampling == {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "max_tokens": 512}
    assert auto.eos_token_ids == [7]  # the model's own EOS is already a stop
    assert "top_k=40" in auto.describe() and str(tmp_path) in auto.describe()
    assert load_generation_defaults("vllm", str(tmp_path), 2).sampling == {}
    assert load_generation_defaults(str(tmp_path), "/elsewhere", 2).sampling == auto.sampling
    assert load_generation_defaults("auto", "/no/such/dir", 2).sampling == {}  # auto: no file, no defaults
    over = load_generation_defaults("auto", str(tmp_path), 2, overrides={"temperature": 0.5, "min_p": 0.1})
    assert over.sampling["temperature"] == 0.5 and over.sampling["min_p"] == 0.1
    with pytest.raises(ValueError, match="has no generation_config.json"):
        load_generation_defaults("/no/such/dir", str(tmp_path), 2)
    (tmp_path / "generation_config.json").write_text('{"top_k": "forty"}')
    with pytest.raises(ValueError, match="top_k must be an integer"):
        load_generation_defaults("auto", str(tmp_path), 2)
