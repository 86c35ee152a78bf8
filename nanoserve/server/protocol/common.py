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
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _unsupported(self) -> "StreamOptions":
        if self.continuous_usage_stats:
            raise ValueError("continuous_usage_stats is not supported by this server")
        return self


# Fields of OpenAI's or vLLM's API that this server knows but cannot honour: a request that uses one (with a value
# other than its neutral one) gets a 400 naming it, rather than an answer that silently ignored it.
NEUTRAL = object()
UNSUPPORTED_FIELDS: dict[str, tuple[object, str]] = {
    "prompt_logprobs": (None, "prompt log-probabilities are not computed"),
    "use_beam_search": (False, "beam search is not implemented"),
    "length_penalty": (1.0, "beam search is not implemented"),
    "bad_words": (None, "not supported by this server"),
    "allowed_token_ids": (None, "not supported by this server"),
    "logits_processors": (None, "not supported by this server"),
    "truncate_prompt_tokens": (None, "prompts are never truncated: a prompt that does not fit is a 400"),
    "priority": (0, "requests are scheduled first come, first served"),
    "return_tokens_as_token_ids": (False, "not supported by this server"),
    "spaces_between_special_tokens": (True, "not supported by this server"),
    "mm_processor_kwargs": (None, "this server serves text only"),
    "audio": (None, "this server serves text only"),
    "prediction": (None, "predicted outputs are not supported"),
    "web_search_options": (None, "web search is not available"),
    "functions": (None, "the deprecated functions API is not supported: use tools"),
    "function_call": (None, "the deprecated functions API is not supported: use tool_choice"),
    "documents": (None, "not supported by this server"),
}


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

    @model_validator(mode="before")
    @classmethod
    def _known_but_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (neutral, why) in UNSUPPORTED_FIELDS.items():
                if name in data and data[name] != neutral and data[name] is not None:
                    raise ValueError(f"{name}: {why}")
            modalities = data.get("modalities")
            if modalities is not None and modalities != ["text"]:
                raise ValueError("modalities: this server answers in text only")
        return data

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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request; `defaults` (the model's generation config) fill the fields it leaves
        unset. Raises ValueError naming the parameter if a value is out of range."""
        base = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                **(defaults or {})}

        def given(name: str) -> Any:
            value = getattr(self, name)
            return base[name] if value is None else value

        return SamplingParams(
            n=self.n, temperature=given("temperature"), top_p=given("top_p"), top_k=given("top_k"),
            min_p=given("min_p"), repetition_penalty=given("repetition_penalty"),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
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
