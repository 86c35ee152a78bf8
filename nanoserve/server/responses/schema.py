"""The bodies of OpenAI's Responses API (POST /v1/responses), as pydantic models: the request with its input
items, tools and text format, the response object with its output items (reasoning, message, function_call), and
the stream's events.

The request is served as a chat: `instructions` and the input items become chat messages (convert.py turns
them into a ChatCompletionRequest), so the chat template, the tool-call and reasoning parsers and
structured outputs are the chat endpoint's. What this API has and nanoserve cannot honour is refused by name:
built-in tools (web search, file search, ...), `background`, `truncation: "auto"`, prompt templates (`prompt`),
`conversation`, input parts other than text and images (input_image, for a model that sees).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator

from nanoserve.server.schema_base import Int, RequestBody, RequestModel, ResponseModel, now


# -- the input items ---------------------------------------------------------------------------------------------
class InputText(RequestModel):
    """A text part of an input message: input_text (user, system, developer), output_text (an earlier assistant
    turn) or text."""

    type: Literal["input_text", "output_text", "text"]
    text: str


def _text_as_part(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


TextParts = Annotated[list[InputText], BeforeValidator(_text_as_part)]
"""A string or a list of text parts (a string is one part)."""


class InputImage(RequestModel):
    """An image part of an input message (a model that sees): a data URL, or a URL the server may fetch."""

    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted; every image is read at the resolution the model's processor chooses."""


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"input_text": "text", "output_text": "text", "text": "text", "input_image": "image"}.get(kind) \
        if isinstance(kind, str) else None


MessagePart = Annotated[Annotated[InputText, Tag("text")] | Annotated[InputImage, Tag("image")],
                        Discriminator(_part_kind, custom_error_type="content_part_type", custom_error_message=(
                            "a part's type must be input_text, output_text, text or input_image"))]


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[list[MessagePart], BeforeValidator(_text_as_part)]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, InputText))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as a chat message's: its text, or with images, text and image_url parts in order."""
        if all(isinstance(p, InputText) for p in self.content):
            return self.text()
        return [{"type": "text", "text": p.text} if isinstance(p, InputText) else
                {"type": "image_url", "image_url": {"url": p.image_url}} for p in self.content]


class FunctionCallItem(RequestModel):
    """A call the model made in an earlier turn, as the client sends it back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(RequestModel):
    """The client's result of a call: becomes a `tool` message answering `call_id`."""

    type: Literal["function_call_output"]
    call_id: str
    output: TextParts
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningText(RequestModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItemParam(RequestModel):
    """The thinking of an earlier turn (its text, or the opaque `encrypted_content` this server gave out)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


INPUT_ITEMS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
               "reasoning": "Reasoning"}
"""Item type -> its tag in the InputItem union (capitalised: error paths leave such tags out)."""


def _item_kind(value: Any) -> str | None:
    """The input item's kind, by its `type` (a message may leave it out)."""
    if isinstance(value, dict):
        kind = value.get("type", "message" if "role" in value else None)
    else:
        kind = getattr(value, "type", None)
    return INPUT_ITEMS.get(kind) if isinstance(kind, str) else None  # a type that is no string is no known item


InputItem = Annotated[Annotated[InputMessage, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
                      | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
                      | Annotated[ReasoningItemParam, Tag("Reasoning")],
                      Discriminator(_item_kind, custom_error_type="input_item_type", custom_error_message=(
                          "the item's type must be one of message, function_call, function_call_output, reasoning "
                          "(built-in tool calls and item references are not supported by this server)"))]


# -- tools, text format, reasoning -----------------------------------------------------------------------------------
class FunctionTool(RequestModel):
    """A function tool, in this API's flat shape (the chat API nests the same fields under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _function_tool(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(f"type: {value.get('type')!r} tools are not available on this server: only function "
                         f"tools (type \"function\") are")
    return value


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """text.format: "text" (no constraint), "json_object" (any JSON object), "json_schema" (the answer follows
    `schema`, whatever `strict` says)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema(self) -> "TextFormat":
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("text.format.schema: this field is required for type json_schema")
        return self


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    """Passed to the chat template as the variable `verbosity` (templates that do not read it ignore it)."""


class ReasoningConfig(RequestModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    """Passed to the chat template as `reasoning_effort`, as vLLM does."""
    summary: Literal["auto", "concise", "detailed"] | None = None
    """Accepted as vLLM does: no summaries are written; the reasoning item carries the whole reasoning text."""
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url", "file_search_call.results", "message.input_image.image_url",
              "web_search_call.action.sources", "web_search_call.results")
"""What `include` may name. The first two change the answer; the others name outputs of tools or inputs this
server never has, so they add nothing (as in vLLM)."""


def _text_as_message(value: Any) -> Any:
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class ResponsesRequest(RequestBody):
    """POST /v1/responses."""

    model: str | None = None
    input: Annotated[list[InputItem], BeforeValidator(_text_as_message)]
    """The conversation's new items; a string is one user message."""
    instructions: str | None = None
    """A system message put before the input (an earlier turn's instructions do not carry over)."""
    previous_response_id: str | None = None
    """Continue a stored response: its conversation (without its instructions) comes before this input."""
    store: bool = True
    """Keep this response for GET /v1/responses/{id} and previous_response_id (the store holds the most recent
    --responses-store-size responses)."""
    stream: bool = False
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Annotated[FunctionTool, BeforeValidator(_function_tool)]] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: Int | None = None
    """At most this many function calls are returned."""
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    top_logprobs: Int | None = None
    """With include ["message.output_text.logprobs"]: this many alternatives per token (0-20)."""
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    """"auto" (drop the start of the conversation to fit) is refused: a prompt that does not fit is a 400."""
    background: Literal[False] | None = None
    """true is refused: responses are not run in the background."""
    prompt_cache_key: str | None = None
    """Accepted: the prefix cache reuses any earlier prompt's blocks without a key."""
    safety_identifier: str | None = None
    # vLLM extensions
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: dict[str, Any] | None = None
    """vLLM's structured outputs (one constraint, or options such as disable_any_whitespace that join
    text.format's constraint)."""
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    """Only requests with the same salt share prefix-cache blocks (as on chat completions)."""
    priority: Int = 0
    """With --scheduling-policy priority: lower is served sooner (as on chat completions)."""
    request_id: str | None = None
    """The response's id (default "resp_" and a random hex)."""

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("prompt") is not None:
                raise ValueError("prompt: prompt templates are not supported by this server")
            if data.get("conversation") is not None:
                raise ValueError("conversation: conversations are not stored by this server; use "
                                 "previous_response_id or send the whole input")
            if data.get("background"):
                raise ValueError("background: responses are not run in the background by this server")
            if data.get("truncation") == "auto":
                raise ValueError("truncation: prompts are never truncated; an input that does not fit is a 400")
        return data

    @model_validator(mode="after")
    def _combinations(self) -> "ResponsesRequest":
        if self.top_logprobs is not None and not self.wants_logprobs and self.top_logprobs != 0:
            raise ValueError("top_logprobs: requires include [\"message.output_text.logprobs\"]")
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            raise ValueError("max_tool_calls: must be at least 1")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    @property
    def wants_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or ())

    @property
    def max_calls(self) -> int | None:
        """How many function calls the answer may hold (None: any)."""
        cap = self.max_tool_calls
        return min(cap or 1, 1) if not self.parallel_tool_calls else cap


