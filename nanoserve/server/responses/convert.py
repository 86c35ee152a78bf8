"""OpenAI's Responses API (POST /v1/responses) served as a chat. A Responses request becomes a
ChatCompletionRequest (its instructions, an earlier stored turn and its input items become chat messages), which
server/prepare.py's prepare_chat prepares as any chat; the generated text goes through the same reasoning and
tool-call parsers, whose pieces become output items (reasoning, message, function_call) and, streamed, this API's
events.

    chat_request      ResponsesRequest -> (ChatCompletionRequest, the turn's conversation)
    prepare_response  ... -> Prepared, with errors naming this API's fields (RESPONSES_FIELDS: input,
                      max_output_tokens, text.format)
    OutputBuilder     the answer's blocks (server/answer_blocks.py) -> output items and the stream events that build
                      them (one path for both answers: a streamed response ends with its events' items, ids and
                      all)
    response_object   the Response: items, status, usage (reasoning tokens counted on the token ids), echoes
    whole_response    the non-streamed answer

The streamed answer (response.created ... response.completed) is events.py; the store of finished responses
(GET /v1/responses/{id}, previous_response_id) is store.py.
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.server.answer_blocks import AnswerBlocks, Block
from nanoserve.server.errors import APIError, fields_renamed
from nanoserve.server.openai import schema as P
from nanoserve.server.openai.convert import cache_write_tokens, chat_logprobs
from nanoserve.server.prepare import Prepared, as_chat_request, prepare_chat
from nanoserve.server.responses import schema as R
from nanoserve.server.responses.store import ResponseStore, StoredResponse
from nanoserve.server.state import ServerState

# -- the request as a chat ---------------------------------------------------------------------------------------
ENCRYPTED_PREFIX = "nanoserve-reasoning:"
"""reasoning.encrypted_content as this server gives it out: the reasoning text, base64-encoded (not encrypted:
the server keeps no key), so that a client that stores nothing can send an earlier turn's thinking back."""


def encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob: str, param: str) -> str:
    try:
        if not blob.startswith(ENCRYPTED_PREFIX):
            raise ValueError
        return base64.b64decode(blob[len(ENCRYPTED_PREFIX):], validate=True).decode()
    except ValueError:
        raise APIError(400, f"{param}: not reasoning content this server gave out", param="input") from None


def conversation(req: R.ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    """The chat messages of this turn without its instructions: a stored earlier turn's (its answer's function
    calls included, as OpenAI keeps them), then the input items. An assistant turn's reasoning, text and function
    calls (separate items here) join into one assistant message, as the chat template takes them."""
    messages = list(store.get(req.previous_response_id, "previous_response_id").conversation) \
        if req.previous_response_id else []

    def assistant() -> dict[str, Any]:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant"})
        return messages[-1]

    for i, item in enumerate(req.input):
        if isinstance(item, R.InputMessage):
            turn = assistant() if item.role == "assistant" else None
            if turn is not None and not turn.get("content") and not turn.get("tool_calls"):
                turn["content"] = item.text()  # the text of the turn a reasoning item opened
            else:
                messages.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, R.FunctionCallItem):
            calls = assistant().setdefault("tool_calls", [])
            if all(c["id"] != item.call_id for c in calls):  # a stored turn's call sent back again is one call
                calls.append({"id": item.call_id, "type": "function",
                              "function": {"name": item.name, "arguments": item.arguments}})
        elif isinstance(item, R.FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": "".join(p.text for p in item.output)})
        else:  # reasoning: starts the assistant turn it belongs to
            parts = item.content or item.summary
            text = "".join(p.text for p in parts) if parts else (
                decode_reasoning(item.encrypted_content, f"input[{i}].encrypted_content")
                if item.encrypted_content else "")
            messages.append({"role": "assistant", "reasoning_content": text})
    return messages


def chat_request(req: R.ResponsesRequest, messages: list[dict[str, Any]]) -> P.ChatCompletionRequest:
    """The chat request this Responses request stands for."""
    body: dict[str, Any] = {
        "model": req.model, "messages": ([{"role": "system", "content": req.instructions}]
                                         if req.instructions is not None else []) + messages,
        "parallel_tool_calls": req.parallel_tool_calls, "max_completion_tokens": req.max_output_tokens,
        "stream": req.stream, "logprobs": req.wants_logprobs,
        "top_logprobs": req.top_logprobs if req.wants_logprobs else None,
        "ignore_eos": req.ignore_eos, "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop", "logit_bias",
                 "structured_outputs", "cache_salt", "priority"):
        body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if req.tools or req.tool_choice != "auto":
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    kwargs = dict(req.chat_template_kwargs or {})
    if req.text is not None and req.text.verbosity is not None:
        kwargs.setdefault("verbosity", req.text.verbosity)
    body["chat_template_kwargs"] = kwargs or None
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    last = req.input[-1] if req.input else None
    if isinstance(last, R.InputMessage) and last.role == "assistant" and last.status in ("in_progress",
                                                                                         "incomplete"):
        body["add_generation_prompt"], body["continue_final_message"] = False, True  # continue it (as vLLM)
    return as_chat_request(body)


RESPONSES_FIELDS = (("response_format.json_schema.schema", "text.format.schema"),
                    ("response_format", "text.format"), ("max_completion_tokens", "max_output_tokens"),
                    ("messages", "input"), ("tool_choice.function.name", "tool_choice.name"))
"""Chat field -> this API's field, in the errors of the chat preparation (errors.fields_renamed)."""


def prepare_response(server: ServerState, req: R.ResponsesRequest
                     ) -> tuple[Prepared, P.ChatCompletionRequest, list[dict[str, Any]]]:
    """The request prepared as a chat (model, sampling, tools, template, tokens, length checks), the chat request
    and the turn's conversation."""
    messages = conversation(req, server.responses)
    with fields_renamed(RESPONSES_FIELDS):
        chat = chat_request(req, messages)
        return prepare_chat(server, chat), chat, messages


# -- output items ------------------------------------------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def token_logprobs(server: ServerState, c: CompletionOutput, start: int, end: int, top: int
                    ) -> list[R.TokenLogprob]:
    lps = chat_logprobs(server, c, start, end, top)
    return [R.TokenLogprob(**lp.model_dump()) for lp in (lps.content if lps else None) or []]


