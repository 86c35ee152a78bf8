"""A model's generation_config.json as the server's default sampling parameters (vLLM's --generation-config).

    --generation-config auto   (default) the model directory's generation_config.json, if it has one
    --generation-config vllm   none: the defaults of SamplingParams
    --generation-config DIR    DIR/generation_config.json

Its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) become the defaults
for requests that do not set them; an eos_token_id list adds the ids beyond the model's own EOS as stop tokens
(generation stops at any of them, as in vLLM). --override-generation-config JSON sets or replaces fields.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass
class GenerationDefaults:
    """Defaults for the fields a request leaves unset, and extra stop token ids."""

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    eos_token_ids: list[int] = field(default_factory=list)  # EOS ids besides the model's own
    source: str | None = None  # the file they came from

    def describe(self) -> str:
        if not self.sampling and not self.eos_token_ids:
            return "none (SamplingParams' own defaults)"
        parts = [f"{k}={v}" for k, v in self.sampling.items()]
        if self.eos_token_ids:
            parts.append(f"extra eos_token_ids={self.eos_token_ids}")
        return ", ".join(parts) + (f" (from {self.source})" if self.source else "")


def load_generation_defaults(mode: str, model_dir: str, model_eos_token_id: int | None,
                             overrides: dict[str, Any] | None = None) -> GenerationDefaults:
    """Read the generation config `mode` points at (see the module docstring). Raises ValueError naming the
    flag when the file is unreadable or a value has the wrong type."""
    config: dict[str, Any] = {}
    source = None
    if mode != "vllm":
        directory = model_dir if mode == "auto" else mode
        path = os.path.join(directory, FILE)
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--generation-config: cannot read {path}: {exc}") from exc
            if not isinstance(config, dict):
                raise ValueError(f"--generation-config: {path} must hold a JSON object")
            source = path
        elif mode != "auto":
            raise ValueError(f"--generation-config: {directory!r} has no {FILE}")
    if overrides:
        config = {**config, **overrides}
        source = f"{source} + --override-generation-config" if source else "--override-generation-config"
    sampling = {}
    for key, name in SAMPLING_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        want_int = name in ("top_k", "max_tokens")
        if isinstance(value, bool) or not isinstance(value, int if want_int else (int, float)):
            raise ValueError(f"--generation-config: {key} must be {'an integer' if want_int else 'a number'}, "
                             f"got {value!r}")
        sampling[name] = value
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else list(eos) if isinstance(eos, list) else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"--generation-config: eos_token_id must be a token id or a list of them, got {eos!r}")
    extra = [i for i in dict.fromkeys(ids) if i != model_eos_token_id]
    return GenerationDefaults(sampling, extra, source)