# -- the response ------------------------------------------------------------------------------------------------
class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(ResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(ResponseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class ReasoningContent(ResponseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(ResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningContent] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"]


class FunctionCallOutput(ResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | ReasoningItem | FunctionCallOutput


class InputTokensDetails(ResponseModel):
    cached_tokens: int = 0
    """Prompt tokens whose KV blocks came from the prefix cache."""
    cache_write_tokens: int = 0
    """Prompt tokens in full KV blocks this request added to the prefix cache (0 with prefix caching off)."""


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = 0


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class Response(ResponseModel):
    """The response object: what POST /v1/responses answers (streamed: what response.completed carries), and
    what GET /v1/responses/{id} returns for a stored one."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    store: bool = True
    service_tier: str = "default"
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# -- the stream's events -------------------------------------------------------------------------------------------
class StreamEvent(ResponseModel):
    """One Server-Sent Event of a streamed response (`event: <type>` + `data: <this>`); sequence_number counts
    the stream's events from 0."""

    type: str
    sequence_number: int = 0


class ResponseEvent(StreamEvent):
    """response.created / response.in_progress / response.completed."""

    response: Response


class ItemEvent(StreamEvent):
    """response.output_item.added / response.output_item.done."""

    output_index: int
    item: OutputItem


class InItemEvent(StreamEvent):
    """An event inside one output item."""

    item_id: str
    output_index: int


class PartEvent(InItemEvent):
    """response.content_part.added / response.content_part.done (an output_text or reasoning_text part)."""

    content_index: int = 0
    part: OutputText | ReasoningContent


class TextDeltaEvent(InItemEvent):
    """response.reasoning_text.delta."""

    content_index: int = 0
    delta: str


class OutputTextDeltaEvent(TextDeltaEvent):
    """response.output_text.delta, with the step's token logprobs when asked."""

    logprobs: list[TokenLogprob] = Field(default_factory=list)


class TextDoneEvent(InItemEvent):
    """response.reasoning_text.done."""

    content_index: int = 0
    text: str


class OutputTextDoneEvent(TextDoneEvent):
    """response.output_text.done (its logprobs are in the message item; the list here stays empty, as vLLM's)."""

    logprobs: list[TokenLogprob] = Field(default_factory=list)


class ArgumentsDeltaEvent(InItemEvent):
    """response.function_call_arguments.delta."""

    delta: str


class ArgumentsDoneEvent(InItemEvent):
    """response.function_call_arguments.done."""

    name: str
    arguments: str


class ErrorEvent(StreamEvent):
    """error: the response failed after the stream began."""

    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None
