"""Keeping slow request work off the event loop.

The event loop answers every connection (/health included), so one request that parses a 10 MB body, renders a
chat template over it or tokenizes it on the loop would freeze every other client for as long as that takes.
`Offloader.run(size, fn, ...)` runs such work in a small thread pool when the request is large and inline when
it is small: a thread hop costs tens of microseconds and a context switch, which for the common short request is
more than the work itself (docs/operating.md has the measurement). Tokenizers' encode and pydantic's JSON parser
are native code; the chat template is jinja2, which yields the GIL every switch interval, so the loop keeps
running beside a big job either way.

Each pool thread has a tokenizer of its own (Hugging Face fast tokenizers must not be used from two threads at
once); `tokenizer()` gives the calling thread's, the loop thread included.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

OFFLOAD_MIN_BYTES = 64 << 10
"""Requests whose body is at least this large are prepared in the pool; smaller ones inline (the server's
--offload-min-bytes; `python -m studies.event_loop` measures the choices, docs/operating.md)."""
DEFAULT_THREADS = 2
MEDIA_WORDS = (b"image", b"video")
"""A body with either word may hold an image or a video part (a data URL to decode, a URL to fetch)."""


class Offloader:
    """A thread pool for request preparation, with one tokenizer per thread (made by `load_tokenizer`)."""

    def __init__(self, load_tokenizer: Callable[[], Any], threads: int = DEFAULT_THREADS,
                 min_bytes: int = OFFLOAD_MIN_BYTES):
        self._load_tokenizer = load_tokenizer
        self._local = threading.local()
        self.min_bytes = min_bytes
        self.threads = max(1, min(threads, os.cpu_count() or 1))
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="nanoserve-prepare",
                                        initializer=self.tokenizer)

    def tokenizer(self):
        """The calling thread's tokenizer (made on first use)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = self._load_tokenizer()
        return tok

    async def run(self, body: bytes | int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), in the pool when `body` (the request's body, or its size) is at least `min_bytes` long or
        may carry images or videos (MEDIA_WORDS: loading and decoding them is slow however small the body), else
        inline."""
        size = body if isinstance(body, int) else \
            self.min_bytes if any(w in body for w in MEDIA_WORDS) else len(body)
        if size < self.min_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
