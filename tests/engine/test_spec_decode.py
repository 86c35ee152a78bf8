"""Speculative decoding: the ngram drafter, the acceptance rule, and the engine with `speculative_config`.

Greedy output with speculation must equal greedy output without it, token for token (fp32, CPU, m3-tiny's random
weights, whose greedy output repeats itself often enough for prompt lookup to be accepted), also with prefix
caching, under preemption, with a small token budget, with stop strings and logprobs; an abort while a verify
step is in flight must leave every block free; rejection sampling must reproduce the target distribution
(a chi-square test on a small vocabulary).
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.spec_decode.ngram import NgramProposer
from nanoserve.spec_decode.rejection import rejection_sample
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts, finish_all, step_until_in_flight

FAST = engine_opts()
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_MODEL_LEN = 256


# -- the config ------------------------------------------------------------------------------------------------
def test_config_takes_vllms_names_and_defaults():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    cfg = SpeculativeConfig.from_dict({"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (cfg.method, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 3, 3)


@pytest.mark.parametrize("raw, words", [
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, ["unknown", "draft_model"]),
    ({"method": "medusa", "num_speculative_tokens": 2}, ["method", "medusa"]),
    ({"method": "ngram"}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ["prompt_lookup_min", "prompt_lookup_max"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, ["prompt_lookup_min"]),
    ("ngram", ["dict"]),
])
def test_bad_config_is_an_error_naming_the_field(raw, words):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.from_dict(raw)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_llm_refuses_a_bad_speculative_config():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM("m3-tiny", optimizations=FAST, max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "ngram", "num_speculative_tokens": -1})


# -- the ngram drafter -----------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    assert NgramProposer(2, 2, 4).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]  # fewer than k follow: up to the end
    # the 3-gram [1, 2, 3] matched at its most recent earlier place (before the 7), not the first (before the 9)
    assert NgramProposer(1, 3, 3).propose([5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3]) == [7, 1, 2]
    # the longest n first: [8, 4] occurs once, followed by 6; the 1-gram [4] last occurred before 5
    assert NgramProposer(1, 2, 1).propose([8, 4, 6, 4, 5, 8, 4]) == [6]
    assert NgramProposer(2, 2, 3).propose([8, 4, 6, 4, 5, 3, 4]) == []  # no 2-gram match, and 1-grams are off
    assert NgramProposer(1, 1, 2).propose([7]) == [] and NgramProposer(1, 1, 2).propose([1, 2], k=0) == []
    # ids whose bytes straddle: 256 = 00 01 .., a byte search must match whole tokens only
    assert NgramProposer(1, 1, 2).propose([1, 256, 1, 0, 256]) == [1, 0]


# -- the acceptance rule ---------------------------------------------------------------------------------------
CHI2_CRITICAL_5DF = 20.52  # chi-square with 5 degrees of freedom at p = 0.001


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafter", ["distribution", "deterministic"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    """Drafts drawn from q (or a fixed guess, q one-hot), accepted or replaced by the rule: the first emitted token
    follows p_0, and the second (where the first draft was accepted) p_1 - whatever q is."""
    g = torch.Generator().manual_seed(0)
    vocab, rows, k = 6, 40000, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=g), dim=-1)
    if drafter == "distribution":
        drafts = torch.multinomial(q, rows, replacement=True, generator=g).T.contiguous()
        draft_probs = q.expand(rows, k, vocab)
    else:
        drafts = torch.tensor([[2, 4]]).expand(rows, k).contiguous()
        draft_probs = None
    tokens, accepted = rejection_sample(
        p.repeat(rows, 1), torch.arange(rows) * (k + 1), drafts, torch.full((rows,), k),
        torch.rand(rows, k, generator=g), torch.empty(rows, vocab).exponential_(generator=g), draft_probs)
    assert chi_square(tokens[:, 0], p[0]) < CHI2_CRITICAL_5DF
    second = accepted >= 1
    assert chi_square(tokens[second, 1], p[1]) < CHI2_CRITICAL_5DF
    # the draft is kept as far as it was accepted, one token is drawn after it, the rest is padding
    width = torch.arange(k + 1)[None, :]
    assert torch.equal(tokens[:, :k][width[:, :k] < accepted[:, None]], drafts[width[:, :k] < accepted[:, None]])
    assert bool((tokens >= 0).sum(dim=1).eq(accepted + 1).all())
    # a deterministic guess is accepted with probability p(guess)
    if draft_probs is None:
        assert abs(float((accepted >= 1).double().mean()) - float(p[0, 2])) < 0.01


def test_greedy_rows_accept_the_longest_prefix_equal_to_the_argmax():
    vocab = 5
    target = torch.zeros(2 * 4, vocab)
    argmax = [[1, 2, 3, 4], [0, 0, 0, 0]]
    for r in range(2):
        for j in range(4):
            target[r * 4 + j, argmax[r][j]] = 1.0  # a greedy row's distribution: one-hot at the argmax
    drafts = torch.tensor([[1, 2, 0], [0, 3, 0]])
    tokens, accepted = rejection_sample(target, torch.tensor([0, 4]), drafts, torch.tensor([3, 1]),
                                        torch.rand(2, 3), torch.empty(2, vocab).exponential_())
    assert accepted.tolist() == [2, 1]
    assert tokens.tolist() == [[1, 2, 3, -1], [0, 0, -1, -1]]  # the argmax after the accepted run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_acceptance_on_the_host_equals_the_rejection_sampler(seed):
    """Switch spec_greedy_accept against its reference on fresh random logits (fp32, exact): plain greedy
    sequences with 1-4 drafts, each draft the argmax with some tokens changed, and logits with ties."""
    from nanoserve.runner.sampler import Sampler
    from nanoserve.spec_decode import verify
    from nanoserve.step import StepSeq

    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    vocab, num_seqs = 50, 12
    counts = [rng.randint(1, 4) for _ in range(num_seqs)]
    rows = sum(n + 1 for n in counts)
    logits = torch.randint(0, 6, (rows, vocab), generator=gen).float()  # small integers: ties are common
    argmax = logits.argmax(dim=-1).tolist()
    seqs, start = [], 0
    for i, n in enumerate(counts):
        draft = argmax[start: start + n]
        for j in range(n):
            if rng.random() < 0.3:
                draft[j] = (draft[j] + rng.randint(1, vocab - 1)) % vocab
        seqs.append(StepSeq(i, 0, SamplingParams(temperature=0.0), [1, 2, 3], [], 0, 3, n + 1, True, draft))
        start += n + 1

    def accepted(greedy_accept: bool) -> list[list[int]]:
        device = verify.verify(logits, seqs, Sampler(torch.device("cpu"), seed, eos_token_id=None), None,
                               greedy_accept)
        assert device.greedy == greedy_accept
        return verify.to_host(device)[0]

    on_host = accepted(True)
    assert on_host == accepted(False)
    full = [len(tokens) - 1 == s.num_draft for tokens, s in zip(on_host, seqs)]
    assert any(full) and not all(full)  # both whole drafts and rejections were checked


# -- the engine --------------------------------------------------------------------------------------------------
def repetitive_prompts() -> list[list[int]]:
    rng = random.Random(7)
    motif = [rng.randrange(9, 512) for _ in range(12)]
    return [motif * 4, [rng.randrange(9, 512) for _ in range(40)], motif[:5] * 6 + [rng.randrange(9, 512)],
            [rng.randrange(9, 512) for _ in range(90)]]


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def run(llm: LLM, prompts, params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def tokens_of(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ref_llm() -> LLM:
    return LLM("m3-tiny", optimizations=FAST, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def expected(ref_llm) -> list[list[int]]:
    return tokens_of(run(ref_llm, repetitive_prompts(), GREEDY))


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM("m3-tiny", optimizations=FAST, max_model_len=MAX_MODEL_LEN, speculative_config=NGRAM)


def test_greedy_output_is_unchanged_and_drafts_are_accepted(spec_llm, expected):
    stats = spec_llm.engine.stats
    before = (stats.spec_decode_num_drafts, stats.spec_decode_num_accepted_tokens, stats.num_steps)
    assert tokens_of(run(spec_llm, repetitive_prompts(), GREEDY)) == expected
    drafts, accepted = stats.spec_decode_num_drafts - before[0], stats.spec_decode_num_accepted_tokens - before[1]
    assert drafts > 10 and accepted > 10, "prompt lookup was meant to find and land drafts here"
    assert stats.spec_decode_num_draft_tokens >= accepted
    assert sum(stats.spec_decode_accepted_per_pos) == stats.spec_decode_num_accepted_tokens
    assert list(stats.spec_decode_accepted_per_pos) == sorted(stats.spec_decode_accepted_per_pos, reverse=True)
    assert stats.spec_decode_mean_accepted_length > 1.0
    # fewer steps than tokens: 4 prompts x 40 tokens would take 40 decode steps one token at a time
    assert stats.num_steps - before[2] < 40
    assert_all_blocks_free(spec_llm)


@pytest.mark.parametrize("setting", ["no_prefix_caching", "preemption", "small_budget", "switch_off",
                                     "device_acceptance"])
def test_greedy_output_is_unchanged_under(setting, expected):
    kwargs = dict(optimizations=FAST, max_model_len=MAX_MODEL_LEN, speculative_config=NGRAM)
    if setting == "no_prefix_caching":
        kwargs["enable_prefix_caching"] = False
    elif setting == "preemption":
        kwargs["num_gpu_blocks_override"] = 16  # 256 tokens for 209 prompt + 160 output tokens
    elif setting == "small_budget":
        kwargs["max_num_batched_tokens"] = 18  # chunked prompts; drafts cut to what the budget leaves
    elif setting == "device_acceptance":  # greedy rows through the rejection sampler, the reference path
        kwargs["optimizations"] = FAST.replace(spec_greedy_accept=False)
    else:
        kwargs["optimizations"] = FAST.replace(speculative_decoding=False)
    llm = LLM("m3-tiny", **kwargs)
    assert tokens_of(run(llm, repetitive_prompts(), GREEDY)) == expected
    stats = llm.engine.stats
    if setting == "switch_off":
        assert llm.engine.spec_config is None and stats.spec_decode_num_drafts == 0
    else:
        assert stats.spec_decode_num_accepted_tokens > 0
    if setting == "preemption":
        assert stats.num_preemptions > 0, "the pool was meant to be small enough to preempt"
    if setting == "no_prefix_caching":
        assert stats.prefix_cache_hits == 0
    assert_all_blocks_free(llm)


def test_prefix_cache_is_hit_after_speculated_outputs(spec_llm, ref_llm):
    """The blocks a speculating sequence registered hold what the tokens say: a prompt that continues one of
    them is served from the cache and still decodes as without speculation."""
    prompt = repetitive_prompts()[0]
    first = tokens_of(run(spec_llm, [prompt], GREEDY))[0]
    hits = spec_llm.engine.stats.prefix_cache_hits
    longer = prompt + first
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert tokens_of(run(spec_llm, [longer], sp)) == tokens_of(run(ref_llm, [longer], sp))
    assert spec_llm.engine.stats.prefix_cache_hits - hits >= 5 * 16  # 48 prompt + most of 40 output tokens
    assert_all_blocks_free(spec_llm)


def test_stop_strings_and_max_tokens_cut_an_accepted_run(spec_llm, ref_llm):
    prompts = repetitive_prompts()
    ref = run(ref_llm, prompts, GREEDY)
    cut = 0
    for i, out in enumerate(ref):
        text = out.outputs[0].text
        for start in (len(text) // 3, len(text) // 2):
            stop = text[start: start + 3]
            if not stop.strip():
                continue
            sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
            want, got = run(ref_llm, [prompts[i]], sp)[0].outputs[0], run(spec_llm, [prompts[i]], sp)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
                (want.token_ids, want.text, want.finish_reason, want.stop_reason)
            cut += want.finish_reason == "stop"
    assert cut >= 4
    for max_tokens in (1, 2, 5, 7):  # drafts are cut to what max_tokens leaves
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert tokens_of(run(spec_llm, prompts, sp)) == [t[:max_tokens] for t in tokens_of(ref)]
    assert_all_blocks_free(spec_llm)


def test_logprobs_are_the_targets_at_each_position(spec_llm, ref_llm):
    prompts = repetitive_prompts()[:2]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    accepted = spec_llm.engine.stats.spec_decode_num_accepted_tokens
    for want, got in zip(run(ref_llm, prompts, sp), run(spec_llm, prompts, sp)):
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 24
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert list(lw) == list(lg)
            assert all(abs(lw[t] - lg[t]) < 1e-4 for t in lw)
        assert abs(g.cumulative_logprob - w.cumulative_logprob) < 1e-3
    assert spec_llm.engine.stats.spec_decode_num_accepted_tokens > accepted


def test_processed_logprobs_too(ref_llm):
    """logprobs_mode processed_logprobs: the logprobs of the logits the draw used, position by position."""
    prompts = repetitive_prompts()[:2]
    sp = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1, logit_bias={77: 1.5}),
          SamplingParams(temperature=0.7, top_k=5, max_tokens=16, ignore_eos=True, logprobs=1, seed=3)]
    llm = LLM("m3-tiny", optimizations=FAST, max_model_len=MAX_MODEL_LEN, speculative_config=NGRAM,
              logprobs_mode="processed_logprobs")
    plain = LLM("m3-tiny", optimizations=FAST, max_model_len=MAX_MODEL_LEN, logprobs_mode="processed_logprobs")
    want, got = run(plain, prompts, sp), run(llm, prompts, sp)
    w, g = want[0].outputs[0], got[0].outputs[0]  # greedy: the same tokens, the same values
    assert g.token_ids == w.token_ids
    assert all(list(a) == list(b) and all(abs(a[t] - b[t]) < 1e-4 for t in a) for a, b in zip(w.logprobs, g.logprobs))
    for lp in got[1].outputs[0].logprobs:  # sampled with top_k=5: only the kept tokens have a finite logprob
        (token, value), = [(t, v) for t, v in lp.items()][:1]
        assert value > float("-inf")
    assert llm.engine.stats.spec_decode_num_drafts > 0
    assert_all_blocks_free(llm)


def test_prompt_logprobs_beside_verify_steps(ref_llm):
    """A prompt that asks for prompt logprobs is prefilled (in chunks) in the steps where others verify drafts:
    its rows come before theirs in the step's logits, and both come out as without speculation."""
    prompts = repetitive_prompts()
    logprob_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=2)
    spec_llm = LLM("m3-tiny", optimizations=FAST, max_model_len=MAX_MODEL_LEN, speculative_config=NGRAM,
                   max_num_batched_tokens=16)
    engine = spec_llm.engine
    for i in (0, 1):  # two sequences decoding (and drafting) before the prompt-logprob request arrives
        engine.add_request(f"early{i}", prompts[i], GREEDY)
    finished = {}

    def step():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for _ in range(6):
        step()
    mixed = []

    def watch(event, **payload):
        if event == "step":
            scheduled = payload["scheduled"]
            mixed.append(any(s.num_draft for s in scheduled) and any(s.seq.needs_prompt_logprobs for s in scheduled))
    engine.add_observer(watch)
    engine.add_request("plp", prompts[3], logprob_params)
    while engine.has_unfinished_requests():
        step()
    engine.observers.remove(watch)
    assert any(mixed), "the prompt-logprob prefill was meant to share a step with a verify query"
    want = run(ref_llm, [prompts[0], prompts[1], prompts[3]], [GREEDY, GREEDY, logprob_params])
    got = [finished["early0"], finished["early1"], finished["plp"]]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(got[2].prompt_logprobs) == len(prompts[3])
    for a, b in zip(want[2].prompt_logprobs[1:], got[2].prompt_logprobs[1:]):
        assert list(a) == list(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert_all_blocks_free(spec_llm)


def test_sampled_requests_speculate_and_finish(spec_llm):
    """Sampling (rejection sampling: its distribution is the unit test's) runs through verify steps: seeded
    requests are reproducible, n > 1 completions differ, every block comes back."""
    prompts = repetitive_prompts()[:2]
    sp = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, ignore_eos=True, seed=11, n=2)
    drafts = spec_llm.engine.stats.spec_decode_num_drafts
    a, b = run(spec_llm, prompts, sp), run(spec_llm, prompts, sp)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    assert all(len(c.token_ids) == 30 for o in a for c in o.outputs)
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in a)
    assert spec_llm.engine.stats.spec_decode_num_drafts > drafts
    assert_all_blocks_free(spec_llm)


