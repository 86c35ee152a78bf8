"""Request bodies -> request models, and where that parsing runs.

`parse_body(model, body)` is the one way a body is parsed: pydantic's strict JSON parse (model_validate_json),
which raises ValidationError for a bad body; the parsed model also lists the top-level fields it ignored
(RequestBody.ignored_fields, schema_base.py), which the routes log.

Parsing holds the GIL from the first byte to the last - pydantic-core does not release it, and neither does any
other JSON parser - so a thread does not keep the event loop free: a 10 MB body costs the loop (and the engine
thread) some 10-20 ms whichever thread parses it. `BodyParser` therefore parses a body of at least
`process_min_bytes` (--parse-process-min-bytes, default 1 MiB) in a small pool of worker processes
(--parse-processes, default 2; 0 parses every body in this process). Sending the body there and the parsed
request back costs this process about a millisecond a 10 MB body (pickling is a copy); a request that fails to
parse comes back as its ValidationError, the same one the in-process parse raises, and a prompt too long to
tokenize comes back as its length alone (parse_body's eliding), so the server never unpickles it. Smaller
bodies - almost all of them - are parsed here, inline or in the Offloader's threads (offload.py), since a process
hop costs more than their parse.

The workers are spawned (not forked: the server has threads and an engine), import only the request models,
ignore SIGINT and SIGTERM (the server decides when they stop: its shutdown stops them after the drain), and exit
by themselves if the server process dies. A worker that dies (the kernel's OOM killer, say) breaks the pool:
the request is parsed in this process instead, and a new pool is started for the next large body.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from nanoserve.server.offload import Offloader
from nanoserve.server.schema_base import RequestBody

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=RequestBody)

PARSE_PROCESS_MIN_BYTES = 1 << 20
"""Bodies at least this large are parsed in the worker processes (--parse-process-min-bytes)."""
DEFAULT_PARSE_PROCESSES = 2
"""Worker processes for large bodies (--parse-processes; at most the CPU count). Two let two clients' huge bodies
be parsed side by side; more would only compete for the cores the engine and the event loop need."""


def parse_body(model: type[M], body: bytes, max_prompt_chars: int = 0) -> M:
    """`body` parsed as `model` (strict JSON); ValidationError if it does not parse or validate. Text prompts
    longer than `max_prompt_chars` (0: none) are elided (RequestBody.elide_long_prompts): they are refused later,
    in the usual order of checks, and only their length crosses back from a worker process."""
    req = model.model_validate_json(body)
    if max_prompt_chars:
        req.elide_long_prompts(max_prompt_chars)
    return req


def _worker_init() -> None:
    """In each worker: leave the signals to the server, and exit when the server process is gone (a SIGKILL gives
    it no chance to stop the pool), rather than wait forever for work."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        def exit_with_parent() -> None:
            parent.join()
            os._exit(0)

        threading.Thread(target=exit_with_parent, name="nanoserve-parse-watchdog", daemon=True).start()


class BodyParser:
    """Parses request bodies: large ones in a pool of worker processes (started on the first large body), others
    in this process through the Offloader (inline when small, in its threads from its min_bytes)."""

    def __init__(self, offloader: Offloader, processes: int = DEFAULT_PARSE_PROCESSES,
                 process_min_bytes: int = PARSE_PROCESS_MIN_BYTES):
        if processes < 0:
            raise ValueError(f"parse_processes must be >= 0 (0 = parse every body in the server process), "
                             f"got {processes}")
        if process_min_bytes < 0:
            raise ValueError(f"parse_process_min_bytes must be >= 0, got {process_min_bytes}")
        self.offloader = offloader
        self.processes = min(processes, os.cpu_count() or 1)
        self.process_min_bytes = process_min_bytes
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    def in_process_pool(self, size: int) -> bool:
        """Whether a body of `size` bytes is parsed in the worker processes."""
        return self.processes > 0 and size >= self.process_min_bytes and not self._closed

    async def parse(self, model: type[M], body: bytes, max_prompt_chars: int = 0) -> M:
        """`body` parsed as `model`, text prompts over `max_prompt_chars` elided (parse_body); ValidationError as
        parse_body raises it, wherever the parse ran."""
        if self.in_process_pool(len(body)):
            pool = self._get_pool()
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, parse_body, model, body,
                                                                         max_prompt_chars)
            except BrokenProcessPool:
                logger.warning("a body-parsing worker process died; parsing this request in the server process "
                               "and starting new workers for the next large body")
                self._discard(pool)
        return await self.offloader.run(len(body), parse_body, model, body, max_prompt_chars)

    def worker_pids(self) -> list[int]:
        """The worker processes' ids (none before the first large body)."""
        procs = getattr(self._pool, "_processes", None) or {}
        return sorted(procs)

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self.processes, initializer=_worker_init,
                                             mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        if self._pool is pool:
            self._pool = None
        pool.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        """Stop the workers (a parse under way finishes first) and parse in this process from now on."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
