"""Prompt logprobs through the offline LLM: equal to the log-softmax of a direct forward of the model at every
prompt position, on one-shot and chunked prefills, past the prefix cache (which such a request does not read),
across preemption and recompute, with n > 1, and for the whole vocabulary."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import LLM, SamplingParams
from tests.helpers.engine_utils import LOGPROB_ATOL, direct_logprobs
from tests.helpers.server_utils import FAST_CPU

CHUNK = 32  # max_num_batched_tokens: longer prompts are prefilled in chunks


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("m3-tiny", optimizations=FAST_CPU, kv_cache_tokens=2048, max_num_batched_tokens=CHUNK,
               max_model_len=256, max_logprobs=600)


def prompt_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(9, 500) for _ in range(n)]


def check(entries: list, ids: list[int], ref: torch.Tensor, num: int) -> None:
    """entries[0] is None; entries[i] holds prompt token i and its `num` best alternatives, with the reference's
    log-softmax values and ranks."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], entries[i]
        top = row.topk(num).indices.tolist() if num else []
        assert next(iter(entry)) == ids[i], "the prompt token comes first"
        assert set(entry) == {ids[i]} | set(top)
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=LOGPROB_ATOL)
            # 1 + the tokens more likely (within the tolerance, either side)
            low, high = int((row > row[t] + LOGPROB_ATOL).sum()), int((row > row[t] - LOGPROB_ATOL).sum())
            assert low + 1 <= lp.rank <= high + 1
        assert entry[ids[i]].decoded_token is not None


@pytest.mark.parametrize("length, num", [(9, 0), (9, 3), (CHUNK, 1), (75, 2)])  # one step, exactly one, 3 chunks
def test_prompt_logprobs_equal_a_direct_forward(llm, length, num):
    ids = prompt_ids(length, length)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=num),
                       use_tqdm=False)[0]
    check(out.prompt_logprobs, ids, direct_logprobs(llm, ids), num)
    # and asking for them changes nothing else
    plain = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(llm):
    ids = prompt_ids(5, 70)
    sp = SamplingParams(max_tokens=1, temperature=0)
    llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)
    cached = llm.generate({"prompt_token_ids": ids}, sp, use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0  # the prefix is in the cache ...
    ref = direct_logprobs(llm, ids)
    # ... but a request that needs its logits recomputes it: whole and right
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check(out.prompt_logprobs, ids, ref, 1)
    assert out.outputs[0].token_ids == cached.outputs[0].token_ids


def test_n_sequences_share_one_set_of_prompt_logprobs(llm):
    ids = prompt_ids(7, 20)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=4,
                                                                  prompt_logprobs=1), use_tqdm=False)[0]
    check(out.prompt_logprobs, ids, direct_logprobs(llm, ids), 1)
    assert len(out.outputs) == 3


def test_whole_vocabulary(llm):
    ids = prompt_ids(8, 6)
    vocab = llm.engine.model_config.vocab_size
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    ref = direct_logprobs(llm, ids)
    for i in range(1, len(ids)):
        assert len(out.prompt_logprobs[i]) == vocab
        ranks = {t: e.rank for t, e in out.prompt_logprobs[i].items()}
        assert ranks[int(ref[i - 1].argmax())] == 1 and all(1 <= r <= vocab for r in ranks.values())
        probs = torch.tensor([e.logprob for e in out.prompt_logprobs[i].values()]).exp()
        assert probs.sum().item() == pytest.approx(1.0, abs=1e-4)
        assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=LOGPROB_ATOL)


def test_preempted_and_recomputed_prompts_keep_whole_prompt_logprobs():
    """A pool so small that long prompts are preempted mid-prefill and recomputed: each still gets one entry per
    prompt token, equal to the reference."""
    tiny = LLM("m3-tiny", optimizations=FAST_CPU, num_gpu_blocks_override=10, max_num_batched_tokens=16,
               max_model_len=128)
    prompts = [prompt_ids(20 + k, 40 + 9 * k) for k in range(4)]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=1)] * 4
    outs = tiny.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tiny.engine.stats.num_preemptions > 0
    for p, out in zip(prompts, outs):
        check(out.prompt_logprobs, p, direct_logprobs(tiny, p), 1)


def test_reference_input_preparation_gives_the_same_rows():
    """The plain input path (fast_input_prep off) picks the same prompt rows as the vectorised one."""
    plain = LLM("m3-tiny", optimizations=FAST_CPU.replace(fast_input_prep=False), kv_cache_tokens=1024,
                max_num_batched_tokens=CHUNK, max_model_len=128)
    ids = prompt_ids(30, 50)
    out = plain.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                         use_tqdm=False)[0]
    check(out.prompt_logprobs, ids, direct_logprobs(plain, ids), 2)


def test_prompt_logprob_chunks_and_row_slices_bound_memory(monkeypatch):
    """A prompt asking for prompt logprobs is prefilled PROMPT_LOGPROB_CHUNK tokens at a time even when the budget
    is larger, and its logits are reduced ROW_SLICE rows at a time; the values are those of a direct forward."""
    from nanoserve.engine import scheduler
    from nanoserve.runner import prompt_logprobs

    monkeypatch.setattr(scheduler, "PROMPT_LOGPROB_CHUNK", 24)
    monkeypatch.setattr(prompt_logprobs, "ROW_SLICE", 7)
    with LLM("m3-tiny", optimizations=FAST_CPU, kv_cache_tokens=1024, max_num_batched_tokens=256,
             max_model_len=256) as llm:
        chunks: list[int] = []
        schedule = llm.engine.scheduler.schedule

        def recording(*args):
            out = schedule(*args)
            chunks.extend(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
            return out

        llm.engine.scheduler.schedule = recording
        ids = prompt_ids(11, 60)
        out = llm.generate({"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2), use_tqdm=False)[0]
        check(out.prompt_logprobs, ids, direct_logprobs(llm, ids), 2)
        assert chunks == [24, 24, 12]
        chunks.clear()
        llm.generate({"prompt_token_ids": prompt_ids(12, 60)}, SamplingParams(max_tokens=1), use_tqdm=False)
        assert chunks == [60], "without prompt logprobs the whole prompt runs in one step"
