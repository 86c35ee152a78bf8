"""Property-based fuzzing from the server's own /openapi.json (schemathesis): request bodies that fit every POST
route's schema and bodies that break it, sent to `python -m nanoserve.server` as a process of its own (with the
tool and reasoning parsers on, so their request paths are fuzzed too). No request shape may yield a 5xx: a body
the server cannot serve is a 4xx naming what is wrong. The budget is bounded (a fixed number of examples per
operation, derandomized, so a run is repeatable); generation is kept short (n and the token limits capped) so the
run costs seconds of CPU, not minutes. The server serves m3-tiny-vl (m3-tiny with a tiny vision tower), so image
parts reach the decoder: a second test sends images of random sizes and formats, whole or broken, through the
chat and Anthropic APIs - a readable image gets a 200, anything else a 400, never a 5xx or a stalled server."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.images import data_url
from tests.helpers.server_utils import AGENT_FLAGS, ServerProcess

schemathesis = pytest.importorskip("schemathesis")  # (a test dependency; a GPU machine's wheels may lack it)

EXAMPLES = 30  # per operation and generation mode
CAPS = {"n": 2, "best_of": 2, "max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8,
        "thinking_token_budget": 8}
"""Fields that only make a valid request longer to serve: capped (when an integer above the cap) so the run stays
cheap; a value the server must refuse is still sent as generated."""


@pytest.fixture(scope="module")
def server(tiny_vl_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with ServerProcess(tiny_vl_dir, log, "--max-model-len", "256", *AGENT_FLAGS, name="tiny") as srv:
        yield srv


HI = [{"role": "user", "content": "Hi"}]
BASES = {"/v1/completions": {"prompt": "Hi"}, "/v1/chat/completions": {"messages": HI},
         "/invocations": {"prompt": "Hi"}, "/v1/messages": {"messages": HI, "max_tokens": 4},
         "/v1/messages/count_tokens": {"messages": HI}, "/v1/responses": {"input": "Hi"},
         "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [5]}}
"""What a generated body lacks to be servable: filled in (with the served model's name) for half the examples,
so that the generated fields reach the code behind the first checks instead of stopping at a missing field."""


def prepared(body, path: str, fill: bool):
    if not isinstance(body, dict):
        return body
    if fill and path in BASES:
        body = {**BASES[path], **body, "model": "tiny"}
    return {k: min(v, CAPS[k]) if k in CAPS and type(v) is int and v > CAPS[k] else v for k, v in body.items()}


@pytest.mark.slow
def test_no_request_shape_gets_a_5xx(server):
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"} <= {op.path for op in posts}
    failures = []
    for op in operations:
        strategies = [op.as_strategy(generation_mode=mode) for mode in (GenerationMode.POSITIVE,
                                                                        GenerationMode.NEGATIVE)]

        @settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.one_of(*strategies), st.booleans())
        def run(case, fill):
            case.body = prepared(case.body, op.path, fill)
            response = case.call(base_url=server.url, timeout=120)
            if response.status_code >= 500:
                failures.append((op.method, op.path, case.body, response.status_code, response.text[:300]))

        run()
    assert not failures, "\n".join(map(repr, failures[:10]))
    assert server.proc.poll() is None, server.log()


FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
READ = ("PNG", "JPEG", "WEBP")  # what the processor accepts


@st.composite
def images(draw) -> tuple[bytes, str, bool]:
    """(bytes, media type, whether the server must read it): a random image in a random format, possibly broken
    (cut short, bytes overwritten, garbage in front) or sent under another media type."""
    import io

    import numpy as np
    from PIL import Image

    width, height = draw(st.integers(1, 120)), draw(st.integers(1, 120))
    fmt = draw(st.sampled_from(FORMATS))
    pixels = np.random.default_rng(draw(st.integers(0, 1000))).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    data = out.getvalue()
    damage = draw(st.sampled_from(["none", "none", "cut", "overwrite", "prefix"]))
    if damage == "cut":
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif damage == "overwrite":
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at + 16:]
    elif damage == "prefix":
        data = draw(st.binary(min_size=1, max_size=8)) + data
    media_type = draw(st.sampled_from(["image/png", "image/jpeg", "image/webp", "image/gif"]))
    readable = damage == "none" and fmt in READ and max(width, height) / min(width, height) < 200
    return data, media_type, readable


@pytest.mark.slow
def test_no_image_gets_a_5xx(server):
    import base64

    import httpx

    failures = []

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(images(), st.booleans())
    def run(image, anthropic):
        data, media_type, readable = image
        if anthropic:
            body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                             "data": base64.b64encode(data).decode()}},
                {"type": "text", "text": "What is this?"}]}]}
            path = "/v1/messages"
        else:
            body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {
                    "url": data_url(data, media_type)}}]}]}
            path = "/v1/chat/completions"
        response = httpx.post(f"{server.url}{path}", json=body, timeout=120)
        status = response.status_code
        if status >= 500 or (readable and status != 200) or status not in (200, 400):
            failures.append((path, len(data), media_type, readable, status, response.text[:300]))

    run()
    assert not failures, "\n".join(map(repr, failures[:10]))
    assert server.healthy(), server.log()
