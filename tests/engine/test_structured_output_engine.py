"""Structured outputs on m3-tiny (CPU): random weights, so every valid output below is the grammar mask's doing.

Covers: JSON schema / regex / choice / EBNF / json_object offline; a mixed batch leaves the unconstrained rows'
greedy tokens as they are alone; n > 1; a format that ends finishes with "stop" (even under ignore_eos); max_tokens
still ends a constrained request; overlap scheduling and preemption do not change constrained outputs; a bad spec
fails add_request; all blocks are free afterwards.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.sampling import StructuredOutputsParams
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
"""Every string and number is bounded, so even a random model's greedy output must close within max_tokens."""


def sp(max_tokens: int = 48, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=max_tokens, **kw)


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("m3-tiny", optimizations=engine_opts(), max_model_len=256)


def run(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


# -- offline generation ---------------------------------------------------------------------------------------
def test_a_spec_xgrammar_rejects_fails_add_request_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="bogus"):
        llm.engine.add_request("bad", "hi", sp(structured_outputs=so(json={"type": "bogus"})))
    assert not llm.engine.has_unfinished_requests()


def test_json_schema_regex_choice_grammar_and_json_object(llm):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    outs = run(llm, ["Tell me about", "A serving engine", "Hello", "Sum:", "Object:"], [
        sp(64, structured_outputs=so(json=PERSON, disable_any_whitespace=True)),
        sp(24, structured_outputs=so(regex=r"[a-z]{2,5}-[0-9]{3}")),
        sp(16, structured_outputs=so(choice=["yes", "no", "maybe so"])),
        sp(24, temperature=1.0, seed=3, structured_outputs=so(grammar=grammar)),
        sp(48, structured_outputs=so(json_object=True, disable_any_whitespace=True)),
    ])
    person, code, choice, expr, obj = (o.outputs[0] for o in outs)
    assert person.finish_reason == "stop", person
    jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", code.text) and code.finish_reason == "stop"
    assert choice.text in ("yes", "no", "maybe so") and choice.finish_reason == "stop"
    # a random model sampling with temperature 1 may keep adding terms until max_tokens: then a prefix
    if expr.finish_reason == "stop":
        assert re.fullmatch(r"\((?:[1-9][0-9]?\+)*[1-9][0-9]?\)", expr.text)
    else:
        assert expr.finish_reason == "length" and re.fullmatch(r"\((?:[1-9][0-9]?\+?)*", expr.text)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")
    # the stop token ends the format and is not in the text
    assert person.token_ids[-1] == llm.engine.eos_token_id
    assert_all_blocks_free(llm)


def test_mixed_batch_leaves_unconstrained_tokens_as_alone(llm):
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(9, 512) for _ in range(n)]} for n in (12, 30, 7, 21)]
    plain = sp(12, ignore_eos=True)
    alone = [run(llm, prompts[i], plain)[0].outputs[0].token_ids for i in (0, 2)]
    mixed = run(llm, prompts, [plain, sp(40, structured_outputs=so(json=PERSON, disable_any_whitespace=True)),
                               plain, sp(12, structured_outputs=so(regex="[0-9]{4}"))])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert re.fullmatch("[0-9]{4}", mixed[3].outputs[0].text)
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)
    assert_all_blocks_free(llm)


def test_n_sequences_each_follow_the_grammar(llm):
    out = run(llm, "Codes:", sp(16, temperature=1.0, seed=11, n=3, structured_outputs=so(regex="[a-z]{3}-[0-9]{2}")))
    texts = [c.text for c in out[0].outputs]
    assert len(texts) == 3 and all(re.fullmatch("[a-z]{3}-[0-9]{2}", t) for t in texts), texts
    assert len(set(texts)) > 1  # own draws, own matchers
    assert all(c.finish_reason == "stop" for c in out[0].outputs)


def test_format_end_stops_even_under_ignore_eos_and_max_tokens_still_ends(llm):
    done = run(llm, "Answer:", sp(30, ignore_eos=True, structured_outputs=so(choice=["alpha", "beta"])))[0].outputs[0]
    assert done.text in ("alpha", "beta") and done.finish_reason == "stop"
    # an unbounded format: max_tokens ends it, and the text so far is a prefix the grammar accepted
    cut = run(llm, "Digits:", sp(5, structured_outputs=so(regex="[0-9]+x")))[0].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5 and re.fullmatch("[0-9]+", cut.text)
    assert_all_blocks_free(llm)


def test_overlap_and_preemption_do_not_change_constrained_outputs():
    """Constrained greedy requests, run with overlap scheduling and overlap_grammar (the grammar work after the
    forward's launch, batched) on and off and with a pool small enough to preempt, give the same tokens as each
    alone with every switch off."""
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(9, 512) for _ in range(n)]} for n in (60, 45, 70, 50)]
    params = [sp(40, structured_outputs=so(json=PERSON, disable_any_whitespace=True)),
              sp(14, ignore_eos=True),
              sp(20, structured_outputs=so(regex="[a-z]{2,8}[0-9]{1,3}")),
              sp(30, structured_outputs=so(choice=["one", "two", "three"]))]
    ref = LLM("m3-tiny", optimizations=engine_opts(paged_kv=False, prefix_caching=False, chunked_prefill=False,
                                                   continuous_batching=False, overlap_scheduling=False,
                                                   overlap_grammar=False),
              kv_cache_tokens=2048, max_model_len=256)
    expected = [run(ref, p, q)[0].outputs[0].token_ids for p, q in zip(prompts, params)]
    for overlap, grammar in ((True, True), (False, True), (True, False)):
        small = LLM("m3-tiny", optimizations=engine_opts(overlap_scheduling=overlap, overlap_grammar=grammar),
                    num_gpu_blocks_override=12, max_num_batched_tokens=64, max_model_len=128)
        got = [o.outputs[0].token_ids for o in run(small, prompts, params)]
        assert got == expected, f"overlap_scheduling={overlap}, overlap_grammar={grammar}"
        assert small.engine.stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
        assert_all_blocks_free(small)


