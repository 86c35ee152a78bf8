"""Speculative decoding with the host one step behind (switch spec_async): a verify step launched before the previous
step's tokens reach the host, its queries and positions taken from the previous step's draft chain on the device.

Against its reference - each speculative step launched once the previous step's tokens are on the host - on the
CPU with the graphs emulated (each replay re-runs the captured function over the same static buffers, as in
tests/engine/test_spec_graphs.py): the same greedy tokens, the same drafts (so the same acceptance counts, per
position), steps really launched ahead, and every KV block accounted for after every step; and the interplay with
the host's late view: a stop string inside an accepted run, an abort and max_tokens while a step is in flight,
preemption (a small pool) and new requests arriving between steps.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine.test_spec_graphs import GREEDY, MAX_MODEL_LEN, MTP, acceptance, prompts
from tests.helpers.engine_utils import (
    abort_while_in_flight,
    assert_all_blocks_free,
    engine_opts,
    finished,
    stop_and_limits,
)


def build(model: str, spec_async: bool, feed_in_graph: bool = True, **kwargs) -> tuple[LLM, list]:
    """An engine with the draft chain under emulated graphs; the list fills with each launched step's count of
    sequences whose query came from the device."""
    opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True, spec_draft_chain=True,
                                 spec_async=spec_async, spec_feed_in_graph=feed_in_graph,
                                 spec_multi_step=False)  # (one step per launch: tests/engine/test_spec_multi_step.py)
    llm = LLM(model, optimizations=opts, max_model_len=kwargs.pop("max_model_len", MAX_MODEL_LEN), max_num_seqs=4,
              speculative_config=MTP, **kwargs)
    runner = llm.engine.executor.runner
    runner.graph_capture = lambda fn: fn
    fed: list[int] = []
    execute = runner.execute_model

    def counting(step):
        fed.append(sum(s.on_device for s in step.seqs))
        bm = llm.engine.block_manager
        bm.check_integrity()  # every step: the pool's books balance
        return execute(step)

    runner.execute_model = counting
    return llm, fed


def run(llm: LLM, batches, params=GREEDY) -> list[list[int]]:
    outs = []
    for batch in batches:
        outs += [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
    return outs


@pytest.mark.parametrize("feed_in_graph", [True, False], ids=["feed in graph", "feed by the host"])
@pytest.mark.parametrize("model", ["mtp_dir", "m3-mini"])
def test_launched_ahead_the_same_tokens_and_drafts(model, feed_in_graph, request):
    """m3-tiny's random MTP module (drafts mostly rejected) and the trained m3-mini's (mostly accepted, whole and
    partial runs): the same tokens and the same acceptance, per position, as the reference; most steps ahead -
    with the fed queries taken inside the verify graph (spec_feed_in_graph) and by the host's launches."""
    name = request.getfixturevalue(model) if model == "mtp_dir" else model
    batches = [prompts()[:1], prompts()] if model == "mtp_dir" else \
        [[[1, 2, 3] + list(range(40, 80))], [list(range(100, 140)), list(range(300, 330)) * 2]]
    kwargs = {} if model == "mtp_dir" else {"dtype": "float32", "max_model_len": 512}
    results = {}
    for spec_async in (True, False):
        llm, fed = build(name, spec_async, feed_in_graph, **kwargs)
        results[spec_async] = run(llm, batches), acceptance(llm.engine.stats), fed
        assert_all_blocks_free(llm)
        llm.shutdown()
    (out, accepted, fed), (ref, ref_accepted, ref_fed) = results[True], results[False]
    assert out == ref and accepted == ref_accepted
    assert not any(ref_fed), "the reference launched a step ahead"
    assert sum(n > 0 for n in fed) > len(fed) // 2, f"most steps were meant to be launched ahead: {fed}"
    if model == "m3-mini":
        per_pos = accepted[3]
        assert per_pos[0] > 0 and per_pos[-1] < accepted[0], "whole and partial drafts were both meant to occur"


def test_stops_limits_and_aborts_with_a_step_in_flight(mtp_dir):
    """A stop string completed inside an accepted run, max_tokens reached in a step whose successor is already
    launched, and an abort while a step launched ahead is in flight: the outputs the reference gives, nothing
    past a stop, every block back."""
    ref_llm, _ = build(mtp_dir, False)
    llm, fed = build(mtp_dir, True)
    p = prompts()
    params = stop_and_limits(ref_llm, p[0], stop_at=10, max_tokens=(30, 7, 25))
    ref, got = finished(ref_llm, p, params), finished(llm, p, params)
    assert got == ref and ref[0][2] == "stop" and ref[1][2] == "length" and len(ref[1][1]) == 7
    assert any(fed)
    assert_all_blocks_free(llm)
    # an abort while a step launched ahead is in flight
    abort_while_in_flight(llm, p, GREEDY, lambda step: any(s.on_device for s in step.seqs), run(ref_llm, [p]),
                          "step was launched ahead")
    for lm in (ref_llm, llm):
        lm.shutdown()


