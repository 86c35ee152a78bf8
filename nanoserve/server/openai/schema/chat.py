"""POST /v1/chat/completions: messages, the request, its choices with the chat logprobs format, the response
and the stream chunk (deltas)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_serializer, model_validator

from nanoserve.server.openai.schema.sampling import PromptLogprob, SamplingRequest, UsageInfo
from nanoserve.server.schema_base import Int, RequestModel, ResponseModel, now


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class MediaURL(RequestModel):
    url: str
    """A data URL (data:image/png;base64,...; a video as data:video/jpeg;base64,<frame>,<frame>,...), an http(s)
    URL of a host --allowed-media-domains lists, or a file URL under --allowed-local-media-path."""
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted as OpenAI's; every image is read at the resolution the model's processor chooses."""


class ImagePart(RequestModel):
    type: Literal["image_url"] = "image_url"
    image_url: MediaURL | str
    uuid: str | None = None


class VideoPart(RequestModel):
    type: Literal["video_url"] = "video_url"
    video_url: MediaURL | str
    uuid: str | None = None


def _part_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return getattr(value, "type", None)
    kind = value.get("type")
    if kind is None:  # vLLM's short forms {"image_url": ...}, {"video_url": ...}
        kind = next((k for k in ("image_url", "video_url") if k in value), None)
    return kind if kind in ("text", "image_url", "video_url") else None


ContentPart = Annotated[Annotated[TextPart, Tag("text")] | Annotated[ImagePart, Tag("image_url")]
                        | Annotated[VideoPart, Tag("video_url")],
                        Discriminator(_part_kind, custom_error_type="content_part_type", custom_error_message=(
                            "a content part's type must be text, image_url or video_url"))]


class FunctionCall(RequestModel):
    name: str
    arguments: str | dict[str, Any]
    """A JSON object as a string (OpenAI's shape); an object is accepted too."""


class ToolCallParam(RequestModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: str = Field(min_length=1)
    """system, developer, user, assistant, tool - or any other role, passed to the chat template as it is (vLLM's
    rule: the template decides what a custom role renders as)."""
    content: str | list[ContentPart] | None = None
    """A string, or parts: text, images (image_url) and videos (video_url) for a model that sees."""
    name: str | None = None
    tool_call_id: str | None = None
    """role tool: the id of the call this message answers."""
    tool_calls: list[ToolCallParam] | None = None
    """role assistant: the calls the model made."""
    reasoning_content: str | None = None
    reasoning: str | None = None
    """role assistant: its thinking, for a template that shows it (vLLM's two names)."""

    def to_template_dict(self) -> dict[str, Any]:
        """The message as a plain dict (unset fields left out); chat_template.template_messages takes it on."""
        return self.model_dump(exclude_none=True)


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of an object: the call's arguments."""
    strict: bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions. The messages are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool = False
    top_logprobs: Int | None = None
    """With logprobs: this many alternatives per token (0-20; -1 = the whole vocabulary, past the cap)."""
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    """Default "auto" when tools are given (needs --enable-auto-tool-choice), else "none"."""
    parallel_tool_calls: bool = True
    """false: at most one call is returned."""
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Continue the final (assistant) message instead of starting a new one; needs add_generation_prompt false."""
    add_special_tokens: bool = False
    """Let the tokenizer add its special tokens (BOS) to the rendered prompt; the template already has them."""
    echo: bool = False
    """Start the answer with the final message's content when it is the assistant's (with continue_final_message)."""
    include_reasoning: bool = True
    """false: the reasoning is split off and not returned."""
    chat_template: str | None = None
    """This request's chat template (jinja), instead of the server's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template; M3's: thinking_mode = enabled | disabled | adaptive."""
    reasoning_effort: str | None = None
    """Passed to the chat template as the variable reasoning_effort (templates that do not read it ignore it)."""
    thinking_token_budget: Int | None = None
    """At most this many thinking tokens: then the end-of-thinking marker is forced (needs --reasoning-parser)."""

    @model_validator(mode="after")
    def _logprobs_pair(self) -> "ChatCompletionRequest":
        # as vLLM: top_logprobs 0 (or null) goes without logprobs, a count asks for them
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise ValueError("top_logprobs: must be >= 0 (or -1 for the whole vocabulary)")
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ValueError("thinking_token_budget: must be >= 0")
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


class ResponseFunctionCall(ResponseModel):
    name: str
    arguments: str


class ResponseToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    """The thinking (with --reasoning-parser), under both of vLLM's names."""
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


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
    service_tier: str | None = None
    system_fingerprint: str | None = None
    """OpenAI's fields, always null here (as vLLM sends them)."""
    kv_transfer_params: dict[str, Any] | None = None
    """On a prefill server (P/D), where the prompt's KV blocks wait for the decode server (vLLM's field)."""


def _without_nulls(handler, model) -> dict[str, Any]:
    return {k: v for k, v in handler(model).items() if v is not None}


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_nulls(handler, self)


class DeltaToolCall(ResponseModel):
    """A piece of a tool call: the first carries index, id, type and the function's name (arguments ""), the
    later ones the next piece of `arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_nulls(handler, self)


class DeltaMessage(ResponseModel):
    """What a stream chunk adds to a chat message: the role once (first chunk), then content, reasoning and
    tool-call pieces."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_nulls(handler, self)


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
