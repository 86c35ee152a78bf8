"""Structured outputs over HTTP, against a real uvicorn server (m3-tiny, random weights: every parseable output is
the grammar mask's doing): response_format json_schema / json_object through the openai client, vLLM's
structured_outputs field on both endpoints, streaming, logprobs of masked tokens, and the 400s - a schema xgrammar
cannot compile, a bad structured_outputs, the removed guided_* fields - with the KV pool free afterwards."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from tests.helpers.server_utils import SERVED_MODEL, post, wait_until

MODEL = SERVED_MODEL  # conftest's engine, app, server and client
CHAT = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def assert_pool_free(engine: AsyncLLMEngine) -> None:
    eng = engine.engine
    wait_until(lambda: not eng.requests and not engine.num_in_flight, what="the engine to go idle")
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.block_manager.check_integrity()


def test_openai_client_response_format_json_schema_returns_parseable_json(client, engine):
    resp = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0.0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    # the same through the completions endpoint, streaming: the pieces join into the same kind of document
    stream = client.completions.create(
        model=MODEL, prompt="Person:", temperature=0.0, max_tokens=60, stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                    "structured_outputs": {"disable_any_whitespace": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert_pool_free(engine)


def test_json_object_and_structured_outputs_regex_choice_grammar(server, client, engine):
    obj = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0.0, max_tokens=40,
                                         response_format={"type": "json_object"},
                                         extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    content = obj.choices[0].message.content
    assert content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    r = post(server, "/v1/completions", {"prompt": "Code:", "max_tokens": 20, "temperature": 0.0,
                                     "structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}).json()
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r["choices"][0]["text"]) and r["choices"][0]["finish_reason"] == "stop"
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0.0, "n": 2,
                                          "seed": 5, "structured_outputs": {"choice": ["left", "right"]}}).json()
    assert [c["message"]["content"] in ("left", "right") for c in r["choices"]] == [True, True]
    r = post(server, "/v1/completions", {"prompt": "Bits:", "max_tokens": 12, "temperature": 0.0,
                                     "structured_outputs": {"grammar": 'root ::= ("0" | "1"){4} "!"'}}).json()
    assert re.fullmatch("[01]{4}!", r["choices"][0]["text"])
    assert_pool_free(engine)


def test_logprobs_of_masked_alternatives_are_finite(server):
    """Only two tokens are allowed at the first step, so most of the top 5 alternatives are masked (-inf): they are
    sent as -9999.0, as vLLM does, since JSON has no infinity."""
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0.0, "logprobs": True,
                                          "top_logprobs": 5, "structured_outputs": {"choice": ["a", "b"]}})
    assert r.status_code == 200, r.text
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    values = [t["logprob"] for t in first["top_logprobs"]]
    assert first["logprob"] > -9999.0 and -9999.0 in values


@pytest.mark.parametrize("path, body, param, message", [
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "bogus"}}}},
     "response_format", r"response_format\.json_schema\.schema cannot be compiled: .*bogus"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}},
     "structured_outputs", r"structured_outputs\.regex cannot be compiled: .*parenthesis"),
    ("completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nothing"}},
     "structured_outputs", r"structured_outputs\.grammar cannot be compiled"),
    ("completions", {"prompt": "x", "structured_outputs": {"json": {"type": "object"}, "regex": "a"}},
     "structured_outputs", "exactly one"),
    ("completions", {"prompt": "x", "structured_outputs": {"regex": "a", "backend": "outlines"}},
     "structured_outputs", "unknown field.*backend"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"},
                          "structured_outputs": {"regex": "a"}}, "response_format", "cannot be combined"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "x"}}},
     "response_format", r"json_schema\.schema: this field is required"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format", "type"),
    ("completions", {"prompt": "x", "guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
    ("chat/completions", {"messages": CHAT, "guided_choice": ["a"]}, "guided_choice", "structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field(server, engine, path, body, param, message):
    r = post(server, f"/v1/{path}", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(message, err["message"]), err
    assert_pool_free(engine)


def test_server_keeps_serving_after_bad_schemas(server, client):
    for _ in range(2):
        assert post(server, "/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": 7}}}
                    ).status_code == 400
    ok = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0.0)
    assert len(ok.choices[0].text) > 0
