"""The bodies of Anthropic's Messages API, as pydantic models: POST /v1/messages and POST /v1/messages/count_tokens
- the request with its content blocks, tools and thinking setting, the message it answers with, the stream's
events, and this API's error body.

Served as a chat, as vLLM serves it (convert.py). What this API has and nanoserve cannot honour is
refused by name: server tools (web search, code execution, ...), document blocks. Image blocks (base64 data, or a
URL the server may fetch) go to a model that sees as the chat's image parts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator

from nanoserve.server.schema_base import Int, RequestBody, RequestModel, ResponseModel


# -- content blocks ------------------------------------------------------------------------------------------------
class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    """Accepted: the prefix cache keeps every prompt's KV blocks without being asked."""


class ImageSource(RequestModel):
    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    """With type base64: the data's format (GIF is refused when decoded: PNG, JPEG and WebP are read)."""
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> "ImageSource":
        if self.type == "base64" and (self.media_type is None or self.data is None):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and self.url is None:
            raise ValueError("a url image source needs url")
        return self

    def as_url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else self.url  # type: ignore


class ImageBlock(RequestModel):
    """An image in a user message, for a model that sees."""

    type: Literal["image"]
    source: ImageSource
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(RequestModel):
    """A call the model made in an earlier turn (assistant)."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(RequestModel):
    """The client's result of a call (user): a `tool` message answering `tool_use_id`."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    """Shown to the model as the result's text, prefixed "Error: "."""
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(RequestModel):
    """An earlier turn's thinking (assistant); its `signature` is not checked."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(RequestModel):
    """Another model's encrypted thinking: nothing this model can read, so it is left out of the prompt (as vLLM
    does)."""

    type: Literal["redacted_thinking"]
    data: str


BLOCKS = {"text": "Text", "image": "Image", "tool_use": "ToolUse", "tool_result": "ToolResult",
          "thinking": "Thinking", "redacted_thinking": "RedactedThinking"}
"""Block type -> its tag in the ContentBlock union (capitalised: error paths leave such tags out)."""


def _block_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return BLOCKS.get(kind) if isinstance(kind, str) else None  # a type that is no string is no known block


ContentBlock = Annotated[Annotated[TextBlock, Tag("Text")] | Annotated[ImageBlock, Tag("Image")]
                         | Annotated[ToolUseBlock, Tag("ToolUse")]
                         | Annotated[ToolResultBlock, Tag("ToolResult")] | Annotated[ThinkingBlock, Tag("Thinking")]
                         | Annotated[RedactedThinkingBlock, Tag("RedactedThinking")],
                         Discriminator(_block_kind, custom_error_type="content_block_type", custom_error_message=(
                             "the block's type must be one of text, image, tool_use, tool_result, thinking, "
                             "redacted_thinking (no document blocks)"))]


def _text_as_block(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_text_as_block)]
    """A string, or a list of content blocks (a string is one text block)."""


# -- tools, thinking -------------------------------------------------------------------------------------------------
class Tool(RequestModel):
    """A client tool. Anthropic's server tools (a `type` such as web_search_20250305) are refused: this server
    runs no tools of its own."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"type: {data['type']!r} is a server tool, and this server runs none: only client "
                             f"tools (name, description, input_schema) are available")
        return data


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False
    """At most one tool_use block."""

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice.name: required when type is 'tool'")
        return self


class ThinkingConfig(RequestModel):
    """enabled (M3's thinking_mode "enabled"; `budget_tokens` bounds it), disabled, or adaptive (the model
    decides: M3's "adaptive")."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None
    """With enabled: the thinking takes at most this many tokens (then it is closed); at least 1024 and less than
    max_tokens, as Anthropic requires."""


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    """Passed to the chat template as `reasoning_effort`, as vLLM does."""
    format: OutputFormat | None = None
    """The answer (after any thinking) follows this JSON schema."""


class Metadata(RequestModel):
    user_id: str | None = None


class ChatFields(RequestBody):
    """What both endpoints take to build the prompt."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extension: variables for the chat template (M3's thinking_mode)."""

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(b.text for b in self.system)


class MessagesRequest(ChatFields):
    """POST /v1/messages."""

    max_tokens: Int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None
    cache_salt: str | None = None
    """vLLM's extension: only requests with the same salt share prefix-cache blocks."""

    @model_validator(mode="after")
    def _limits(self) -> "MessagesRequest":
        if self.max_tokens < 1:
            raise ValueError("max_tokens: must be at least 1")
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None:
            if self.thinking.type != "enabled":
                raise ValueError("thinking.budget_tokens: only with thinking type 'enabled'")
            if budget < 1024 or budget >= self.max_tokens:
                raise ValueError(f"thinking.budget_tokens: must be at least 1024 and less than max_tokens "
                                 f"({self.max_tokens}), got {budget}")
        return self


class CountTokensRequest(ChatFields):
    """POST /v1/messages/count_tokens: the prompt a MessagesRequest with these fields would have."""


# -- the answer ------------------------------------------------------------------------------------------------------
class TextContent(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str
    """The SHA-256 of the thinking text: this server holds no key to sign it with."""


class ToolUseContent(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


AnswerBlock = TextContent | ThinkingContent | ToolUseContent


class Usage(ResponseModel):
    input_tokens: int
    """Prompt tokens not read from the prefix cache (Anthropic's count)."""
    output_tokens: int
    cache_creation_input_tokens: int = 0
    """Prompt tokens in full KV blocks this request added to the prefix cache."""
    cache_read_input_tokens: int = 0
    """Prompt tokens whose KV blocks came from the prefix cache."""


class MessageResponse(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[AnswerBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(ResponseModel):
    input_tokens: int


# -- the stream's events ---------------------------------------------------------------------------------------------
class StreamEvent(ResponseModel):
    """One Server-Sent Event (`event: <type>` + `data: <this>`)."""

    type: str


class MessageStartEvent(StreamEvent):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class BlockStartEvent(StreamEvent):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: AnswerBlock


class BlockDeltaEvent(StreamEvent):
    """delta: {"type": "text_delta", "text"}, {"type": "thinking_delta", "thinking"}, {"type": "signature_delta",
    "signature"} or {"type": "input_json_delta", "partial_json"}."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: dict[str, str]


class BlockStopEvent(StreamEvent):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class DeltaUsage(ResponseModel):
    output_tokens: int


class MessageDelta(ResponseModel):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None


class MessageDeltaEvent(StreamEvent):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: DeltaUsage


class MessageStopEvent(StreamEvent):
    type: Literal["message_stop"] = "message_stop"


class ErrorDetail(ResponseModel):
    type: str
    message: str


class ErrorBody(ResponseModel):
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}} (also a stream's `error` event)."""

    type: Literal["error"] = "error"
    error: ErrorDetail
