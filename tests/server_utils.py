"""Helpers for the server tests: a fast CPU engine, and a real uvicorn server on a free loopback port in a thread."""

from __future__ import annotations

import re
import socket
import threading
import time

from nanoserve.config import EngineConfig, Optimizations

# Triton kernels run in the interpreter on the CPU (slow); the server tests exercise the reference paths.
FAST_CPU = Optimizations.reference_kernels().replace(cuda_graphs=False)
MAX_MODEL_LEN = 512
KV_CACHE_TOKENS = 4096
SWITCH_FLAGS = ["--no-triton-attention", "--no-triton-msa", "--no-fused-moe", "--no-fold-shared-expert",
                "--no-fused-qk-norm-rope", "--no-fused-add-rmsnorm", "--no-cuda-graphs"]


def engine_config(model_dir: str, **overrides) -> EngineConfig:
    kwargs = dict(model=model_dir, optimizations=FAST_CPU, max_model_len=MAX_MODEL_LEN,
                  kv_cache_tokens=KV_CACHE_TOKENS, device="cpu")
    kwargs.update(overrides)
    return EngineConfig.from_kwargs(**kwargs)


class ServerThread:
    """uvicorn serving `app` from a background thread, on a socket bound before it starts (no port race)."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        assert not self.thread.is_alive(), "the test server did not stop"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        m = re.match(r"^([^\s{]+)(?:\{([^}]*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0
