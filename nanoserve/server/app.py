"""The HTTP routes: an OpenAI-compatible API over an AsyncLLMEngine.

Follow one POST /v1/chat/completions from the socket to the engine and back:

    uvicorn            reads the HTTP request off the socket and calls the FastAPI app (ASGI)
    check_api_key      401 unless the Bearer token matches --api-key (when one is set)
    parse_body         bytes -> JSON -> ChatCompletionRequest (protocol.py); a bad body is a 400 naming the field
    prepare_chat       the model name (404 if unknown), SamplingParams (400 if out of range), the chat template
                       renders the messages, the tokenizer turns the text into ids, the length checks (400)
    add_requests       AsyncLLMEngine.add_request: queued on the engine (503 if the queue is full) -> streams
    respond            non-streaming: wait for the finished output and answer one JSON body;
                       streaming: a Server-Sent Events body, one chunk per engine step with the new text

If the client hangs up, the response is cancelled, which closes the request's stream, which aborts it in the
engine and frees its KV blocks. Every error leaves as OpenAI's {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Iterator, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineShutdownError, QueueFullError,
                                           RequestStream)
from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.engine.tokenizer import apply_chat_template
from nanoserve.sampling import SamplingParams
from nanoserve.server import protocol as P
from nanoserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               500: "internal_server_error", 503: "service_unavailable"}
SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)
MAX_ECHOED_INPUT_CHARS = 40  # error messages quote a bad value only when it is short
SSE_DONE = "data: [DONE]\n\n"


# -- errors -----------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error to answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> P.ErrorResponse:
        info = P.ErrorInfo(message=self.message, type=ERROR_TYPES.get(self.status, "error"), param=self.param,
                           code=self.code if self.code is not None else self.status)
        return P.ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def describe_validation_error(exc: ValidationError) -> APIError:
    """pydantic's first error as one sentence that names the field, e.g. "messages[0].role: Input should be
    'system', 'developer', 'user', 'assistant' or 'tool' (got 'robot')"."""
    err = exc.errors()[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"malformed JSON in the request body: {err['msg'].removeprefix('Invalid JSON: ')}")
    if err["type"] == "model_type" and not err["loc"]:
        return APIError(400, "the request body must be a JSON object")
    # drop pydantic's union-member tags ("str", "list[int]", "TextPart") from the location
    loc = [x for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x[:1].isupper() or x in
                                                                  ("str", "int", "float", "bool")))]
    path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")
    msg = err["msg"].removeprefix("Value error, ")
    if not path and ": " in msg:  # a model-level check: "field: problem"
        path, msg = msg.split(": ", 1)
    if err["type"] == "missing":
        msg = "this field is required"
    elif "input" in err and not err["type"].startswith("value_error") and \
            len(repr(err["input"])) <= MAX_ECHOED_INPUT_CHARS:
        msg += f" (got {err['input']!r})"
    param = str(loc[0]) if loc else (path or None)
    return APIError(400, f"{path}: {msg}" if path else msg, param=param)


def invalid_value(exc: ValueError, req: P.SamplingRequest, prompt_field: str) -> APIError:
    """A 400 for a SamplingParams / engine ValueError. Its message starts with the parameter's name; when the
    request calls it differently (chat's top_logprobs is SamplingParams.logprobs), the message says the
    request's name."""
    message = str(exc)
    first = message.split(" ", 1)[0].split("=", 1)[0]
    if first.startswith("prompt"):
        return APIError(400, message, param=prompt_field)
    if first not in SAMPLING_FIELDS:
        return APIError(400, message)
    param = req.request_field(first)
    return APIError(400, param + message[len(first):], param=param)


@contextlib.contextmanager
def engine_errors(req: P.SamplingRequest, prompt_field: str) -> Iterator[None]:
    """Map what the engine (or SamplingParams) raises for a request to its HTTP status."""
    try:
        yield
    except ValueError as exc:
        raise invalid_value(exc, req, prompt_field) from exc
    except QueueFullError as exc:
        raise APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}) from exc
    except EngineShutdownError as exc:
        raise APIError(503, str(exc), code="shutting_down", headers={"Retry-After": str(exc.retry_after)}) from exc
    except EngineDeadError as exc:
        raise APIError(500, str(exc), code="engine_dead") from exc


# -- the server's state -------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A request ready for the engine: one (text, token ids) per prompt, and the sampling parameters."""

    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams


