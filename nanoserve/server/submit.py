"""Prepared requests -> the engine, and waiting for them: add_requests (one engine request per prompt, all or
none), collect (the finished outputs, cancelled if the client hangs up), close_all (abort what is unfinished).
A stream that is closed before its request finishes aborts the request and frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, TypeVar

from fastapi import Request

from nanoserve.engine.outputs import RequestOutput
from nanoserve.entrypoints.async_engine import RequestStream
from nanoserve.sampling import SamplingParams
from nanoserve.server.errors import APIError, engine_errors
from nanoserve.server.openai import schema as P
from nanoserve.server.prepare import Prepared, compile_structured_outputs
from nanoserve.server.state import OpenAIServer

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def add_requests(server: OpenAIServer, request_id: str, prepared: Prepared, req: P.SamplingRequest,
                       prompt_field: str) -> list[RequestStream]:
    """One engine request per prompt; all or none (a failure aborts the ones already added)."""
    await compile_structured_outputs(server, prepared)
    streams: list[RequestStream] = []
    try:
        with engine_errors(req, prompt_field):
            for i, (text, ids) in enumerate(prepared.prompts):
                prompt = {"prompt": text, "prompt_token_ids": ids}
                if req.cache_salt is not None:
                    prompt["cache_salt"] = req.cache_salt
                streams.append(await server.engine.add_request(f"{request_id}-{i}", prompt, prepared.params,
                                                               req.priority))
                server.metrics.observe_request(prepared.params, len(ids))
                if server.log_requests is not None:
                    log_request(f"{request_id}-{i}", text, ids, prepared.params, server.log_requests)
    except BaseException:
        await close_all(streams)
        raise
    return streams


def log_request(request_id: str, text: str | None, ids: list[int], params: SamplingParams, max_chars: int) -> None:
    """--enable-log-requests: one line per queued request (vLLM's "Received request ..."): its id, prompt size
    and sampling parameters, and the first `max_chars` characters of its prompt (--max-log-len)."""
    shown = f", prompt: {(text or '')[:max_chars]!r}" if max_chars else ""
    logger.info("Received request %s: prompt_tokens=%d%s, params: %s", request_id, len(ids), shown, params)


async def wait_for_outputs(request: Request, streams: list[RequestStream], req: P.SamplingRequest,
                           prompt_field: str) -> list[RequestOutput]:
    """The finished output of every stream (a non-streaming response). The streams are closed however this ends:
    an engine error, the client hanging up (499), or done."""
    try:
        with engine_errors(req, prompt_field):
            return await unless_disconnected(request, collect(streams))
    finally:
        await close_all(streams)


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream."""
    finals = []
    for stream in streams:
        last = None
        async for out in stream:
            last = out
        finals.append(last)
    return finals


async def close_all(streams: list[RequestStream]) -> None:
    for s in streams:
        await s.aclose()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but cancel it if the client hangs up first (so its requests are aborted, not finished for
    nobody). After the body is read, the only thing ASGI `receive()` can still deliver is the disconnect."""
    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()