class OutputBuilder:
    """One response's output items and their stream events, from the answer's blocks (answer_blocks.py): a
    reasoning block is a reasoning item, a text block a message, a call a function_call item. The items are the
    same whether or not anyone streams the events."""

    def __init__(self, prepared: Prepared, max_calls: int | None = None, encrypted_reasoning: bool = False):
        self.blocks = AnswerBlocks(prepared.chat, max_calls)
        self.encrypted_reasoning = encrypted_reasoning
        self.items: list[R.OutputItem] = []

    def feed(self, text: str, finished: bool, logprobs: list[R.TokenLogprob] | None = None,
             incomplete: bool = False) -> list[R.StreamEvent]:
        """The events of this piece of text (and, when `finished`, of closing the last item: "incomplete" when
        the output was cut off)."""
        events: list[R.StreamEvent] = []
        for change in self.blocks.feed(text, finished):
            block = change.block
            if change.op == "open":
                events += self._open(block)
            elif change.op == "delta":
                events.append(self._delta(block, change.delta, logprobs))
            else:
                events += self._close(block, "incomplete" if incomplete and finished else "completed")
        return events

    def _open(self, block: Block) -> list[R.StreamEvent]:
        if block.kind == "reasoning":
            item, part = R.ReasoningItem(id=_item_id("rs"), content=[], status="in_progress"), \
                R.ReasoningContent(text="")
        elif block.kind == "text":
            item, part = R.OutputMessage(id=_item_id("msg"), status="in_progress", content=[]), R.OutputText(text="")
        else:
            item, part = R.FunctionCallOutput(id=_item_id("fc"), call_id=block.call_id, name=block.name,
                                              arguments="", status="in_progress"), None
        self.items.append(item)
        events: list[R.StreamEvent] = [R.ItemEvent(type="response.output_item.added", output_index=block.index,
                                                   item=item.model_copy(deep=True))]
        if part is not None:
            item.content.append(part.model_copy())
            events.append(R.PartEvent(type="response.content_part.added", item_id=item.id, output_index=block.index,
                                      part=part))
        return events

    def _delta(self, block: Block, delta: str, logprobs: list[R.TokenLogprob] | None) -> R.StreamEvent:
        item_id = self.items[block.index].id
        if block.kind == "reasoning":
            return R.TextDeltaEvent(type="response.reasoning_text.delta", item_id=item_id,
                                    output_index=block.index, delta=delta)
        if block.kind == "text":
            return R.OutputTextDeltaEvent(type="response.output_text.delta", item_id=item_id,
                                          output_index=block.index, delta=delta, logprobs=logprobs or [])
        return R.ArgumentsDeltaEvent(type="response.function_call_arguments.delta", item_id=item_id,
                                     output_index=block.index, delta=delta)

    def _close(self, block: Block, status: str) -> list[R.StreamEvent]:
        """The item takes its block's final text (or arguments) and status; then its done events."""
        item, index = self.items[block.index], block.index
        item.status = status
        if block.kind == "call":
            item.arguments = block.text
        else:
            item.content[0].text = block.text
        if block.kind == "reasoning":
            if self.encrypted_reasoning:
                item.encrypted_content = encode_reasoning(block.text)
            events = [R.TextDoneEvent(type="response.reasoning_text.done", item_id=item.id, output_index=index,
                                      text=block.text),
                      R.PartEvent(type="response.content_part.done", item_id=item.id, output_index=index,
                                  part=R.ReasoningContent(text=block.text))]
        elif block.kind == "text":
            events = [R.OutputTextDoneEvent(type="response.output_text.done", item_id=item.id, output_index=index,
                                            text=block.text),
                      R.PartEvent(type="response.content_part.done", item_id=item.id, output_index=index,
                                  part=R.OutputText(text=block.text))]
        else:
            events = [R.ArgumentsDoneEvent(type="response.function_call_arguments.done", item_id=item.id,
                                           output_index=index, name=item.name, arguments=block.text)]
        return events + [R.ItemEvent(type="response.output_item.done", output_index=index,
                                     item=item.model_copy(deep=True))]


