"""A small byte-level tokenizer with M3's special tokens and chat format, for the preset models.

The real M3 tokenizer ships with its checkpoint; presets have random weights, so any tokenizer works as long as it
round-trips text, has M3's special tokens and renders M3-format chats (m3_spec.md section 4). Ids 0-255 are the
256 bytes (no merges, so every string is encodable and a multi-byte character spans several tokens - which the
incremental detokeniser must handle), and the special tokens follow from id 256.
"""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = [
    "]~b]",            # 256: role start ("]~b]user\n")
    "]~!b[",           # 257: BOS
    "[e~[",            # 258: EOS / end of turn
    "<mm:think>",      # 259
    "</mm:think>",     # 260
    "]<]minimax[>[",   # 261: tool-call namespace
    "<tool_call>",     # 262
    "</tool_call>",    # 263
    "]!p~[",           # 264: padding
]
BOS, EOS = "]~!b[", "[e~["

# M3's turn format: BOS, then "]~b]ROLE\n...[e~[\n" per message; the assistant's role is "ai".
CHAT_TEMPLATE = (
    "{{- ']~!b[' -}}"
    "{%- for message in messages -%}"
    "{%- set role = {'assistant': 'ai', 'user': 'user', 'system': 'system', 'tool': 'tool', "
    "'developer': 'developer'}.get(message['role'], message['role']) -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- ']~b]tool\\n<response>' + message['content'] + '</response>[e~[\\n' -}}"
    "{%- else -%}"
    "{{- ']~b]' + role + '\\n' + message['content'] + '[e~[\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- ']~b]ai\\n' -}}"
    "{%- if thinking_mode is defined and thinking_mode == 'enabled' -%}{{- '<mm:think>' -}}"
    "{%- elif thinking_mode is defined and thinking_mode == 'disabled' -%}{{- '<mm:think></mm:think>' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def write_tokenizer(out_dir: str) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": "]!p~[",
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": "]!p~["}, f, indent=2)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
