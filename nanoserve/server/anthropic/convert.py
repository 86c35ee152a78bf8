"""Anthropic's Messages API (POST /v1/messages) served as a chat, as vLLM serves it: the request's system
prompt and content blocks become chat messages, server/prepare.py's prepare_chat prepares them as any chat, and
the answer's blocks (server/answer_blocks.py: thinking, text, calls) become content blocks and, streamed, this
API's events.

    chat_request     MessagesRequest / CountTokensRequest -> ChatCompletionRequest
    prepare_message  ... -> Prepared, with errors naming this API's fields (ANTHROPIC_FIELDS)
    count_tokens     POST /v1/messages/count_tokens: the prompt's size
    message_response the whole answer (the streamed one: events.py)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from typing import Any

from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.server.answer_blocks import AnswerBlocks, Block
from nanoserve.server.anthropic import schema as A
from nanoserve.server.errors import APIError, fields_renamed
from nanoserve.server.openai import schema as P
from nanoserve.server.openai.convert import cache_write_tokens
from nanoserve.server.prepare import (
    Prepared,
    as_chat_request,
    chat_prompt_ids,
    chat_setup,
    prepare_chat,
    render_messages,
)
from nanoserve.server.state import ServerState

ANTHROPIC_FIELDS = (("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"),
                    ("response_format.json_schema.schema", "output_config.format.schema"),
                    ("response_format", "output_config.format"), ("tool_choice.function.name", "tool_choice.name"),
                    ("thinking_token_budget", "thinking.budget_tokens"))
"""Chat field -> this API's field, in the errors of the chat preparation (errors.fields_renamed)."""
TOOL_FIELDS = {"parameters": "input_schema"}
"""A chat tool's field -> this API's name for it."""


def anthropic_fields() -> contextlib.AbstractContextManager[None]:
    """Errors raised inside name this API's fields (ANTHROPIC_FIELDS, TOOL_FIELDS) instead of the chat's."""
    return fields_renamed(ANTHROPIC_FIELDS, TOOL_FIELDS)

THINKING_MODES = {"enabled": "enabled", "disabled": "disabled", "adaptive": "adaptive"}
"""thinking.type -> M3's chat-template variable thinking_mode."""


# -- the request as a chat -------------------------------------------------------------------------------------------
def chat_messages(req: A.ChatFields) -> list[dict[str, Any]]:
    """The system prompt, then each message: a user turn's tool_result blocks become `tool` messages (before its
    text, as vLLM orders them), an assistant turn's thinking, text and tool_use blocks one assistant message."""
    system = req.system_text()
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(req.messages):
        texts: list[dict[str, str]] = []
        if m.role == "user":
            for j, b in enumerate(m.content):
                if isinstance(b, A.ToolResultBlock):
                    messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
                elif isinstance(b, A.TextBlock):
                    texts.append({"type": "text", "text": b.text})
                elif isinstance(b, A.ImageBlock):
                    texts.append({"type": "image_url", "image_url": {"url": b.source.as_url()}})
                elif not isinstance(b, A.RedactedThinkingBlock):
                    raise APIError(400, f"messages[{i}].content[{j}]: a {b.type} block belongs to an assistant "
                                        f"message", param="messages")
            if texts:
                messages.append({"role": "user", "content": texts})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": None}
        for j, b in enumerate(m.content):
            if isinstance(b, A.TextBlock):
                texts.append({"type": "text", "text": b.text})
            elif isinstance(b, A.ThinkingBlock):
                message["reasoning_content"] = message.get("reasoning_content", "") + b.thinking
            elif isinstance(b, A.ToolUseBlock):
                message.setdefault("tool_calls", []).append({"id": b.id, "type": "function", "function": {
                    "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            elif isinstance(b, (A.ToolResultBlock, A.ImageBlock)):
                raise APIError(400, f"messages[{i}].content[{j}]: a {b.type} block belongs to a user message",
                               param="messages")
        message["content"] = texts or None
        messages.append(message)
    return messages


def chat_request(req: A.ChatFields) -> P.ChatCompletionRequest:
    """The chat request this Anthropic request stands for."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema, "strict": t.strict}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        kwargs.setdefault("thinking_mode", THINKING_MODES[req.thinking.type])
        body["thinking_token_budget"] = req.thinking.budget_tokens
    body["chat_template_kwargs"] = kwargs or None
    if isinstance(req, A.MessagesRequest):
        body.update(max_completion_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, cache_salt=req.cache_salt,
                    user=req.metadata.user_id if req.metadata is not None else None)
        config = req.output_config
        if config is not None and config.effort is not None:
            body["reasoning_effort"] = config.effort
        if config is not None and config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": config.format.schema_}}
    return as_chat_request(body)


def prepare_message(server: ServerState, req: A.MessagesRequest) -> tuple[Prepared, P.ChatCompletionRequest]:
    with anthropic_fields():
        chat = chat_request(req)
        return prepare_chat(server, chat), chat


def count_tokens(server: ServerState, req: A.CountTokensRequest) -> A.CountTokensResponse:
    """The prompt's size: the chat template's rendering of the request (its tools checked as /v1/messages checks
    them), tokenized."""
    with anthropic_fields():
        chat = chat_request(req)
        chat_setup(server, chat)
        media: list = []
        _, text = render_messages(server, chat, media)
        ids, _ = chat_prompt_ids(server, text, media, False)
    return A.CountTokensResponse(input_tokens=len(ids))


# -- the answer ------------------------------------------------------------------------------------------------------
def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode()).hexdigest()


def tool_use_id(block: Block) -> str:
    return "toolu_" + block.call_id.removeprefix("call_")


def content_block(block: Block) -> A.AnswerBlock:
    """A finished block as this API's content block."""
    if block.kind == "reasoning":
        return A.ThinkingContent(thinking=block.text, signature=signature(block.text))
    if block.kind == "text":
        return A.TextContent(text=block.text)
    try:
        arguments = json.loads(block.text) if block.text else {}
    except json.JSONDecodeError:  # cut off by max_tokens (stop_reason says so): what was not finished is empty
        arguments = {}
    return A.ToolUseContent(id=tool_use_id(block), name=block.name, input=arguments)


def stop_reason(c: CompletionOutput, called_tools: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage(server: ServerState, out: RequestOutput, output_tokens: int) -> A.Usage:
    cached = out.num_cached_tokens
    return A.Usage(input_tokens=len(out.prompt_token_ids) - cached, output_tokens=output_tokens,
                   cache_creation_input_tokens=cache_write_tokens(server, out), cache_read_input_tokens=cached)


def blocks_for(req: A.MessagesRequest, prepared: Prepared) -> AnswerBlocks:
    one = req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use
    return AnswerBlocks(prepared.chat, max_calls=1 if one else None)


def message_response(server: ServerState, req: A.MessagesRequest, prepared: Prepared, message_id: str,
                     out: RequestOutput) -> A.MessageResponse:
    """A non-streamed answer: the whole text through the blocks at once."""
    c = out.outputs[0]
    blocks = blocks_for(req, prepared)
    blocks.feed(c.text, True)
    reason, sequence = stop_reason(c, bool(blocks.calls))
    content = [content_block(b) for b in blocks.blocks] or [A.TextContent(text="")]  # as vLLM: never no block
    return A.MessageResponse(id=message_id, model=prepared.model, content=content, stop_reason=reason,
                             stop_sequence=sequence, usage=usage(server, out, len(c.token_ids)))


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
