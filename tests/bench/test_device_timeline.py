"""The device's side of a step (`--speculative host` on a GPU, nanoserve/bench/device_timeline.py), checked on the CPU
with events that read a fake clock: the arithmetic of forward, chain, span and bubble; and, on an engine that
speculates with m3-mini's MTP module under emulated graphs, that every step gets its events in stream order and
the verify steps that ran a draft chain get the chain's."""

from __future__ import annotations

import pytest

from nanoserve.bench.device_timeline import DeviceTimeline, install


class Clock:
    """A device clock the test moves by hand; an event takes the time it is recorded at."""

    def __init__(self):
        self.now = 0.0
        self.recorded: list[float] = []

    def event(self):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now
                clock.recorded.append(clock.now)

            def elapsed_time(self, end):
                return end.t - self.t

        return Event()


def test_forward_chain_span_and_bubbles_from_the_events():
    clock = Clock()
    tl = DeviceTimeline(new_event=clock.event)
    # request 1: two steps; the second starts 0.5 ms after the first ended (a bubble), the first runs a chain
    tl.boundary()
    for name, t in (("start", 0.0), ("forward", 1.0), ("chain_start", 1.0), ("chain", 1.5), ("end", 2.0),
                    ("start", 2.5), ("forward", 3.0), ("end", 3.5)):
        clock.now = t
        tl.mark(name)
    # request 2 starts 100 ms later: that gap is the client's, not a bubble. Between its two steps the draft model's
    # passes run for 0.4 ms of a 0.7 ms gap (the device busy, not idle): a bubble of 0.3
    tl.boundary()
    for name, t in (("start", 103.5), ("forward", 104.0), ("end", 104.5), ("draft_start", 104.6), ("draft", 105.0),
                    ("start", 105.2), ("forward", 105.7), ("end", 107.2)):
        clock.now = t
        tl.mark(name)
    s = tl.summary()
    assert s["steps"] == 4 and s["chain_steps"] == 1 and s["draft_steps"] == 1
    assert s["forward_ms"] == pytest.approx((1.0 + 0.5 + 0.5 + 0.5) / 4)
    assert s["chain_ms"] == pytest.approx(0.5) and s["draft_ms"] == pytest.approx(0.4)
    assert s["device_ms"] == pytest.approx((2.0 + 1.0 + 1.0 + 2.0) / 4)
    assert s["bubble_ms"] == pytest.approx((0.5 + 0.3) / 2)  # two gaps within a request, not the 99 ms between
    assert s["idle_share"] == pytest.approx(0.8 / (6.0 + 0.8))


def test_no_events_no_numbers():
    s = DeviceTimeline(new_event=Clock().event).summary()
    assert s["steps"] == 0 and s["device_ms"] is None and s["bubble_ms"] is None and s["idle_share"] is None


def test_every_step_of_a_speculating_engine_gets_its_events():
    from nanoserve import LLM, SamplingParams
    from tests.helpers.engine_utils import engine_opts

    opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True, spec_draft_chain=True)
    llm = LLM("m3-mini", optimizations=opts, dtype="float32", max_model_len=512, max_num_seqs=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    try:
        llm.engine.executor.runner.graph_capture = lambda fn: fn  # graphs emulated: the draft chain runs
        clock = Clock()

        def tick():  # the device clock advances 1 ms per event, so stream order shows in the timestamps
            clock.now += 1.0
            return clock.event()

        tl = DeviceTimeline(new_event=tick)
        install(llm.engine, tl)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for prompt in (list(range(100, 140)), list(range(300, 330))):
            tl.boundary()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 24
    finally:
        llm.shutdown()
    assert len(tl.steps) >= 4 and all({"start", "forward", "end"} <= set(s) for s in tl.steps)
    assert clock.recorded == sorted(clock.recorded), "events recorded out of stream order"
    chained = [s for s in tl.steps if "chain" in s]
    assert chained, "no verify step ran a draft chain"
    assert all(s["start"].t < s["forward"].t <= s["chain_start"].t < s["chain"].t < s["end"].t for s in chained)
    s = tl.summary()
    assert s["steps"] == len(tl.steps) and s["chain_steps"] == len(chained) and s["bubble_ms"] > 0
    # the first drafts after each prompt come from the draft model's passes once its first token is on the host
    assert s["draft_steps"] >= 2 and all(st["end"].t < st["draft_start"].t < st["draft"].t
                                         for st in tl.steps if "draft" in st)