# -- a format held until the thinking ends (reasoning_end_token_id; the server's --reasoning-parser) ----------------
THINKING_PROMPT = "]~b]user\nIs 91 prime?[e~[\n]~b]ai\n<mm:think>"  # a chat turn whose prompt opened the thinking


def think_end_bias(llm, end: int, lo: int = 3, hi: int = 16) -> tuple[float, int]:
    """A logit_bias on the end-of-thinking token that makes the greedy model close its thinking after lo..hi
    tokens (m3-tiny's random weights would rarely close it at all): (bias, index of the closing token)."""
    for bias in range(0, 60):
        ids = run(llm, THINKING_PROMPT,
                  sp(hi + 1, ignore_eos=True, logit_bias={end: float(bias)}))[0].outputs[0].token_ids
        if end in ids:
            k = ids.index(end)
            if lo <= k <= hi:
                return float(bias), k
            if k < lo:
                break
    raise AssertionError("no logit_bias closes the thinking after a few tokens")


def test_format_holds_only_after_the_thinking_ends(llm):
    """The output starts in an open thinking block: the reasoning is sampled unconstrained (the tokens up to and
    including </mm:think> are those of the same request without a format), and the answer after it follows the
    JSON schema to its end."""
    end = llm.get_tokenizer().convert_tokens_to_ids("</mm:think>")
    bias, k = think_end_bias(llm, end)
    free, held, whole = (o.outputs[0] for o in run(llm, [THINKING_PROMPT] * 3, [
        sp(80, logit_bias={end: bias}, skip_special_tokens=False),
        sp(80, logit_bias={end: bias}, skip_special_tokens=False,
           structured_outputs=so(json=PERSON, disable_any_whitespace=True, reasoning_end_token_id=end)),
        sp(80, logit_bias={end: bias}, skip_special_tokens=False,
           structured_outputs=so(json=PERSON, disable_any_whitespace=True))]))
    assert held.token_ids[:k + 1] == free.token_ids[:k + 1]
    reasoning, answer = held.text.split("</mm:think>", 1)
    assert held.finish_reason == "stop", held
    jsonschema.validate(json.loads(answer), PERSON)
    assert reasoning and not reasoning.lstrip().startswith("{")
    # without the gate the format holds from the first token: no thinking at all, just the JSON
    assert whole.finish_reason == "stop" and "</mm:think>" not in whole.text
    jsonschema.validate(json.loads(whole.text), PERSON)
    assert_all_blocks_free(llm)


def test_thinking_that_never_ends_is_never_constrained(llm):
    """Until the end-of-thinking token comes, nothing is masked: a request whose thinking runs to max_tokens gives
    exactly the tokens of the same request without a format (greedy, and with sampling from one seed)."""
    end = llm.get_tokenizer().convert_tokens_to_ids("</mm:think>")
    never = {end: -100.0}
    gate = so(regex="[0-9]{3}", reasoning_end_token_id=end)
    for extra in (dict(), dict(temperature=1.0, seed=5)):
        free, held = (o.outputs[0] for o in run(llm, [THINKING_PROMPT] * 2, [
            sp(24, logit_bias=never, ignore_eos=True, **extra),
            sp(24, logit_bias=never, ignore_eos=True, structured_outputs=gate, **extra)]))
        assert held.token_ids == free.token_ids and held.finish_reason == "length"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_rejected_token_ends_the_sequence_with_error_in_both_grammar_paths(monkeypatch, overlap):
    """If a sampled token broke the grammar (here: the mask is not applied, so the random model writes what it
    likes), the sequence ends with finish_reason "error" and the rejected token last, whether the grammar accepts
    each token on receipt (overlap_grammar off) or in the batched catch-up after the next launch (on, where the
    next step's token is dropped). The other requests of the batch go on as alone."""
    from nanoserve.runner import grammar_mask

    monkeypatch.setattr(grammar_mask.MaskUploader, "apply", lambda self, logits, mask: logits)
    prompts = ["Digits:", "A serving engine"]
    params = [sp(12, structured_outputs=so(regex="[0-9]{6}")), sp(8, ignore_eos=True)]
    outs = {}
    for grammar in (False, True):
        llm = LLM("m3-tiny", optimizations=engine_opts(overlap_scheduling=overlap, overlap_grammar=grammar),
                  max_model_len=256)
        outs[grammar] = [o.outputs[0] for o in run(llm, prompts, params)]
        assert_all_blocks_free(llm)
    bad, plain = outs[True]
    assert bad.finish_reason == "error" and not re.fullmatch("[0-9]*", bad.text), bad
    assert [(o.token_ids, o.finish_reason) for o in outs[True]] == [(o.token_ids, o.finish_reason) for o in outs[False]]
    assert len(plain.token_ids) == 8
