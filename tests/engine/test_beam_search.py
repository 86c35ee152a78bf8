"""Beam search (LLM.beam_search, vLLM's): the beams equal a beam search over direct forward passes of the model,
each beam's cumulative logprob is the sum of its tokens' logprobs, beams come back ranked by vLLM's length-penalised
score, beam_width 1 is greedy, ignore_eos / max_tokens / the model's length are honoured, the beams of a prompt
share their prefix's KV blocks and every block is free again afterwards, and bad parameters are ValueErrors naming
the parameter.

m3-tiny's random weights end beams with EOS often enough (2 x beam_width candidates per beam) to rank beams of
different lengths."""

from __future__ import annotations

import asyncio
import math
import random
import re

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.entrypoints.beam_search import BeamSearchSequence, BeamSearchStream, get_beam_search_score
from nanoserve.presets.tokenizer import EOS_ID
from nanoserve.sampling import BeamSearchParams
from tests.helpers.engine_utils import LOGPROB_ATOL, assert_all_blocks_free, direct_logprobs
from tests.helpers.server_utils import FAST_CPU, engine_config

MAX_MODEL_LEN = 128
BLOCK = 16  # m3-tiny's KV block (= MSA block) size


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("m3-tiny", optimizations=FAST_CPU, kv_cache_tokens=2048, max_model_len=MAX_MODEL_LEN)


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(9, 500) for _ in range(n)]


def score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's beam score, written out: cumulative logprob / (tokens, prompt included, less a final EOS) ** lp."""
    length = len(beam.tokens) - (beam.tokens[-1] == EOS_ID)
    return beam.cum_logprob / length ** length_penalty


def search(llm: LLM, ids: list[int], **params) -> list[BeamSearchSequence]:
    return llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(**params))[0].sequences


def reference_beam_search(llm: LLM, ids: list[int], beam_width: int, max_tokens: int,
                          length_penalty: float) -> list[tuple[list[int], float]]:
    """The same algorithm on logprobs from one direct forward pass of each beam (no engine, no KV sharing):
    (tokens, cumulative logprob) of the best beams, best first."""
    beams, done = [(list(ids), 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            row = direct_logprobs(llm, tokens)[-1]
            for t in row.topk(2 * beam_width).indices.tolist():
                (done if t == EOS_ID else candidates).append((tokens + [t], cum + row[t].item()))
        beams = sorted(candidates, key=lambda b: b[1], reverse=True)[:beam_width]

    def key(b):
        return b[1] / (len(b[0]) - (b[0][-1] == EOS_ID)) ** length_penalty
    return sorted(done + beams, key=key, reverse=True)[:beam_width]


@pytest.mark.parametrize("seed, length, beam_width, max_tokens", [(3, 4, 4, 8), (11, 40, 3, 6), (4, 20, 2, 10)])
def test_beams_equal_a_beam_search_over_direct_forwards(llm, seed, length, beam_width, max_tokens):
    ids = prompt_ids(seed, length)
    beams = search(llm, ids, beam_width=beam_width, max_tokens=max_tokens)
    ref = reference_beam_search(llm, ids, beam_width, max_tokens, 1.0)
    assert [b.tokens for b in beams] == [tokens for tokens, _ in ref]
    for beam, (_, cum) in zip(beams, ref):
        assert beam.cum_logprob == pytest.approx(cum, abs=LOGPROB_ATOL * max_tokens)
    assert_all_blocks_free(llm)


def test_each_beams_cumulative_logprob_is_the_sum_of_its_tokens_logprobs(llm):
    ids = prompt_ids(3, 4)
    beams = search(llm, ids, beam_width=4, max_tokens=10, length_penalty=0.0)
    assert len(beams) == 4
    assert any(b.finish_reason == "stop" for b in beams) and any(b.finish_reason == "length" for b in beams)
    for beam in beams:
        generated = beam.tokens[len(ids):]
        ref = direct_logprobs(llm, beam.tokens[:-1])  # row i predicts token i + 1
        assert len(beam.logprobs) == len(generated)
        total = 0.0
        for j, (token, candidates) in enumerate(zip(generated, beam.logprobs)):
            want = ref[len(ids) - 1 + j]
            assert candidates[token] == pytest.approx(want[token].item(), abs=LOGPROB_ATOL)
            # the step's candidates: the 2 x beam_width most likely tokens
            assert set(candidates) == set(want.topk(8).indices.tolist())
            total += want[token].item()
        assert beam.cum_logprob == pytest.approx(total, abs=LOGPROB_ATOL * len(generated))
        if beam.finish_reason == "stop":
            assert generated[-1] == EOS_ID and EOS_ID not in generated[:-1] and beam.stop_reason == EOS_ID
        else:
            assert len(generated) == 10 and EOS_ID not in generated
        # the text is the whole sequence's (vLLM's offline shape), without the EOS's
        text_ids = beam.tokens[:-1] if beam.finish_reason == "stop" else beam.tokens
        assert beam.text == llm.get_tokenizer().decode(text_ids)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -1.0])
