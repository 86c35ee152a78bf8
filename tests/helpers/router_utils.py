"""vLLM's router (`vllm-router`, the Rust router in the `vllm-router` wheel) as a subprocess, for the tests that put
nanoserve servers behind it: replicas (tests/server/test_router.py) and prefill/decode disaggregation
(tests/server/test_pd_disaggregation.py)."""

from __future__ import annotations

import shutil
import subprocess

import httpx

from tests.helpers.server_utils import HealthCheckedProcess, free_port


class RouterProcess(HealthCheckedProcess):
    """`vllm-router` in a subprocess on a free loopback port, in front of `workers` (its --worker-urls; none in P/D
    mode, where `args` name the --prefill and --decode servers); its log in `log_path`."""

    START_TIMEOUT_S = 60

    def __init__(self, log_path, workers: list[str], *args: str):
        binary = shutil.which("vllm-router")
        assert binary, "vllm-router is not installed (pip install -e '.[test]' installs it)"
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [binary, "--host", "127.0.0.1", "--port", str(self.port), *(["--worker-urls", *workers] if workers
                                                                         else []),
               "--prometheus-port", str(self.metrics_port), "--log-level", "info", *args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def __exit__(self, *exc) -> None:  # (asked to stop first: it closes its connections)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
