"""Incremental detokenisation: text grows token by token without ever emitting half a character.

A byte-level tokenizer can split one UTF-8 character over several tokens; decoding a prefix of them yields the
replacement character U+FFFD. So each step decodes a short window of recent tokens twice (with and without the
newest) and emits only the new suffix once it no longer ends in U+FFFD. A sequence that ends by length inside a
character gets the held-back tail at the end (`flush`), U+FFFD included, as vLLM gives it: its text is then what
decoding its tokens gives.
"""

from __future__ import annotations

from nanoserve.engine.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"


def detokenize_step(tokenizer, seq: Sequence) -> str:
    """Append the text of seq's newest output tokens to seq.text and return what was added (maybe "")."""
    skip = seq.params.skip_special_tokens
    out = seq.output_token_ids
    # the Rust tokenizer directly: transformers' decode wrapper costs ~3x more per call, twice per token
    decode = getattr(tokenizer, "backend_tokenizer", tokenizer).decode
    prefix_text = decode(out[seq.prefix_offset: seq.read_offset], skip_special_tokens=skip)
    new_text = decode(out[seq.prefix_offset:], skip_special_tokens=skip)
    if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
        return ""
    delta = new_text[len(prefix_text):]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(out)
    seq.text += delta
    return delta



def flush(tokenizer, seq: Sequence) -> str:
    """seq ended: append the text its newest tokens held back (an unfinished character, as U+FFFD); returns it."""
    skip = seq.params.skip_special_tokens
    out = seq.output_token_ids
    if seq.read_offset >= len(out):
        return ""
    decode = getattr(tokenizer, "backend_tokenizer", tokenizer).decode
    prefix_text = decode(out[seq.prefix_offset: seq.read_offset], skip_special_tokens=skip)
    tail = decode(out[seq.prefix_offset:], skip_special_tokens=skip)[len(prefix_text):]
    seq.prefix_offset = seq.read_offset = len(out)
    seq.text += tail
    return tail