def test_beams_are_ranked_by_the_length_penalised_score(llm, length_penalty):
    for seed in (3, 4, 11):
        beams = search(llm, prompt_ids(seed, 4), beam_width=4, max_tokens=10, length_penalty=length_penalty)
        scores = [score(b, length_penalty) for b in beams]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("length_penalty", [3.4e16, -3.4e16])
def test_an_extreme_length_penalty_still_ranks_the_beams(llm, length_penalty):
    """length ** length_penalty leaves the floats (overflow above, 0 below): the search still answers, its beams
    from the same search (the penalty only orders the finished ones), none of them scored above 0."""
    beams = search(llm, prompt_ids(3, 4), beam_width=4, max_tokens=10, length_penalty=length_penalty)
    assert len(beams) == 4
    assert all(get_beam_search_score(b.tokens, b.cum_logprob, EOS_ID, length_penalty) <= 0 for b in beams)


def test_length_penalty_changes_the_ranking_as_the_formula_says(llm):
    ids = prompt_ids(3, 4)
    by_logprob = search(llm, ids, beam_width=4, max_tokens=10, length_penalty=0.0)
    by_mean = search(llm, ids, beam_width=4, max_tokens=10, length_penalty=1.0)
    # length_penalty 0 ranks by the cumulative logprob, which shorter (EOS-ended) beams win; 1 by the mean, which
    # the beams that ran to max_tokens win here
    assert by_logprob[0].finish_reason == "stop" and len(by_logprob[0].tokens) < len(ids) + 10
    assert by_mean[0].finish_reason == "length" and len(by_mean[0].tokens) == len(ids) + 10
    # the search itself does not depend on the penalty (live beams have equal lengths), only the final ranking:
    # both answers are the best 4 of the same beams, each by its own score
    pool = {tuple(b.tokens): b for b in by_logprob + by_mean}.values()
    for lp, got in ((0.0, by_logprob), (1.0, by_mean)):
        ranked = sorted(pool, key=lambda b: score(b, lp), reverse=True)[:4]
        assert [b.tokens for b in got] == [b.tokens for b in ranked]


@pytest.mark.parametrize("seed", [3, 11])
def test_beam_width_1_is_greedy(llm, seed):
    ids = prompt_ids(seed, 30)
    greedy = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                    logprobs=0), use_tqdm=False)[0].outputs[0]
    (beam,) = search(llm, ids, beam_width=1, max_tokens=12, ignore_eos=True)
    assert beam.tokens == ids + greedy.token_ids
    assert beam.cum_logprob == pytest.approx(greedy.cumulative_logprob, abs=LOGPROB_ATOL * 12)


def test_ignore_eos_and_max_tokens(llm):
    ids = prompt_ids(3, 4)
    beams = search(llm, ids, beam_width=4, max_tokens=10, length_penalty=0.0, ignore_eos=True)
    # without ignore_eos this prompt's best beams end in EOS (tests above); with it, every beam runs to max_tokens
    assert all(len(b.tokens) == len(ids) + 10 and b.finish_reason == "length" for b in beams)
    # EOS was among the candidates, and continued like any other token instead of ending a beam
    assert any(EOS_ID in step for b in beams for step in b.logprobs)
    (one,) = llm.beam_search(["a short prompt"], BeamSearchParams(beam_width=4, max_tokens=1))[:1]
    assert len(one.sequences) == 4 and all(len(b.logprobs) == 1 for b in one.sequences)
    assert_all_blocks_free(llm)


def test_include_stop_str_in_output_keeps_the_eos_text(llm):
    ids = prompt_ids(3, 4)
    with_eos = search(llm, ids, beam_width=4, max_tokens=10, length_penalty=0.0, include_stop_str_in_output=True)
    without = search(llm, ids, beam_width=4, max_tokens=10, length_penalty=0.0)
    assert [b.tokens for b in with_eos] == [b.tokens for b in without]
    ended = [(a, b) for a, b in zip(with_eos, without) if a.finish_reason == "stop"]
    assert ended
    for a, b in ended:
        assert a.text == llm.get_tokenizer().decode(a.tokens) and a.text.endswith(a.text[len(b.text):])
        assert len(a.text) > len(b.text)


