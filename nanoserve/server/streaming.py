"""Server-Sent Events, as every streaming route sends them (the OpenAI APIs, the Responses API, Anthropic's
Messages API): the pieces each API's event generator is built from, and the response that carries the events.

    StreamedChoice        how much of one choice the client has been sent (holding back a possible stop string)
    stop_holdback         how many characters to hold back: the longest stop string less one
    sse / sse_error       one event; an error after the 200 headers went out
    merge_streams         (prompt index, output) from several engine streams as they come
    EventStreamResponse   the response that sends the events and closes the engine streams however it ends

Each API's events are its own: openai/events.py, responses/events.py, anthropic/events.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.entrypoints.async_engine import EngineDeadError, RequestStream
from nanoserve.sampling import SamplingParams
from nanoserve.server.errors import APIError
from nanoserve.server.submit import close_all

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class StreamedChoice:
    """How much of one choice (one completion) the client has been sent."""

    text_sent: int = 0
    tokens_sent: int = 0
    done: bool = False

    def next_piece(self, c: CompletionOutput, holdback: int) -> tuple[str, int, int]:
        """The text not yet sent and the range of new tokens. Until the completion finishes, the last `holdback`
        characters stay back: they may be the start of a stop string the engine will cut off."""
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(self.text_sent, len(c.text) - holdback)
        text, start_tok = c.text[self.text_sent:end], self.tokens_sent
        self.text_sent, self.tokens_sent, self.done = end, len(c.token_ids), finished
        return text, start_tok, len(c.token_ids)


def stop_holdback(params: SamplingParams) -> int:
    return max((len(s) for s in params.stop_list), default=1) - 1


def sse(payload: BaseModel, event: str | None = None) -> str:
    """One Server-Sent Event; `event` names it (the Responses and Anthropic APIs name every event by its type,
    the completions APIs none)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload.model_dump_json()}\n\n"


def sse_error(exc: Exception) -> str:
    """A failure after the 200 headers went out can only be reported in the stream itself."""
    return sse(APIError(500 if isinstance(exc, EngineDeadError) else 503, str(exc)).body())


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as exc:
            queue.put_nowait((i, None, exc))
        queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


class EventStreamResponse(StreamingResponse):
    """Server-Sent Events over the engine's streams. However the response ends - finished, the client gone
    (Starlette cancels it), the server shutting down - its streams are closed, so unfinished requests are
    aborted and their KV blocks freed, even if the body never started."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_all(self.streams)
