"""Every error leaves in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with vLLM's values
(on Anthropic's Messages API, /v1/messages, in Anthropic's: {"type": "error", "error": {"type", "message"}}):
`code` is the HTTP status, `type` vLLM's name for it (BadRequestError, NotFoundError, ...; otherwise the status
phrase). Non-streaming errors are the response body; a streaming request that fails after its 200 went out gets
the same object as one SSE event, then [DONE]. Here: APIError, the mapping of pydantic's and the engine's
exceptions onto it, and the app's exception handlers (EXCEPTION_HANDLERS)."""

from __future__ import annotations

import contextlib
import logging
import re
from http import HTTPStatus
from typing import Iterator

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.entrypoints.async_engine import EngineDeadError, EngineShutdownError, QueueFullError
from nanoserve.sampling import SamplingParams
from nanoserve.server.anthropic import schema as A
from nanoserve.server.openai import schema as P
from nanoserve.server.schema_base import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               408: "RequestTimeoutError", 413: "RequestEntityTooLargeError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = "/v1/messages"
"""Errors on these routes (Anthropic's Messages API) take Anthropic's shape."""
SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__)
RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
MAX_ECHOED_INPUT_CHARS = 40  # error messages quote a bad value only when it is short


class APIError(Exception):
    """An error to answer in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    @property
    def type(self) -> str:
        if self.status in ERROR_TYPES:
            return ERROR_TYPES[self.status]
        try:
            return HTTPStatus(self.status).phrase
        except ValueError:  # 499 (the client closed the connection) has no standard phrase
            return "ClientClosedRequest" if self.status == 499 else "Error"

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.status))

    def response(self, anthropic: bool = False) -> JSONResponse:
        """The error as a JSON response: OpenAI's shape, or Anthropic's for its Messages API."""
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)

    async def answer(self, scope, receive, send) -> None:
        """Answer an ASGI request with this error, in the shape its path takes (for the middlewares, which run
        before any route and its exception handlers)."""
        await self.response(anthropic_path(scope["path"]))(scope, receive, send)

    def anthropic_body(self) -> A.ErrorBody:
        """Anthropic's shape: {"type": "error", "error": {"type", "message"}} with its error types."""
        return A.ErrorBody(error=A.ErrorDetail(type=ANTHROPIC_ERROR_TYPES.get(self.status, "api_error"),
                                               message=self.message))


# -- exceptions -> APIError --------------------------------------------------------------------------------
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
    elif err["type"] in RANGE_ERRORS:  # pydantic's error type, which vLLM's messages carry and its tests read
        msg += f" (got {err['input']!r}) [type={err['type']}]"
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
    first = message.split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    if first not in SAMPLING_FIELDS:
        if first in type(req).model_fields:  # a request field the engine checks (priority, cache_salt)
            return APIError(400, message, param=first)
        return APIError(400, message, param=prompt_field if first.startswith("prompt") else None)
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
        raise APIError(503, str(exc), headers={"Retry-After": str(exc.retry_after)}) from exc
    except EngineShutdownError as exc:
        raise APIError(503, str(exc), headers={"Retry-After": str(exc.retry_after)}) from exc
    except EngineDeadError as exc:
        raise APIError(500, str(exc)) from exc


@contextlib.contextmanager
def fields_renamed(names: tuple[tuple[str, str], ...], tool_fields: dict[str, str] | None = None) -> Iterator[None]:
    """Errors of the chat machinery, for an API served as a chat (Responses, Anthropic Messages): each names
    this API's field instead of the chat request's. `names`: (chat field, this API's field) pairs, the longer
    paths first. A chat tool's fields sit under `function` (tools[i].function.parameters); these APIs' tools hold
    them directly, some under names of their own (`tool_fields`: parameters -> input_schema)."""
    def tool_field(m: re.Match) -> str:
        return f"{m.group(1)}.{(tool_fields or {}).get(m.group(2), m.group(2))}"

    try:
        yield
    except APIError as exc:
        message, param = (re.sub(r"^(tools\[\d+\])\.function\.(\w+)", tool_field, text) if text else text
                          for text in (exc.message, exc.param))
        for chat_name, name in names:
            if message.startswith(chat_name):
                message = name + message[len(chat_name):]
            if param == chat_name:
                param = name
            elif param == chat_name.split(".")[0]:
                param = name.split(".")[0]
        raise APIError(exc.status, message, param=param, headers=exc.headers) from exc


# -- the app's exception handlers ----------------------------------------------------------------------------
def anthropic_path(path: str) -> bool:
    """Whether an error on this path is written in Anthropic's shape (the Messages API's routes)."""
    return path.startswith(ANTHROPIC_PATHS)


def _anthropic(request: Request) -> bool:
    return anthropic_path(request.url.path)


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response(_anthropic(request))


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # keeps the exception's headers: a 405's Allow names the methods the route takes
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response(_anthropic(request))


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return APIError(400, str(exc)).response(_anthropic(request))


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}").response(_anthropic(request))


EXCEPTION_HANDLERS = {APIError: on_api_error, StarletteHTTPException: on_http_error,
                      RequestValidationError: on_validation_error, Exception: on_unexpected}