def test_a_beam_that_fills_the_context_ends(llm):
    ids = prompt_ids(1, MAX_MODEL_LEN - 3)
    beams = search(llm, ids, beam_width=3, max_tokens=10, ignore_eos=True)
    assert beams and all(len(b.tokens) == MAX_MODEL_LEN and b.finish_reason == "length" for b in beams)
    assert_all_blocks_free(llm)


def test_prompts_searched_together_or_apart_agree(llm):
    prompts = [{"prompt_token_ids": prompt_ids(s, n)} for s, n in ((3, 4), (11, 40), (4, 20))]
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    together = llm.beam_search(prompts, params)
    limited = llm.beam_search(prompts, params, concurrency_limit=2)
    apart = [llm.beam_search([p], params)[0] for p in prompts]
    for outs in (limited, apart):
        assert [[b.tokens for b in o.sequences] for o in outs] == [[b.tokens for b in o.sequences] for o in together]
    assert_all_blocks_free(llm)


def test_without_prefix_caching_the_same_beams(llm):
    """The shared blocks are an optimization: with prefix caching off every beam computes its whole sequence each
    step, and the beams are the same."""
    ids = prompt_ids(11, 40)
    with LLM("m3-tiny", optimizations=FAST_CPU.replace(prefix_caching=False), kv_cache_tokens=2048,
             max_model_len=MAX_MODEL_LEN) as plain:
        want = search(plain, ids, beam_width=3, max_tokens=6)
        assert_all_blocks_free(plain)
    got = search(llm, ids, beam_width=3, max_tokens=6)
    assert [b.tokens for b in got] == [b.tokens for b in want]


def test_a_temperature_adds_a_drawn_candidate(llm):
    """temperature > 0 (vLLM's): each step also draws a token, which joins the 2 x beam_width most likely as a
    candidate; the ranking is the same score."""
    ids = prompt_ids(4, 20)
    beams = search(llm, ids, beam_width=2, max_tokens=8, temperature=1.0, length_penalty=0.5)
    scores = [score(b, 0.5) for b in beams]
    assert scores == sorted(scores, reverse=True)
    for beam in beams:
        ref = direct_logprobs(llm, beam.tokens[:-1])
        for j, step in enumerate(beam.logprobs):
            top = set(ref[len(ids) - 1 + j].topk(4).indices.tolist())
            assert top <= set(step) and len(step) <= 5
        total = sum(ref[len(ids) - 1 + j][t].item() for j, t in enumerate(beam.tokens[len(ids):]))
        assert beam.cum_logprob == pytest.approx(total, abs=LOGPROB_ATOL * 8)


def test_the_beams_share_their_prefix_blocks_and_free_them_all(llm):
    ids = prompt_ids(11, 70)  # four full blocks, then six tokens
    bm = llm.engine.block_manager
    bm.reset_prefix_cache()  # nothing cached from earlier tests: the first step computes the whole prompt
    free_before = bm.num_free_blocks
    shared_steps, hits = [], []

    def watch(event, **payload):
        if event == "step":
            tables = [s.seq.block_table for s in payload["scheduled"]]
            if len(tables) > 1:
                # every beam of a step holds the same first blocks, one physical copy with a reference per beam
                first = [t[:70 // BLOCK] for t in tables]
                shared_steps.append(all(f == first[0] for f in first)
                                    and all(bm.blocks[b].ref_count == len(tables) for b in first[0]))
        elif event == "prefix_hit":
            hits.append(payload["tokens"])

    llm.engine.add_observer(watch)
    computed = llm.engine.stats.num_computed_prefill_tokens
    try:
        beams = search(llm, ids, beam_width=4, max_tokens=8, ignore_eos=True)
    finally:
        llm.engine.observers.remove(watch)
    computed = llm.engine.stats.num_computed_prefill_tokens - computed
    assert len(beams) == 4
    assert shared_steps and all(shared_steps)
    # after the first step (one beam), every beam's request found the prompt's full blocks in the cache
    assert len(hits) == 7 * 4 and min(hits) >= 70 // BLOCK * BLOCK
    # each beam computes only the tokens past its last full block: far less than its whole sequence per step
    assert computed <= len(ids) + 8 * 4 * BLOCK < 8 * 4 * len(ids)
    assert bm.num_free_blocks == free_before
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, message", [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width must be at least 1, got 0."),
    ({"beam_width": 1.5, "max_tokens": 4}, "beam_width must be an int, but is of type <class 'float'>"),
    ({"beam_width": True, "max_tokens": 4}, "beam_width must be an int"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature must be"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan}, "length_penalty must be a finite number"),
    ({"beam_width": 2, "max_tokens": 4, "ignore_eos": 1}, "ignore_eos must be True or False"),
    ({"beam_width": 2, "max_tokens": 4, "include_stop_str_in_output": None}, "include_stop_str_in_output must"),
])
def test_bad_params_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BeamSearchParams(**kwargs)