class OpenAIServer:
    """What the routes share: the engine, a tokenizer of the server's own, the model name and the metrics."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str):
        self.engine = engine
        self.model_name = served_model_name
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(served_model_name)
        engine.finish_listeners.append(self.metrics.observe_finished)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- request -> prompts + SamplingParams -----------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        # add_special_tokens=False, as LLMEngine.tokenize_prompt: the prompt is exactly what the client sent
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        return None, prompt

    def check_length(self, ids: list[int], params: SamplingParams, req: P.SamplingRequest,
                     prompt_field: str) -> None:
        n, limit = len(ids), self.max_model_len
        what = "prompt" if prompt_field == "prompt" else f"{prompt_field} (rendered with the chat template)"
        if n == 0:
            raise APIError(400, f"{what} is empty: it must contain at least one token", param=prompt_field)
        if n >= limit:
            raise APIError(400, f"{what} is too long: {n} tokens, but max_model_len is {limit} (the prompt and "
                                f"at least one generated token must fit)", param=prompt_field)
        if params.max_tokens is not None and n + params.max_tokens > limit:
            field = req.request_field("max_tokens")
            raise APIError(400, f"{field}={params.max_tokens} does not fit: the prompt has {n} tokens and "
                                f"max_model_len is {limit}, so at most {limit - n} tokens can be generated",
                           param=field)

    def prepare_completion(self, req: P.CompletionRequest) -> Prepared:
        self.check_model(req.model)
        with engine_errors(req, "prompt"):
            params = req.sampling_params(req.max_tokens, req.logprobs)
            params.validate(self.engine.config.max_logprobs)
        prompts = [self.tokenize(p) for p in req.prompts()]
        for _, ids in prompts:
            self.check_length(ids, params, req, "prompt")
        return Prepared(prompts, params)

    def prepare_chat(self, req: P.ChatCompletionRequest) -> Prepared:
        self.check_model(req.model)
        with engine_errors(req, "messages"):
            params = req.sampling_params(req.max_new_tokens, req.num_logprobs)
            params.validate(self.engine.config.max_logprobs)
        messages = [m.to_template_dict() for m in req.messages]
        try:
            text = apply_chat_template(self.tokenizer, messages, req.add_generation_prompt, req.chat_template_kwargs)
        except Exception as exc:  # jinja2 errors, bad chat_template_kwargs: the request's fault
            raise APIError(400, f"messages: could not render the chat template: {exc}", param="messages") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_length(ids, params, req, "messages")
        return Prepared([(text, ids)], params)

    # -- the engine ---------------------------------------------------------------------------------------
    async def add_requests(self, request_id: str, prepared: Prepared, req: P.SamplingRequest,
                           prompt_field: str) -> list[RequestStream]:
        """One engine request per prompt; all or none (a failure aborts the ones already added)."""
        streams: list[RequestStream] = []
        try:
            with engine_errors(req, prompt_field):
                for i, (text, ids) in enumerate(prepared.prompts):
                    prompt = {"prompt": text, "prompt_token_ids": ids}
                    streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, prepared.params))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    # -- logprobs in the two OpenAI formats ------------------------------------------------------------------
    def completion_logprobs(self, c: CompletionOutput, start: int, end: int, text_offset: int
                            ) -> P.CompletionLogProbs | None:
        if c.logprobs is None:
            return None
        out = P.CompletionLogProbs()
        for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
            token = self.token_text(tid)
            out.tokens.append(token)
            out.token_logprobs.append(lps[tid])
            out.top_logprobs.append({self.token_text(t): lp for t, lp in lps.items()})
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out

    def chat_logprobs(self, c: CompletionOutput, start: int, end: int, num: int) -> P.ChatLogProbs | None:
        if c.logprobs is None:
            return None
        content = []
        for tid, lps in zip(c.token_ids[start:end], c.logprobs[start:end]):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:num]
            content.append(P.ChatLogProb(**self._chat_token(tid, lps[tid]),
                                         top_logprobs=[P.ChatTopLogProb(**self._chat_token(t, lp)) for t, lp in top]))
        return P.ChatLogProbs(content=content)

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> P.UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))


# -- streaming helpers ------------------------------------------------------------------------------------
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


def sse(payload: BaseModel) -> str:
    """One Server-Sent Event."""
    return f"data: {payload.model_dump_json()}\n\n"


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


T = TypeVar("T")


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


# -- response builders --------------------------------------------------------------------------------------
def completion_response(server: OpenAIServer, request_id: str, req: P.CompletionRequest,
                        outputs: list[RequestOutput]) -> P.CompletionResponse:
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            choices.append(P.CompletionChoice(
                index=i * req.n + c.index, text=c.text,
                logprobs=server.completion_logprobs(c, 0, len(c.token_ids), 0),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return P.CompletionResponse(id=request_id, model=server.model_name, choices=choices,
                                usage=server.usage(outputs))


def chat_response(server: OpenAIServer, request_id: str, req: P.ChatCompletionRequest,
                  out: RequestOutput) -> P.ChatCompletionResponse:
    choices = [P.ChatChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                            logprobs=server.chat_logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0),
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
               for c in out.outputs]
    return P.ChatCompletionResponse(id=request_id, model=server.model_name, choices=choices,
                                    usage=server.usage([out]))


async def completion_events(server: OpenAIServer, request_id: str, req: P.CompletionRequest,
                            streams: list[RequestStream], params: SamplingParams) -> AsyncIterator[str]:
    """The SSE body of a streaming completion: a chunk per engine step with each choice's new text."""
    sent = [[StreamedChoice() for _ in range(req.n)] for _ in streams]
    finals: dict[int, RequestOutput] = {}
    holdback = stop_holdback(params)
    try:
        async for i, out in merge_streams(streams):
            choices = []
            for c in out.outputs:
                state = sent[i][c.index]
                if state.done:
                    continue
                offset = state.text_sent
                text, t0, t1 = state.next_piece(c, holdback)
                if text or t1 > t0 or state.done:
                    choices.append(P.CompletionChoice(
                        index=i * req.n + c.index, text=text, logprobs=server.completion_logprobs(c, t0, t1, offset),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            if out.finished:
                finals[i] = out
            if choices:
                yield sse(P.CompletionChunk(id=request_id, model=server.model_name, choices=choices))
        if req.include_usage:
            usage = server.usage([finals[i] for i in sorted(finals)])
            yield sse(P.CompletionChunk(id=request_id, model=server.model_name, choices=[], usage=usage))
    except (EngineDeadError, EngineShutdownError) as exc:
        yield sse_error(exc)
    yield SSE_DONE


async def chat_events(server: OpenAIServer, request_id: str, req: P.ChatCompletionRequest,
                      stream: RequestStream, params: SamplingParams) -> AsyncIterator[str]:
    """The SSE body of a streaming chat completion: the role first, then content pieces as they come."""
    def chunk(choices: list[P.ChatStreamChoice], usage: P.UsageInfo | None = None) -> str:
        return sse(P.ChatCompletionChunk(id=request_id, model=server.model_name, choices=choices, usage=usage))

    sent = [StreamedChoice() for _ in range(req.n)]
    holdback, final = stop_holdback(params), None
    try:
        yield chunk([P.ChatStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=""))
                     for i in range(req.n)])
        async for out in stream:
            choices = []
            for c in out.outputs:
                state = sent[c.index]
                if state.done:
                    continue
                text, t0, t1 = state.next_piece(c, holdback)
                if text or t1 > t0 or state.done:
                    choices.append(P.ChatStreamChoice(
                        index=c.index, delta=P.DeltaMessage(content=text),
                        logprobs=server.chat_logprobs(c, t0, t1, req.top_logprobs or 0),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            final = out if out.finished else final
            if choices:
                yield chunk(choices)
        if req.include_usage and final is not None:
            yield chunk([], server.usage([final]))
    except (EngineDeadError, EngineShutdownError) as exc:
        yield sse_error(exc)
    yield SSE_DONE


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


# -- the app ------------------------------------------------------------------------------------------------
async def parse_body(request: Request, model: type[P.RequestModel]) -> Any:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise describe_validation_error(exc) from exc


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              shutdown_timeout: float = 10.0) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine loop and, on shutdown, drains and releases the engine."""
    server = OpenAIServer(engine, served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        logger.info("serving `%s`", served_model_name)
        try:
            yield
        finally:
            logger.info("shutting down: draining in-flight requests (up to %.0f s)", shutdown_timeout)
            await engine.shutdown(drain_timeout=shutdown_timeout)

    app = FastAPI(title="nanoserve", summary="An OpenAI-compatible server for MiniMax M3", lifespan=lifespan)
    app.state.server = server

    # every error leaves in OpenAI's shape
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, str(exc)).response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models")
    async def list_models() -> dict[str, Any]:
        card = P.ModelCard(id=served_model_name, root=engine.config.model, max_model_len=server.max_model_len)
        return P.ModelList(data=[card]).model_dump()

    @v1.post("/completions")
    async def create_completion(request: Request) -> Response:
        req: P.CompletionRequest = await parse_body(request, P.CompletionRequest)
        prepared = server.prepare_completion(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await server.add_requests(request_id, prepared, req, "prompt")
        if req.stream:
            return EventStreamResponse(completion_events(server, request_id, req, streams, prepared.params), streams)
        try:
            with engine_errors(req, "prompt"):
                outputs = await unless_disconnected(request, collect(streams))
        finally:
            await close_all(streams)
        return JSONResponse(completion_response(server, request_id, req, outputs).model_dump())

    @v1.post("/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        req: P.ChatCompletionRequest = await parse_body(request, P.ChatCompletionRequest)
        prepared = server.prepare_chat(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        [stream] = await server.add_requests(request_id, prepared, req, "messages")
        if req.stream:
            return EventStreamResponse(chat_events(server, request_id, req, stream, prepared.params), [stream])
        try:
            with engine_errors(req, "messages"):
                [output] = await unless_disconnected(request, collect([stream]))
        finally:
            await stream.aclose()
        return JSONResponse(chat_response(server, request_id, req, output).model_dump())

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_error is not None:
            return APIError(503, f"the engine has stopped after an error: {engine.dead_error}",
                            code="engine_dead").response()
        if not engine.is_running:
            return APIError(503, "the engine loop is not running", code="engine_not_running").response()
        try:
            # reads worker state only (no collective): a tensor-parallel worker that died while the server was
            # idle shows here before any request trips over it
            engine.engine.executor.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return APIError(503, f"the engine is unhealthy: {exc}", code="engine_dead").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = server.metrics.render(engine.snapshot)
        return Response(body, media_type=content_type)

    return app
