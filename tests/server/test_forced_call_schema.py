"""A forced call's arguments validate against the tool's JSON schema, whatever a model picks among the tokens the
format allows: random walks over the token masks of MiniMaxM3ToolCallParser.structural_tag (every allowed token
equally likely, as a random-weight model), read back by the tool parser, checked with jsonschema."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser as R
from nanoserve.parsers.tool_calls import MiniMaxM3ToolCallParser as Parser
from nanoserve.parsers.tools import ToolChoice, check_tools

xgr = pytest.importorskip("xgrammar")

MARKERS = frozenset(("]<]minimax[>[", "<tool_call>", "</tool_call>", "<mm:think>", "</mm:think>"))
SPECIAL = ("]~b]", "]~!b[", "[e~[", "<mm:think>", "</mm:think>", "]<]minimax[>[", "<tool_call>", "</tool_call>",
           "]!p~[")

# every kind of schema the format holds a value to; strings are bounded so that a uniform walk ends
SCHEMAS = {
    "string_bounds": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "code": {"type": "string", "minLength": 2, "maxLength": 3}},
        "required": ["city", "code"]},
    "pattern_enum_const": {"type": "object", "properties": {
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "unit": {"type": "string", "enum": ["C", "F"]},
        "v": {"const": 2}, "mix": {"enum": [1, "auto", True, None]}}, "required": ["zip", "unit", "v", "mix"]},
    "numbers": {"type": "object", "properties": {
        "days": {"type": "integer", "minimum": 1, "maximum": 14}, "t": {"type": "number", "minimum": -5,
                                                                       "maximum": 5},
        "n": {"type": "integer"}, "flag": {"type": "boolean"}, "none": {"type": "null"}},
        "required": ["days", "t", "n", "flag", "none"], "additionalProperties": False},
    "nullable_anyof": {"type": "object", "properties": {
        "note": {"type": ["string", "null"], "maxLength": 4},
        "when": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["now"]}]}},
        "required": ["note", "when"]},
    "nested": {"type": "object", "properties": {
        "legs": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/leg"}},
        "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}},
        "opts": {"type": "object", "properties": {"fast": {"type": "boolean"}}, "required": ["fast"]}},
        "required": ["legs", "opts"], "$defs": {"leg": {"type": "object", "properties": {
            "from": {"type": "string", "maxLength": 6}, "nights": {"type": "integer", "minimum": 0, "maximum": 30}},
            "required": ["from"]}}},
    "free_object": {"type": "object", "properties": {
        "labels": {"type": "object", "maxProperties": 1, "propertyNames": {"maxLength": 3},
                   "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}},
        "required": ["labels"]},
    "required_undeclared": {"type": "object", "properties": {}, "required": ["x"],
                            "additionalProperties": {"type": "boolean"}},
}


@pytest.fixture(scope="module")
def compiler(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return tok, info, xgr.GrammarCompiler(info)


def walk(compiler, tag: dict, seed: int, limit: int = 1500) -> tuple[list[int], str]:
    """A uniform random walk over the format's token masks until it ends (EOS): the tokens and their text."""
    tok, info, comp = compiler
    matcher = xgr.GrammarMatcher(comp.compile_structural_tag(json.dumps(tag)))
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    rng, out = random.Random(seed), []
    while not matcher.is_terminated():
        assert len(out) < limit, tok.decode(out, skip_special_tokens=False)
        matcher.fill_next_token_bitmask(mask)
        allowed = [i for i in range(info.vocab_size) if (int(mask[0, i // 32]) >> (i % 32)) & 1]
        out.append(rng.choice(allowed))
        assert matcher.accept_token(out[-1])
    return out[:-1], tok.decode(out[:-1], skip_special_tokens=False)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_give_schema_valid_arguments(compiler, name):
    """Each schema, named and required, with the markers as tokens (as the server compiles it) and spelled
    (a tokenizer without them): the parser reads one call whose arguments validate; no value holds a marker."""
    tools = check_tools([{"type": "function", "function": {"name": name, "parameters": SCHEMAS[name]}},
                         {"type": "function", "function": {"name": "other", "parameters": {
                             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}])
    for seed, (choice, markers) in enumerate([(ToolChoice("named", name), MARKERS), (ToolChoice("required"), MARKERS),
                                              (ToolChoice("named", name), frozenset())]):
        for k in range(3):
            _, text = walk(compiler, Parser.structural_tag(tools, choice, False, markers), seed * 10 + k)
            content, calls = Parser(tools).parse(text)
            assert content.strip() == "" and len(calls) == 1, text
            args = json.loads(calls[0].arguments)
            schema = SCHEMAS[name] if calls[0].name == name else tools["other"]
            jsonschema.validate(args, schema)
            values = json.dumps(args)
            assert not any(s in values for s in SPECIAL), values


@pytest.mark.parametrize("state", ["open", "none", "closed"])
def test_thinking_before_a_call_holds_no_other_marker(compiler, state):
    """The thinking a forced call allows before it never writes a tool-call or thinking marker other than the
    end of thinking (a call opened inside the thinking would be read as reasoning); the call after it validates."""
    tok = compiler[0]
    tools = check_tools([{"type": "function", "function": {"name": "f", "parameters": SCHEMAS["string_bounds"]}}])
    tag = R.wrap_structural_tag(Parser.structural_tag(tools, ToolChoice("named", "f"), False, MARKERS), state, 12,
                                MARKERS)
    end = tok.convert_tokens_to_ids(R.end)
    others = {tok.convert_tokens_to_ids(m) for m in MARKERS} - {end}
    for seed in range(8):
        ids, text = walk(compiler, tag, seed)
        cut = ids.index(end) + 1 if end in ids else 0
        thinking = ids[1 if state == "none" and ids[0] == tok.convert_tokens_to_ids(R.start) else 0:max(0, cut - 1)]
        assert not others & set(thinking), text
        answer = tok.decode(ids[cut:], skip_special_tokens=False)
        _, calls = Parser(tools).parse(answer)
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["string_bounds"])