def test_bad_requests_are_value_errors_and_leak_nothing(llm):
    with pytest.raises(ValueError, match=r"beam_width must be at most 10 .*max_logprobs is 20"):
        llm.beam_search(["hello"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="prompt is too long"):
        llm.beam_search([{"prompt_token_ids": prompt_ids(1, MAX_MODEL_LEN)}], BeamSearchParams(beam_width=2,
                                                                                               max_tokens=2))
    with pytest.raises(ValueError, match="prompt_token_ids must be integers"):
        llm.beam_search([{"prompt_token_ids": [10**9]}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search(["hello"], SamplingParams())
    assert_all_blocks_free(llm)


def test_on_the_async_engine_the_same_beams_as_one_request_output(llm, tiny_dir):
    """BeamSearchStream (what the server's use_beam_search runs): the beams LLM.beam_search finds, as one finished
    RequestOutput whose choices are the best beams - generated token ids (the EOS only with
    include_stop_str_in_output), text without the EOS, cumulative logprob, finish reason; closing it early aborts
    the step in flight. Every block is free afterwards."""
    ids = prompt_ids(3, 4)
    params = BeamSearchParams(beam_width=4, max_tokens=10, length_penalty=0.0)
    want = search(llm, ids, beam_width=4, max_tokens=10, length_penalty=0.0)
    engine = AsyncLLMEngine.from_config(engine_config(tiny_dir, max_model_len=MAX_MODEL_LEN, kv_cache_tokens=2048))
    tok = llm.get_tokenizer()

    async def run(request_id, keep_eos=False, num_logprobs=None):
        p = BeamSearchParams(**{**params.__dict__, "include_stop_str_in_output": keep_eos})
        stream = await BeamSearchStream.start(engine, request_id, {"prompt_token_ids": ids, "prompt": None}, p,
                                              tok.decode, num_logprobs=num_logprobs)
        return [out async for out in stream]

    async def main():
        await engine.start()
        try:
            (out,) = await run("a", num_logprobs=2)
            with pytest.raises(ValueError, match=r"logprobs must be in \[0, 8\] with beam search"):
                await run("e", num_logprobs=9)
            (kept,) = await run("b", keep_eos=True)
            stream = await BeamSearchStream.start(engine, "c", {"prompt_token_ids": ids}, params, tok.decode)
            await asyncio.sleep(0)
            await stream.aclose()  # the first step is in flight: aborted
            with pytest.raises(ValueError, match="prompt is too long"):
                await BeamSearchStream.start(engine, "d", {"prompt_token_ids": prompt_ids(1, MAX_MODEL_LEN)}, params,
                                             tok.decode)
            while engine.engine.requests:
                await asyncio.sleep(0.01)
            await engine.run_on_engine_thread(engine.engine.block_manager.check_integrity)
        finally:
            await engine.shutdown()
        return out, kept

    out, kept = asyncio.run(main())
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert out.finished and out.prompt_token_ids == ids and len(out.outputs) == 4
    for i, (c, k, beam) in enumerate(zip(out.outputs, kept.outputs, want)):
        generated = beam.tokens[len(ids):]
        assert c.index == i and c.finish_reason == beam.finish_reason
        assert c.cumulative_logprob == pytest.approx(beam.cum_logprob, abs=LOGPROB_ATOL * 10)
        assert k.token_ids == generated
        if beam.finish_reason == "stop":
            assert c.token_ids == generated[:-1] and c.stop_reason == EOS_ID
        else:
            assert c.token_ids == generated
        assert c.text == k.text == tok.decode(c.token_ids)
        # logprobs as asked: each returned token's, then the 2 most likely of its step's candidates
        assert k.logprobs is None and len(c.logprobs) == len(c.token_ids)
        for t, entry, step in zip(c.token_ids, c.logprobs, beam.logprobs):
            best = sorted(step, key=step.get, reverse=True)[:2]
            assert next(iter(entry)) == t and set(entry) == {t, *best}
            assert all(entry[x] == pytest.approx(step[x], abs=LOGPROB_ATOL) for x in entry)
