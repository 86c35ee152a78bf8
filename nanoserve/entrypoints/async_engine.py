"""AsyncLLMEngine: the asyncio bridge between the HTTP server and the (blocking) LLMEngine.

One engine, many concurrent HTTP requests. The pieces:

    the engine thread   a single worker thread that is the only code ever touching the LLMEngine. Every engine
                        call - add a request, abort, step, shut down - is a job submitted to it, so the engine
                        needs no locks, and the model step (seconds of CPU or GPU work, holding no event-loop
                        time) never freezes the event loop that serves HTTP.
    the engine loop     one asyncio task: apply pending aborts and run `step()` on the engine thread, hand each
                        RequestOutput to its request's stream, repeat; sleep when no request is unfinished.
    a RequestStream     per request, what its HTTP handler iterates. Outputs are cumulative (the full text so
                        far), so the stream keeps only the newest one: a slow client gets bigger chunks instead of
                        a growing backlog. Closing the stream early (the client went away) aborts the request,
                        which frees its KV blocks.

Failure rules: a full waiting queue raises QueueFullError (HTTP 503 + Retry-After); if `step()` raises, every
stream gets an EngineDeadError (HTTP 500), the engine is marked dead (/health answers 503) and new requests fail
at once - never a hang.

Life cycle, as the offline LLM's: `await shutdown()` (or leaving `async with engine:`) drains, stops the loop and
releases the engine - its tensor-parallel workers exit and the process groups are left, so another engine of any
tensor-parallel size can be built in the same process. Where no event loop runs any more, `close()` (or leaving
a plain `with engine:`) releases it; so does dropping the last reference (a finalizer; a step still running on the
engine thread, say one abandoned when asyncio.run returned, holds a reference until it ends), or the interpreter's
exit.

This module imports no web framework: the server (nanoserve/server) builds on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from nanoserve.config import EngineConfig
from nanoserve.engine.llm_engine import EngineStats, LLMEngine, Prompt
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.tokenizer import load_tokenizer
from nanoserve.sampling import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1  # what a rejected client is told to wait; the queue drains at the engine's pace
DRAIN_POLL_SECONDS = 0.05


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error; no request can be served any more."""


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (EngineConfig.max_waiting_requests); try again later."""

    retry_after = RETRY_AFTER_SECONDS


class EngineShutdownError(RuntimeError):
    """The server is shutting down and admits no new requests (or aborted this one while draining)."""

    retry_after = RETRY_AFTER_SECONDS


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters and gauges after its latest job, read by /metrics without touching the engine."""

    stats: EngineStats
    num_running: int  # requests with a sequence holding KV blocks
    num_waiting: int  # sequences waiting for admission (new or preempted)
    kv_cache_usage: float  # fraction of KV blocks in use
    num_free_blocks: int
    num_blocks: int


class RequestStream:
    """The outputs of one request, as an async iterator that ends after the finished output.

    The engine loop `put`s every new (cumulative) RequestOutput; only the newest is kept. `aclose()` before the
    end aborts the request in the engine."""

    def __init__(self, request_id: str, on_close: Callable[[str], None]):
        self.request_id = request_id
        self._on_close = on_close
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False  # the finished output was handed out
        self.closed = False

    # -- the engine loop's side ---------------------------------------------------------------------------
    def put(self, output: RequestOutput) -> None:
        self._latest = output
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    # -- the consumer's side ------------------------------------------------------------------------------
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.closed:
            output, self._latest = self._latest, None
            if output is not None:
                if output.finished:
                    self.finished = self.closed = True
                return output
            if self._error is not None:
                self.closed = True
                raise self._error
            self._ready.clear()
            await self._ready.wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop listening; if the request has not finished, abort it (freeing its KV blocks)."""
        if not self.closed:
            self.closed = True
            self._on_close(self.request_id)


def _set_engine_thread_device(device) -> None:
    """The engine thread's initializer: the current CUDA device is per thread; it must be the engine's. (A plain
    function: a bound method would keep the AsyncLLMEngine alive for as long as the thread lives.)"""
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)


def _release_engine(engine: LLMEngine, thread: ThreadPoolExecutor) -> None:
    """Shut the engine down on its own thread (after any job still running there), then end that thread. The
    AsyncLLMEngine's finalizer: it holds the engine and the thread, never the AsyncLLMEngine."""
    try:
        thread.submit(engine.shutdown).result()
    except RuntimeError:  # the pool no longer takes jobs (the interpreter is exiting): its thread is idle
        engine.shutdown()
    thread.shutdown(wait=True)