# -- the response ------------------------------------------------------------------------------------------------
def reasoning_tokens(server: ServerState, prepared: Prepared, c: CompletionOutput) -> int:
    """How many generated tokens are thinking (the markers not counted), found on the token ids."""
    if server.reasoning_end_id is None or prepared.chat.reasoning_state == "closed":
        return 0
    ids = list(c.token_ids)
    end = ids.index(server.reasoning_end_id) if server.reasoning_end_id in ids else len(ids)
    if prepared.chat.reasoning_state == "open":
        return end
    start = server.reasoning_start_id
    return end - ids.index(start) - 1 if start is not None and start in ids[:end] else 0


def response_object(server: ServerState, req: R.ResponsesRequest, prepared: Prepared, response_id: str,
                    created_at: int, builder: OutputBuilder | None = None, out: RequestOutput | None = None
                    ) -> R.Response:
    """The Response: in progress (no output yet) or finished (`builder`'s items, `out`'s usage)."""
    params = prepared.params
    status, usage, incomplete = "in_progress", None, None
    if out is not None:
        c = out.outputs[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        incomplete = R.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        prompt, generated = len(out.prompt_token_ids), len(c.token_ids)
        usage = R.ResponseUsage(
            input_tokens=prompt, input_tokens_details=R.InputTokensDetails(
                cached_tokens=out.num_cached_tokens, cache_write_tokens=cache_write_tokens(server, out)),
            output_tokens=generated,
            output_tokens_details=R.OutputTokensDetails(reasoning_tokens=reasoning_tokens(server, prepared, c)),
            total_tokens=prompt + generated)
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    text.setdefault("format", {"type": "text"})
    choice = req.tool_choice
    return R.Response(
        id=response_id, created_at=created_at, status=status, model=prepared.model,
        output=list(builder.items) if builder is not None and out is not None else [],
        usage=usage, incomplete_details=incomplete, instructions=req.instructions,
        previous_response_id=req.previous_response_id, max_output_tokens=params.max_tokens,
        max_tool_calls=req.max_tool_calls, temperature=params.temperature, top_p=params.top_p,
        top_logprobs=req.top_logprobs if req.wants_logprobs else None,
        tools=[t.model_dump(exclude_none=True) for t in req.tools],
        tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
        parallel_tool_calls=req.parallel_tool_calls, text=text,
        reasoning=req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
        store=req.store, service_tier=req.service_tier or "default", metadata=req.metadata, user=req.user,
        safety_identifier=req.safety_identifier)


def finished_response(server: ServerState, req: R.ResponsesRequest, prepared: Prepared, response_id: str,
                      created_at: int, builder: OutputBuilder, out: RequestOutput,
                      messages: list[dict[str, Any]]) -> R.Response:
    """The finished Response (the message's text carries every generated token's logprobs when asked, as
    vLLM's), stored when the request asked for it."""
    if req.wants_logprobs:
        c = out.outputs[0]
        for item in builder.items:
            if isinstance(item, R.OutputMessage):
                item.content[0].logprobs = token_logprobs(server, c, 0, len(c.token_ids), req.top_logprobs or 0)
    response = response_object(server, req, prepared, response_id, created_at, builder, out)
    if req.store:
        server.responses.put(StoredResponse(response, messages + [builder.blocks.answer_message()]))
    return response


def builder_for(req: R.ResponsesRequest, prepared: Prepared) -> OutputBuilder:
    return OutputBuilder(prepared, req.max_calls, req.wants_encrypted_reasoning)


def whole_response(server: ServerState, req: R.ResponsesRequest, prepared: Prepared, response_id: str,
                   created_at: int, out: RequestOutput, messages: list[dict[str, Any]]) -> R.Response:
    """A non-streamed answer: the whole text through the builder at once."""
    builder = builder_for(req, prepared)
    c = out.outputs[0]
    builder.feed(c.text, True, incomplete=c.finish_reason == "length")
    return finished_response(server, req, prepared, response_id, created_at, builder, out, messages)
