"""The text a client is sent, against a real m3-tiny server (conftest's): m3-tiny's byte-level vocabulary splits
rare characters over several tokens, so steps whose token completes no character are common.

- a streamed chat sends no delta whose content is "" after the role's chunk (a step with no text to show sends its
  logprobs under a delta without content), and the deltas join to the non-streamed answer;
- a request that ends inside a character ends with the text tokenizer.decode gives its tokens, the unfinished
  character as U+FFFD (vLLM flushes it so: engine/detokenizer.py `flush`).
"""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server_utils import SERVED_MODEL, stream_events

CHAT = [{"role": "user", "content": "Write a word in Greek, then one in Japanese."}]


@pytest.fixture(scope="module")
def tok(engine):
    return engine.get_tokenizer()


def test_a_streamed_chat_sends_no_empty_content(server, tok):
    body = {"messages": CHAT, "temperature": 0.0, "max_tokens": 48, "logprobs": True}
    whole = httpx.post(f"{server.url}/v1/chat/completions", json={"model": SERVED_MODEL, **body}, timeout=120).json()
    events = stream_events(server, "/v1/chat/completions", body)
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["delta"].get("content") != "" for c in chunks[1:]), [c["delta"] for c in chunks]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == whole["choices"][0]["message"]["content"]
    # not vacuous: some tokens completed no character, and their chunks went out without content
    silent = [c for c in chunks[1:] if "content" not in c["delta"] and c["logprobs"]]
    assert silent, "every token of this answer showed text: pick a prompt whose answer splits characters"


def ends_inside_a_character(server, tok) -> tuple[list[int], int]:
    """A prompt and a max_tokens at which m3-tiny's greedy answer stops inside a character."""
    for seed in range(8):
        prompt = [(37 * i + 11 * seed) % 400 + 9 for i in range(12)]
        out = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": SERVED_MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}).json()
        ids = out["choices"][0]["token_ids"]
        for k in range(1, len(ids)):
            if tok.decode(ids[:k]).endswith("\ufffd") and not tok.decode(ids[:k + 1]).endswith("\ufffd"):
                return prompt, k
    raise AssertionError("no greedy answer of m3-tiny stopped inside a character")


def test_an_answer_cut_inside_a_character_ends_as_its_tokens_decode(server, tok):
    prompt, k = ends_inside_a_character(server, tok)
    body = {"prompt": prompt, "max_tokens": k, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    out = httpx.post(f"{server.url}/v1/completions", json={"model": SERVED_MODEL, **body}, timeout=120).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    events = stream_events(server, "/v1/completions", body)
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert choice["text"] == streamed == tok.decode(choice["token_ids"])
