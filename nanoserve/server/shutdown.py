"""The server's life after start-up: a graceful drain on SIGTERM / SIGINT, and a prompt exit when the engine dies.

    Lifecycle             the phase (serving / draining / engine dead) and the count of HTTP requests in flight
    LifecycleMiddleware   counts requests; while draining, a new request gets 503 + Retry-After; once the engine
                          is dead, every route but /health (and /ping, its SageMaker twin) and /metrics answers
                          500 naming the cause
    GracefulServer        uvicorn.Server with the signal handling and the supervision below

On the first SIGTERM or SIGINT, in this order:

    1. stop accepting work: new requests get 503 (code "shutting_down") + Retry-After, /health turns 503
    2. let the requests in flight finish, for up to --shutdown-timeout seconds
    3. abort the rest through the engine: every stream ends with an error event and [DONE], every
       non-streaming request gets a JSON error (503, "shutting_down"); then the engine and its workers stop
    4. close the listening socket and the idle connections, and exit 0

A second signal exits at once (status 128 + the signal's number), whatever is running.

If the engine dies (a step raised, a tensor-parallel worker died or stopped answering), the requests in flight
get their errors (500, "engine_dead", naming the cause), /health answers 503, and the process exits with status 1
so that a supervisor restarts it - as vLLM does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import uvicorn

from nanoserve.entrypoints.async_engine import AsyncLLMEngine, EngineShutdownError
from nanoserve.server.errors import APIError

logger = logging.getLogger(__name__)

POLL_S = 0.05
FLUSH_GRACE_S = 5.0
"""After the engine aborted what was left (or died), how long the error responses get to reach their clients."""
ENGINE_DEAD_EXIT_CODE = 1
DEAD_LINGER_S = 1.0
"""After the engine died, how long the server keeps answering (503 / 500 naming the cause) before it exits, so a
health probe or a retrying client sees why rather than a refused connection."""
UNGUARDED_PATHS = ("/health", "/ping", "/metrics")
"""Routes that answer for themselves while the server drains or after the engine died."""


class Lifecycle:
    """Where the server is in its life, shared by the middleware, /health and GracefulServer."""

    def __init__(self, engine: AsyncLLMEngine, shutdown_timeout: float):
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.in_flight = 0  # HTTP requests being answered (bodies still streaming included)
        self.draining = False
        self.signal: int | None = None  # the signal that started the drain

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve: a failed step, or a tensor-parallel worker gone while the engine was idle
        (the executor's check reads the workers' state only - no collective - so it is cheap enough per request)."""
        err = self.engine.dead_error
        if err is not None:
            return f"the engine has stopped after an error: {err}"
        if not self.engine.is_running:  # not started yet, or stopped by a drain: not a failure
            return None
        try:
            self.engine.engine.executor.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means the engine cannot serve
            return f"the engine is unhealthy: {exc}"
        return None

    async def drain(self) -> None:
        """Steps 1-3 of the module docstring."""
        self.draining = True
        deadline = time.monotonic() + self.shutdown_timeout
        if self.in_flight:
            logger.info("draining %d request(s) in flight (up to %g s)", self.in_flight, self.shutdown_timeout)
        while self.in_flight and time.monotonic() < deadline and self.engine.dead_error is None:
            await asyncio.sleep(POLL_S)
        if self.in_flight:
            logger.warning("--shutdown-timeout (%g s) is over: aborting %d request(s)", self.shutdown_timeout,
                           self.in_flight)
        await self.engine.shutdown(drain_timeout=0)  # aborts what is left, stops the engine and its workers
        await self.wait_for_responses(FLUSH_GRACE_S)

    async def wait_for_responses(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)


class LifecycleMiddleware:
    """ASGI middleware: counts the requests in flight and turns requests away while draining or dead."""

    def __init__(self, app, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        life = self.lifecycle
        if scope["path"] not in UNGUARDED_PATHS:
            if life.dead_reason is not None:
                await APIError(500, life.dead_reason).answer(scope, receive, send)
                return
            if life.draining:
                retry = str(EngineShutdownError.retry_after)
                await APIError(503, "the server is shutting down and accepts no new requests",
                               headers={"Retry-After": retry, "Connection": "close"}).answer(scope, receive, send)
                return
        life.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            life.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains on the first signal, exits at once on the second, and exits non-zero when the
    engine dies. `exit_code` is what the process should exit with once `run()` returns."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:  # a signal handler: runs on the main thread, between bytecodes
        name = signal.Signals(sig).name
        if self.lifecycle.signal is not None or self._loop is None:
            logger.warning("%s again: exiting at once", name)
            os._exit(128 + sig)
        self.lifecycle.signal = sig
        logger.info("%s: shutting down gracefully (a second signal exits at once)", name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        async def drain_then_exit() -> None:
            if self.lifecycle.dead_reason is not None:  # a signal that comes after the engine died: still exit 1
                self.exit_code = ENGINE_DEAD_EXIT_CODE
            try:
                await self.lifecycle.drain()
            finally:
                self.should_exit = True

        self._drain_task = asyncio.ensure_future(drain_then_exit())

    async def on_tick(self, counter: int) -> bool:
        if self.lifecycle.dead_reason is not None and self.exit_code == 0 and self._drain_task is None:
            logger.error("%s; exiting with status %d", self.lifecycle.dead_reason, ENGINE_DEAD_EXIT_CODE)
            self.exit_code = ENGINE_DEAD_EXIT_CODE
            self.lifecycle.draining = True
            t0 = time.monotonic()
            await self.lifecycle.wait_for_responses(FLUSH_GRACE_S)  # the errors reach their clients first
            await asyncio.sleep(max(0.0, DEAD_LINGER_S - (time.monotonic() - t0)))
            self.should_exit = True
        return await super().on_tick(counter)
