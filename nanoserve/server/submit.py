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
from nanoserve.entrypoints.beam_search import BeamSearchStream
from nanoserve.sampling import BeamSearchParams, SamplingParams
from nanoserve.server.errors import APIError, engine_errors
from nanoserve.server.openai import schema as P
from nanoserve.server.prepare import Prepared, compile_structured_outputs
from nanoserve.server.state import ServerState

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def add_requests(server: ServerState, request_id: str, prepared: Prepared, req: P.SamplingRequest,
                       prompt_field: str) -> list[RequestStream]:
    """One engine request per prompt; all or none (a failure aborts the ones already added)."""
    await compile_structured_outputs(server, prepared)
    streams: list[RequestStream] = []
    try:
        with engine_errors(req, prompt_field):
            for i, (text, ids) in enumerate(prepared.prompts):
                prompt = {"prompt": text, "prompt_token_ids": ids}
                if prepared.mm_features:
                    prompt["mm_features"] = prepared.mm_features
                if req.cache_salt is not None:
                    prompt["cache_salt"] = req.cache_salt
                if req.use_beam_search:
                    streams.append(await start_beam_search(server, f"{request_id}-{i}", prompt, prepared.params,
                                                           req))
                else:
                    streams.append(await server.engine.add_request(f"{request_id}-{i}", prompt, prepared.params,
                                                                   req.priority, req.kv_transfer_params))
                server.metrics.observe_request(prepared.params, len(ids))
                if server.log_requests is not None:
                    log_request(f"{request_id}-{i}", text, ids, prepared.params, server.log_requests)
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def start_beam_search(server: ServerState, request_id: str, prompt: dict, params: SamplingParams,
                            req: P.SamplingRequest) -> BeamSearchStream:
    """use_beam_search, as vLLM's: `n` is the beam width; the request's temperature (or the model's default),
    max_tokens, ignore_eos, include_stop_str_in_output, skip_special_tokens and length_penalty hold; logprobs are
    each token's and the best of its step's 2 x n candidates. The fields beam search cannot honour were refused
    with the body (openai/schema/sampling.py); a format that tools or a thinking budget put on the output is refused
    here."""
    if params.structured_outputs is not None:
        raise APIError(400, "use_beam_search: not supported with a format on the output (a forced tool_choice, "
                            "thinking_token_budget)", param="use_beam_search")
    max_logprobs = server.engine.config.max_logprobs
    if 2 * params.n > max_logprobs:
        raise ValueError(f"n must be at most {max_logprobs // 2} with use_beam_search (the beam width: each step "
                         f"asks for 2 x n logprobs, and --max-logprobs is {max_logprobs}), got {params.n}")
    max_tokens = params.max_tokens if params.max_tokens is not None else \
        server.max_model_len - len(prompt["prompt_token_ids"])
    beam = BeamSearchParams(beam_width=params.n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
                            temperature=params.temperature, length_penalty=req.length_penalty,
                            include_stop_str_in_output=params.include_stop_str_in_output)
    tokenizer, skip = server.offload.tokenizer(), params.skip_special_tokens
    return await BeamSearchStream.start(server.engine, request_id, prompt, beam,
                                        lambda ids: tokenizer.decode(ids, skip_special_tokens=skip), req.priority,
                                        params.logprobs)


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
