"""The Responses API's streamed answer, as Server-Sent Events (the pieces: server/streaming.py): response.created
and response.in_progress, the output items' events as the text arrives (convert.py's OutputBuilder makes them and
the items alike), then response.completed with the whole response."""

from __future__ import annotations

from typing import Any, AsyncIterator

from nanoserve.entrypoints.async_engine import EngineDeadError, EngineShutdownError, RequestStream
from nanoserve.server.prepare import Prepared
from nanoserve.server.responses import schema as R
from nanoserve.server.responses.convert import builder_for, finished_response, response_object, token_logprobs
from nanoserve.server.state import ServerState
from nanoserve.server.streaming import StreamedChoice, sse, stop_holdback


async def response_events(server: ServerState, req: R.ResponsesRequest, prepared: Prepared, response_id: str,
                          created_at: int, stream: RequestStream, messages: list[dict[str, Any]]
                          ) -> AsyncIterator[str]:
    """The streamed body: response.created and response.in_progress, the items' events as the text arrives,
    then response.completed with the whole response (status "incomplete" when max_output_tokens cut it, as
    vLLM sends it). An engine failure ends the stream with an `error` event. No [DONE]: this API has none."""
    seq = 0

    def emit(event: R.StreamEvent) -> str:
        nonlocal seq
        event.sequence_number, seq = seq, seq + 1
        return sse(event, event.type)

    builder = builder_for(req, prepared)
    start = response_object(server, req, prepared, response_id, created_at)
    yield emit(R.ResponseEvent(type="response.created", response=start))
    yield emit(R.ResponseEvent(type="response.in_progress", response=start))
    state, holdback, final = StreamedChoice(), stop_holdback(prepared.params), None
    try:
        async for out in stream:
            c = out.outputs[0]
            if state.done:
                continue
            text, t0, t1 = state.next_piece(c, holdback)
            logprobs = token_logprobs(server, c, t0, t1, req.top_logprobs or 0) if req.wants_logprobs else None
            for event in builder.feed(text, state.done, logprobs, incomplete=c.finish_reason == "length"):
                yield emit(event)
            final = out if out.finished else final
    except (EngineDeadError, EngineShutdownError) as exc:
        yield emit(R.ErrorEvent(code="engine_dead" if isinstance(exc, EngineDeadError) else "server_shutting_down",
                                message=str(exc)))
        return
    if final is not None:
        done = finished_response(server, req, prepared, response_id, created_at, builder, final, messages)
        yield emit(R.ResponseEvent(type="response.completed", response=done))
