"""Helpers for the server tests: a fast CPU engine, and a real uvicorn server on a free loopback port in a thread."""

from __future__ import annotations

import re
import socket
import threading
import time

from nanoserve.config import KERNEL, EngineConfig, Optimizations

# Triton kernels run in the interpreter on the CPU (slow); the server tests exercise the reference paths.
FAST_CPU = Optimizations.reference_kernels().replace(cuda_graphs=False)
MAX_MODEL_LEN = 512
KV_CACHE_TOKENS = 4096
SERVED_MODEL = "m3-tiny-test"  # the model name the shared `app` fixture (tests/conftest.py) serves
AGENT_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "minimax_m3", "--reasoning-parser", "minimax_m3")
"""The server flags of an agent deployment: tool calls and reasoning parsed from M3's output."""
SWITCH_FLAGS = [f"--no-{name.replace('_', '-')}" for name in Optimizations.names(KERNEL)] + ["--no-cuda-graphs"]
"""FAST_CPU as server flags: every KERNEL switch off (kernels in Triton's interpreter are slow), no CUDA graphs."""


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


def post(server, path: str, body: dict):
    """POST `body` (with the served model's name) to `path` on a test server; the httpx.Response."""
    import httpx

    return httpx.post(f"{server.url}{path}", json={"model": SERVED_MODEL, **body}, timeout=120)


def stream_events(server, path: str, body: dict) -> list:
    """The parsed `data:` events of a streaming request to a test server, [DONE] last (as the string)."""
    import json

    import httpx

    events = []
    with httpx.stream("POST", f"{server.url}{path}", json={"model": SERVED_MODEL, "stream": True, **body},
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    return events


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


class HealthCheckedProcess:
    """A subprocess serving HTTP at `self.url`, its output in `self.log_path`: entering waits (up to START_TIMEOUT_S)
    for /health to answer 200; leaving stops it if it still runs. Subclasses set `self.proc` (the Popen),
    `self.url` and `self.log_path`."""

    START_TIMEOUT_S = 180

    def log(self) -> str:
        return self.log_path.read_text()

    def healthy(self) -> bool:
        import httpx

        assert self.proc.poll() is None, self.log()
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def __enter__(self):
        try:
            wait_until(self.healthy, timeout=self.START_TIMEOUT_S, what=f"{type(self).__name__} to start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ServerProcess(HealthCheckedProcess):
    """`python -m nanoserve.server` in a subprocess on a free port (CPU, the fast reference paths), its output in
    `log_path`. Entering waits for /health to answer 200; leaving kills it if it still runs."""

    def __init__(self, model_dir: str, log_path, *extra: str, name: str = "tiny", env: dict | None = None):
        import os
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "nanoserve.server", "--model", model_dir, "--port", str(self.port),
               "--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", str(KV_CACHE_TOKENS),
               "--served-model-name", name, *SWITCH_FLAGS, *extra]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

