"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SEED = 2**63 - 1


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
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
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
    """Return the chosen token's log-probability and this many top alternatives (of the raw model logits)."""
    skip_special_tokens: bool = True
    stop_list: list[str] = field(init=False, default_factory=list)

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
        self.validate()

    def validate(self, max_logprobs: int | None = None) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # rejects NaN

        if not is_int(self.n) or self.n < 1:
            raise bad("n", "an integer >= 1")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "a number in [0, 100]")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 or -1 = disabled)")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "a number in [0, 1]")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "a number in (0, 10]")
        if not is_num(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "a number in [-2, 2]")
        if not is_num(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "a number in [-2, 2]")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", f"an integer in [0, {MAX_SEED}]")
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
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        # the cap is the engine's (its max_logprobs), so it applies when a request reaches an engine
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0
                                          or (max_logprobs is not None and self.logprobs > max_logprobs)):
            raise bad("logprobs", "an integer >= 0" if max_logprobs is None else f"an integer in [0, {max_logprobs}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