class AsyncLLMEngine:
    """Runs an LLMEngine in a background loop and serves many concurrent requests from asyncio code.

        async with AsyncLLMEngine.from_config(config) as engine:         # start(); shutdown() on leaving
            stream = await engine.add_request(request_id, prompt, params)   # raises at once if invalid / full
            async for output in stream: ...                                 # cumulative RequestOutputs
    or, in one call, `async for output in engine.generate(request_id, prompt, params)`.

    `start()` and `shutdown()` must be awaited in the event loop that serves the requests; `close()` is the
    synchronous release for when that loop is gone (see the module docstring)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.config: EngineConfig = engine.config
        self.max_model_len: int = engine.max_model_len
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-engine",
                                          initializer=_set_engine_thread_device,
                                          initargs=(engine.executor.device,))
        # runs once: at shutdown() / close(), when this object is collected, or at the interpreter's exit
        self._finalizer = weakref.finalize(self, _release_engine, engine, self._thread)
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._stopping = False
        self.accepting = False
        self.dead_error: BaseException | None = None
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []  # e.g. the server's latency histograms
        self.snapshot = self._take_snapshot()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLMEngine":
        """Build the engine (loads the model: slow, blocking) and wrap it."""
        return cls(LLMEngine(config))

    def get_tokenizer(self):
        """A tokenizer of the server's own (same files as the engine's). Hugging Face fast tokenizers must not be
        shared between threads, and the engine's is used by the engine thread."""
        return load_tokenizer(self.config.tokenizer or self.engine.executor.model_dir)

    # -- state --------------------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done() and self.dead_error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _take_snapshot(self) -> EngineSnapshot:
        """Called on the engine thread after each job."""
        eng, bm = self.engine, self.engine.block_manager
        stats = dataclasses.replace(eng.stats, finished=dict(eng.stats.finished))
        running = len({seq.request_id for seq in eng.scheduler.running})
        return EngineSnapshot(stats, running, eng.num_waiting, bm.usage, bm.num_free_blocks, bm.num_blocks)

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine loop in the running event loop."""
        if not self._finalizer.alive:
            raise RuntimeError("this AsyncLLMEngine has been shut down; build a new one")
        if self._loop_task is not None:
            raise RuntimeError("the engine loop is already started")
        self._wakeup = asyncio.Event()
        self.accepting = True
        self._loop_task = asyncio.create_task(self._run_loop(), name="nanoserve-engine-loop")

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `drain_timeout` seconds, abort the rest,
        stop the loop and release the device. Calling it again does nothing."""
        if self._stopping:
            return
        self.accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._streams and self.is_running and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if self._streams:
            logger.warning("aborting %d request(s) still running at shutdown", len(self._streams))
            for stream in list(self._streams.values()):
                stream.fail(EngineShutdownError("the server is shutting down; the request was aborted"))
        self._streams.clear()
        self._stopping = True  # the loop exits after its current step
        if self._wakeup is not None:
            self._wakeup.set()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        loop = asyncio.get_running_loop()
        try:
            if self._finalizer.alive:
                await loop.run_in_executor(self._thread, self._abort_all)
        finally:
            await loop.run_in_executor(None, self._finalizer)  # blocking: the engine thread, then the workers
        logger.info("engine shut down")

    def close(self) -> None:
        """Release the engine without an event loop: for an engine whose loop was never started or whose event
        loop has ended (asyncio.run returned). A running engine loop is stopped with `await shutdown()`.
        Idempotent; afterwards no request is accepted."""
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError("the engine loop is still running: await engine.shutdown() in its event loop")
        self._stopping, self.accepting = True, False
        self._finalizer()

    async def __aenter__(self) -> "AsyncLLMEngine":
        if self._loop_task is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    def __enter__(self) -> "AsyncLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _abort_all(self) -> None:
        try:
            self.engine.abort_request(list(self.engine.requests))
            self.snapshot = self._take_snapshot()
        except Exception:  # a failed engine may not abort cleanly; the device is released all the same
            logger.exception("could not abort the remaining requests at shutdown")

    # -- requests -----------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0,
                          kv_transfer_params: dict[str, Any] | None = None) -> RequestStream:
        """Queue a request and return its stream (`priority`, `kv_transfer_params`: LLMEngine.add_request's).
        Raises ValueError (bad prompt or parameters), QueueFullError, EngineShutdownError or EngineDeadError before
        anything is queued."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id, self._abort_soon)
        self._streams[request_id] = stream
        try:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._thread, self._add_on_engine_thread, request_id, prompt, params,
                                       priority, kv_transfer_params)
        except asyncio.CancelledError:
            # The job may still run (the thread does not stop mid-job); the abort queued here runs after it.
            self._abort_soon(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._wakeup.set()  # type: ignore[union-attr]
        return stream

    async def compile_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Compile a structured-output spec in a worker thread (not the engine thread, which keeps stepping), so
        the engine's add_request finds it in its cache. Raises ValueError when xgrammar cannot compile it."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.structured_output.compile, spec)

    def _add_on_engine_thread(self, request_id: str, prompt: Prompt, params: SamplingParams,
                              priority: int = 0, kv_transfer_params: dict[str, Any] | None = None) -> None:
        bound, waiting = self.config.max_waiting_requests, self.engine.num_waiting
        if params.n > bound:
            raise ValueError(f"n={params.n} is more than the server queues at once (--max-waiting-requests "
                             f"{bound})")
        if waiting + params.n > bound:
            raise QueueFullError(f"the server is overloaded: {waiting} sequences are waiting to start "
                                 f"(--max-waiting-requests {bound}); retry later")
        self.engine.add_request(request_id, prompt, params, priority=priority, kv_transfer_params=kv_transfer_params)
        self.snapshot = self._take_snapshot()

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its (cumulative) outputs until it finishes. Closing or cancelling the
        iteration early aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def _check_alive(self) -> None:
        if not self._finalizer.alive:
            raise EngineShutdownError("this engine has been shut down and accepts no requests")
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine has stopped after an error: {self.dead_error}")
        if not self.accepting:
            if self._loop_task is None:
                raise EngineDeadError("the engine loop is not started")
            raise EngineShutdownError("the server is shutting down and accepts no new requests")

    def _abort_soon(self, request_id: str) -> None:
        """Called when a stream is closed early: the loop aborts the request before its next step."""
        if self._streams.pop(request_id, None) is not None:
            self._pending_aborts.append(request_id)
            if self._wakeup is not None:
                self._wakeup.set()

    # -- the engine loop ----------------------------------------------------------------------------------
    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        try:
            while not self._stopping:
                aborts, self._pending_aborts = self._pending_aborts, []
                # Cleared before the job is submitted: a request added during the step sets it again, so the
                # wait below cannot miss it.
                self._wakeup.clear()
                outputs, busy, transfers = await loop.run_in_executor(self._thread, self._step_on_engine_thread,
                                                                      aborts)
                self._dispatch(outputs)
                if transfers is not None:  # only KV transfers under way (P/D): poll them, or step for a request
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), transfers)
                elif not busy and not self._pending_aborts:
                    await self._wakeup.wait()
        except Exception as exc:
            self._die(exc)
            await loop.run_in_executor(self._thread, self._abort_after_failure)

    def _step_on_engine_thread(self, aborts: list[str]) -> tuple[list[RequestOutput], bool, float | None]:
        """One step: its outputs, whether requests remain, and how long the loop may wait when only KV transfers
        are under way (LLMEngine.kv_transfer_wait)."""
        engine = self.engine
        if aborts:
            engine.abort_request(aborts)
        outputs = engine.step() if engine.has_unfinished_requests() or engine.kv_transfer_wait() else []
        self.snapshot = self._take_snapshot()
        return outputs, engine.has_unfinished_requests(), engine.kv_transfer_wait()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished:
                self._notify_finished(output)
                stream = self._streams.pop(output.request_id, None)
            else:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)

    def _notify_finished(self, output: RequestOutput) -> None:
        for fn in self.finish_listeners:
            try:
                fn(output)
            except Exception:  # a listener (metrics) must never take the engine down
                logger.exception("finish listener %r failed", fn)

    def _die(self, exc: BaseException) -> None:
        logger.error("engine loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        self.dead_error = exc
        self.accepting = False
        error = EngineDeadError(f"the engine failed: {type(exc).__name__}: {exc}")
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()

    def _abort_after_failure(self) -> None:
        """Best effort: return the KV blocks of every request the failed engine still holds."""
        try:
            self.engine.abort_request(list(self.engine.requests))
            self.snapshot = self._take_snapshot()
        except Exception:
            logger.exception("could not abort the requests of the failed engine")

    async def run_on_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the engine thread, between steps (for tests and tools that inspect the engine)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
