"""`speculative_config`, as vLLM takes it: a dict (the server's `--speculative-config` JSON, or
`LLM(speculative_config={...})`) checked once into a SpeculativeConfig. An unknown key or a bad value is a
ValueError naming it; nothing is silently ignored."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "mtp", "eagle3")
"""The drafters this engine has: prompt lookup, the checkpoint's own MTP module (spec_decode/mtp.py), and an EAGLE-3
draft directory (spec_decode/eagle3.py)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft: `method`, how many draft tokens a step verifies (`num_speculative_tokens`, k), and the ngram
    drafter's match lengths (`prompt_lookup_min` <= n <= `prompt_lookup_max`, vLLM's names and defaults). With
    "mtp", k defaults to 1 (one MTP module); a larger k applies the module again to its own output. "eagle3" needs
    `model`, the draft directory."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    @classmethod
    def from_dict(cls, raw: Any) -> "SpeculativeConfig":
        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown or unsupported key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        method = raw.get("method")
        if method == "[ngram]":  # vLLM's older spelling
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {method!r}")
        k = raw.get("num_speculative_tokens", 1 if method == "mtp" else None)
        if not _is_int(k) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        model = raw.get("model")
        if method == "eagle3":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method 'eagle3' needs model, the draft model's directory")
        elif model is not None:
            raise ValueError(f"speculative_config: model (a draft directory) applies to method 'eagle3' only, not "
                             f"{method!r}")
        if method != "ngram":
            given = [n for n in ("prompt_lookup_min", "prompt_lookup_max") if raw.get(n) is not None]
            if given:
                raise ValueError(f"speculative_config: {', '.join(given)} apply to method 'ngram' only")
            return cls(method, k, model=model)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        # vLLM's defaults: both 5 when neither is given, else the one given for both
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method, k, lo, hi)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
