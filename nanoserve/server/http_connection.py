"""The HTTP connection: which HTTP/1.1 parser uvicorn runs (--http), with a deadline on each request's request
line and headers (--request-header-timeout).

    http_protocol(name, header_timeout)   what to pass as uvicorn.Config(http=...)

uvicorn bounds only an idle kept-alive connection (--timeout-keep-alive); a connection that never sends a whole
request - nothing at all, or half a request line - is held forever, and an ASGI middleware cannot help because the
app is called only once the headers are complete. So the deadline lives in the connection: it starts when the
connection opens, or when the first byte of the next request arrives on a kept-alive one, and is not moved by
further bytes (a client sending a byte a second must not hold the connection). When it passes before the headers
are complete, a client that sent part of a request gets 408 in OpenAI's error shape and the connection is closed;
one that sent nothing is just closed.

Both of uvicorn's parsers get the deadline. httptools (llhttp, in C; what uvicorn's "auto" picks when it is
installed, as in vLLM's deployments) is the default: a large body goes through it with one copy per socket read,
where h11, in pure Python, copies each read some five times on the event loop - for a 10 MB prompt that is
10-20 ms of the loop, which every other client waits through (docs/operating.md measures it).
"""

from __future__ import annotations

import asyncio
import importlib.util

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve.server.errors import APIError

HTTP_PARSERS = ("auto", "httptools", "h11")


def resolve_http(name: str) -> str:
    """The parser --http names: "auto" is httptools when it is installed, else h11 (uvicorn's rule)."""
    if name not in HTTP_PARSERS:
        raise ValueError(f"http must be one of {', '.join(HTTP_PARSERS)}, got {name!r}")
    if name == "auto":
        return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    if name == "httptools" and importlib.util.find_spec("httptools") is None:
        raise ValueError("--http httptools: the httptools package is not installed (pip install httptools)")
    return name


def http_protocol(name: str = "auto", header_timeout: float = 0.0) -> str | type[asyncio.Protocol]:
    """uvicorn.Config(http=...) for the parser `name` ("auto", "httptools", "h11"), with a deadline of
    `header_timeout` seconds on each request's headers (0: none, and uvicorn's own protocol class)."""
    name = resolve_http(name)
    if not header_timeout:
        return name
    if name == "httptools":
        return _httptools_with_deadline(header_timeout)
    return _h11_with_deadline(header_timeout)


def _timeout_response(seconds: float) -> bytes:
    error = APIError(408, f"the request headers did not arrive within {seconds:g} s (--request-header-timeout)")
    body = error.body().model_dump_json().encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


class _HeaderDeadline:
    """The deadline's bookkeeping, mixed into a uvicorn protocol class (before it, so these methods wrap its own):
    arm it when the connection opens or a request may begin, disarm it when the headers are complete, the response
    is done or the connection ends; when it fires with the headers still incomplete, answer
    408 if part of a request came, and close. The subclass says whether the headers are still awaited."""

    header_timeout: float = 0.0
    timeout_response: bytes = b""
    _header_deadline: asyncio.TimerHandle | None = None
    _bytes_of_request = False

    def _awaiting_headers(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        self._disarm()  # the kept-alive connection now idles: uvicorn's keep-alive timeout bounds that
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._header_deadline = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        self._bytes_of_request = False

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or not self._awaiting_headers():
            return
        if self._bytes_of_request:
            self.logger.warning("closing a connection whose request headers did not arrive within %g s "
                                "(--request-header-timeout)", self.header_timeout)
            self.transport.write(self.timeout_response)
        self.transport.close()


def _h11_with_deadline(seconds: float) -> type[H11Protocol]:
    class HeaderTimeoutH11Protocol(_HeaderDeadline, H11Protocol):
        header_timeout = seconds
        timeout_response = _timeout_response(seconds)

        def _awaiting_headers(self) -> bool:
            return self.conn.their_state is h11.IDLE  # no complete request line + headers yet

        def data_received(self, data: bytes) -> None:
            waiting = self._awaiting_headers()
            super().data_received(data)
            if self._awaiting_headers():  # still (or again, after a pipelined request) in the headers
                self._bytes_of_request = True
                if self._header_deadline is None:
                    self._arm()
            elif waiting or self._header_deadline is not None:
                self._disarm()

    return HeaderTimeoutH11Protocol


def _httptools_with_deadline(seconds: float) -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
        """llhttp calls on_message_begin at a request's first byte and on_headers_complete at the blank line, so
        the parser's callbacks bracket exactly the span the deadline bounds."""

        header_timeout = seconds
        timeout_response = _timeout_response(seconds)
        _in_headers = True  # from the connection's start until its first request's headers are complete

        def _awaiting_headers(self) -> bool:
            return self._in_headers

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = self._bytes_of_request = True
            if self._header_deadline is None:  # a kept-alive connection's next request
                self._arm()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._disarm()
            super().on_headers_complete()

    return HeaderTimeoutHttpToolsProtocol
