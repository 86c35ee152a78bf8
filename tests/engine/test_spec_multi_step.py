"""Several speculative steps per launch (switch spec_multi_step, spec_decode/multi_step.py): one graph runs
spec_steps_per_launch verify steps and draft chains back to back, each step taking its queries from the one before.

Against its reference - one speculative step per launch - on the CPU with the graphs emulated (each replay re-runs
the captured function over the same static buffers, as in tests/engine/test_spec_async.py): the same greedy
tokens, the same acceptance per position, launches that really ran several steps, every KV block accounted for
after every launch; and the host's late view: a stop string and EOS inside a launch, max_tokens (the last steps
fall back to one per launch), an abort while a launch is in flight, a pool too small for a launch's farthest reach
and requests waiting to be admitted.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine.test_spec_async import run
from tests.engine.test_spec_decode import eagle_config
from tests.engine.test_spec_graphs import GREEDY, MAX_MODEL_LEN, MTP, acceptance, eagle_draft, prompts  # noqa: F401
from tests.helpers.engine_utils import (
    abort_while_in_flight,
    assert_all_blocks_free,
    engine_opts,
    finished,
    stop_and_limits,
)

STEPS = 4


def build(model: str, multi: bool, spec: dict = MTP, **kwargs) -> tuple[LLM, list]:
    """An engine with the draft chain under emulated graphs; the list fills with each launch's number of steps
    as the runner ran it (1 where no multi-step graph ran)."""
    opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True, spec_draft_chain=True,
                                 spec_multi_step=multi)
    llm = LLM(model, optimizations=opts, max_model_len=kwargs.pop("max_model_len", MAX_MODEL_LEN), max_num_seqs=4,
              speculative_config=spec, spec_steps_per_launch=STEPS, **kwargs)
    runner = llm.engine.executor.runner
    runner.graph_capture = lambda fn: fn
    launches: list[int] = []
    execute = runner.execute_model

    def counting(step):
        llm.engine.block_manager.check_integrity()  # every launch: the pool's books balance
        out = execute(step)
        launches.append(runner._multi_out[0].shape[0] if runner._multi_out is not None else 1)
        return out

    runner.execute_model = counting
    return llm, launches


@pytest.mark.parametrize("model", ["mtp_dir", "m3-mini", "eagle3"])
def test_several_steps_per_launch_the_same_tokens_and_acceptance(model, request):
    """m3-tiny's random MTP module and a random EAGLE-3 draft (drafts mostly rejected) and the trained m3-mini's MTP
    (mostly accepted): the same tokens and the same acceptance, per position, as one step per launch, with most
    launches running all their steps - at batch 1 and 2."""
    spec = MTP
    if model == "eagle3":
        name, spec = request.getfixturevalue("tiny_dir"), eagle_config(request.getfixturevalue("eagle_draft"), 3)
    else:
        name = request.getfixturevalue(model) if model == "mtp_dir" else model
    batches = [[[1, 2, 3] + list(range(40, 80))], [list(range(100, 140)), list(range(300, 330)) * 2]] \
        if model == "m3-mini" else [prompts()[:1], prompts()[1:]]
    kwargs = {"dtype": "float32", "max_model_len": 512} if model == "m3-mini" else {}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    results = {}
    for multi in (True, False):
        llm, launches = build(name, multi, spec, **kwargs)
        results[multi] = run(llm, batches, params), acceptance(llm.engine.stats), launches
        assert_all_blocks_free(llm)
        llm.shutdown()
    (out, accepted, launches), (ref, ref_accepted, ref_launches) = results[True], results[False]
    assert out == ref and accepted == ref_accepted
    assert set(ref_launches) == {1}
    assert launches.count(STEPS) >= 3 and len(launches) < len(ref_launches), (launches, ref_launches)


def test_stops_limits_and_aborts_inside_a_launch(mtp_dir):
    """A stop string completed in a launch's second step, max_tokens and EOS-free runs of several lengths, and an
    abort while a launch of several steps is in flight: the reference's outputs and finish reasons, nothing past a
    stop, every block back."""
    ref_llm, _ = build(mtp_dir, False)
    llm, launches = build(mtp_dir, True)
    p = prompts()
    params = stop_and_limits(ref_llm, p[0], stop_at=14, max_tokens=(40, 23, 37))
    ref, got = finished(ref_llm, p, params), finished(llm, p, params)
    assert got == ref and ref[0][2] == "stop" and ref[1][2] == "length" and len(ref[1][1]) == 23
    assert STEPS in launches
    assert_all_blocks_free(llm)
    abort_while_in_flight(llm, p, GREEDY, lambda step: step.spec_steps > 1, run(ref_llm, [p]),
                          "launch of several steps")
    for lm in (ref_llm, llm):
        lm.shutdown()


def test_a_small_pool_and_waiting_requests_run_one_step(mtp_dir):
    """A pool too small for the farthest a launch of several steps reaches, and requests waiting to be admitted:
    those launches run one step (nothing is taken from the pool for them), the outputs are the reference's."""
    p = prompts()
    small = dict(num_gpu_blocks_override=12, max_model_len=192)
    ref_llm, _ = build(mtp_dir, False, **small)
    expected = run(ref_llm, [p])
    ref_llm.shutdown()
    llm, launches = build(mtp_dir, True, **small)
    scheduler = llm.engine.scheduler
    reserve, refused = scheduler.reserve, []

    def reserving(reach):
        free = llm.engine.block_manager.num_free_blocks
        ok = reserve(reach)
        if not ok:
            refused.append(free == llm.engine.block_manager.num_free_blocks)  # (nothing taken)
        return ok

    scheduler.reserve = reserving
    assert run(llm, [p]) == expected
    assert refused and all(refused), "the pool was meant to be too small for some launch of several steps"
    assert_all_blocks_free(llm)
    llm.shutdown()
    # more requests than max_num_seqs: while some wait, no launch runs several steps
    llm, launches = build(mtp_dir, True)
    engine = llm.engine
    waiting_seen = []
    spec_steps = engine._spec_steps

    def watching(sched, step):
        n = spec_steps(sched, step)
        waiting_seen.append((bool(engine.scheduler.waiting), n))
        return n

    engine._spec_steps = watching
    assert run(llm, [p + p[:2]]) == run(build(mtp_dir, False)[0], [p + p[:2]])
    assert any(w for w, _ in waiting_seen) and all(n == 1 for w, n in waiting_seen if w)
    assert any(n == STEPS for w, n in waiting_seen if not w)
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_the_warm_up_captures_the_launches_graphs(mtp_dir):
    """With switch spec_multi_step, the warm-up runs a launch of several steps per batch bucket after the draft
    chain's verify step, capturing its graph in that step's context bucket: later requests capture none, and the
    greedy output is the reference's."""
    from nanoserve.engine.warmup import warm_up

    p = prompts()
    ref_llm, _ = build(mtp_dir, False)
    expected = run(ref_llm, [p])
    ref_llm.shutdown()
    llm, launches = build(mtp_dir, True)
    runner = llm.engine.executor.runner
    captured = []
    runner.graph_capture = lambda fn: captured.append(fn.key) or fn
    warm_up(llm.engine, budget_s=600)
    warm = [k for k in captured if k[0] == "multi"]
    assert sorted(k[1] for k in warm) == [1, 2, 4], warm  # (max_num_seqs 4: batch buckets 1, 2 and 4)
    launches.clear()
    before = len(captured)
    assert run(llm, [p]) == expected
    assert STEPS in launches and captured[before:] == [], captured[before:]
    assert_all_blocks_free(llm)
    llm.shutdown()
