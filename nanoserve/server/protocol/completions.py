"""POST /v1/completions: the request, its choices with the completions logprobs format, the response and the
stream chunk."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nanoserve.server.protocol.common import ResponseModel, SamplingRequest, UsageInfo, now


class CompletionRequest(SamplingRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists;
    each prompt is one engine request with `n` completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    """Log-probabilities of the chosen token and this many alternatives per position."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        def token_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        if isinstance(v, str) or token_ids(v) or (isinstance(v, list) and (
                all(isinstance(p, str) for p in v) or all(token_ids(p) for p in v))):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")

    @model_validator(mode="after")
    def _unsupported_completion_fields(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo: not supported by this server")
        if self.suffix is not None:
            raise ValueError("suffix: not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported by this server (use n)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
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


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionChunk(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
