"""One bad client cannot stall the server, and the server ends well: against real `python -m nanoserve.server`
processes - the event loop answers /health while huge prompts are refused or tokenized, request limits (413, 400),
half-sent headers or body are dropped (408, connection closed), SIGTERM drains in order (error events + [DONE], JSON
errors, 503 for new requests, exit 0), a second signal exits at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.helpers.server_utils import MAX_MODEL_LEN, ServerProcess

MODEL = "tiny"
BODY_LIMIT = 12_000_000
PROMPT_CHARS = 500_000
BODY_TIMEOUT = 1.0
HEADER_TIMEOUT = 1.0


def words(n_chars: int) -> str:
    """Varied text (BPE merges do not collapse it), `n_chars` long."""
    base = "".join(f"w{i % 997} " for i in range(n_chars // 4 + 1))
    return base[:n_chars]


def limited_server(tiny_dir, tmp_path_factory, http: str):
    log = tmp_path_factory.mktemp("robust") / "server.log"
    return ServerProcess(tiny_dir, log, "--max-request-body-bytes", str(BODY_LIMIT), "--max-prompt-chars",
                         str(PROMPT_CHARS), "--max-prompts-per-request", "4", "--request-body-timeout",
                         str(BODY_TIMEOUT), "--request-header-timeout", str(HEADER_TIMEOUT), "--http", http)


@pytest.fixture(scope="module")
def srv(tiny_dir, tmp_path_factory):
    """The server with its default HTTP parser (httptools)."""
    with limited_server(tiny_dir, tmp_path_factory, "auto") as s:
        yield s


@pytest.fixture(scope="module")
def srv_h11(tiny_dir, tmp_path_factory):
    """The same limits with uvicorn's other parser, h11 (the deadlines live in each parser's connection class)."""
    with limited_server(tiny_dir, tmp_path_factory, "h11") as s:
        yield s


both_parsers = pytest.mark.parametrize("server_fixture", ["srv", "srv_h11"])


def test_event_loop_answers_health_while_huge_prompts_arrive(srv):
    """A 10 MB prompt is refused before tokenizing; a 400k-character prompt is tokenized in the thread pool. While
    both are handled, /health keeps answering quickly: the slow work is not on the event loop."""
    results: dict[str, tuple[httpx.Response, float]] = {}

    def send(key: str, body: bytes) -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/v1/completions", timeout=120, content=body,
                       headers={"Content-Type": "application/json"})
        results[key] = (r, time.monotonic() - t0)

    # encoded up front: building a 10 MB body in the sender thread would hold this process's GIL and delay the
    # /health polls here, not in the server
    bodies = {key: json.dumps(dict(model=MODEL, prompt=prompt, max_tokens=1)).encode()
              for key, prompt in (("huge", "x" * 10_000_000), ("big", words(400_000)))}
    senders = [threading.Thread(target=send, args=item) for item in bodies.items()]
    latencies = []
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        for t in senders:
            t.start()
        while any(t.is_alive() for t in senders):
            t0 = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.02)
    huge, _ = results["huge"]
    assert huge.status_code == 400, huge.text
    assert "--max-prompt-chars" in huge.json()["error"]["message"] and huge.json()["error"]["param"] == "prompt"
    big, big_seconds = results["big"]
    assert big.status_code == 400 and "max_model_len" in big.json()["error"]["message"], big.text  # tokenized
    worst = max(latencies)
    # tokenizing on the loop would have held /health for about as long as the big request took
    assert worst < min(1.0, big_seconds / 4), (worst, big_seconds, len(latencies))


def test_request_limits(srv):
    url = f"{srv.url}/v1/completions"
    big = httpx.post(url, content=b"{" + b" " * BODY_LIMIT + b"}", timeout=30)
    assert big.status_code == 413 and "--max-request-body-bytes" in big.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(13):
            yield b" " * 1_000_000

    chunked = httpx.post(url, content=chunks(), timeout=30, headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413, chunked.text
    # Anthropic's route answers in Anthropic's error shape, whether the middleware or the route refuses the body
    for body in (b"{" + b" " * BODY_LIMIT + b"}", chunks()):
        big = httpx.post(f"{srv.url}/v1/messages", content=body, timeout=30,
                         headers={"Content-Type": "application/json"})
        assert big.status_code == 413 and big.json()["type"] == "error", big.text
        assert big.json()["error"]["type"] == "request_too_large", big.text
        assert "--max-request-body-bytes" in big.json()["error"]["message"]
    many = httpx.post(url, json=dict(model=MODEL, prompt=["a", "b", "c", "d", "e"], max_tokens=1), timeout=30)
    assert many.status_code == 400 and "--max-prompts-per-request" in many.json()["error"]["message"]
    assert many.json()["error"]["param"] == "prompt"
    chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=30,
                      json=dict(model=MODEL, messages=[{"role": "user", "content": "y" * (PROMPT_CHARS + 1)}]))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
    assert "--max-prompt-chars" in chat.json()["error"]["message"]
    ok = httpx.post(url, json=dict(model=MODEL, prompt=["a", "b"], max_tokens=2), timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_prompts_too_long_to_tokenize_keep_the_order_of_errors(srv):
    """A body of 1 MiB or more is parsed in a worker process, which sends back only the length of a prompt too long
    to tokenize; the server still checks in the usual order - the model name (404), the sampling fields, the prompt
    count, then the characters - and a list keeps its short prompts."""
    url = f"{srv.url}/v1/completions"
    huge = "x" * 2_000_000

    def post(**fields):
        r = httpx.post(url, json=dict(dict(model=MODEL, max_tokens=1), **fields), timeout=60)
        return r.status_code, r.json()["error"]

    code, error = post(model="nope", prompt=huge)
    assert code == 404 and error["param"] == "model", error
    code, error = post(prompt=huge, temperature=-1.0)
    assert code == 400 and error["param"] == "temperature", error
    code, error = post(prompt=[huge] * 5)
    assert code == 400 and "--max-prompts-per-request" in error["message"], error
    code, error = post(prompt=["Hi", huge])
    assert code == 400 and error["param"] == "prompt", error
    assert f"{len(huge)} characters" in error["message"] and "--max-prompt-chars" in error["message"]
    code, error = post(prompt=["y" * (PROMPT_CHARS + 1)])  # a small body, parsed in the server: the same answer
    assert code == 400 and f"{PROMPT_CHARS + 1} characters" in error["message"], error
    tok = httpx.post(f"{srv.url}/tokenize", json=dict(model=MODEL, prompt=huge), timeout=60)
    assert tok.status_code == 400 and "--max-prompt-chars" in tok.json()["error"]["message"], tok.text
    assert srv.healthy()


@both_parsers
def test_half_sent_body_is_answered_408_and_dropped(server_fixture, request):
    srv = request.getfixturevalue(server_fixture)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        t0 = time.monotonic()
        data = b""
        while chunk := s.recv(65536):  # until the server closes the connection
            data += chunk
        elapsed = time.monotonic() - t0
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"--request-body-timeout" in data
    assert BODY_TIMEOUT * 0.9 <= elapsed < BODY_TIMEOUT + 5, elapsed
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200


def read_until_closed(s: socket.socket, drip: bytes = b"") -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took; `drip`: bytes to send
    one by one, 0.2 s apart, while waiting (a client that trickles its headers)."""
    t0 = time.monotonic()
    data = b""
    s.settimeout(0.2 if drip else 10)
    while True:
        assert time.monotonic() - t0 < 15, "the server did not close the connection"
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            assert drip, "the server did not close the connection"
            try:
                s.sendall(drip[:1])
            except OSError:  # closed by the server meanwhile
                pass
            drip = drip[1:] or b"x"
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - t0


