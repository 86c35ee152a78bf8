"""LLM(reasoning_parser="minimax_m3"): offline structured output under thinking, and LLM.chat's reasoning split.

m3-tiny has random weights: a logit_bias on </mm:think> and a seed make it close its thinking after a few tokens
(searched for once, as tests/engine/test_structured_output_engine.py does)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.parsers.reasoning import MiniMaxM3ReasoningParser
from nanoserve.sampling import StructuredOutputsParams
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts

ANSWER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                           "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def llm():
    with LLM("m3-tiny", optimizations=engine_opts(), max_model_len=1024, reasoning_parser="minimax_m3") as llm:
        yield llm


def closing(llm, end):
    """Sampling (seed, bias) whose unconstrained thinking closes after some text within 24 tokens."""
    for bias in (2, 4, 6, 8):
        for seed in range(8):
            p = SamplingParams(temperature=1.0, seed=seed, logit_bias={end: bias}, max_tokens=24)
            c = llm.chat(CHAT, p, use_tqdm=False, chat_template_kwargs={"thinking_mode": "enabled"})[0].outputs[0]
            if c.reasoning and c.content is not None and MiniMaxM3ReasoningParser.end in c.text:
                return seed, bias
    pytest.fail("no seed closes the thinking")


def test_chat_splits_reasoning_and_the_format_holds_only_the_answer(llm):
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids(MiniMaxM3ReasoningParser.end)
    seed, bias = closing(llm, end)
    kw = dict(use_tqdm=False, chat_template_kwargs={"thinking_mode": "enabled"})
    free = llm.chat(CHAT, SamplingParams(temperature=1.0, seed=seed, logit_bias={end: bias}, max_tokens=24),
                    **kw)[0].outputs[0]
    held = llm.chat(CHAT, SamplingParams(temperature=1.0, seed=seed, logit_bias={end: bias}, max_tokens=64,
                                         structured_outputs=StructuredOutputsParams(json=ANSWER,
                                                                                    disable_any_whitespace=True)),
                    **kw)[0].outputs[0]
    assert held.reasoning == free.reasoning  # the thinking is sampled unconstrained: the same tokens
    assert held.finish_reason == "stop"
    jsonschema.validate(json.loads(held.content), ANSWER)
    assert held.text == held.reasoning + MiniMaxM3ReasoningParser.end + held.content
    # thinking disabled: the whole answer is the format's, no reasoning
    off = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(
        json=ANSWER, disable_any_whitespace=True)), use_tqdm=False,
        chat_template_kwargs={"thinking_mode": "disabled"})[0].outputs[0]
    assert off.reasoning is None
    jsonschema.validate(json.loads(off.content), ANSWER)
    assert_all_blocks_free(llm)


def test_generate_holds_after_the_thinking_only_for_a_prompt_that_opens_it(llm):
    """A raw prompt: only one that leaves a thinking block open waits for </mm:think> (the server's
    completions rule); any other is constrained from the first token."""
    so = StructuredOutputsParams(choice=["yes", "no"])
    plain = llm.generate("Answer:", SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so),
                         use_tqdm=False)[0].outputs[0]
    assert plain.text in ("yes", "no")
    end = llm.get_tokenizer().convert_tokens_to_ids(MiniMaxM3ReasoningParser.end)
    opened = llm.generate("Answer: <mm:think>", SamplingParams(
        temperature=0.0, max_tokens=16, logit_bias={end: 100}, skip_special_tokens=False, structured_outputs=so),
        use_tqdm=False)[0].outputs[0]
    assert opened.text in ("</mm:think>yes", "</mm:think>no"), opened.text


def test_unknown_reasoning_parser_names_the_parameter():
    with pytest.raises(ValueError, match="reasoning_parser: unknown reasoning parser 'nope'"):
        LLM("m3-tiny", reasoning_parser="nope")
