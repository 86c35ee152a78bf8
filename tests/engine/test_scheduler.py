"""The continuous-batching scheduler, driven directly: a Scheduler and a BlockManager, sequences with made-up
tokens, and a fake model step (every scheduled token is "computed"; a sequence that finished its tokens gets one
new output token)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoserve.config import Optimizations
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from nanoserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from nanoserve.sampling import SamplingParams

BS = 4
SAMPLED_TOKEN = 7

_ids = itertools.count()
_tokens = itertools.count(100)  # fresh token ids: no accidental prefix-cache hits between prompts


class Harness:
    def __init__(self, num_blocks: int = 64, budget: int = 64, max_num_seqs: int = 16, max_model_len: int = 64,
                 policy: str = "fcfs", **switches: bool):
        opts = Optimizations().replace(**switches)
        self.bm = BlockManager(num_blocks, BS, opts.prefix_caching)
        self.events: list[tuple[str, dict]] = []
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, opts, policy), self.bm,
                               on_event=lambda name, **kw: self.events.append((name, kw)))
        self.budget = budget

    def add(self, prompt_len: int | None = None, max_tokens: int = 4, tokens: list[int] | None = None,
            priority: int = 0) -> Sequence:
        tokens = tokens if tokens is not None else [next(_tokens) for _ in range(prompt_len)]
        seq_id = next(_ids)
        seq = Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(max_tokens=max_tokens), priority=priority)
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.budget
        sampled = [s.seq for s in out.scheduled if s.samples]
        assert [s.seq for s in self.sched.update_after_step(out)] == sampled
        for seq in sampled:
            seq.num_pending -= 1  # the token arrives (the engine's update)
            seq.output_token_ids.append(SAMPLED_TOKEN)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                self.sched.finish(seq, FinishReason.LENGTH)
        self.bm.check_integrity()
        return out

    def run(self, max_steps: int = 500) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            outs.append(self.step())
            assert len(outs) < max_steps, "the scheduler made no progress"
        assert self.bm.num_free_blocks == self.bm.num_blocks
        return outs

    def named(self, name: str) -> list[dict]:
        return [kw for n, kw in self.events if n == name]


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def test_budget_respected_and_decodes_first():
    h = Harness(budget=20)
    seqs = [h.add(n, max_tokens=m) for n, m in [(30, 6), (5, 8), (17, 3), (9, 10), (41, 2), (2, 5)]]
    outs = h.run()
    mixed = 0
    for out in outs:
        assert 0 < out.num_batched_tokens <= 20
        kinds = [s.num_new_tokens == 1 for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "a prefill chunk came before a decode"
        mixed += any(kinds) and not all(kinds)
    assert mixed > 0, "no step mixed decodes and prefills, so the ordering was not exercised"
    for seq, m in zip(seqs, [6, 8, 3, 10, 2, 5]):
        assert seq.status == SequenceStatus.FINISHED and len(seq.output_token_ids) == m
        assert seq.num_computed_tokens == seq.num_tokens - 1


def test_running_decodes_take_the_budget_before_new_prefills():
    h = Harness(budget=16)
    a = h.add(6, max_tokens=10)
    h.step()
    b = h.add(40)
    out = h.step()
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 15)]
    assert out.scheduled[0].is_decode and not out.scheduled[1].is_decode


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    h = Harness(budget=16)
    seq = h.add(50, max_tokens=2)
    plans, outputs = [], []
    while h.sched.has_unfinished():
        plans.append(plan(h.step()))
        outputs.append(len(seq.output_token_ids))
    assert plans == [[(seq.seq_id, 16)], [(seq.seq_id, 16)], [(seq.seq_id, 16)], [(seq.seq_id, 2)],
                     [(seq.seq_id, 1)]]
    assert outputs == [0, 0, 0, 1, 2]  # no token is sampled from a partial prompt
    assert [kw["remaining"] for kw in h.named("chunk")] == [34, 18, 2]


def test_chunked_prefill_off_schedules_a_prompt_whole():
    h = Harness(budget=64, chunked_prefill=False)
    a, b = h.add(50, max_tokens=2), h.add(40, max_tokens=2)
    out = h.step()
    assert plan(out) == [(a.seq_id, 50)]  # b does not fit the 14 tokens left and is not split
    out = h.step()
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 40)]
    h.run()
    assert not h.named("chunk")


def test_running_chunked_prefill_continues_before_new_admissions():
    h = Harness(budget=16)
    a = h.add(40)
    b = h.add(10)
    assert plan(h.step()) == [(a.seq_id, 16)]
    assert plan(h.step()) == [(a.seq_id, 16)]
    assert plan(h.step()) == [(a.seq_id, 8), (b.seq_id, 8)]


def test_preemption_picks_the_newest_and_requeues_it_at_the_front():
    h = Harness(num_blocks=6, prefix_caching=False)
    a, b, c = h.add(8, max_tokens=3), h.add(8, max_tokens=3), h.add(8, max_tokens=3)
    h.step()  # all three prefilled: 6 full blocks, the pool is empty; each needs a 3rd block to decode
    assert h.bm.num_free_blocks == 0 and h.sched.running == [a, b, c]
    d = h.add(2, max_tokens=3)
    out = h.step()
    assert out.preempted == [c]
    assert plan(out) == [(a.seq_id, 1), (b.seq_id, 1)]
    assert list(h.sched.waiting) == [c, d]
    assert c.status == SequenceStatus.WAITING and c.num_computed_tokens == 0 and not c.block_table
    assert c.seq_id not in h.bm.tables and c.num_preemptions == 1 and h.sched.num_preemptions == 1
    assert [kw["seq"] for kw in h.named("preempt")] == [c]
    assert not out.admitted, "nothing is admitted in a step that had to preempt"
    h.run()
    # c went before d, and recomputed its prompt and its output token (9 tokens) when it came back
    admits = [kw for kw in h.named("admit")]
    assert [kw["seq"] for kw in admits][3:] == [c, d]
    assert admits[3]["num_new_tokens"] == 9
    assert len(c.output_token_ids) == 3 and c.output_token_ids == [SAMPLED_TOKEN] * 3


def test_preempted_sequence_reuses_its_own_cached_blocks():
    """The pool hands out a preempted sequence's tail blocks first, so its head is still cached when it
    comes back."""
    h = Harness(num_blocks=8, prefix_caching=True)
    h.add(8, max_tokens=3), h.add(8, max_tokens=3)
    c = h.add(16, max_tokens=3)
    h.step()
    assert h.step().preempted == [c]  # the two older sequences took one of c's 4 blocks each
    h.run()
    readmit = [kw for kw in h.named("admit") if kw["seq"] is c][1]
    assert readmit["num_cached_tokens"] == 8 and readmit["num_new_tokens"] == 17 - 8


def test_a_sequence_with_no_one_newer_to_preempt_preempts_itself():
    h = Harness(num_blocks=4, max_model_len=16, prefix_caching=False)
    a, b = h.add(5, max_tokens=4), h.add(8, max_tokens=3)
    h.step()  # 4 blocks: a has room left in its second block, b does not
    out = h.step()
    assert out.preempted == [b] and plan(out) == [(a.seq_id, 1)]
    assert list(h.sched.waiting) == [b] and not b.block_table
    h.run()
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 3 and b.num_preemptions == 1


def test_priority_policy_admits_by_priority_then_arrival():
    """--scheduling-policy priority: one sequence at a time; lower priority values first, ties by arrival (a
    request that arrives later with a better priority overtakes the queue, never one already running)."""
    h = Harness(max_num_seqs=1, policy="priority")
    a = h.add(4, max_tokens=2, priority=0)
    h.step()  # a runs
    b, c, d, e = (h.add(4, max_tokens=2, priority=p) for p in (5, -1, 5, 0))
    h.run()
    assert [kw["seq"] for kw in h.named("admit")] == [a, c, e, b, d]


def test_priority_policy_preempts_the_worst_and_fcfs_ignores_priority():
    for policy, expect in (("priority", "a"), ("fcfs", "c")):
        h = Harness(num_blocks=6, prefix_caching=False, policy=policy)
        a, b, c = h.add(8, max_tokens=3, priority=9), h.add(8, max_tokens=3), h.add(8, max_tokens=3)
        h.step()  # 6 full blocks; each needs a third to decode
        out = h.step()
        assert out.preempted == [{"a": a, "c": c}[expect]], policy
        if policy == "priority":  # the others decode, best first; the preempted one waits in rank order
            assert plan(out) == [(b.seq_id, 1), (c.seq_id, 1)] and list(h.sched.waiting) == [a]
        h.run()


def test_max_num_seqs_respected():
    h = Harness(max_num_seqs=2, budget=64)
    for n in [5, 9, 3, 12, 7]:
        h.add(n, max_tokens=3)
    seen = []
    while h.sched.has_unfinished():
        out = h.step()
        assert len(h.sched.running) <= 2 and len(out.scheduled) <= 2
        seen.append(len(out.scheduled))
    assert max(seen) == 2


def test_continuous_batching_admits_every_step():
    h = Harness()
    a = h.add(5, max_tokens=6)
    h.step()
    b = h.add(5, max_tokens=2)
    out = h.step()
    assert out.admitted == [b] and plan(out) == [(a.seq_id, 1), (b.seq_id, 5)]


def test_continuous_batching_off_admits_a_new_batch_only_after_the_previous_finished():
    h = Harness(continuous_batching=False)
    a, b = h.add(5, max_tokens=2), h.add(6, max_tokens=6)
    out = h.step()
    assert out.admitted == [a, b]
    c = h.add(5, max_tokens=2)
    while not b.is_finished:
        assert c.status == SequenceStatus.WAITING, "admitted while the previous batch was still running"
        assert c not in h.step().admitted
    assert a.is_finished
    out = h.step()
    assert out.admitted == [c]
    h.run()


def test_paged_kv_off_reserves_max_model_len_at_admission():
    h = Harness(num_blocks=20, max_model_len=32, paged_kv=False, prefix_caching=False)
    a, b, c = h.add(5, max_tokens=2), h.add(5, max_tokens=2), h.add(5, max_tokens=2)
    out = h.step()
    assert out.admitted == [a, b]  # 8 blocks each; c's 8 do not fit in the 4 left
    assert len(a.block_table) == len(b.block_table) == 32 // BS
    assert h.bm.num_free_blocks == 4
    h.run()
    assert c.is_finished


def test_paged_kv_on_allocates_on_demand():
    h = Harness(num_blocks=20, max_model_len=32)
    a = h.add(5, max_tokens=8)
    h.step()
    assert len(a.block_table) == 2
    for _ in range(3):
        h.step()
    assert len(a.block_table) == 2  # 8 tokens computed (5 + 3): still 2 blocks
    h.step()
    assert len(a.block_table) == 3


@pytest.mark.parametrize("where", ["waiting", "mid_prefill", "decoding"])
def test_abort_anywhere_returns_the_blocks(where):
    h = Harness(budget=16)
    other = h.add(6, max_tokens=20)
    seq = h.add(40, max_tokens=20)
    if where != "waiting":
        h.step()  # other prefilled, seq's first chunk
        assert seq.status == SequenceStatus.RUNNING and 0 < seq.num_computed_tokens < seq.num_prompt_tokens
    if where == "decoding":
        while not seq.output_token_ids:
            h.step()
        assert seq.block_table
    held = len(seq.block_table)
    free_before = h.bm.num_free_blocks
    h.sched.finish(seq, FinishReason.ABORT)
    h.bm.check_integrity()
    assert h.bm.num_free_blocks == free_before + held
    assert seq not in h.sched.running and seq not in h.sched.waiting
    assert seq.status == SequenceStatus.FINISHED and seq.finish_reason == FinishReason.ABORT
    assert not seq.block_table
    assert h.named("finish")[-1]["seq"] is seq and h.named("finish")[-1]["reason"] == "abort"
    h.sched.finish(seq, FinishReason.ABORT)  # a second abort is a no-op
    h.run()
    assert other.is_finished and len(other.output_token_ids) == 20


# -- random workloads ---------------------------------------------------------------------------------------

WORKLOAD_MAX_MODEL_LEN = 48
LAYER_SWITCHES = ("paged_kv", "prefix_caching", "continuous_batching", "chunked_prefill")


def sampled_token(seq: Sequence) -> int:
    """The fake model's next token: differs between sequences and positions, so outputs tell them apart."""
    return 100 + (seq.seq_id * 31 + seq.num_tokens * 7) % 50


