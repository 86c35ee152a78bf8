"""POST /v1/completions: the request, its choices with the completions logprobs format, the response and the
stream chunk."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nanoserve.server.openai.schema.sampling import PromptLogprob, SamplingRequest, UsageInfo
from nanoserve.server.schema_base import ElidedText, Int, ResponseModel, now


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists;
    each prompt is one engine request with `n` completions."""

    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    prompt_embeds: Any = None
    """vLLM's embedded prompts: refused (this server takes text and token ids)."""
    max_tokens: Int | None = 16
    """Null means 16, as in vLLM; 0 only with echo (the prompt alone comes back)."""
    logprobs: Int | None = None
    """Log-probabilities of the chosen token and this many alternatives per position."""
    echo: bool = False
    """Put the prompt before each choice's text (and, with logprobs, the prompt tokens' logprobs before the
    choice's, the first prompt token's being null)."""
    add_special_tokens: bool = True
    """Add the tokenizer's special tokens (BOS) to a text prompt, as vLLM does by default."""
    suffix: str | None = None
    """Refused: insertion (fill in the middle) is not supported."""
    best_of: Int | None = None
    """Refused unless it equals n (drawing best_of and returning the n most likely is not implemented)."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        def token_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if v is None or (isinstance(v, list) and not v):
            return None  # refused with vLLM's message below
        if isinstance(v, str) or token_ids(v) or (isinstance(v, list) and (
                all(isinstance(p, str) for p in v) or all(token_ids(p) for p in v))):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    @model_validator(mode="after")
    def _unsupported_completion_fields(self) -> "CompletionRequest":
        if self.prompt_embeds is not None and self.prompt_embeds != []:
            raise ValueError("prompt_embeds: not supported by this server (send the prompt as text or token ids)")
        if self.prompt is None:
            raise ValueError("prompt: Either prompt or prompt_embeds must be provided and non-empty.")
        if self.suffix is not None:
            raise ValueError("suffix: not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported by this server (use n)")
        if self.max_tokens is not None and (self.max_tokens < 0 or self.max_tokens == 0 and not self.echo):
            raise ValueError(f"max_tokens: must be at least 1 (0 only with echo), got {self.max_tokens}")
        if self.kv_transfer_params and len(self.prompts()) > 1:
            raise ValueError("kv_transfer_params: only with one prompt (the KV blocks of one sequence move between "
                             "the servers)")
        return self

    @property
    def max_new_tokens(self) -> int:
        """What the engine generates: max_tokens (null: 16); with echo and max_tokens 0, one token, dropped."""
        if self.max_tokens is None:
            return 16
        return max(self.max_tokens, 1)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the response holds the prompt alone."""
        return self.echo and self.max_tokens == 0

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """prompt_logprobs, or with echo and logprobs the logprobs count (the echoed prompt's logprobs), as vLLM."""
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def elide_long_prompts(self, max_chars: int) -> None:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):  # a list of texts (token ids stay as they are)
            self.prompt = [ElidedText.of(x, max_chars) for x in p]
        else:
            self.prompt = ElidedText.of(p, max_chars)

    def prompts(self) -> list[str | ElidedText | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, (str, ElidedText)):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class CompletionLogProbs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With return_token_ids: the choice's token ids (streamed: this chunk's)."""
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the prompt's token ids (streamed: in the choice's first chunk only)."""


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """On a prefill server (P/D), where the prompt's KV blocks wait for the decode server (vLLM's field)."""


class CompletionChunk(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
