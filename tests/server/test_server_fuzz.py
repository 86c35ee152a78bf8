"""Property-based fuzzing from the server's own /openapi.json (schemathesis): request bodies that fit every POST
route's schema and bodies that break it, sent to `python -m nanoserve.server` as a process of its own (with the
tool and reasoning parsers on, so their request paths are fuzzed too). No request shape may yield a 5xx: a body
the server cannot serve is a 4xx naming what is wrong. The budget is bounded (a fixed number of examples per
operation, derandomized, so a run is repeatable); generation is kept short (n and the token limits capped) so the
run costs seconds of CPU, not minutes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.server_utils import AGENT_FLAGS, ServerProcess

schemathesis = pytest.importorskip("schemathesis")  # (a test dependency; a GPU machine's wheels may lack it)

EXAMPLES = 30  # per operation and generation mode
CAPS = {"n": 2, "best_of": 2, "max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8,
        "thinking_token_budget": 8}
"""Fields that only make a valid request longer to serve: capped (when an integer above the cap) so the run stays
cheap; a value the server must refuse is still sent as generated."""


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    with ServerProcess(tiny_dir, log, "--max-model-len", "256", *AGENT_FLAGS, name="tiny") as srv:
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