@both_parsers
def test_stalled_headers_are_answered_408_and_dropped(server_fixture, request):
    """Half a request line and headers, then nothing; headers trickled a byte at a time; a connection that sends
    nothing; half of a second request on a kept-alive connection: each is closed within --request-header-timeout
    (408 in OpenAI's shape where part of a request came), while the server keeps answering others."""
    srv = request.getfixturevalue(server_fixture)
    results: dict[str, tuple[bytes, float]] = {}
    half = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"

    def client(key: str) -> None:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
            if key == "half":
                s.sendall(half)
                results[key] = read_until_closed(s)
            elif key == "drip":
                results[key] = read_until_closed(s, drip=half * 4)
            elif key == "silent":
                results[key] = read_until_closed(s)
            else:  # kept alive: one whole request, its answer, then half of the next one
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                first = b""
                while b"\r\n\r\n" not in first or not first.endswith(b"}"):
                    first += s.recv(65536)
                s.sendall(b"GET /heal")
                data, elapsed = read_until_closed(s)
                results[key] = (first, 0.0)
                results["second"] = (data, elapsed)

    threads = [threading.Thread(target=client, args=(k,)) for k in ("half", "drip", "silent", "kept")]
    for t in threads:
        t.start()
    with httpx.Client(base_url=srv.url, timeout=5) as http:
        while any(t.is_alive() for t in threads):  # others are served meanwhile
            assert http.get("/health").status_code == 200
            time.sleep(0.05)
    for t in threads:
        t.join()
    assert results["kept"][0].startswith(b"HTTP/1.1 200"), results["kept"]
    for key in ("half", "drip", "second"):
        data, elapsed = results[key]
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), (key, data[:300])
        error = json.loads(body)["error"]
        assert error["code"] == 408 and "--request-header-timeout" in error["message"], (key, error)
        assert HEADER_TIMEOUT * 0.9 <= elapsed < HEADER_TIMEOUT + 3, (key, elapsed)
    data, elapsed = results["silent"]
    assert data == b"" and HEADER_TIMEOUT * 0.9 <= elapsed < HEADER_TIMEOUT + 3, (data, elapsed)
    ok = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="Hi", max_tokens=2), timeout=30)
    assert ok.status_code == 200, ok.text


