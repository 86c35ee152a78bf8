"""The ngram drafter (vLLM's `method: "ngram"`, prompt lookup decoding): no weights. The context's last n tokens,
for the longest n in [prompt_lookup_min, prompt_lookup_max] that occurred before, are matched at their most
recent earlier occurrence, and the up to k tokens that followed it there are the draft. It pays off where the
output repeats its context: code edits, agents quoting tool results, retrieval answers."""

from __future__ import annotations

from array import array


class NgramProposer:
    """Drafts by prompt lookup (see the module docstring)."""

    def __init__(self, min_n: int, max_n: int, k: int):
        if not 1 <= min_n <= max_n or k < 1:
            raise ValueError(f"need 1 <= min_n ({min_n}) <= max_n ({max_n}) and k ({k}) >= 1")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, tokens: list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: the configured k) draft tokens to follow `tokens`; [] when no n-gram matches."""
        k = self.k if k is None else k
        size = len(tokens)
        if k < 1 or size < self.min_n + 1:
            return []
        # a byte search (C speed) over the tokens as int64s: a context of 100k tokens is searched per step
        data = array("q", tokens).tobytes()
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = find_last(data, data[(size - n) * 8:], (size - 1) * 8)
            if start is not None:
                return tokens[start + n: start + n + k]
        return []


def find_last(data: bytes, needle: bytes, end: int) -> int | None:
    """The token index of the last occurrence of `needle` (whole int64s) inside data[:end], or None."""
    while True:
        pos = data.rfind(needle, 0, end)
        if pos < 0:
            return None
        if pos % 8 == 0:
            return pos // 8
        end = pos + len(needle) - 1  # a match across token boundaries: look before it
