"""POST /v1/chat/completions: messages, the request, its choices with the chat logprobs format, the response
and the stream chunk (deltas)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_serializer, model_validator

from nanoserve.server.protocol.common import (Int, PromptLogprob, RequestModel, ResponseModel, SamplingRequest,
                                              UsageInfo, now)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it: content as one string."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. The messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool = False
    top_logprobs: Int | None = None
    """With logprobs: this many alternatives per token (0-20; -1 = the whole vocabulary, past the cap)."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _logprobs_pair(self) -> "ChatCompletionRequest":
        # as vLLM: top_logprobs 0 (or null) goes without logprobs, a count asks for them
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise ValueError("top_logprobs: must be >= 0 (or -1 for the whole vocabulary)")
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def request_field(self, sampling_field: str) -> str:
        if sampling_field == "logprobs":
            return "top_logprobs"
        if sampling_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return sampling_field


class ChatTopLogProb(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProb(ChatTopLogProb):
    top_logprobs: list[ChatTopLogProb] = Field(default_factory=list)


class ChatLogProbs(ResponseModel):
    content: list[ChatLogProb] | None = None


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With return_token_ids: the choice's token ids."""


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the rendered prompt's token ids."""


class DeltaMessage(ResponseModel):
    """What a stream chunk adds to a chat message: the role once (first chunk), then content pieces."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With return_token_ids: this chunk's new token ids."""


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the prompt's token ids, in the first chunk only."""
