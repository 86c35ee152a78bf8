"""OpenAI chat messages -> the prompt text, through the model's own chat template (jinja, via transformers).

    load_chat_template(value)      --chat-template: a file's contents, or the template itself
    template_messages(messages)    request messages -> what chat templates read: text content, each tool call's
                                   `arguments` as an object (clients send it as a JSON string), reasoning kept
    render_chat(tokenizer, ...)    the prompt: tools, add_generation_prompt / continue_final_message and the
                                   template's own variables (M3: thinking_mode) as vLLM passes them

Errors are ValueErrors whose message starts with the request field at fault.
"""

from __future__ import annotations

import json
import os
from typing import Any

# variables the server passes to the template itself: chat_template_kwargs may not set them
RESERVED_TEMPLATE_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                               "chat_template", "tokenize", "return_dict"}


def load_chat_template(value: str | None) -> str | None:
    """--chat-template FILE|STRING (vLLM's rule: an existing file is read; text with template syntax is the
    template; anything else is a file that is not there)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(s in value for s in ("{{", "{%", "{#")):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a jinja template")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Request messages (plain dicts, OpenAI's shape) as chat templates expect them."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}]: must be an object with a 'role'")
        msg = {k: v for k, v in m.items() if v is not None}
        content = msg.get("content")
        if isinstance(content, list):  # text parts joined: the string form every template reads
            msg["content"] = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        elif content is None:
            msg["content"] = ""
        if msg.get("tool_calls"):
            msg["tool_calls"] = [tool_call_for_template(tc, f"messages[{i}].tool_calls[{j}]")
                                 for j, tc in enumerate(msg["tool_calls"])]
        out.append(msg)
    return out


def tool_call_for_template(call: dict[str, Any], where: str) -> dict[str, Any]:
    call = dict(call)
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):  # templates render the arguments object field by field (vLLM parses it too)
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({exc})") from exc
        if not isinstance(args, dict):
            raise ValueError(f"{where}.function.arguments: must be a JSON object")
        fn["arguments"] = args
    call["function"] = fn
    return call


def render_chat(tokenizer, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text for `messages` (already in template form)."""
    if not messages:
        raise ValueError("messages: must contain at least one message")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message: cannot be combined with add_generation_prompt (set "
                         "add_generation_prompt to false to continue the final message)")
    kwargs = dict(chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs.{clash[0]}: set by the request itself, not through "
                         f"chat_template_kwargs")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError("messages: this model's tokenizer has no chat template (start the server with "
                         "--chat-template, or use /v1/completions)")
    try:
        return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as exc:  # jinja errors and the template's own raise_exception: the request's content
        raise ValueError(f"messages: could not render the chat template: {exc}") from exc