def sse_lines(resp: httpx.Response) -> list[str]:
    return [line for line in resp.iter_lines() if line.startswith("data: ")]


def test_sigterm_aborts_what_outlives_the_timeout_then_exits_0(tiny_dir, tmp_path):
    """Requests longer than --shutdown-timeout: the stream ends with an error event and [DONE], the non-streaming
    request gets a JSON error, a request arriving during the drain gets 503 + Retry-After; exit status 0."""
    # 4000 tokens outlive the 3 s timeout on any machine
    long = dict(model=MODEL, prompt="Long prompts are split", max_tokens=4000, ignore_eos=True)
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--shutdown-timeout", "3", "--max-model-len", "4096",
                       "--kv-cache-tokens", "8192") as srv:
        streamed: list[str] = []
        answers: dict[str, httpx.Response] = {}
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(long, stream=True), timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streamed.append(line)
                        first.set()

        def plain() -> None:
            answers["plain"] = httpx.post(f"{srv.url}/v1/completions", json=long, timeout=60)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert first.wait(60)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        late = httpx.post(f"{srv.url}/v1/completions", json=dict(long, max_tokens=2), timeout=10)
        late_messages = httpx.post(f"{srv.url}/v1/messages", timeout=10, json=dict(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]))
        health = httpx.get(f"{srv.url}/health", timeout=10)
        rc = srv.proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(timeout=10)
        log = srv.log()
    assert rc == 0, log
    assert 3 <= elapsed < 15, elapsed
    assert late.status_code == 503 and int(late.headers["Retry-After"]) >= 1
    assert late.json()["error"]["code"] == 503 and "shutting down" in late.json()["error"]["message"]
    assert late_messages.status_code == 503 and int(late_messages.headers["Retry-After"]) >= 1
    assert late_messages.json()["type"] == "error", late_messages.text
    assert late_messages.json()["error"]["type"] == "overloaded_error"
    assert health.status_code == 503
    assert streamed[-1] == "data: [DONE]", streamed[-3:]
    error = json.loads(streamed[-2][6:])["error"]
    assert "shutting down" in error["message"], error
    plain_answer = answers["plain"]
    assert plain_answer.status_code == 503, plain_answer.text
    assert plain_answer.headers["content-type"] == "application/json"
    assert "shutting down" in plain_answer.json()["error"]["message"]
    assert "engine shut down" in log and "stopped by SIGTERM" in log


def test_second_signal_exits_at_once(tiny_dir, tmp_path):
    long = dict(model=MODEL, prompt="Long prompts are split", max_tokens=MAX_MODEL_LEN - 20, ignore_eos=True,
                stream=True)
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--shutdown-timeout", "600") as srv:
        first = threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, timeout=60) as r:
                    for _ in r.iter_lines():
                        first.set()
            except httpx.HTTPError:
                pass  # the process is gone mid-stream: that is the point

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert srv.proc.poll() is None  # draining (up to 600 s)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        rc = srv.proc.wait(timeout=10)
        reader.join(timeout=10)
    assert rc == 128 + signal.SIGINT and time.monotonic() - t0 < 5


