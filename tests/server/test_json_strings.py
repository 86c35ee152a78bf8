"""A JSON output format admits only what json.loads takes: strings whose length the schema bounds (minLength /
maxLength, in values and in property names) hold no raw control character - xgrammar's own rule for them admits a
tab or U+0001 - whatever a model picks among the tokens the format allows (uniform random walks over the token
masks on m3-tiny's byte-level vocabulary, which has a token for every control byte), alone and as the element of a
structural tag the server builds around the thinking."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from nanoserve.engine.structured_output import StructuredOutputManager, format_element
from nanoserve.presets.tokenizer import EOS_ID
from nanoserve.sampling import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "code": {"type": ["string", "null"], "minLength": 2, "maxLength": 4},
    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 5}},
    "labels": {"type": "object", "maxProperties": 2, "propertyNames": {"maxLength": 3},
               "additionalProperties": {"type": "boolean"}},
    "note": {"$ref": "#/$defs/note"}},
    "required": ["name", "code", "tags", "labels", "note"], "additionalProperties": False,
    "$defs": {"note": {"type": "string", "minLength": 1, "maxLength": 6}}}
PARAMS = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def manager(tiny_dir):
    return StructuredOutputManager(tiny_dir, 512, [EOS_ID])


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from nanoserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir)


def formats(manager):
    """The format as a JSON schema, and as the element of a structural tag (the server's thinking_token_budget
    and auto tool-call formats hold it that way)."""
    tag = {"type": "structural_tag", "format": format_element(PARAMS)}
    return {"json": manager.compile(PARAMS), "element": manager.compile(StructuredOutputsParams(structural_tag=tag))}


def walk(compiled, tok, seed: int, limit: int = 400) -> str:
    """A uniform random walk over the format's token masks until it ends (EOS); the text."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, 512)
    rng, out = random.Random(seed), []
    while not matcher.is_terminated():
        assert len(out) < limit, tok.decode(out)
        matcher.fill_next_token_bitmask(mask)
        allowed = [i for i in range(512) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
        out.append(rng.choice(allowed))
        assert matcher.accept_token(out[-1])
    return tok.decode(out[:-1])


def test_bounded_strings_hold_no_control_character(manager):
    for name, compiled in formats(manager).items():
        done = json.dumps({"name": "Zoë", "code": None, "tags": ["a"], "labels": {"ab": True}, "note": "x"},
                          ensure_ascii=False)  # the separators the format writes without free whitespace
        assert xgr.GrammarMatcher(compiled).accept_string(done), name
        empty = '{"name": "", "code": null, "tags": '
        for text in ('{"name": "a\t', '{"name": "a\x01', '{"name": "ok", "code": "\x1f', empty + '["\n',
                     empty + '[], "labels": {"\x02'):
            assert xgr.GrammarMatcher(compiled).accept_string(text[:-1]), (name, text)
            assert not xgr.GrammarMatcher(compiled).accept_string(text), (name, text)


@pytest.mark.parametrize("seed", range(16))
def test_random_outputs_load_as_json(manager, tok, seed):
    for name, compiled in formats(manager).items():
        text = walk(compiled, tok, seed)
        jsonschema.validate(json.loads(text), SCHEMA)
