"""Study: does one bad client stall the others? The latency of GET /health and of a small completion, alone and
while other clients send huge prompts. Its answer is docs/operating.md's table of the server's parsing choices.

    python -m studies.event_loop                       # from the repository root: m3-tiny on the CPU, 10 MB prompts
    python -m studies.event_loop --bad-prompt-chars 1000000 --server-arg=--max-prompt-chars=0
    python -m studies.event_loop --url http://127.0.0.1:8000 --model NAME

It measures the server's event loop, not the model: run it on the CPU with m3-tiny. Two phases of `--duration`
seconds each: `quiet` (the probe alone) and `loaded` (`--bad-clients` processes each sending prompts of
`--bad-prompt-chars` characters back to back, prepared once, so the senders cost the probe nothing). The probe,
in its own process, alternates GET /health and a one-token completion of a short prompt and records each latency.
The table gives p50 / p99 / max per phase and what the loaded phase added to the p99.

With the server's defaults a 10 MB prompt is parsed in one of the server's worker processes and refused
(--max-prompt-chars) before it is tokenized; `--server-arg=--parse-processes=0` parses it in the server process
instead, `--server-arg=--max-prompt-chars=0` makes the server tokenize it too (in its thread pool), and
`--server-arg=--offload-min-bytes=1000000000` puts the tokenizing back on the event loop, to see the difference.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

SMALL_PROMPT = "Hello, how are you today?"


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    a = np.asarray(values) * 1e3
    return {"n": len(values), "p50_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max())}


def _bad_client(url: str, body: bytes, stop: mp.Event, counts: dict) -> None:
    """Send `body` to /v1/completions back to back until `stop`; count the statuses."""
    import httpx

    with httpx.Client(timeout=600, headers={"Content-Type": "application/json"}) as http:
        while not stop.is_set():
            try:
                code = str(http.post(f"{url}/v1/completions", content=body).status_code)
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            counts[code] = counts.get(code, 0) + 1


def _probe(url: str, model: str, seconds: float) -> dict[str, list[float]]:
    import httpx

    health, small = [], []
    body = {"model": model, "prompt": SMALL_PROMPT, "max_tokens": 1}
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            r = http.get("/health")
            health.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"/health answered {r.status_code}: {r.text[:200]}")
            t0 = time.perf_counter()
            r = http.post("/v1/completions", json=body)
            small.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"the small completion answered {r.status_code}: {r.text[:200]}")
            time.sleep(0.01)
    return {"health": health, "small": small}


def run(url: str, model: str, duration: float, bad_clients: int, bad_prompt_chars: int) -> dict:
    _probe(url, model, 1.0)  # warm-up
    quiet = _probe(url, model, duration)
    body = json.dumps({"model": model, "prompt": "x" * bad_prompt_chars, "max_tokens": 1}).encode()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        stop = ctx.Event()
        counts = [manager.dict() for _ in range(bad_clients)]
        procs = [ctx.Process(target=_bad_client, args=(url, body, stop, c), daemon=True) for c in counts]
        for p in procs:
            p.start()
        time.sleep(1.0)  # the first bodies are on their way
        loaded = _probe(url, model, duration)
        stop.set()
        for p in procs:
            p.join(timeout=600)
        statuses: dict[str, int] = {}
        for c in counts:
            for k, v in c.items():
                statuses[k] = statuses.get(k, 0) + v
    result = {"bad_clients": bad_clients, "bad_prompt_chars": bad_prompt_chars, "duration_s": duration,
              "bad_statuses": statuses}
    for phase, data in (("quiet", quiet), ("loaded", loaded)):
        result[phase] = {k: _percentiles(v) for k, v in data.items()}
    result["added_p99_ms"] = {k: result["loaded"][k]["p99_ms"] - result["quiet"][k]["p99_ms"]
                              for k in ("health", "small")}
    return result


def print_table(r: dict) -> None:
    print(f"{r['bad_clients']} client(s) sending {r['bad_prompt_chars']:,}-character prompts; their answers: "
          f"{r['bad_statuses']}")
    print(f"{'':>8} {'phase':>7} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for what in ("health", "small"):
        for phase in ("quiet", "loaded"):
            m = r[phase][what]
            print(f"{what:>8} {phase:>7} {m['n']:>5} {m['p50_ms']:>8.1f} {m['p99_ms']:>8.1f} {m['max_ms']:>8.1f}")
        print(f"{what:>8} p99 added by the bad clients: {r['added_p99_ms'][what]:.1f} ms")


def start_server(model: str, port: int, server_args: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nanoserve.server", "--model", model, "--device", "cpu", "--port", str(port),
           "--log-level", "warning", *server_args]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.event_loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (default: start m3-tiny on the CPU)")
    ap.add_argument("--model", default="m3-tiny", help="the model to start, or the served name at --url")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--server-arg", action="append", default=[], help="an extra flag for the started server")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--bad-clients", type=int, default=2)
    ap.add_argument("--bad-prompt-chars", type=int, default=10_000_000)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        proc = start_server(args.model, args.port, args.server_arg, os.devnull)
    try:
        wait_healthy(url, proc)
        result = run(url, args.model, args.duration, args.bad_clients, args.bad_prompt_chars)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    result["server_args"] = args.server_arg
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
