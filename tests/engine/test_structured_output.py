"""Structured outputs, the parts below the engine loop: StructuredOutputsParams validation, spec normalisation,
compilation with xgrammar (cached, errors as ValueErrors naming the field), and the grammar bitmask in the sampler
(constrained rows only; every drawn token allowed by the grammar; greedy rows take the masked argmax).
The engine-level behaviour is in test_structured_output_engine.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from nanoserve.engine.sequence import Sequence
from nanoserve.engine.structured_output import StructuredOutputManager, choice_grammar, format_element, grammar_key
from nanoserve.engine.tokenizer import load_tokenizer
from nanoserve.presets.tokenizer import EOS_ID, VOCAB_SIZE
from nanoserve.runner.grammar_mask import MaskUploader
from nanoserve.runner.sampler import Sampler
from nanoserve.sampling import SamplingParams, StructuredOutputsParams

PADDED_VOCAB = VOCAB_SIZE + 24
"""Logits wider than the tokenizer, as a model whose embedding rows are padded: the extra ids are never allowed."""


def sp(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=max_tokens, **kw)


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def manager(tiny_dir) -> StructuredOutputManager:
    return StructuredOutputManager(tiny_dir, PADDED_VOCAB, [EOS_ID], max_batch=2)


# -- params and compilation ---------------------------------------------------------------------------------
def test_params_need_exactly_one_constraint_and_name_bad_fields():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one.*json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="whitespace_pattern"):
        StructuredOutputsParams(json_object=True, whitespace_pattern=r"\s*")
    with pytest.raises(ValueError, match="unknown field.*backend"):
        StructuredOutputsParams.from_dict({"regex": "a", "backend": "x"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


def test_grammar_key_keeps_property_order_and_forbids_extra_properties_on_request():
    key = grammar_key(so(json=json.dumps({"properties": {"b": {}, "a": {}}}), disable_additional_properties=True))
    assert list(json.loads(key.spec)["properties"]) == ["b", "a"]
    assert json.loads(key.spec)["additionalProperties"] is False
    assert grammar_key(so(json={"type": "object"})) == grammar_key(so(json='{"type": "object"}'))


def test_bad_specs_are_value_errors_with_xgrammar_message(manager):
    m = manager
    with pytest.raises(ValueError, match=r"structured_outputs\.json cannot be compiled: .*bogus"):
        m.compile(so(json={"type": "bogus"}))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex cannot be compiled: .*parenthesis"):
        m.compile(so(regex="(ab"))
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar cannot be compiled: .*not defined"):
        m.compile(so(grammar="root ::= missing"))
    with pytest.raises(ValueError, match="not valid JSON"):
        m.compile(so(json="{nope"))


def test_compiled_grammars_are_cached_per_spec(manager):
    m = manager
    a = m.compile(so(regex="cache-[0-9]"))
    n = m.num_compiled
    assert m.compile(so(regex="cache-[0-9]")) is a and m.num_compiled == n
    m.compile(so(regex="cache-[0-9]+"))
    assert m.num_compiled == n + 1


def test_choice_grammar_escapes_quotes_backslashes_and_newlines(manager):
    choices = ['say "hi"', "back\\slash", "two\nlines"]
    assert choice_grammar(["a"]) == 'root ::= "a"'
    m = manager
    compiled = m.compile(so(choice=choices))
    for c in choices:
        g = m.new_grammar(compiled)
        assert g.matcher.accept_string(c) and g.matcher.is_completed()
    g = m.new_grammar(compiled)
    assert not g.matcher.accept_string("say hi")


@pytest.mark.parametrize("params, good, bad", [
    (so(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}), '{"n": 12}', '{"m": 1}'),
    (so(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        disable_any_whitespace=True), '{"n": 12}', '{ "n": 12}'),
    (so(json_object=True), '{"a": [1]}', "[1]"),
    (so(regex="x[0-9]+"), "x42", "y42"),
    (so(choice=["yes", "no"]), "no", "maybe"),
    (so(grammar='root ::= "a" "b"*'), "abb", "ba"),
    (so(structural_tag={"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}), "ok", "no"),
], ids=["json", "json-compact", "json_object", "regex", "choice", "grammar", "structural_tag"])
def test_format_element_holds_the_same_language_inside_a_larger_format(manager, params, good, bad):
    """Each constraint as an element after a prefix (what thinking_token_budget builds): the prefix, then exactly
    what the constraint alone accepts."""
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "P:"}, format_element(params)]}}
    compiled = manager.compile(so(structural_tag=tag))
    g = manager.new_grammar(compiled)
    assert g.matcher.accept_string("P:" + good) and g.matcher.is_completed()
    g = manager.new_grammar(compiled)
    assert not (g.matcher.accept_string("P:" + bad) and g.matcher.is_completed())


# -- the mask in the sampler --------------------------------------------------------------------------------
def _seq(i: int, params: SamplingParams) -> Sequence:
    return Sequence(i, str(i), 0, [10, 11], params)


def test_sampler_mask_allows_only_grammar_tokens_and_leaves_other_rows_alone(manager, tiny_dir):
    m, vocab = manager, PADDED_VOCAB
    compiled = m.compile(so(regex="[0-9]+"))
    tok = load_tokenizer(tiny_dir)
    digits = {i for i in range(len(tok)) if re.fullmatch(r"[0-9]+", tok.decode([i]))}
    assert digits
    gen = torch.Generator().manual_seed(0)
    params = [sp(temperature=1.0), sp(), sp(temperature=1.0), sp()]
    seqs = [_seq(i, p) for i, p in enumerate(params)]
    seqs[0].grammar, seqs[3].grammar = m.new_grammar(compiled), m.new_grammar(compiled)
    eos = EOS_ID
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=eos)
    for step in range(20):
        logits = torch.randn(4, vocab, generator=gen) * 5
        logits[[0, 3], eos] = -1e4  # keep the constrained rows going
        mask = m.bitmask(seqs)
        assert mask.rows == [0, 3]
        masked = MaskUploader(torch.device("cpu")).apply(logits.clone(), mask)
        assert torch.equal(masked[[1, 2]], logits[[1, 2]])  # unconstrained rows untouched
        allowed = {i for i in range(vocab) if masked[0, i] > float("-inf")}
        assert allowed == (digits if step == 0 else digits | {eos})  # EOS once the format may end
        result = sampler(logits, seqs, mask)
        assert result.token_ids[0] in digits and result.token_ids[3] in digits
        assert result.token_ids[3] == int(masked[3].argmax())  # greedy row: argmax of the masked logits
        assert result.token_ids[1] == int(logits[1].argmax())
        for i in (0, 3):
            seqs[i].output_token_ids.append(result.token_ids[i])
            assert seqs[i].grammar.accept(result.token_ids[i])


def test_stale_matcher_state_is_refused(manager):
    m = manager
    s = _seq(0, sp())
    s.grammar = m.new_grammar(m.compile(so(regex="[0-9]+")))
    s.output_token_ids.append(20)  # appended but never accepted
    with pytest.raises(RuntimeError, match="stale"):
        m.bitmask([s])
