"""The Messages API's streamed answer, as Server-Sent Events (the pieces: server/streaming.py): message_start,
each content block's content_block_start / _delta / _stop as the answer's blocks (server/answer_blocks.py)
change, then message_delta and message_stop."""

from __future__ import annotations

from typing import AsyncIterator

from nanoserve.entrypoints.async_engine import EngineDeadError, EngineShutdownError, RequestStream
from nanoserve.server.answer_blocks import Change
from nanoserve.server.anthropic import schema as A
from nanoserve.server.anthropic.convert import blocks_for, signature, stop_reason, tool_use_id, usage
from nanoserve.server.prepare import Prepared
from nanoserve.server.state import ServerState
from nanoserve.server.streaming import StreamedChoice, sse, stop_holdback


def sse_event(event: A.StreamEvent | A.ErrorBody) -> str:
    return sse(event, event.type)


def _events(change: Change) -> list[A.StreamEvent]:
    block = change.block
    if change.op == "open":
        start = {"reasoning": A.ThinkingContent(thinking="", signature=""), "text": A.TextContent(text="")}.get(
            block.kind) or A.ToolUseContent(id=tool_use_id(block), name=block.name, input={})
        return [A.BlockStartEvent(index=block.index, content_block=start)]
    if change.op == "delta":
        delta = {"reasoning": {"type": "thinking_delta", "thinking": change.delta},
                 "text": {"type": "text_delta", "text": change.delta},
                 "call": {"type": "input_json_delta", "partial_json": change.delta}}[block.kind]
        return [A.BlockDeltaEvent(index=block.index, delta=delta)]
    events: list[A.StreamEvent] = []
    if block.kind == "reasoning":
        events.append(A.BlockDeltaEvent(index=block.index, delta={"type": "signature_delta",
                                                                  "signature": signature(block.text)}))
    return events + [A.BlockStopEvent(index=block.index)]


async def message_events(server: ServerState, req: A.MessagesRequest, prepared: Prepared, message_id: str,
                         stream: RequestStream) -> AsyncIterator[str]:
    """The streamed answer: message_start (on the first output, so that its usage has the prefix-cache counts),
    each block's content_block_start / _delta / _stop, then message_delta (stop_reason, output tokens) and
    message_stop. An engine failure ends the stream with an `error` event."""
    blocks = blocks_for(req, prepared)
    state, holdback, started = StreamedChoice(), stop_holdback(prepared.params), False
    try:
        async for out in stream:
            c = out.outputs[0]
            if not started:
                started = True
                yield sse_event(A.MessageStartEvent(message=A.MessageResponse(
                    id=message_id, model=prepared.model, content=[], usage=usage(server, out, 0))))
            if state.done:
                continue
            text, _, _ = state.next_piece(c, holdback)
            for change in blocks.feed(text, state.done):
                for event in _events(change):
                    yield sse_event(event)
            if state.done:
                reason, sequence = stop_reason(c, bool(blocks.calls))
                yield sse_event(A.MessageDeltaEvent(delta=A.MessageDelta(stop_reason=reason, stop_sequence=sequence),
                                                    usage=A.DeltaUsage(output_tokens=len(c.token_ids))))
                yield sse_event(A.MessageStopEvent())
    except (EngineDeadError, EngineShutdownError) as exc:
        kind = "api_error" if isinstance(exc, EngineDeadError) else "overloaded_error"
        yield sse_event(A.ErrorBody(error=A.ErrorDetail(type=kind, message=str(exc))))
