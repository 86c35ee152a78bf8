"""Load the model directory's tokenizer (tokenizer.json + tokenizer_config.json, chat_template.jinja) through
transformers. Chats are rendered with it in nanoserve/chat_template.py."""

from __future__ import annotations

import os


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(path, "tokenizer.json")) and \
            not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        raise ValueError(f"no tokenizer found in {path!r} (expected tokenizer.json / tokenizer_config.json)")
    return AutoTokenizer.from_pretrained(path)