def test_requests_that_cannot_speculate_decode_beside_those_that_do(spec_llm, ref_llm):
    """Penalties read a sequence's own output while it is sampled: such a request decodes one token per step in
    the same batches, unchanged."""
    prompts = repetitive_prompts()[:2]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3), GREEDY]
    assert tokens_of(run(spec_llm, prompts, params)) == tokens_of(run(ref_llm, prompts, params))
    assert_all_blocks_free(spec_llm)


@pytest.mark.parametrize("overlap_grammar", [True, False])
def test_structured_outputs_speculate_under_their_grammar(overlap_grammar, ref_llm):
    """A JSON schema, a regex and a grammar with speculation: each verified position is masked by the grammar
    after the draft tokens before it, drafts are cut where the grammar forbids them, and the grammar advances
    over the accepted tokens only - greedy output equals the output without speculation, and stays valid."""
    import json

    import jsonschema

    from nanoserve.sampling import StructuredOutputsParams as SO
    from tests.engine.test_structured_output_engine import PERSON

    opts = FAST.replace(overlap_grammar=overlap_grammar)
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SO(json=PERSON,
                                                                                 disable_any_whitespace=True)),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(regex=r"(ab|abc|[0-9]{2})+;")),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=SO(
                  grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?')),
              SamplingParams(temperature=0.8, seed=2, max_tokens=40,
                             structured_outputs=SO(regex=r"(xy|x[0-9])+\."))]
    prompts = ["Tell me about", "Codes: abab", "Sum: (1+2+1+2", "Pairs:"]
    plain = LLM("m3-tiny", optimizations=opts, max_model_len=MAX_MODEL_LEN)
    spec = LLM("m3-tiny", optimizations=opts, max_model_len=MAX_MODEL_LEN,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                                   "prompt_lookup_min": 1})
    want, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got[:3]] == [o.outputs[0].token_ids for o in want[:3]]
    jsonschema.validate(json.loads(got[0].outputs[0].text), PERSON)
    import re
    assert re.fullmatch(r"\((?:[1-9][0-9]?\+)*[1-9][0-9]?\)", got[2].outputs[0].text)
    sampled = got[3].outputs[0]
    assert re.fullmatch(r"(xy|x[0-9])+\.", sampled.text) or sampled.finish_reason == "length"
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in got)
    assert spec.engine.stats.spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(spec)


