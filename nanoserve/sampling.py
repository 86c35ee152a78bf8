"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # the int64 range, as vLLM's request models
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: +-100 bans or forces a token

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a format (vLLM's `StructuredOutputsParams`): set exactly one of `json` (a JSON
    schema, as a dict or a JSON string), `regex`, `choice` (the output is one of these strings), `grammar` (EBNF, in
    xgrammar's GBNF dialect), `json_object=True` (any JSON object) or `structural_tag` (an xgrammar structural tag,
    as a dict or a JSON string). The engine compiles it with xgrammar and masks every token the format forbids
    (engine/structured_output.py). Invalid values raise ValueError naming the field."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    """JSON only: no whitespace between tokens beyond a single space after ':' and ',' (compact output)."""
    disable_additional_properties: bool = False
    """JSON schema only: objects without an explicit additionalProperties get additionalProperties: false."""
    whitespace_pattern: str | None = None
    """Not supported by the xgrammar backend: setting it raises ValueError (vLLM's xgrammar backend rejects it too)."""
    reasoning_end_token_id: int | None = None
    """The output starts in the model's thinking, which the format does not hold: the format applies from the
    token after the first time this token (the end-of-thinking marker, M3's `</mm:think>`) is generated; until
    then the output is sampled unconstrained. None: the format applies from the first token. Not a request
    field: the server sets it with --reasoning-parser (docs/agent_api.md), as vLLM applies structured outputs
    only after the reasoning ends."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) is not None)

    def validate(self) -> None:
        kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of " + ", ".join(CONSTRAINT_KINDS)
                             + (f"; got {', '.join(kinds)}" if kinds else "; got none"))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or a JSON string), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when set")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structured_outputs.structural_tag must be an object or a JSON string")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be true or false")
        if self.reasoning_end_token_id is not None and (not isinstance(self.reasoning_end_token_id, int)
                                                        or isinstance(self.reasoning_end_token_id, bool)
                                                        or self.reasoning_end_token_id < 0):
            raise ValueError("structured_outputs.reasoning_end_token_id must be a token id (an int >= 0)")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (the xgrammar backend has no "
                             "custom whitespace pattern); use disable_any_whitespace instead")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "StructuredOutputsParams":
        """From a request body's `structured_outputs` object; an unknown key is a ValueError naming it."""
        known = set(CONSTRAINT_KINDS) | {"disable_any_whitespace", "disable_additional_properties",
                                         "whitespace_pattern"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s): {', '.join(unknown)}")
        return cls(**d)


@dataclass
class SamplingParams:
    """Per-request generation settings. Invalid values raise ValueError naming the parameter."""

    n: int = 1
    """Number of completions to generate for the prompt."""
    temperature: float = 1.0
    """0 = greedy. Higher = flatter distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1 = all)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the most likely token's."""
    repetition_penalty: float = 1.0
    """>1 discourages tokens already in the prompt or output (divides positive logits, multiplies negative)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that appeared in the output."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output."""
    seed: int | None = None
    """Per-request seed (any int64): the same seed gives the same tokens whatever else is in the batch."""
    max_tokens: int | None = 16
    """Maximum new tokens (None = up to the model's max length)."""
    min_tokens: int = 0
    """EOS and stop tokens are suppressed until this many tokens were generated."""
    stop: str | list[str] | None = None
    """Stop strings: generation ends when the text contains one (not included unless include_stop_str_in_output)."""
    stop_token_ids: list[int] | None = None
    """Stop tokens: generation ends after one (its text is not included unless include_stop_str_in_output)."""
    ignore_eos: bool = False
    """Keep generating after EOS (until max_tokens or another stop)."""
    include_stop_str_in_output: bool = False
    """Keep the stop string or stop token's text at the end of the output text."""
    logprobs: int | None = None
    """Return the chosen token's log-probability and this many top alternatives (-1 = the whole vocabulary).
    Of the raw model logits unless the engine's logprobs_mode says otherwise."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token after the first, its log-probability and this many top alternatives
    (-1 = the whole vocabulary). The first prompt token has none (None in the output)."""
    prompt_logprobs_temperature: float | None = None
    """The prompt logprobs are of the logits divided by this (vLLM's field; None: 1, the raw distribution). Below 1
    the distribution is sharper (the most likely token's logprob nearer 0), above 1 flatter."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling, in [-100, 100] (-100 bans, +100 forces)."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be generated (a non-empty list)."""
    bad_words: list[str] | None = None
    """Words that must not be generated: the word's last token is banned wherever the output ends with the
    tokens before it (each word is tokenized as written and with a leading space)."""
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice, grammar or structural tag (see the class)."""
    stop_list: list[str] = field(init=False, default_factory=list)
    bad_words_token_ids: list[list[int]] = field(init=False, default_factory=list)
    """The tokenized bad_words; the engine fills this in when the request arrives."""

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_list = list(self.stop)
        elif self.stop is not None:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        elif self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        if isinstance(self.allowed_token_ids, tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, tuple):
            self.bad_words = list(self.bad_words)
        self.validate()

    def validate(self, max_logprobs: int | None = None, vocab_size: int | None = None) -> None:
        """Check every value; with an engine's `max_logprobs` and `vocab_size`, also the limits that depend on
        it (logprobs counts, token ids inside the vocabulary)."""
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not is_num(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", "a finite number >= 0")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 or -1 = disabled)")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "a finite number > 0")
        if not is_num(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "a number in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "a number in [-2, 2]")
        if self.prompt_logprobs_temperature is not None and (
                not is_num(self.prompt_logprobs_temperature)
                or not 0.0 < self.prompt_logprobs_temperature < math.inf):
            raise bad("prompt_logprobs_temperature", "a finite number > 0")
        if self.seed is not None and (not is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise bad("seed", f"an integer in [{MIN_SEED}, {MAX_SEED}]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop_list):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs", "a StructuredOutputsParams")
            self.structured_outputs.validate()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        self._validate_token_fields(is_int, is_num)
        # the caps are the engine's (its max_logprobs and vocabulary), so they apply when a request reaches one
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if not is_int(value) or value < -1:
                raise bad(name, "an integer >= 0, or -1 for the whole vocabulary")
            if value == -1 and vocab_size is None:
                continue  # the whole vocabulary: checked against the cap once the vocabulary is known
            if max_logprobs is not None and (vocab_size if value == -1 else value) > max_logprobs:
                whole = f" (-1 asks for the whole vocabulary, {vocab_size} tokens)" if value == -1 else ""
                raise ValueError(f"{name} must be an integer in [0, {max_logprobs}] (this engine's max_logprobs), "
                                 f"got {value}{whole}")
        if vocab_size is not None:
            self._check_vocabulary(vocab_size)

    def _validate_token_fields(self, is_int, is_num) -> None:
        """Shapes and ranges of logit_bias, allowed_token_ids and bad_words."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bad_keys = [k for k in self.logit_bias if not is_int(k) or k < 0]
            if bad_keys:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {bad_keys!r}")
            bad_values = {k: v for k, v in self.logit_bias.items()
                          if not is_num(v) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
            if bad_values:
                raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {bad_values!r}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{self.allowed_token_ids!r}")
            if not all(is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a list of non-negative integers")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")

    def _check_vocabulary(self, vocab_size: int) -> None:
        """Every token id the request names must be inside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                          ("logit_bias", list(self.logit_bias or ()))):
            outside = sorted({t for t in ids or () if t >= vocab_size})
            if outside:
                raise ValueError(f"{name} contains token ids outside the vocabulary: {outside} (the vocabulary "
                                 f"has {vocab_size} tokens, ids 0..{vocab_size - 1})")

    def set_bad_words_token_ids(self, encode) -> None:
        """Tokenize bad_words with `encode(text) -> ids`: each word as written (leading spaces dropped) and, when
        that tokenizes differently into as many tokens, with one leading space - the form it takes mid-text."""
        self.bad_words_token_ids = []
        for word in self.bad_words or ():
            plain = list(encode(word.lstrip()))
            spaced = list(encode(" " + word.lstrip()))
            self.bad_words_token_ids.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                self.bad_words_token_ids.append(spaced)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's `BeamSearchParams`; `LLM.beam_search`, the server's `use_beam_search`).
    Invalid values raise ValueError naming the parameter."""

    beam_width: int
    """Beams kept at each step, and beams returned per prompt."""
    max_tokens: int
    """Tokens generated per beam at most."""
    ignore_eos: bool = False
    """EOS is a continuation like any other token instead of ending its beam."""
    temperature: float = 0.0
    """Each step draws one token at this temperature beside the top 2 x beam_width candidates (0: greedy, so the
    draw adds nothing). The candidates' logprobs are the engine's (logprobs_mode), as vLLM's."""
    length_penalty: float = 1.0
    """Beams are ranked by cumulative logprob / length ** length_penalty: above 1 favours longer beams, 0 ranks
    by the logprob alone."""
    include_stop_str_in_output: bool = False
    """Keep the EOS that ended a beam in the returned token ids (the server's) and text (LLM.beam_search's)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, max_logprobs: int | None = None) -> None:
        """Check every value; with an engine's `max_logprobs`, also that its 2 x beam_width candidates fit."""
        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        # vLLM's wording for beam_width (its _verify_num_sequences)
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool):
            raise ValueError(f"beam_width must be an int, but is of type {type(self.beam_width)}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if max_logprobs is not None and 2 * self.beam_width > max_logprobs:
            raise ValueError(f"beam_width must be at most {max_logprobs // 2} (each step asks for 2 x beam_width "
                             f"logprobs, and this engine's max_logprobs is {max_logprobs}), got {self.beam_width}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not is_num(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
