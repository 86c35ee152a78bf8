"""Sampling: parameter validation, the sampler on hand-made logits, seeded reproducibility, stop conditions,
logprobs against a direct forward of the model, and incremental detokenisation."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.engine.detokenizer import detokenize_step
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.stop_checker import find_stop_string
from nanoserve.presets.tokenizer import EOS_ID
from nanoserve.runner.sampler import Sampler
from tests.helpers.engine_utils import LOGPROB_ATOL, direct_logprobs, engine_opts, random_tokens

DRAWS = 4000  # rows per distribution check; a frequency's std is <= 0.008, checked to FREQ_TOL
FREQ_TOL = 0.03


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("m3-tiny", optimizations=engine_opts(), kv_cache_tokens=2048, max_num_batched_tokens=64,
               max_model_len=256)


def run(llm: LLM, prompt: list[int], **params):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


# -- SamplingParams validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"n": True}, "n"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"frequency_penalty": None}, "frequency_penalty"),
    ({"seed": -(2**63) - 1}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": 2**63}, "seed"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": ""}, "stop"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"), ({"stop": ["a", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"logprobs": -2}, "logprobs"), ({"logprobs": 2.5}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"), ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"), ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": "word"}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert re.match(rf"{name}\b", str(err.value)), str(err.value)


def test_sampling_params_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="x").stop_list == ["x"]
    assert SamplingParams(stop=("x", "yz")).stop_list == ["x", "yz"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy
    # edges are valid: seeds span int64 as in vLLM; -1 logprobs = the whole vocabulary; +-100 biases
    SamplingParams(max_tokens=None, min_tokens=100, seed=2**63 - 1, logprobs=20, prompt_logprobs=0)
    SamplingParams(seed=-(2**63), logprobs=-1, prompt_logprobs=-1, logit_bias={0: -100, 7: 100.0})


def test_logprobs_are_capped_by_the_engine_not_the_params(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=2, logprobs=25)  # the engine decides the cap
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        llm.engine.add_request("too-many-logprobs", [10, 11], sp)
    generous = LLM("m3-tiny", optimizations=engine_opts(), kv_cache_tokens=256, max_model_len=64, max_logprobs=30)
    out = generous.generate([10, 11], sp, use_tqdm=False)[0].outputs[0]
    assert [len(lp) for lp in out.logprobs] == [25, 25]  # greedy: the chosen token is the top one


# -- the sampler on hand-made logits ------------------------------------------------------------------------

_seq_ids = iter(range(10**9))


def fake_seq(params: SamplingParams, prompt: list[int] = (10,), output: list[int] = ()) -> Sequence:
    seq = Sequence(next(_seq_ids), "r", 0, list(prompt), params)
    seq.output_token_ids = list(output)
    return seq


PROBS = [0.5, 0.3, 0.15, 0.05]


def draw_frequencies(params: SamplingParams, probs=PROBS) -> torch.Tensor:
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)
    logits = torch.tensor(probs).log().repeat(DRAWS, 1)
    tokens = sampler(logits, [fake_seq(params) for _ in range(DRAWS)]).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(probs)).float() / DRAWS


def renormalised(keep: int, probs=PROBS) -> list[float]:
    kept = probs[:keep]
    return [p / sum(kept) for p in kept] + [0.0] * (len(probs) - keep)


@pytest.mark.parametrize("params, expected", [
    ({}, PROBS),
    ({"temperature": 2.0}, torch.softmax(torch.tensor(PROBS).log() / 2.0, -1).tolist()),
    ({"temperature": 0.5}, torch.softmax(torch.tensor(PROBS).log() / 0.5, -1).tolist()),
    ({"top_k": 2}, renormalised(2)),
    ({"top_k": 1}, renormalised(1)),
    ({"top_p": 0.7}, renormalised(2)),  # 0.5 < 0.7 <= 0.8: the two most likely
    ({"top_p": 0.85}, renormalised(3)),
    ({"top_p": 1e-6}, renormalised(1)),
    ({"min_p": 0.35}, renormalised(2)),  # keep p >= 0.175
    ({"min_p": 0.25}, renormalised(3)),  # keep p >= 0.125
    ({"top_k": 3, "top_p": 0.7}, renormalised(2)),
])
def test_sampling_distribution(params, expected):
    freq = draw_frequencies(SamplingParams(**params))
    assert torch.allclose(freq, torch.tensor(expected), atol=FREQ_TOL), (freq.tolist(), expected)
    for token, p in enumerate(expected):
        if p == 0.0:
            assert freq[token] == 0.0, f"token {token} should never be drawn"


def test_each_row_uses_its_own_parameters():
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)
    params = [SamplingParams(top_k=1), SamplingParams(temperature=0.0), SamplingParams(top_p=0.7),
              SamplingParams(min_p=0.25)] * (DRAWS // 4)
    logits = torch.tensor(PROBS).log().repeat(len(params), 1)
    tokens = torch.tensor(sampler(logits, [fake_seq(p) for p in params]).token_ids).view(-1, 4)
    assert (tokens[:, 0] == 0).all() and (tokens[:, 1] == 0).all()
    assert set(tokens[:, 2].tolist()) == {0, 1} and set(tokens[:, 3].tolist()) == {0, 1, 2}


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(seed=1234)

    def draws(batch_rows: list[int], sampler_seed: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), seed=sampler_seed, eos_token_id=None)
        seq = fake_seq(seeded)
        others = [fake_seq(SamplingParams(top_k=5 * (i + 1))) for i in range(len(batch_rows))]
        out = []
        for _ in range(20):  # the seeded row first, then after the others, with different neighbours
            rows = torch.cat([logits[:1], logits[batch_rows]]) if batch_rows else logits[:1]
            out.append(sampler(rows, [seq] + others).token_ids[0])
        return out

    alone = draws([], 0)
    assert draws([1, 2, 3], 1) == alone and draws([4, 5], 2) == alone
    assert len(set(alone)) > 1


def test_penalties_change_logits_as_specified():
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0, 0.0]])
    prompt, output = [0, 1], [2, 2, 3]

    def penalised(**kw) -> list[float]:
        return sampler._apply_penalties(logits.clone(), [fake_seq(SamplingParams(**kw), prompt, output)])[0].tolist()

    # repetition (prompt and output tokens): positive logits divided, negative multiplied
    assert penalised(repetition_penalty=2.0) == [1.0, -2.0, 0.25, -1.0, 1.0, 0.0]
    # presence: once per token that appeared in the output; frequency: per occurrence
    assert penalised(presence_penalty=0.5) == [2.0, -1.0, 0.0, -1.0, 1.0, 0.0]
    assert penalised(frequency_penalty=0.25) == [2.0, -1.0, 0.0, -0.75, 1.0, 0.0]
    assert penalised(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25) == \
        [1.0, -2.0, -0.75, -1.75, 1.0, 0.0]
    assert penalised() == logits[0].tolist()


def test_penalties_steer_greedy_choice_and_logprobs_stay_raw():
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)
    logits = torch.tensor([[3.0, 2.0, 0.0, -1.0]]).repeat(2, 1)
    original = logits.clone()
    plain = fake_seq(SamplingParams(temperature=0.0, logprobs=1), prompt=[0])
    penalised = fake_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=1), prompt=[0])
    res = sampler(logits, [plain, penalised])
    assert res.token_ids == [0, 1]
    raw = torch.log_softmax(original[0], -1)
    assert res.chosen_logprob[1] == pytest.approx(raw[1].item())  # logprobs of the raw model logits
    assert torch.equal(logits, original), "the sampler must not modify its input"


def test_min_tokens_suppresses_eos_and_stop_ids():
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=EOS_ID)
    logits = torch.full((1, 12), -5.0)
    logits[0, EOS_ID], logits[0, 5], logits[0, 7] = 3.0, 2.0, 1.0

    def pick(output_len: int, **kw) -> int:
        params = SamplingParams(temperature=0.0, stop_token_ids=[5], min_tokens=3, **kw)
        return sampler(logits, [fake_seq(params, output=[9] * output_len)]).token_ids[0]

    assert pick(0) == 7 and pick(2) == 7  # EOS and the stop id are masked until 3 tokens exist
    assert pick(3) == EOS_ID
    assert pick(0, ignore_eos=True) == EOS_ID  # EOS does not end this request, so it is not suppressed


# -- through the engine -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_case(llm):
    """A prompt whose greedy continuation (EOS ignored) contains EOS after a few tokens, and that continuation."""
    for seed in range(20):
        prompt = random_tokens(random.Random(seed), 30)
        tokens = run(llm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True).token_ids
        if EOS_ID in tokens[2:12]:
            return prompt, tokens
    pytest.fail("no prompt led m3-tiny to EOS; pick other prompts")


def test_seeded_sampling_reproducible_regardless_of_batch(llm):
    rng = random.Random(21)
    prompt = random_tokens(rng, 25)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=777, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids

    def in_batch(others: list[tuple[list[int], SamplingParams]], engine_llm: LLM) -> list[int]:
        prompts = [{"prompt_token_ids": p} for p, _ in others]
        params = [s for _, s in others]
        outs = engine_llm.generate(prompts[:1] + [{"prompt_token_ids": prompt}] + prompts[1:],
                                   params[:1] + [sp] + params[1:], use_tqdm=False)
        return outs[1].outputs[0].token_ids

    batch_a = [(random_tokens(rng, 40), SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True)),
               (random_tokens(rng, 7), SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)),
               (random_tokens(rng, 90), SamplingParams(temperature=0.7, seed=1, top_k=5, max_tokens=5))]
    batch_b = [(prompt, SamplingParams(temperature=1.0, seed=778, max_tokens=12, ignore_eos=True)),
               (random_tokens(rng, 60), SamplingParams(temperature=1.2, min_p=0.1, max_tokens=20, ignore_eos=True))]
    assert in_batch(batch_a, llm) == alone
    assert in_batch(batch_b, llm) == alone
    # and on a pool so small that sequences are preempted and recomputed mid-generation
    tiny = LLM("m3-tiny", optimizations=engine_opts(), num_gpu_blocks_override=8, max_num_batched_tokens=32,
               max_model_len=128)
    assert in_batch(batch_a + batch_b, tiny) == alone
    assert tiny.engine.stats.num_preemptions > 0
    other_seed = run(llm, prompt, temperature=0.9, top_p=0.95, seed=778, max_tokens=12, ignore_eos=True)
    assert other_seed.token_ids != alone


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"temperature": 0.0}])
def test_degenerate_filters_equal_greedy(llm, params):
    prompt = random_tokens(random.Random(4), 20)
    greedy = run(llm, prompt, temperature=0.0, max_tokens=10, ignore_eos=True).token_ids
    assert run(llm, prompt, **{"temperature": 1.0, "max_tokens": 10, "ignore_eos": True, **params}).token_ids \
        == greedy


def test_stop_token_ids_end_generation(llm, eos_case):
    prompt, tokens = eos_case
    tok = llm.get_tokenizer()
    stop = next(t for t in tokens[3:] if t != EOS_ID and tok.decode([t]).isprintable())
    first = tokens.index(stop)
    out = run(llm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # the stop token's text is left out, unless asked for
    before = tok.decode(tokens[:first], skip_special_tokens=True).rstrip("\ufffd")
    assert out.text == before
    kept = run(llm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop],
               include_stop_str_in_output=True)
    assert kept.token_ids == out.token_ids
    assert kept.text == tok.decode(tokens[: first + 1], skip_special_tokens=True).rstrip("\ufffd") != before


def test_eos_ends_generation_unless_ignored(llm, eos_case):
    prompt, tokens = eos_case
    out = run(llm, prompt, temperature=0.0, max_tokens=24)
    assert out.token_ids == tokens[: tokens.index(EOS_ID) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = run(llm, prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_min_tokens_holds_off_eos(llm, eos_case):
    prompt, tokens = eos_case
    at = tokens.index(EOS_ID)
    out = run(llm, prompt, temperature=0.0, max_tokens=24, min_tokens=at + 2)
    assert out.token_ids[:at] == tokens[:at]
    assert EOS_ID not in out.token_ids[: at + 2] and len(out.token_ids) >= at + 2
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == EOS_ID


def test_stop_strings_end_generation_at_the_right_place(llm):
    prompt = random_tokens(random.Random(8), 30)
    tok = llm.get_tokenizer()
    base = run(llm, prompt, temperature=0.0, max_tokens=30, ignore_eos=True)
    text, tokens = base.text, base.token_ids
    # a 2-character stop string from the middle of the text, made of complete characters
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i: i + 2] and text[i: i + 2].strip())
    stop = text[start: start + 2]
    at = text.index(stop)
    # generation ends on the token that completes the stop string
    end = next(j for j in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:j], skip_special_tokens=True))

    out = run(llm, prompt, temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    assert out.text == text[:at]
    assert out.token_ids == tokens[:end]
    assert out.finish_reason == "stop" and out.stop_reason == stop

    kept = run(llm, prompt, temperature=0.0, max_tokens=30, ignore_eos=True, stop=stop,
               include_stop_str_in_output=True)
    assert kept.text == text[: at + len(stop)] and kept.token_ids == tokens[:end]

    # any of several stop strings
    either = run(llm, prompt, temperature=0.0, max_tokens=30, ignore_eos=True, stop=["never in the text", stop])
    assert either.stop_reason == stop and either.text == text[:at]


def test_find_stop_string_looks_only_at_what_the_delta_completed():
    assert find_stop_string("hello world", 3, ["wor", "hello"]) == (6, "wor")
    assert find_stop_string("hello world", 2, ["hello"]) is None  # completed earlier, not by this delta
    assert find_stop_string("abXYcd", 2, ["XYc"]) == (2, "XYc")  # spans the previous text and the delta
    assert find_stop_string("aXbX", 2, ["bX", "X"]) == (2, "bX")  # the earliest start wins


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}])
def test_logprobs_equal_log_softmax_of_the_model_logits(llm, params):
    num = 5
    prompt = random_tokens(random.Random(12), 70)  # over the 64-token budget: chunked, then decoded
    out = run(llm, prompt, max_tokens=8, ignore_eos=True, logprobs=num, **params)
    ref = direct_logprobs(llm, prompt + out.token_ids[:-1])
    assert len(out.logprobs) == len(out.token_ids)
    total = 0.0
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert next(iter(lp)) == token, "the chosen token comes first"
        top = row.topk(num)
        assert set(lp) == set(top.indices.tolist()) | {token}
        for t, v in lp.items():
            assert v == pytest.approx(row[t].item(), abs=LOGPROB_ATOL)
        if params["temperature"] == 0.0:
            assert token == top.indices[0].item()
        total += lp[token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)
    assert not math.isnan(out.cumulative_logprob)


# -- incremental detokenisation -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["héllo 世界 🙂", "🙂🙂 naïve café — ok", "plain ascii text"])
def test_incremental_detokenizer_never_emits_a_broken_character(llm, text):
    tok = llm.get_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    seq = fake_seq(SamplingParams(), prompt=[10])
    deltas = []
    for t in ids + [EOS_ID]:  # the special EOS adds no text
        seq.output_token_ids.append(t)
        delta = detokenize_step(tok, seq)
        assert "\ufffd" not in delta, f"broken character emitted after {len(seq.output_token_ids)} tokens"
        deltas.append(delta)
    assert "".join(deltas) == text == seq.text
    if not text.isascii():
        assert "" in deltas[:-1], "no character was split across tokens, so the test proves nothing"


@settings(derandomize=True, max_examples=150, deadline=None)
@given(text=st.text(alphabet="ab é世界🙂€—\n", min_size=1, max_size=30))
def test_incremental_detokenizer_on_random_text(llm, text):
    tok = llm.get_tokenizer()
    seq = fake_seq(SamplingParams(), prompt=[10])
    for t in tok.encode(text, add_special_tokens=False):
        seq.output_token_ids.append(t)
        assert "\ufffd" not in detokenize_step(tok, seq)
    assert seq.text == text
