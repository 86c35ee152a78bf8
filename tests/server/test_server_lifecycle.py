"""The server's life and failures: the async bridge on its own, backpressure (503 + Retry-After), an engine that
dies (500, /health 503, no hang, no leaked blocks), graceful SIGTERM of `python -m nanoserve.server`, the CLI."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from nanoserve.config import Optimizations
from nanoserve.entrypoints.async_engine import AsyncLLMEngine, EngineShutdownError
from nanoserve.sampling import SamplingParams
from nanoserve.server import build_app
from tests.helpers.server_utils import MAX_MODEL_LEN, SWITCH_FLAGS, ServerThread, engine_config, free_port, wait_until

MODEL = "tiny"
PROMPT = "Long prompts are split into chunks"
LONG = dict(model=MODEL, prompt=PROMPT, max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True)


def assert_pool_free(engine: AsyncLLMEngine) -> None:
    bm = engine.engine.block_manager
    assert not engine.engine.requests
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity()


def data_lines(resp: httpx.Response):
    return (line for line in resp.iter_lines() if line.startswith("data: "))


def test_async_engine_generate_abort_and_shutdown(tiny_dir):
    """The bridge without HTTP: outputs stream until finished; leaving early aborts; shutdown aborts the rest."""
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir))
    stats = engine.engine.stats

    async def main():
        await engine.start()
        outs = [o async for o in engine.generate("a", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        assert all(not o.finished for o in outs[:-1])

        gen = engine.generate("b", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        async for _ in gen:
            break
        await gen.aclose()  # the consumer leaves: the request is aborted

        async def consume(rid: str) -> None:
            async for _ in engine.generate(rid, PROMPT, SamplingParams(max_tokens=400, ignore_eos=True)):
                pass

        task = asyncio.create_task(consume("c"))
        while "c" not in engine.engine.requests:
            await asyncio.sleep(0.01)
        task.cancel()  # the consumer is cancelled: aborted too
        while stats.num_aborted < 2:
            await asyncio.sleep(0.01)
        await engine.run_on_engine_thread(assert_pool_free, engine)

        stream = await engine.add_request("d", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()
        await engine.shutdown(drain_timeout=0.2)  # too short for 400 tokens: "d" is aborted
        await engine.shutdown()  # a second call is harmless
        with pytest.raises(EngineShutdownError):
            async for _ in stream:
                pass
        with pytest.raises(EngineShutdownError):
            await engine.add_request("e", PROMPT, SamplingParams())

    asyncio.run(main())
    assert stats.num_aborted == 3
    assert not engine.engine.requests


def test_queue_bound_gives_503_with_retry_after(tiny_dir):
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir, max_num_seqs=1, max_waiting_requests=1))
    with ServerThread(build_app(engine, MODEL)) as srv:
        body = dict(model=MODEL, prompt=PROMPT, max_tokens=24, ignore_eos=True)

        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert 200 in codes and 503 in codes and set(codes) == {200, 503}, codes
        for r in responses:
            if r.status_code == 503:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == 503
                assert "max-waiting-requests" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        again = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)  # the burst is over: served again
        assert again.status_code == 200
        wait_until(lambda: not engine.engine.requests)
        assert_pool_free(engine)


def test_engine_failure_gives_500_and_health_503(tiny_dir):
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir))
    with ServerThread(build_app(engine, MODEL)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert http.get("/health").status_code == 200

        def broken_device(inp, feed=None):
            raise RuntimeError("injected device failure")

        # a stream in flight when the engine dies ends with an error event and [DONE]: no hang
        with http.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) as resp:
            events = data_lines(resp)
            assert json.loads(next(events)[6:])["choices"]
            engine.engine.executor.execute_model = broken_device
            rest = list(events)
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "injected device failure" in error["message"] and error["type"] == "InternalServerError"
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 500

        health = http.get("/health")
        assert health.status_code == 503 and "injected device failure" in health.json()["error"]["message"]
        for body in (dict(LONG, max_tokens=4), dict(LONG, max_tokens=4, stream=True)):
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 500
            assert "engine has stopped" in resp.json()["error"]["message"]
            # the same error object streaming or not (a request refused before its stream starts is plain JSON)
            assert set(resp.json()["error"]) == set(error) and resp.json()["error"]["code"] == error["code"]
            assert "injected device failure" in resp.json()["error"]["message"]
        assert http.get("/metrics").status_code == 200
        assert_pool_free(engine)  # the failed engine's requests were aborted, their blocks returned


def test_sigterm_shuts_down_gracefully(tiny_dir, tmp_path):
    """`python -m nanoserve.server` on SIGTERM: the in-flight stream finishes, the process exits 0, in time."""
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "nanoserve.server", "--model", tiny_dir, "--port", str(port), "--device", "cpu",
           "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "4096", "--shutdown-timeout", "20",
           "--served-model-name", MODEL, *SWITCH_FLAGS]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, timeout=120, what="the server to start")
        lines: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                              json=dict(LONG, max_tokens=120, stream=True)) as resp:
                for line in data_lines(resp):
                    lines.append(line)
                    first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(timeout=30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text()
    assert rc == 0, log
    assert elapsed < 30, elapsed
    assert lines[-1] == "data: [DONE]", lines[-3:]  # the in-flight request was allowed to finish
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert "switches: on:" in log and "configuration: model=" in log
    assert "engine shut down" in log and "stopped by SIGTERM" in log
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


# -- the command line ------------------------------------------------------------------------------------------
def test_cli_has_a_flag_pair_per_switch_and_vllm_aliases():
    from nanoserve.server.__main__ import build_parser
    from nanoserve.server.__main__ import engine_config as cli_config

    parser = build_parser()
    for name in Optimizations.names():
        flag = name.replace("_", "-")
        assert cli_config(parser.parse_args([f"--no-{flag}"]), parser).optimizations.as_dict()[name] is False
        assert cli_config(parser.parse_args([f"--{flag}"]), parser).optimizations.as_dict()[name] is True
    cfg = cli_config(parser.parse_args(["--no-enable-prefix-caching", "--enforce-eager", "--max-model-len", "256",
                                        "--tensor-parallel-size", "2", "--enable-expert-parallel", "--seed", "3",
                                        "--max-waiting-requests", "7", "--block-size", "16"]), parser)
    assert not cfg.optimizations.prefix_caching and not cfg.optimizations.cuda_graphs
    assert (cfg.max_model_len, cfg.tensor_parallel_size, cfg.enable_expert_parallel, cfg.seed,
            cfg.max_waiting_requests, cfg.block_size) == (256, 2, True, 3, 7, 16)
    assert cfg.model == "m3-mini" and cfg.optimizations.chunked_prefill
    with pytest.raises(SystemExit):
        cli_config(parser.parse_args(["--enable-prefix-caching", "--no-prefix-caching"]), parser)
    with pytest.raises(SystemExit):
        cli_config(parser.parse_args(["--gpu-memory-utilization", "1.5"]), parser)
    assert cli_config(parser.parse_args(["--worker-timeout", "7.5"]), parser).worker_timeout == 7.5
    assert cli_config(parser.parse_args([]), parser).worker_timeout is None  # $NANOSERVE_WORKER_TIMEOUT, else 30
    with pytest.raises(SystemExit):
        cli_config(parser.parse_args(["--worker-timeout", "-1"]), parser)
    args = parser.parse_args([])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)


def test_worker_timeout_resolution(monkeypatch):
    from nanoserve.distributed.watchdog import DEFAULT_WORKER_TIMEOUT_S, resolve_worker_timeout

    monkeypatch.delenv("NANOSERVE_WORKER_TIMEOUT", raising=False)
    assert resolve_worker_timeout(None) == DEFAULT_WORKER_TIMEOUT_S
    monkeypatch.setenv("NANOSERVE_WORKER_TIMEOUT", "12")
    assert resolve_worker_timeout(None) == 12 and resolve_worker_timeout(3) == 3  # the argument wins
    for bad in ("soon", "-2"):
        monkeypatch.setenv("NANOSERVE_WORKER_TIMEOUT", bad)
        with pytest.raises(ValueError, match="NANOSERVE_WORKER_TIMEOUT"):
            resolve_worker_timeout(None)


def test_engine_imports_no_web_stack():
    """The GPU benchmark machine has no FastAPI / uvicorn / prometheus-client: only nanoserve.server needs them."""
    code = ("import sys, nanoserve, nanoserve.entrypoints.async_engine, nanoserve.engine.llm_engine; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
