"""Load the model directory's tokenizer (tokenizer.json + tokenizer_config.json, chat_template.jinja) through
transformers, and render chats with the model's own template."""

from __future__ import annotations

import os
from typing import Any


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and \
            not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        raise ValueError(f"no tokenizer found in {path!r} (expected tokenizer.json / tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(path)


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """Render OpenAI-style messages to the prompt string the model was trained on."""
    if not messages:
        raise ValueError("messages must contain at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use completions instead")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))