def test_a_small_pool_and_arrivals_fall_back_to_the_host(mtp_dir):
    """A pool too small for the farthest a step launched ahead can reach, and requests that arrive while others
    decode: those steps wait for the tokens (the reference's order), the outputs are the reference's."""
    p = prompts()
    outs = {}
    for spec_async in (True, False):
        llm, fed = build(mtp_dir, spec_async, num_gpu_blocks_override=12, max_model_len=192)
        engine = llm.engine
        engine.add_request("first", {"prompt_token_ids": p[0]}, GREEDY)
        got = {}
        for step in range(400):
            if step == 6:  # arrivals while "first" decodes
                engine.add_request("second", {"prompt_token_ids": p[1]}, GREEDY)
                engine.add_request("third", {"prompt_token_ids": p[2]}, GREEDY)
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = out.outputs[0].token_ids
            if step > 6 and not engine.has_unfinished_requests():
                break
        outs[spec_async] = got, engine.stats.num_preemptions
        assert_all_blocks_free(llm)
        if spec_async:
            assert any(fed), "a step was meant to be launched ahead before the arrivals"
        llm.shutdown()
    assert outs[True][0] == outs[False][0] and len(outs[True][0]) == 3
    assert outs[True][1] > 0 and outs[False][1] > 0, "the pool was meant to be small enough to preempt"


def test_padded_drafts_make_one_query_length(tiny_dir):
    """Batches that mix (switch spec_pad_drafts): with prompt lookup, some sequences find drafts and others do not;
    padding the shorter drafts makes every decode-and-verify step one query length (a verify graph replays) with
    the same greedy tokens as without speculation; off, such steps mix query lengths."""
    from tests.engine.test_spec_graphs import NGRAM

    batch = prompts()
    expected = None
    mixed = {}
    for pad in (True, False):
        opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True, spec_pad_drafts=pad)
        with LLM(tiny_dir, optimizations=opts, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                 speculative_config=NGRAM) as llm:
            runner = llm.engine.executor.runner
            runner.graph_capture = lambda fn: fn
            steps: list[list[int]] = []
            execute = runner.execute

            def spy(inp, *args, execute=execute, steps=steps, **kwargs):
                steps.append(list(inp.query_lens))
                return execute(inp, *args, **kwargs)

            runner.execute = spy
            outs = run(llm, [batch])
            assert_all_blocks_free(llm)
        reference = run_reference(tiny_dir, batch) if expected is None else expected
        expected = reference
        assert outs == expected
        verify_steps = [q for q in steps if max(q) > 1 and max(q) <= 4]  # decodes and verifies, no prompt
        mixed[pad] = sum(len(set(q)) > 1 for q in verify_steps)
    assert mixed[False] > 0, "prompt lookup was meant to leave some sequences without drafts beside others"
    assert mixed[True] == 0


def run_reference(model: str, batch) -> list[list[int]]:
    with LLM(model, optimizations=engine_opts(), max_model_len=MAX_MODEL_LEN, max_num_seqs=4) as llm:
        return run(llm, [batch])


FEED_OPS = {"aten.gather.default", "aten.floor_divide.default", "aten.remainder.Scalar", "aten.index.Tensor"}
"""What taking a fed query launches (apply_verify_feed: rows of the chain's buffers, the slots from the tables)."""


@pytest.mark.parametrize("feed_in_graph", [True, False])
def test_a_step_launched_ahead_takes_its_query_inside_the_graph(feed_in_graph):
    """spec_feed_in_graph: between staging and replay the host launches none of the feed's kernels (they run
    inside the replayed graph); with it off, every step launched ahead launches them itself. Counted by dispatch
    outside the (emulated) graphs, on the trained m3-mini."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    llm, fed = build("m3-mini", True, feed_in_graph, dtype="float32", max_model_len=512)
    runner, inside = llm.engine.executor.runner, [0]

    def capture(fn):
        def replay():
            inside[0] += 1
            try:
                fn()
            finally:
                inside[0] -= 1
        return replay

    runner.graph_capture = capture
    per_step: list[Counter] = []

    class Dispatched(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and per_step:
                per_step[-1][str(func)] += 1
            return func(*args, **(kwargs or {}))

    execute = runner.execute_model

    def counting(step):
        per_step.append(Counter())
        return execute(step)

    runner.execute_model = counting
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with Dispatched():
        run(llm, [[list(range(100, 140))]], params)
    ahead = [ops for ops, n in zip(per_step, fed[-len(per_step):]) if n]
    assert len(ahead) > len(per_step) // 2
    launched = [sum(ops[op] for op in FEED_OPS) for ops in ahead]
    assert all(n == 0 for n in launched) if feed_in_graph else all(n > 0 for n in launched), launched
    llm.shutdown()