def test_abort_while_a_verify_step_is_in_flight_frees_every_block(spec_llm, ref_llm):
    engine = spec_llm.engine
    prompts = repetitive_prompts()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    inflight = step_until_in_flight(engine, lambda step: step.step.verifying, 30)
    assert inflight is not None, "a verify step was meant to be in flight"
    aborted = {s.seq.request_id for s in inflight.sched.scheduled if s.num_draft}
    engine.abort_request(sorted(aborted))
    engine.block_manager.check_integrity()
    finished = finish_all(engine)
    kept = sorted(set(f"r{i}" for i in range(len(prompts))) - aborted)
    assert sorted(finished) == kept
    expected = tokens_of(run(ref_llm, prompts, GREEDY))
    assert all(finished[rid] == expected[int(rid[1:])] for rid in kept)
    assert_all_blocks_free(spec_llm)


# -- the server ----------------------------------------------------------------------------------------------------
def test_server_speculates_with_vllms_flag_and_reports_acceptance(tiny_dir, tmp_path):
    """`--speculative-config` on a real server process: greedy completions (streamed too) equal the offline ones
    without speculation, /metrics carries vLLM's spec_decode counters, and a bad config stops the start naming
    the key."""
    import json
    import subprocess
    import sys

    import httpx
    import openai

    from tests.helpers.server_utils import KV_CACHE_TOKENS, ServerProcess, metric
    from tests.helpers.server_utils import MAX_MODEL_LEN as SERVER_LEN

    prompts = repetitive_prompts()[:3]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(tiny_dir, optimizations=FAST, device="cpu", max_model_len=SERVER_LEN,
             kv_cache_tokens=KV_CACHE_TOKENS) as llm:
        offline = tokens_of(run(llm, prompts, sp))
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--speculative-config", json.dumps(NGRAM)) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        online = []
        for p in prompts:
            out = client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0.0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            online.append(out.choices[0].token_ids)
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=24, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        whole = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=24, temperature=0.0,
                                          extra_body={"ignore_eos": True}).choices[0].text
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        log = srv.log()
    assert online == offline
    assert streamed == whole
    assert "speculative decoding: SpeculativeConfig(method='ngram', num_speculative_tokens=3" in log
    drafts = metric(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert 0 < accepted <= draft_tokens <= 3 * drafts
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    bad = subprocess.run([sys.executable, "-m", "nanoserve.server", "--model", tiny_dir, "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 2, "model": "draft"}'],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--speculative-config" in bad.stderr and "model" in bad.stderr


# -- the MTP drafter ----------------------------------------------------------------------------------------------
def mtp_tensors(model_dir: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors for an MTP module of the checkpoint's model: its block takes the shapes of the model's last
    MSA+MoE layer, under `language_model.model.mtp.layers.0.transformer_layer.`, plus enorm, hnorm, eh_proj and
    final_layernorm."""
    from safetensors import safe_open

    from nanoserve.model.loader import checkpoint_files, read_config

    cfg = read_config(model_dir)
    last = max(i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i) and cfg.is_sparse_attention(i))
    layer = f"language_model.model.layers.{last}."
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, path in checkpoint_files(model_dir).items():
        if key.startswith(layer):
            with safe_open(path, framework="pt") as f:
                t = f.get_tensor(key)
            out["language_model.model.mtp.layers.0.transformer_layer." + key.removeprefix(layer)] = \
                (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype)
    h = cfg.hidden_size
    for n in ("enorm", "hnorm", "final_layernorm"):
        out[f"language_model.model.mtp.layers.0.{n}.weight"] = torch.randn(h, generator=g) * 0.1
    out["language_model.model.mtp.layers.0.eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.05).to(
        torch.bfloat16)
    return out


def test_mtp_loader_reads_every_key(mtp_dir, tmp_path):
    from safetensors.torch import save_file

    from nanoserve.model.loader import CheckpointError, load_model
    from nanoserve.spec_decode.mtp import M3MTP, has_mtp, load_mtp

    model, _ = load_model(mtp_dir, FAST)  # the main loader skips the MTP tensors
    mtp = M3MTP(model.cfg, FAST, torch.float32, "cpu")
    tensors = mtp_tensors(mtp_dir)
    assert has_mtp(mtp_dir) and load_mtp(mtp, mtp_dir) == len(tensors)
    params = dict(mtp.named_parameters())
    block = f"layers.{model.cfg.num_hidden_layers}"
    assert torch.equal(params["eh_proj.weight"], tensors["language_model.model.mtp.layers.0.eh_proj.weight"].float())
    assert torch.equal(params["enorm.weight"], tensors["language_model.model.mtp.layers.0.enorm.weight"])
    o_proj = "language_model.model.mtp.layers.0.transformer_layer.self_attn.o_proj.weight"
    assert torch.equal(params[f"{block}.self_attn.o_proj.weight"], tensors[o_proj].float())
    assert all(bool(p.abs().sum() > 0) for p in params.values()), "a parameter was left unfilled"
    # a missing and an unexpected tensor are named
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bad / f).symlink_to(f"{mtp_dir}/{f}")
    broken = dict(tensors)
    del broken[o_proj]
    broken["language_model.model.mtp.layers.0.surprise.weight"] = torch.zeros(2)
    save_file(broken, str(bad / "mtp.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing MTP tensor\(s\): .*o_proj.*unexpected MTP tensor\(s\): "
                                              r".*surprise"):
        load_mtp(M3MTP(model.cfg, FAST, torch.float32, "cpu"), str(bad))


def test_mtp_needs_a_checkpoint_with_an_mtp_module(tiny_dir):
    with pytest.raises(ValueError, match=r"method 'mtp'.*no MTP module"):
        LLM(tiny_dir, optimizations=FAST, max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_max apply to method 'ngram' only"):
        SpeculativeConfig.from_dict({"method": "mtp", "prompt_lookup_max": 3})
    assert SpeculativeConfig.from_dict({"method": "mtp"}).num_speculative_tokens == 1


@pytest.fixture(scope="module")
def mtp_expected(mtp_dir) -> list[list[int]]:
    with LLM(mtp_dir, optimizations=FAST, max_model_len=MAX_MODEL_LEN) as llm:
        return tokens_of(run(llm, repetitive_prompts(), GREEDY))


@pytest.mark.parametrize("setting", ["plain", "no_prefix_caching", "preemption", "small_budget"])
def test_mtp_greedy_output_is_unchanged(mtp_dir, mtp_expected, setting):
    kwargs = dict(optimizations=FAST, max_model_len=MAX_MODEL_LEN,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    if setting == "no_prefix_caching":
        kwargs["enable_prefix_caching"] = False
    elif setting == "preemption":
        kwargs["num_gpu_blocks_override"] = 16
    elif setting == "small_budget":
        kwargs["max_num_batched_tokens"] = 18
    with LLM(mtp_dir, **kwargs) as llm:
        assert llm.engine.executor.runner.drafter is not None
        assert tokens_of(run(llm, repetitive_prompts(), GREEDY)) == mtp_expected
        stats = llm.engine.stats
        assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens > stats.spec_decode_num_drafts
        if setting == "preemption":
            assert stats.num_preemptions > 0
        sp = SamplingParams(temperature=0.8, max_tokens=12, seed=5, ignore_eos=True)
        assert all(len(t) == 12 for t in tokens_of(run(llm, repetitive_prompts()[:2], sp)))
        assert_all_blocks_free(llm)


def reference_mtp_drafts(model, mtp, tokens: list[int], k: int) -> list[int]:
    """The MTP drafts for a sequence computed from scratch: one prefill of the main model over `tokens`, the MTP
    module over every position at once (h_p with x_{p+1}), then k - 1 further steps on its own output."""
    from nanoserve.batch import AttentionMetadata
    from nanoserve.runner.kv_cache import allocate_kv_caches
    from nanoserve.spec_decode.mtp import mtp_config

    bs, n = model.cfg.index_block_size, len(tokens)
    blocks = -(-(n + k) // bs)
    kv, index = allocate_kv_caches(mtp_config(model.cfg), blocks, bs, torch.float32, "cpu")
    model.bind_kv_caches(kv, index)
    mtp.bind_kv_cache(kv[-1], index[-1])
    table = [list(range(blocks))]
    meta = AttentionMetadata.build([n], [n], table, bs)
    hidden = model(torch.tensor(tokens), meta.positions, meta)
    meta = AttentionMetadata.build([n - 1], [n - 1], table, bs)
    h = mtp(model, torch.tensor(tokens[1:]), hidden[:-1], meta.positions, meta)[-1:]
    drafts = []
    for j in range(k):
        token = model.compute_logits(h).argmax(dim=-1)
        drafts.append(int(token))
        meta = AttentionMetadata.build([1], [n + j], table, bs)
        h = mtp(model, token, h, meta.positions, meta)
    return drafts


def test_mtp_drafts_equal_a_from_scratch_computation(mtp_dir):
    """The MTP's K/V, written step by step (prefill chunks, verify steps with rejected positions, rollback), gives
    the drafts that one computation from scratch over the sequence's tokens gives."""
    from nanoserve.model.loader import load_model
    from nanoserve.spec_decode.mtp import M3MTP, load_mtp

    model, _ = load_model(mtp_dir, FAST)
    mtp = M3MTP(model.cfg, FAST, torch.float32, "cpu")
    load_mtp(mtp, mtp_dir)
    with LLM(mtp_dir, optimizations=FAST, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=18,
             speculative_config={"method": "mtp", "num_speculative_tokens": 3}) as llm:
        engine = llm.engine
        for i, p in enumerate(repetitive_prompts()[:3]):
            engine.add_request(f"r{i}", p, GREEDY)
        checked = 0
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                if len(seq.spec_token_ids) == 3:
                    assert seq.spec_token_ids == reference_mtp_drafts(model, mtp, seq.token_ids, 3)
                    checked += 1
        assert checked >= 30
        assert_all_blocks_free(llm)


# -- the EAGLE-3 drafter ------------------------------------------------------------------------------------------
EAGLE_TAPS = [0, 2, 4]  # m3-tiny has 4 layers: 4 is the stream after the last one
DRAFT_VOCAB = 200


def write_eagle3_dir(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 draft for m3-tiny in vLLM's layout (config.json with eagle_config, midlayer.* tensors, fc,
    norm, its own head over a smaller draft vocabulary with d2t, and t2d); returns the tensors."""
    import json

    from safetensors.torch import save_file

    h, heads, kv, hd, inter = 128, 4, 2, 32, 256
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": inter,
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": 512,
              "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": h, "num_hidden_layers": 1,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE_TAPS, "use_aux_hidden_state": True}}
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.05):
        return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)
    targets = torch.randperm(512, generator=g)[:DRAFT_VOCAB].sort().values
    tensors = {"midlayer.input_layernorm.weight": 1 + rnd(h), "midlayer.hidden_norm.weight": 1 + rnd(h),
               "midlayer.post_attention_layernorm.weight": 1 + rnd(h),
               "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
               "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * h),
               "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * h),
               "midlayer.self_attn.o_proj.weight": rnd(h, heads * hd),
               "midlayer.mlp.gate_proj.weight": rnd(inter, h), "midlayer.mlp.up_proj.weight": rnd(inter, h),
               "midlayer.mlp.down_proj.weight": rnd(h, inter), "fc.weight": rnd(h, 3 * h), "norm.weight": 1 + rnd(h),
               "lm_head.weight": rnd(DRAFT_VOCAB, h, scale=0.5), "d2t": targets - torch.arange(DRAFT_VOCAB),
               "t2d": torch.zeros(512, dtype=torch.bool).index_fill_(0, targets, True)}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("eagle3") / "draft"
    write_eagle3_dir(path)
    return str(path)


def eagle_config(draft: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": draft, "num_speculative_tokens": k}


def test_eagle3_loader_reads_every_tensor_and_names_what_is_wrong(tiny_dir, eagle_dir, tmp_path):
    import json

    from safetensors.torch import save_file

    from nanoserve.model.loader import CheckpointError, load_model
    from nanoserve.spec_decode.eagle3 import load_eagle3

    model, _ = load_model(tiny_dir, FAST)
    tensors = write_eagle3_dir(tmp_path / "again")
    drafter = load_eagle3(eagle_dir, model, FAST, torch.float32, "cpu")
    assert drafter.cfg.aux_layer_ids == tuple(EAGLE_TAPS) and drafter.cfg.draft_vocab_size == DRAFT_VOCAB
    for name, t in tensors.items():
        if name == "t2d":
            continue
        key = "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name
        got = {"lm_head.weight": drafter.lm_head, "d2t": drafter.d2t}.get(key)
        got = drafter.w(key) if got is None else got
        assert torch.equal(got.to(t.dtype), t), name
    assert drafter.embed is None  # the target's embedding
    bad = tmp_path / "bad"
    broken = dict(tensors)
    del broken["fc.weight"]
    broken["midlayer.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    broken["extra.weight"] = torch.zeros(2)
    bad.mkdir()
    (bad / "config.json").write_text((tmp_path / "again" / "config.json").read_text())
    save_file(broken, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): fc.weight; unexpected tensor\(s\): extra.weight"):
        load_eagle3(str(bad), model, FAST, torch.float32, "cpu")
    broken["fc.weight"] = tensors["fc.weight"]
    del broken["extra.weight"]
    save_file(broken, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.weight has shape \(3, 3\), expected \(128, 256\)"):
        load_eagle3(str(bad), model, FAST, torch.float32, "cpu")
    config = json.loads((bad / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 9]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        load_eagle3(str(bad), model, FAST, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs model"):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="applies to method 'eagle3' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "model": eagle_dir})
    with pytest.raises(ValueError, match="does not exist"):
        LLM(tiny_dir, optimizations=FAST, max_model_len=MAX_MODEL_LEN, speculative_config=eagle_config("/nope"))


@pytest.mark.parametrize("setting", ["plain", "preemption"])
def test_eagle3_greedy_output_is_unchanged(tiny_dir, eagle_dir, setting):
    kwargs = dict(optimizations=FAST, max_model_len=MAX_MODEL_LEN, speculative_config=eagle_config(eagle_dir))
    if setting == "preemption":
        kwargs["num_gpu_blocks_override"] = 16
    with LLM(tiny_dir, optimizations=FAST, max_model_len=MAX_MODEL_LEN) as ref:
        want = tokens_of(run(ref, repetitive_prompts(), GREEDY))
    with LLM(tiny_dir, **kwargs) as llm:
        assert tokens_of(run(llm, repetitive_prompts(), GREEDY)) == want
        stats = llm.engine.stats
        assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens > stats.spec_decode_num_drafts
        if setting == "preemption":
            assert stats.num_preemptions > 0
        assert_all_blocks_free(llm)


def reference_eagle3_drafts(model, drafter, tokens: list[int], k: int) -> list[int]:
    """EAGLE-3 drafts from scratch: one prefill of the target over `tokens` with its taps caught, the draft layer
    over every position at once, then k - 1 steps on its own pre-norm output."""
    from nanoserve.batch import AttentionMetadata
    from nanoserve.runner.kv_cache import allocate_kv_caches

    bs, n = model.cfg.index_block_size, len(tokens)
    blocks = -(-(n + k) // bs)
    kv, index = allocate_kv_caches(model.cfg, blocks, bs, torch.float32, "cpu")
    model.bind_kv_caches(kv, index)
    c = drafter.cfg
    drafter.bind_kv_cache(torch.zeros(blocks, 2, bs, c.num_key_value_heads, c.head_dim))
    taps = {}
    layers = len(model.layers)
    hooks = [model.layers[i].register_forward_pre_hook(
        lambda m, args, i=i: taps.__setitem__(i, args[0] if args[1] is None else args[0] + args[1]))
        for i in c.aux_layer_ids if i < layers]
    hooks.append(model.layers[-1].register_forward_hook(
        lambda m, args, out: taps.__setitem__(layers, out[0] + out[1])))
    table = [list(range(blocks))]
    meta = AttentionMetadata.build([n], [n], table, bs)
    model(torch.tensor(tokens), meta.positions, meta)
    for h in hooks:
        h.remove()
    hidden = drafter.combine(torch.cat([taps[i] for i in c.aux_layer_ids], -1))[:-1]
    meta = AttentionMetadata.build([n - 1], [n - 1], table, bs)
    out, carry = drafter.step(model, torch.tensor(tokens[1:]), hidden, meta.positions, meta)
    out, carry = out[-1:], carry[-1:]
    drafts = []
    for j in range(k):
        token = drafter.draft_tokens(model, out)
        drafts.append(int(token))
        meta = AttentionMetadata.build([1], [n + j], table, bs)
        out, carry = drafter.step(model, token, carry, meta.positions, meta)
    return drafts


def test_eagle3_drafts_equal_a_from_scratch_computation(tiny_dir, eagle_dir):
    """The taps of every target step, the draft layer's K/V written step by step (prefill chunks, verify steps,
    rollback) and the draft vocabulary's map give the drafts one computation from scratch gives."""
    from nanoserve.model.loader import load_model
    from nanoserve.spec_decode.eagle3 import load_eagle3

    model, _ = load_model(tiny_dir, FAST)
    drafter = load_eagle3(eagle_dir, model, FAST, torch.float32, "cpu")
    with LLM(tiny_dir, optimizations=FAST, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=18,
             speculative_config=eagle_config(eagle_dir)) as llm:
        engine = llm.engine
        for i, p in enumerate(repetitive_prompts()[:3]):
            engine.add_request(f"r{i}", p, GREEDY)
        checked = 0
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:
                if len(seq.spec_token_ids) == 3:
                    drafts = reference_eagle3_drafts(model, drafter, seq.token_ids, 3)
                    assert seq.spec_token_ids == drafts
                    assert all(d in drafter.d2t.add(torch.arange(DRAFT_VOCAB)).tolist() for d in drafts)
                    checked += 1
        assert checked >= 30
        assert_all_blocks_free(llm)
