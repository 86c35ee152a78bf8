"""Helpers for the tests that run the engine on m3-tiny on the CPU: the switches they run with, random prompts, the
check that a run left nothing behind, the drafts a model-based drafter proposes, and the logprobs of one direct
forward pass to compare the engine's with."""

from __future__ import annotations

import random

import torch

from nanoserve import LLM, Optimizations
from nanoserve.batch import AttentionMetadata

LOGPROB_ATOL = 1e-4  # fp32: engine (batched, paged, chunked) vs one direct forward


def engine_opts(**switches: bool) -> Optimizations:
    """The given switches; every kernel switch off (on the CPU they would run Triton's slow interpreter, and they
    are tested in the kernel tests) and no CUDA graphs; the rest at their defaults."""
    return Optimizations.reference_kernels().replace(cuda_graphs=False, **switches)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(9, 512) for _ in range(n)]  # ids 0-8 are special tokens


def assert_all_blocks_free(llm: LLM) -> None:
    """Every KV block back in the pool (its bookkeeping consistent), no request unfinished, none queued or
    running."""
    bm = llm.engine.block_manager
    bm.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def sampler_of(llm: LLM):
    """The engine's sampler: in the runner, behind the executor (runner/sampler.py)."""
    return llm.engine.executor.runner.sampling.sampler


def record_drafts(llm: LLM) -> list[list[list[int]]]:
    """Every draft the engine's model-based drafter (mtp, eagle3) proposes from now on, in order: one entry per
    draft step, one token list per sequence. Empty, and nothing wrapped, without such a drafter."""
    proposed: list[list[list[int]]] = []
    runner = llm.engine.executor.runner
    if runner.drafter is not None:
        propose = runner.propose_drafts

        def recording(inp):
            out = propose(inp)
            proposed.append(out)
            return out
        runner.propose_drafts = recording
    return proposed


def step_until_in_flight(engine, has, max_steps: int):
    """Step an overlap-scheduling engine until the step it keeps in flight satisfies `has(step)`; that step, or None
    after max_steps steps."""
    for _ in range(max_steps):
        engine.step()
        inflight = engine.overlapped.in_flight
        if inflight is not None and has(inflight):
            return inflight
    return None


def finish_all(engine) -> dict[str, list[int]]:
    """Step until no request is left: the output tokens of each request that finished meanwhile, by request id."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    return finished


def abort_while_in_flight(llm: LLM, prompts: list[list[int]], params, in_flight_is, expected: list[list[int]],
                          what: str) -> None:
    """Add one request per prompt ("a0", "a1", ...) to the overlapped engine, step until the step in flight is one
    `in_flight_is(step)` accepts (pytest.fail naming `what` if none comes in 40 steps), abort "a1" there: the books
    balance, the others finish with `expected`'s tokens, and every block comes back."""
    import pytest

    engine = llm.engine
    for i, q in enumerate(prompts):
        engine.add_request(f"a{i}", {"prompt_token_ids": q}, params)
    for _ in range(40):
        engine.step()
        in_flight = engine.overlapped.in_flight
        if in_flight is not None and in_flight_is(in_flight.step):
            break
    else:
        pytest.fail(f"no {what}")
    engine.abort_request("a1")
    engine.block_manager.check_integrity()
    assert finish_all(engine) == {f"a{i}": out for i, out in enumerate(expected) if i != 1}
    assert_all_blocks_free(llm)


def stop_and_limits(ref_llm: LLM, prompt: list[int], stop_at: int, max_tokens: tuple[int, int, int]) -> list:
    """Three greedy requests that end three ways: the first at a stop string (the two tokens `ref_llm` writes at
    `stop_at` of a free run of `max_tokens[0]`), the other two at their max_tokens, EOS ignored by all."""
    from nanoserve import SamplingParams

    free = ref_llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens[0], ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    stop = ref_llm.get_tokenizer().decode(free[stop_at:stop_at + 2])
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=[stop] if i == 0 else None)
            for i, n in enumerate(max_tokens)]


def finished(llm: LLM, prompts: list[list[int]], params) -> list[tuple[str, list[int], str]]:
    """Each request's (text, token ids, finish reason)."""
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def direct_logprobs(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position of `tokens`, from one forward pass outside the
    scheduler (through the first blocks of the engine's KV pool, whose cached prefixes are dropped after)."""
    engine = llm.engine
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    runner = engine.executor.runner
    n = len(tokens)
    meta = AttentionMetadata.build([n], [n], [list(range(bm.blocks_needed(n)))], bm.block_size, runner.device)
    ids = torch.tensor(tokens, device=runner.device)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(ids, meta.positions, meta))
    bm.reset_prefix_cache()
    return torch.log_softmax(logits.float(), dim=-1)
