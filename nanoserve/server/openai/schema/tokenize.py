"""POST /tokenize and POST /detokenize (vLLM's extensions): the requests and their responses."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from nanoserve.server.openai.schema.chat import ChatMessage, ChatTool
from nanoserve.server.schema_base import ElidedText, RequestBody, ResponseModel


class TokenizeRequest(RequestBody):
    """POST /tokenize: a `prompt` (text, tokenized as /v1/completions does) or `messages` (rendered with the chat
    template first, as /v1/chat/completions does) - exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Add the tokenizer's special tokens (BOS): default true for a prompt, false for messages (the chat
    template writes its own), as in vLLM."""
    add_generation_prompt: bool = True
    """messages only: end with the assistant turn's opening, as a chat completion does."""
    continue_final_message: bool = False
    """messages only: continue the final (assistant) message; needs add_generation_prompt false."""
    tools: list[ChatTool] | None = None
    """messages only: the tools the chat template renders into the prompt."""
    chat_template: str | None = None
    """messages only: this request's chat template (jinja), instead of the server's."""
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    """Also return each token's string (the tokenizer's own spelling, e.g. 'Ġworld')."""

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of `prompt` and `messages`")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: must not be empty")
        return self

    def elide_long_prompts(self, max_chars: int) -> None:
        self.prompt = ElidedText.of(self.prompt, max_chars)


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    """POST /detokenize: token ids -> text."""

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


class DetokenizeResponse(ResponseModel):
    prompt: str
