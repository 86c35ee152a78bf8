"""What both endpoints share: the strict request base, the sampling fields and their SamplingParams, usage,
the model list and OpenAI's error body."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from nanoserve.sampling import SamplingParams


class RequestModel(BaseModel):
    """A request body: strict types, unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class ResponseModel(BaseModel):
    """A response body: exactly the fields declared."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(RequestModel):
    include_usage: bool = False
    """Send one more chunk before [DONE], with no choices and the request's token usage."""


class SamplingRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions: the model and how to sample."""

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError("must be a string or a list of strings")

    @model_validator(mode="after")
    def _unsupported(self) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by this server")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request. Raises ValueError naming the parameter if a value is out of range."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            n=self.n, temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=given(self.top_k, 0), min_p=given(self.min_p, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            presence_penalty=given(self.presence_penalty, 0.0), frequency_penalty=given(self.frequency_penalty, 0.0),
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)

    def request_field(self, sampling_field: str) -> str:
        """The request's name for a SamplingParams field (for error messages)."""
        return sampling_field

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# -- responses --------------------------------------------------------------------------------------------
def now() -> int:
    return int(time.time())


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "nanoserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo
