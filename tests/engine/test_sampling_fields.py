"""The token-level sampling fields (logit_bias, allowed_token_ids, bad_words, vocabulary checks, int64 seeds,
logprobs_mode, logprobs with n > 1): the sampler on hand-made logits, then through the offline LLM against a
direct forward of the model."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.sequence import Sequence
from nanoserve.presets.tokenizer import EOS_ID
from nanoserve.runner.sampler import Sampler
from tests.helpers.engine_utils import LOGPROB_ATOL, direct_logprobs
from tests.helpers.server_utils import FAST_CPU

_seq_ids = iter(range(10**9))


def fake_seq(params: SamplingParams, output: list[int] = ()) -> Sequence:
    seq = Sequence(next(_seq_ids), "r", 0, [10], params)
    seq.output_token_ids = list(output)
    return seq


def greedy_pick(logits: torch.Tensor, *params: SamplingParams, outputs=None, **sampler_kw) -> list[int]:
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=EOS_ID, **sampler_kw)
    outputs = outputs or [()] * len(params)
    return sampler(logits, [fake_seq(p, o) for p, o in zip(params, outputs)]).token_ids


# -- the sampler steps on hand-made logits --------------------------------------------------------------------

def test_logit_bias_applies_to_its_own_row_only():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(3, 1)
    picks = greedy_pick(logits, SamplingParams(temperature=0.0, logit_bias={3: 3.5}),
                        SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={0: -100}))
    assert picks == [3, 0, 1]


def test_allowed_token_ids_mask_every_other_token():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]]).repeat(2, 1)
    allowed = SamplingParams(temperature=0.0, allowed_token_ids=[2, 4])
    assert greedy_pick(logits, allowed, SamplingParams(temperature=0.0)) == [2, 0]
    sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)
    draws = sampler(logits.repeat(200, 1), [fake_seq(SamplingParams(allowed_token_ids=[2, 4]))
                                            for _ in range(400)]).token_ids
    assert set(draws) == {2, 4}


def test_bad_words_ban_the_last_token_after_the_prefix():
    logits = torch.tensor([[1.0, 5.0, 4.0, 3.0]])
    one_token = SamplingParams(temperature=0.0)
    one_token.bad_words_token_ids = [[1]]
    two_tokens = SamplingParams(temperature=0.0)
    two_tokens.bad_words_token_ids = [[3, 1]]  # token 1 is banned only right after token 3
    assert greedy_pick(logits, one_token) == [2]
    assert greedy_pick(logits, two_tokens, outputs=[[0, 3]]) == [2]
    assert greedy_pick(logits, two_tokens, outputs=[[3, 0]]) == [1]
    assert greedy_pick(logits, two_tokens, outputs=[[]]) == [1]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_mode_chooses_what_logprobs_report(mode):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.0, logit_bias={3: 10.0}, logprobs=1)
    res = Sampler(torch.device("cpu"), seed=0, eos_token_id=None, logprobs_mode=mode)(logits, [fake_seq(params)])
    assert res.token_ids == [3]
    seen = logits.clone()
    if mode.startswith("processed"):
        seen[0, 3] += 10.0
    expected = seen if mode.endswith("logits") else torch.log_softmax(seen, -1)
    assert res.chosen_logprob[0] == pytest.approx(expected[0, 3].item(), abs=1e-6)
    assert res.logprobs(0)[res.top_ids[0][0]] == pytest.approx(expected[0].max().item(), abs=1e-6)


def test_processed_logprobs_include_temperature_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=2, seed=5, logprobs=4)
    res = Sampler(torch.device("cpu"), seed=0, eos_token_id=None, logprobs_mode="processed_logprobs")(
        logits, [fake_seq(params)])
    lps = res.logprobs(0)
    expected = torch.log_softmax(torch.tensor([4.0, 2.0]), -1)  # temperature 0.5, then the two best only
    assert lps[0] == pytest.approx(expected[0].item(), abs=1e-6) and lps[1] == pytest.approx(expected[1].item())
    assert lps[2] == float("-inf") and lps[3] == float("-inf")


def test_int64_seeds_are_reproducible_and_distinct():
    logits = torch.zeros(1, 1000)

    def draws(seed: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)
        seq = fake_seq(SamplingParams(seed=seed))
        return [sampler(logits, [seq]).token_ids[0] for _ in range(8)]

    low, high = draws(-(2**63)), draws(2**63 - 1)
    assert draws(-(2**63)) == low and draws(-1) == draws(-1)
    assert len({tuple(low), tuple(high), tuple(draws(-1)), tuple(draws(0))}) == 4


# -- through the engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("m3-tiny", optimizations=FAST_CPU, kv_cache_tokens=2048, max_num_batched_tokens=64, max_model_len=256)


def prompt_ids(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(9, 512) for _ in range(n)]


def run(llm: LLM, prompt: list[int], **params):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_logit_bias_plus_100_forces_the_token(llm):
    prompt = prompt_ids(1)
    greedy = run(llm, prompt, temperature=0.0, max_tokens=6, ignore_eos=True).token_ids
    forced = next(t for t in range(300, 400) if t not in greedy)
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 9}):
        out = run(llm, prompt, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}, logprobs=0, **params)
        assert out.token_ids == [forced] * 6
        # logprobs are of the raw logits (vLLM's default logprobs_mode): the forced token is not likely there
        ref = direct_logprobs(llm, prompt + out.token_ids[:-1])
        for j, lp in enumerate(out.logprobs):
            assert lp[forced] == pytest.approx(ref[len(prompt) - 1 + j, forced].item(), abs=LOGPROB_ATOL)
            assert lp[forced] < -1.0


def test_logit_bias_minus_100_bans_the_greedy_token(llm):
    prompt = prompt_ids(2)
    greedy = run(llm, prompt, temperature=0.0, max_tokens=4, ignore_eos=True).token_ids
    banned = run(llm, prompt, temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={greedy[0]: -100})
    ref = direct_logprobs(llm, prompt)[-1]
    ref[greedy[0]] = float("-inf")
    assert banned.token_ids[0] == ref.argmax().item() != greedy[0]


def test_allowed_token_ids_restrict_generation_to_the_set(llm):
    prompt = prompt_ids(3)
    allowed = [40, 41, 300, EOS_ID]
    out = run(llm, prompt, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
    assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    greedy = run(llm, prompt, temperature=0.0, max_tokens=1, allowed_token_ids=allowed)
    ref = direct_logprobs(llm, prompt)[-1]
    assert greedy.token_ids[0] == max(allowed, key=lambda t: ref[t].item())


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    prompt = prompt_ids(4)
    base = run(llm, prompt, temperature=0.0, max_tokens=16, ignore_eos=True)
    # a word the greedy continuation produces as one token (the text of that token, stripped)
    word_token = next(t for t in base.token_ids if tok.decode([t]).strip().isalpha()
                      and tok.encode(tok.decode([t]).strip(), add_special_tokens=False) == [t])
    word = tok.decode([word_token]).strip()
    out = run(llm, prompt, temperature=0.0, max_tokens=16, ignore_eos=True, bad_words=[word])
    params = SamplingParams(bad_words=[word])
    params.set_bad_words_token_ids(lambda s: tok.encode(s, add_special_tokens=False))
    banned = {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}
    assert word_token in banned
    assert not banned & set(out.token_ids)
    first = base.token_ids.index(word_token)
    assert out.token_ids[:first] == base.token_ids[:first] and out.token_ids[first] != word_token


@pytest.mark.parametrize("field, value", [("logit_bias", {10**6: 1.0}), ("stop_token_ids", [10**6]),
                                          ("allowed_token_ids", [3, 10**6])])
def test_token_ids_outside_the_vocabulary_are_refused(llm, field, value):
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError) as err:
        llm.engine.add_request(f"oov-{field}", [10, 11], SamplingParams(**{field: value}))
    msg = str(err.value)
    assert msg.startswith(field) and str(10**6) in msg and str(vocab) in msg
    assert not llm.engine.has_unfinished_requests()
    run(llm, [10, 11], max_tokens=1, **{field: {vocab - 1: 1.0} if field == "logit_bias" else [vocab - 1]})


def test_whole_vocabulary_logprobs_are_capped_by_max_logprobs(llm):
    with pytest.raises(ValueError, match=r"^logprobs must be an integer in \[0, 20\].*whole vocabulary"):
        llm.engine.add_request("all-logprobs", [10, 11], SamplingParams(logprobs=-1))


def test_logprobs_with_n_greater_than_1(llm):
    prompt = prompt_ids(5)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5,
                                                                      ignore_eos=True, logprobs=2), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        ref = direct_logprobs(llm, prompt + c.token_ids[:-1])
        assert len(c.logprobs) == len(c.token_ids) == 5
        for j, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert next(iter(lp)) == t and len(set(lp) - {t}) <= 2
            assert lp[t] == pytest.approx(ref[len(prompt) - 1 + j, t].item(), abs=LOGPROB_ATOL)
        assert c.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs)), abs=1e-5)