@settings(derandomize=True, max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_workloads_keep_every_promise(data):
    """Random requests (some sharing prefixes, arriving over time, some aborted) under random switches, pool
    sizes, budgets and scheduling policies (with priority, random priorities). The KV the model would write is
    simulated: whenever a sequence samples, every one of its positions must hold its own token - so chunking, prefix
    hits and preemption never skip or misplace work."""
    switches = {name: data.draw(st.booleans(), label=name) for name in LAYER_SWITCHES}
    chunked = switches["chunked_prefill"]
    budget = data.draw(st.integers(4, 64) if chunked else st.integers(WORKLOAD_MAX_MODEL_LEN, 96), label="budget")
    policy = data.draw(st.sampled_from(["fcfs", "priority"]), label="policy")
    h = Harness(num_blocks=data.draw(st.integers(WORKLOAD_MAX_MODEL_LEN // BS, 40), label="blocks"), budget=budget,
                max_num_seqs=data.draw(st.integers(1, 6), label="max_num_seqs"),
                max_model_len=WORKLOAD_MAX_MODEL_LEN, policy=policy, **switches)
    prefixes = [[1, 2, 3] * 8, [4, 5] * 12]
    # (prompt source: a shared prefix / none / an earlier sequence's prompt and output, as a next chat turn;
    #  how much of it; own new tokens; max_tokens; arrival step; abort step)
    requests = data.draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 48), st.integers(0, 30),
                                            st.integers(1, 12), st.integers(0, 30), st.none() | st.integers(0, 40)),
                                  min_size=1, max_size=8), label="requests")
    kv: dict[int, list[int | None]] = {b: [None] * BS for b in range(h.bm.num_blocks)}
    arrivals: dict[int, list[tuple]] = {}
    for r in requests:
        arrivals.setdefault(r[4], []).append(r)
    seqs: list[tuple[Sequence, int | None]] = []
    step = 0
    while step <= max(arrivals) or h.sched.has_unfinished():
        for which, cut, own, max_tokens, _, abort_at in arrivals.get(step, []):
            if which < len(prefixes):
                source = prefixes[which][:cut]
            elif which == len(prefixes) or not seqs:
                source = []
            else:
                source = seqs[cut % len(seqs)][0].token_ids
            prompt = (source + [next(_tokens) for _ in range(own)])[: WORKLOAD_MAX_MODEL_LEN - 1] or [next(_tokens)]
            priority = (cut + max_tokens) % 3 - 1 if policy == "priority" else 0  # -1, 0 or 1
            seqs.append((h.add(tokens=prompt, max_tokens=min(max_tokens, WORKLOAD_MAX_MODEL_LEN - len(prompt)),
                               priority=priority), abort_at))
        for seq, abort_at in seqs:
            if abort_at == step:
                h.sched.finish(seq, FinishReason.ABORT)
        running_before = list(h.sched.running)

        out = h.sched.schedule()
        assert out.num_batched_tokens <= budget and len(h.sched.running) <= h.sched.config.max_num_seqs
        kinds = [s.num_new_tokens == 1 for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True)
        if out.admitted and not switches["continuous_batching"]:
            assert not running_before, "a new batch was admitted while the previous one was running"
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            assert s.num_new_tokens >= 1, "a sequence was scheduled with nothing to compute"
            if not chunked:
                assert start + s.num_new_tokens == seq.num_tokens, "a prompt was split with chunking off"
            if not switches["paged_kv"]:
                assert len(seq.block_table) >= WORKLOAD_MAX_MODEL_LEN // BS
            if not switches["prefix_caching"]:
                assert seq.num_cached_tokens == 0
            for p in range(start, start + s.num_new_tokens):  # the model writes this step's K/V
                block = seq.block_table[p // BS]
                assert h.bm.blocks[block].ref_count == 1, "a shared block was written"
                kv[block][p % BS] = seq.token_at(p)
        sampled = [s.seq for s in out.scheduled if s.samples]
        h.sched.update_after_step(out)
        for seq in sampled:
            seq.num_pending -= 1  # the token arrives (the engine's update)
            assert [kv[seq.block_table[p // BS]][p % BS] for p in range(seq.num_tokens)] == seq.token_ids
            seq.output_token_ids.append(sampled_token(seq))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                h.sched.finish(seq, FinishReason.LENGTH)
        h.bm.check_integrity()
        step += 1
        assert step < 2000, "the scheduler made no progress"

    assert h.bm.num_free_blocks == h.bm.num_blocks
    for seq, _ in seqs:
        assert seq.is_finished
        if seq.finish_reason == FinishReason.LENGTH:
            assert len(seq.output_token_ids) == seq.params.max_tokens
