"""OpenAI chat messages -> the prompt text, through the model's own chat template (jinja, via transformers).

    load_chat_template(value)      --chat-template: a file's contents, or the template itself
    template_messages(messages)    request messages -> what chat templates read: text content, each tool call's
                                   `arguments` as an object (clients send it as a JSON string), reasoning kept;
                                   image and video parts as {"type": "image"} / {"type": "video"}, their sources
                                   collected in order (MediaPart) for the processor
    render_chat(tokenizer, ...)    the prompt: tools, add_generation_prompt / continue_final_message and the
                                   template's own variables (M3: thinking_mode) as vLLM passes them

Errors are ValueErrors whose message starts with the request field at fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
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


@dataclass
class MediaPart:
    """An image or video part of a message: where it comes from (a URL - data:, http(s):, file: - or, offline, an
    object: a PIL image, bytes, frames) and the request field that holds it, for errors."""

    modality: str  # "image" or "video"
    source: Any
    where: str


MEDIA_MARKERS = {"image": "]<]image[>[", "video": "]<]video[>["}
"""What an image or video part is in M3's prompt text: the processor expands each into the item's placeholders."""
MEDIA_PART_TYPES = {"image_url": ("image", "image_url"), "image_pil": ("image", "image_pil"),
                    "video_url": ("video", "video_url"), "image": ("image", "image"), "video": ("video", "video")}
"""A content part's type -> (modality, the key holding its source), as vLLM's chat parser reads them."""


def media_source(part: dict[str, Any], key: str) -> Any:
    """The source of a media part: the URL of {"url": ...}, else the value itself."""
    value = part.get(key)
    return value.get("url") if isinstance(value, dict) else value


def template_messages(messages: list[dict[str, Any]], media: list[MediaPart] | None = None) -> list[dict[str, Any]]:
    """Request messages (plain dicts, OpenAI's shape) as chat templates expect them. Content that is only text
    becomes one string; content with images or videos keeps its parts - text, {"type": "image"}, {"type":
    "video"} - and each media part's source is appended to `media` (None: a media part is a ValueError)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}]: must be an object with a 'role'")
        msg = {k: v for k, v in m.items() if v is not None}
        content = msg.get("content")
        if isinstance(content, list):
            msg["content"] = content_parts(content, f"messages[{i}].content", media)
        elif content is None:
            msg["content"] = ""
        if msg.get("tool_calls"):
            msg["tool_calls"] = [tool_call_for_template(tc, f"messages[{i}].tool_calls[{j}]")
                                 for j, tc in enumerate(msg["tool_calls"])]
        out.append(msg)
    return out


def content_parts(content: list[Any], where: str, media: list[MediaPart] | None) -> str | list[dict[str, Any]]:
    """A message's parts as the template reads them: the text joined (the string form every template reads), or,
    with images or videos among them, the parts in order."""
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind is None and isinstance(p, dict):  # vLLM's short forms: {"image_url": ...}, {"video_url": ...}
            kind = next((k for k in ("image_url", "video_url") if k in p), None)
        if kind in MEDIA_PART_TYPES:
            modality, key = MEDIA_PART_TYPES[kind]
            if media is None:
                raise ValueError(f"{where}[{j}]: {modality} parts are not accepted here")
            media.append(MediaPart(modality, media_source(p, key), f"{where}[{j}].{key}"))
            parts.append({"type": modality})
        else:
            parts.append({"type": "text", "text": p.get("text", "") if isinstance(p, dict) else str(p)})
    if not any(p["type"] != "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def message_text(content: Any) -> str:
    """A template message's text: its string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


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

    def render(msgs: list[dict[str, Any]]) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tools=tools or None, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, **kwargs)
        except Exception as exc:  # jinja errors and the template's own raise_exception: the request's content
            raise ValueError(f"messages: could not render the chat template: {exc}") from exc

    text = render(messages)
    markers = [MEDIA_MARKERS[p["type"]] for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") in MEDIA_MARKERS]
    if sum(text.count(marker) for marker in set(markers)) < len(markers):
        # a template that reads text only: each image or video becomes its marker inside the message's text
        text = render([{**m, "content": "".join(MEDIA_MARKERS.get(p["type"], p.get("text", "")) for p in m["content"])}
                       if isinstance(m.get("content"), list) else m for m in messages])
    return text