def worker_pids(pid: int) -> list[int]:
    """The tensor-parallel workers the server process spawned (its children, less multiprocessing's helpers)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    workers = []
    for c in children:
        with open(f"/proc/{c}/cmdline", "rb") as f:
            cmd = f.read()
        if b"resource_tracker" not in cmd and b"forkserver" not in cmd:
            workers.append(c)
    return workers


def test_a_dead_worker_turns_every_route_and_exits_1(tiny_dir, tmp_path):
    """TP=2 on gloo: a worker killed while the server is idle. /health turns 503, the API routes (/v1/models
    included) answer 500 naming the worker, and the process exits with status 1 for its supervisor."""
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--tensor-parallel-size", "2") as srv:
        assert httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="Hi", max_tokens=2),
                          timeout=60).status_code == 200
        [worker] = worker_pids(srv.proc.pid)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        health = models = messages = None
        while time.monotonic() - t0 < 10:
            try:
                health = httpx.get(f"{srv.url}/health", timeout=10)
                models = httpx.get(f"{srv.url}/v1/models", timeout=10)
                messages = httpx.post(f"{srv.url}/v1/messages", timeout=10, json=dict(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]))
            except httpx.TransportError:
                break  # already gone
            if health.status_code == 503:
                break
            time.sleep(0.05)
        rc = srv.proc.wait(timeout=30)
        log = srv.log()
    assert health is not None and health.status_code == 503, log
    assert "worker 1 died" in health.json()["error"]["message"]
    assert models.status_code == 500 and "worker 1 died" in models.json()["error"]["message"], models.text
    assert messages.status_code == 500 and messages.json()["type"] == "error", messages.text  # Anthropic's shape
    assert "worker 1 died" in messages.json()["error"]["message"]
    assert rc == 1, log


HANG_TIMEOUT = 4.0
"""--worker-timeout in the stopped-worker test: short, so the test is quick."""


def test_a_stopped_worker_fails_requests_and_exits_1_within_the_worker_timeout(tiny_dir, tmp_path):
    """TP=2 on gloo: the worker is alive but stopped (SIGSTOP) when a streaming and a plain request arrive. Rank 0
    must not wait for it in a collective: within --worker-timeout the stream gets an error event and [DONE], the
    plain request a 500 JSON error, both naming the worker, /health turns 503, and the process exits 1."""
    plain_body = dict(model=MODEL, prompt="Hi", max_tokens=4, ignore_eos=True)
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--tensor-parallel-size", "2", "--worker-timeout",
                       str(HANG_TIMEOUT)) as srv:
        assert httpx.post(f"{srv.url}/v1/completions", json=plain_body, timeout=60).status_code == 200
        [worker] = worker_pids(srv.proc.pid)
        streamed: list[str] = []
        answers: dict[str, httpx.Response] = {}
        health: list[httpx.Response] = []
        done = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=dict(plain_body, stream=True),
                              timeout=60) as r:
                streamed.extend(line for line in r.iter_lines() if line.startswith("data: "))

        def plain() -> None:
            answers["plain"] = httpx.post(f"{srv.url}/v1/completions", json=plain_body, timeout=60)

        def probe() -> None:  # /health until the server is gone
            while not done.is_set():
                try:
                    health.append(httpx.get(f"{srv.url}/health", timeout=5))
                except httpx.TransportError:
                    return
                time.sleep(0.05)

        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            threads = [threading.Thread(target=f) for f in (stream, plain, probe)]
            for t in threads:
                t.start()
            rc = srv.proc.wait(timeout=HANG_TIMEOUT + 30)
            elapsed = time.monotonic() - t0
            done.set()
            for t in threads:
                t.join(timeout=10)
        finally:
            done.set()
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(worker, sig)
                except ProcessLookupError:
                    pass
        log = srv.log()
    print(f"\n[hang] worker stopped -> server exited {rc} after {elapsed:.2f} s")
    verdict = f"tensor-parallel worker 1 did not answer within {HANG_TIMEOUT:g} s"
    assert rc == 1, log
    assert HANG_TIMEOUT * 0.75 <= elapsed < HANG_TIMEOUT + 8, (elapsed, log)  # silence counts from the last beat
    answer = answers["plain"]
    assert answer.status_code == 500 and answer.headers["content-type"] == "application/json", answer.text
    assert verdict in answer.json()["error"]["message"], answer.text
    assert streamed[-1] == "data: [DONE]", streamed[-3:]
    error = json.loads(streamed[-2][6:])["error"]
    assert error["code"] == 500 and verdict in error["message"], error
    unhealthy = [r for r in health if r.status_code != 200]
    assert unhealthy and unhealthy[0].status_code == 503 and verdict in unhealthy[0].text, [r.text for r in health]
