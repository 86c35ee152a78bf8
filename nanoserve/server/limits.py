"""What one request may cost the server before the engine sees it: how long its headers and its body may take to
arrive, the size of its body, how many prompts it carries and how many characters a prompt may have before it is
tokenized.

    ServerLimits       the limits (flags --request-header-timeout, --max-request-body-bytes, --request-body-timeout,
                       --max-prompts-per-request, --max-prompt-chars; docs/operating.md)
    BodyLimitMiddleware  an ASGI middleware: 413 for a body over the limit (from Content-Length at once, or while
                       a chunked body arrives), 408 and a closed connection for a body that stalls
    check_prompt_count / check_prompt_chars   400s naming the field, called by prepare.py before any tokenizing

The token-count check against max_model_len (400) stays in prepare.py, after tokenizing; the deadline on the
request headers (--request-header-timeout) lives in the connection itself (http_connection.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sized
from dataclasses import dataclass

from nanoserve.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 64 << 20
DEFAULT_REQUEST_HEADER_TIMEOUT_S = 30.0
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
CHARS_PER_TOKEN_BOUND = 16
"""The default --max-prompt-chars is max_model_len x this: natural text averages 3-5 characters a token, so a
prompt this long cannot fit the context, and refusing it costs nothing while tokenizing it costs seconds."""


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits; 0 turns a limit off."""

    request_header_timeout: float = DEFAULT_REQUEST_HEADER_TIMEOUT_S
    """Seconds from a connection's start (or a kept-alive connection's first byte of its next request) to the end
    of the request's headers."""
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_body_timeout: float = DEFAULT_REQUEST_BODY_TIMEOUT_S
    """Seconds between two pieces of a request body (and for the first piece after the headers)."""
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_prompt_chars: int | None = None
    """None: max_model_len x CHARS_PER_TOKEN_BOUND (see `prompt_chars_limit`)."""

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_prompts_per_request"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        for name in ("request_header_timeout", "request_body_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 0:
            raise ValueError(f"max_prompt_chars must be >= 0 (0 = no limit), got {self.max_prompt_chars}")

    def prompt_chars_limit(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return max_model_len * CHARS_PER_TOKEN_BOUND


# -- prompts (called before tokenizing) ---------------------------------------------------------------------
def check_prompt_count(limits: ServerLimits, count: int, field: str) -> None:
    if limits.max_prompts_per_request and count > limits.max_prompts_per_request:
        raise APIError(400, f"{field}: {count} prompts in one request, but the server takes at most "
                            f"{limits.max_prompts_per_request} (--max-prompts-per-request)", param=field)


def check_prompt_chars(limits: ServerLimits, max_model_len: int, text: Sized, field: str) -> None:
    """A 400 for a text (a str, or the ElidedText the parse left of a longer one) over --max-prompt-chars."""
    limit = limits.prompt_chars_limit(max_model_len)
    if limit and len(text) > limit:
        raise APIError(400, f"{field} is too long: {len(text)} characters, but the server tokenizes at most "
                            f"{limit} (--max-prompt-chars; max_model_len is {max_model_len} tokens)", param=field)


# -- the request body ------------------------------------------------------------------------------------------
class BodyTooLarge(APIError):
    def __init__(self, limit: int, size: int | None = None):
        got = f"{size} bytes" if size is not None else "more"
        super().__init__(413, f"the request body is too large: {got}, but the server takes at most {limit} bytes "
                              f"(--max-request-body-bytes)",
                         headers={"Connection": "close"})


class BodyTimeout(APIError):
    def __init__(self, seconds: float):
        super().__init__(408, f"the request body did not arrive: nothing for {seconds:g} s "
                              f"(--request-body-timeout)", headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Bounds every HTTP request body in size and in time.

    A Content-Length over the limit is answered 413 before the app runs. Otherwise `receive` is wrapped: each
    piece of the body must come within `request_body_timeout` seconds (else BodyTimeout, 408) and the total must
    stay within the limit (else BodyTooLarge, 413). Both are APIErrors, raised where the route reads its body, so
    they leave as the usual JSON error; their `Connection: close` makes uvicorn drop the connection, whose unread
    rest cannot be skipped."""

    def __init__(self, app, limits: ServerLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, timeout = self.limits.max_request_body_bytes, self.limits.request_body_timeout
        length = dict(scope["headers"]).get(b"content-length")
        if limit and length is not None and length.isdigit() and int(length) > limit:
            await BodyTooLarge(limit, int(length)).answer(scope, receive, send)
            return
        received, body_done = 0, False

        async def bounded_receive():
            nonlocal received, body_done
            if body_done:  # after the body, only the disconnect can come, at any time: no timeout
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout) if timeout else await receive()
            except asyncio.TimeoutError:
                raise BodyTimeout(timeout) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if limit and received > limit:
                    raise BodyTooLarge(limit)
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, bounded_receive, send)
