"""Overlap scheduling (switch `overlap_scheduling`) and async scheduling on top of it (switch `async_scheduling`,
engine/overlap.py) against the synchronous step they replace: every output a user sees - token ids, text, finish
and stop reasons, logprobs - must be the same in all three modes, only returned one step() later; aborts must free
blocks at once and stop the outputs. CPU, m3-tiny, reference kernels (tests/engine/test_engine.py's setup).

The modes: "sync" (both off, the reference), "overlap" (overlap on, async off: the same batches as sync, bit for
bit), "async" (both on, the default: a step is launched before the previous step's tokens are received, so a
sequence finishing at a step boundary holds its blocks one step longer and batches may differ there)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.engine import stop_checker
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.entrypoints.async_engine import AsyncLLMEngine
from nanoserve.presets.tokenizer import EOS_ID
from nanoserve.runner.sampler import Sampler, exponential_race
from tests.engine.test_engine import MAX_MODEL_LEN, MIXED_PARAMS, SMALL_BUDGET, SMALL_POOL_BLOCKS, mixed_prompts
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts, random_tokens, sampler_of

LOGPROB_ATOL = 1e-5  # fp32: the same sequence's logits computed in differently composed batches


MODES = {"sync": dict(overlap_scheduling=False, async_scheduling=False),
         "overlap": dict(overlap_scheduling=True, async_scheduling=False),
         "async": dict(overlap_scheduling=True, async_scheduling=True)}
OVERLAPPED = ("overlap", "async")


def make_llm(mode: str, cuda_graphs: bool = False, **kwargs) -> LLM:
    args = dict(num_gpu_blocks_override=SMALL_POOL_BLOCKS, max_num_batched_tokens=SMALL_BUDGET,
                max_model_len=MAX_MODEL_LEN)
    opts = engine_opts(**MODES[mode]).replace(cuda_graphs=cuda_graphs)
    return LLM("m3-tiny", optimizations=opts, **{**args, **kwargs})


@pytest.fixture(scope="module")
def llms() -> dict[str, LLM]:
    """One LLM per mode; a pool and budget small enough to preempt and chunk."""
    return {mode: make_llm(mode) for mode in MODES}


def snapshot(out: RequestOutput) -> tuple:
    """What a user sees of one output (not the timings)."""
    return out.finished, [(c.index, list(c.token_ids), c.text, c.finish_reason, c.stop_reason,
                           c.cumulative_logprob, c.logprobs) for c in out.outputs]


def drive(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]
          ) -> tuple[dict[str, list[tuple]], int]:
    """Add the requests, step until none is unfinished; every output of each request in order, and the number
    of step() calls."""
    engine.block_manager.reset_prefix_cache()  # both engines start from the same (empty) prefix cache
    for rid, prompt, sp in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
    streams: dict[str, list[tuple]] = defaultdict(list)
    calls = 0
    while engine.has_unfinished_requests():
        calls += 1
        for out in engine.step():
            streams[out.request_id].append(snapshot(out))
        assert calls < 1000, "the engine made no progress"
    return dict(streams), calls


def final(streams: dict[str, list[tuple]]) -> dict[str, tuple]:
    for rid, outs in streams.items():
        assert outs[-1][0] and not any(o[0] for o in outs[:-1]), f"{rid}: one finished output, the last"
    return {rid: outs[-1] for rid, outs in streams.items()}


def assert_same_outputs(got: dict[str, tuple], ref: dict[str, tuple]) -> None:
    """Equal outputs; logprob values to LOGPROB_ATOL (a batch composed differently rounds differently)."""
    assert got.keys() == ref.keys()
    for rid in ref:
        (fin_a, comps_a), (fin_b, comps_b) = got[rid], ref[rid]
        assert fin_a == fin_b
        for a, b in zip(comps_a, comps_b, strict=True):
            assert a[:5] == b[:5], rid
            assert (a[5] is None) == (b[5] is None) and (a[5] is None or a[5] == pytest.approx(b[5], abs=1e-4))
            assert (a[6] is None) == (b[6] is None), rid
            for x, y in zip(a[6] or [], b[6] or [], strict=True):
                assert next(iter(x)) == next(iter(y)) and set(x) == set(y), rid  # the chosen token first
                for t in x:
                    assert x[t] == pytest.approx(y[t], abs=LOGPROB_ATOL), rid


# -- the mixed batch of tests/engine/test_engine.py ------------------------------------------------------------------

def test_mixed_batch_same_outputs_one_step_later(llms):
    """Shared prefixes, preemption and chunked prefill: the same outputs, in the same order, one call later."""
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True,
                             logprobs=(3 if i % 2 else None)) for i, p in enumerate(MIXED_PARAMS)]
    requests = [(f"m{i}", p, sp) for i, (p, sp) in enumerate(zip(mixed_prompts(), params))]
    runs = {}
    for mode, llm in llms.items():
        stats = llm.engine.stats
        before = (stats.num_preemptions, stats.num_steps)
        streams, calls = drive(llm.engine, requests)
        runs[mode] = streams, calls, stats.num_preemptions - before[0], stats.num_steps - before[1]
        assert_all_blocks_free(llm)
    (on_streams, on_calls, on_preempt, on_steps), (off_streams, off_calls, off_preempt, off_steps) = \
        runs["overlap"], runs["sync"]
    assert off_preempt > 0, "the pool was meant to be small enough to preempt"
    # the same schedule, so the same batches: every output equal, bit for bit, in the same order per request
    assert (on_preempt, on_steps) == (off_preempt, off_steps)
    assert on_streams == off_streams
    # ... one step() later: the last call only returns the last step's outputs
    assert on_calls == off_calls + 1
    outs = final(on_streams)
    assert [len(outs[f"m{i}"][1][0][1]) for i in range(len(MIXED_PARAMS))] == [p.max_tokens for p in MIXED_PARAMS]
    # async: sequences ending at a step boundary hold their blocks one step longer, so later batches (and the
    # preemptions) may differ; every final output is the same
    async_streams, _, async_preempt, _ = runs["async"]
    assert async_preempt > 0
    assert_same_outputs(final(async_streams), outs)


def test_outputs_are_detokenised_while_the_next_step_runs(llms, monkeypatch):
    """The order of the host work: with the switch on, a token's text is made after the next step's forward
    was launched; off, before."""
    events: list[str] = []
    real_detokenize = stop_checker.detokenize_step

    def detokenize(tokenizer, seq):
        events.append("text")
        return real_detokenize(tokenizer, seq)

    monkeypatch.setattr(stop_checker, "detokenize_step", detokenize)
    for mode, llm in llms.items():
        executor = llm.engine.executor
        real_execute = executor.execute_model
        monkeypatch.setattr(executor, "execute_model",
                            lambda *args: (events.append("forward"), real_execute(*args))[1])
        events.clear()
        drive(llm.engine, [("one", random_tokens(random.Random(2), 12),
                            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
        order = "".join("F" if e == "forward" else "t" for e in events)
        assert order == ("FtFtFtFt" if mode == "sync" else "FFtFtFtt"), (mode, order)


def test_async_steps_launch_before_the_tokens_arrive(llms, monkeypatch):
    """Async scheduling's order: each decode step is launched before the previous step's tokens are received, and
    takes its input token from them on the device (a TokenFeed); overlap alone receives first, feeding nothing.
    A request whose sampling reads its own output (penalties) makes async wait for its tokens, as overlap does."""
    for mode in OVERLAPPED:
        engine = llms[mode].engine
        events: list[str] = []
        real_execute, real_sample = engine.executor.execute_model, engine.executor.sample_tokens

        def execute(step):
            events.append("F" + ("+feed" if step.fed else ""))
            return real_execute(step)

        class Received:  # the step's future: "R" when the engine waits for its tokens
            def __init__(self, future):
                self.future = future

            def result(self):
                events.append("R")
                return self.future.result()

        monkeypatch.setattr(engine.executor, "execute_model", execute)
        monkeypatch.setattr(engine.executor, "sample_tokens", lambda masks=None: Received(real_sample(masks)))
        prompt = random_tokens(random.Random(5), 12)
        for penalised in (False, True):
            events.clear()
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                presence_penalty=0.5 if penalised else 0.0)
            drive(engine, [("one", prompt, sp)])
            got = " ".join(events)
            if mode == "async" and not penalised:
                assert got == "F F+feed R F+feed R F+feed R R", got
            else:
                assert got == "F R F R F R F R", (mode, penalised, got)
        monkeypatch.undo()


# -- stops: which step ends a sequence ----------------------------------------------------------------------

def continuation(llm: LLM, prompt: list[int], n: int = 24) -> tuple[list[int], str]:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


def stop_string_in(llm: LLM, text: str, tokens: list[int], after: int) -> tuple[str, int]:
    """A 2-character stop string of complete characters from `text`, first completed by an output token after
    the first `after` and before the last; and how many tokens it takes to complete it."""
    tok = llm.get_tokenizer()
    for i in range(len(text) - 2):
        stop = text[i: i + 2]
        if "\ufffd" in stop or not stop.strip():
            continue
        end = next(j for j in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:j], skip_special_tokens=True))
        if after < end < len(tokens):
            return stop, end
    pytest.fail("no usable stop string in the text; pick other prompts")


@pytest.fixture(scope="module")
def stop_requests(llms) -> list[tuple[str, list[int], SamplingParams]]:
    """Requests ending every way, several mid-batch (a stop string ends a sequence already scheduled again)."""
    ref = llms["sync"]
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = []
    for k in range(4):  # stop strings, some with the stop string kept, some with logprobs
        prompt = random_tokens(random.Random(100 + k), 20 + 7 * k)
        tokens, text = continuation(ref, prompt)
        stop, end = stop_string_in(ref, text, tokens, after=2 + k)
        reqs.append((f"stop-str-{k}", prompt, SamplingParams(**greedy, stop=["never", stop],
                                                              include_stop_str_in_output=k % 2 == 1,
                                                              logprobs=2 if k < 2 else None)))
        if k == 0:  # the same string completed by the last token allowed: "stop" wins over "length"
            reqs.append(("stop-str-last", prompt, SamplingParams(**{**greedy, "max_tokens": end}, stop=stop)))
            tok_id = tokens[end]  # a stop token id a little later, with its text kept and not
            for keep in (False, True):
                reqs.append((f"stop-id-{keep}", prompt, SamplingParams(**greedy, stop_token_ids=[tok_id],
                                                                       include_stop_str_in_output=keep)))
    for seed in range(40):  # EOS, and EOS held off by min_tokens
        prompt = random_tokens(random.Random(seed), 30)
        tokens, _ = continuation(ref, prompt)
        if EOS_ID in tokens[2:12]:
            at = tokens.index(EOS_ID)
            reqs.append(("eos", prompt, SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)))
            reqs.append(("eos-min", prompt, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=at + 2)))
            reqs.append(("eos-kept", prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                            include_stop_str_in_output=True)))
            break
    else:
        pytest.fail("no prompt led m3-tiny to EOS; pick other prompts")
    reqs.append(("length", random_tokens(random.Random(7), 40), SamplingParams(**{**greedy, "max_tokens": 5})))
    return reqs


def count_launched_rows(engine: LLMEngine) -> Counter:
    counts: Counter = Counter()

    def on_event(name: str, model_input=None, **_) -> None:
        if name == "step":
            counts["sampled rows"] += len(model_input.sample_rows)

    engine.add_observer(on_event)
    return counts


def test_every_stop_gives_the_same_outputs(llms, stop_requests):
    finals, dropped = {}, {}
    for mode, llm in llms.items():
        engine = llm.engine
        launched = count_launched_rows(engine)
        generated = engine.stats.num_generation_tokens
        try:
            streams, _ = drive(engine, stop_requests)
        finally:
            engine.observers.clear()
        finals[mode] = final(streams)
        dropped[mode] = launched["sampled rows"] - (engine.stats.num_generation_tokens - generated)
        assert_all_blocks_free(llm)
    for mode in OVERLAPPED:
        assert_same_outputs(finals[mode], finals["sync"])
    reasons = {rid: (out[1][0][3], out[1][0][4]) for rid, out in finals["sync"].items()}
    assert all(reasons[f"stop-str-{k}"][0] == "stop" and isinstance(reasons[f"stop-str-{k}"][1], str)
               for k in range(4))
    assert reasons["stop-str-last"][0] == "stop" and reasons["length"] == ("length", None)
    assert reasons["eos"] == ("stop", None) and isinstance(reasons["stop-id-False"][1], int)
    # sync computes nothing in vain; overlap had already scheduled one more token of every sequence that a stop
    # string ended while it still had tokens to go, and dropped it; async also of those that EOS or a stop id
    # ended (their token is known only after the next step is launched). Neither schedules a sequence whose last
    # allowed token it has sampled.
    max_tokens = {rid: sp.max_tokens for rid, _, sp in stop_requests}
    mid_batch = sum(1 for rid, (r, s) in reasons.items() if isinstance(s, str) and rid != "stop-str-last")
    stopped_early = sum(1 for rid, out in finals["sync"].items()
                        if out[1][0][3] == "stop" and len(out[1][0][1]) < max_tokens[rid])
    assert dropped["sync"] == 0 and dropped["overlap"] == mid_batch >= 4
    assert dropped["async"] == stopped_early > mid_batch


# -- sampling: seeds, penalties, n > 1 ------------------------------------------------------------------------

def test_seeded_n_completions_are_reproducible(llms):
    rng = random.Random(31)
    requests = [
        ("seeded", random_tokens(rng, 25), SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=10,
                                                          ignore_eos=True, logprobs=2)),
        ("penalised", random_tokens(rng, 18), SamplingParams(n=2, temperature=0.8, top_k=20, seed=5, max_tokens=9,
                                                             repetition_penalty=1.3, presence_penalty=0.5,
                                                             frequency_penalty=0.2, ignore_eos=True)),
        ("unseeded", random_tokens(rng, 30), SamplingParams(temperature=1.0, min_p=0.05, max_tokens=8,
                                                            ignore_eos=True)),
        ("greedy", random_tokens(rng, 70), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ]
    runs = {}
    for mode, llm in llms.items():
        sampler_of(llm).generator.manual_seed(0)  # the engine-wide generator the unseeded request draws from
        streams, _ = drive(llm.engine, requests)
        runs[mode] = streams
        assert_all_blocks_free(llm)
    for mode in OVERLAPPED:  # no stop ends anything early: the same batches, bit for bit
        assert runs[mode] == runs["sync"], mode
    seeded = final(runs["async"])["seeded"][1]
    assert len({tuple(c[1]) for c in seeded}) == 3, "seeded completions of one request must differ"
    again, _ = drive(llms["async"].engine, requests[:2])  # seeded: the same tokens in another batch
    assert_same_outputs(final(again), {rid: final(runs["async"])[rid] for rid in again})


def test_seeded_n_completions_ended_by_a_stop_string(llms):
    """n = 3 seeded completions, one of them ended by a stop string mid-batch (its extra token dropped), the
    others running on: the same outputs (no unseeded request shares the batch, see docs/optimizations.md)."""
    prompt = random_tokens(random.Random(57), 22)
    sp = dict(n=3, temperature=1.0, seed=23, max_tokens=16, ignore_eos=True, logprobs=1)
    free = final(drive(llms["sync"].engine, [("free", prompt, SamplingParams(**sp))])[0])["free"][1]
    tokens, text = free[0][1], free[0][2]
    stop, _ = stop_string_in(llms["sync"], text, tokens, after=2)
    requests = [("stopped", prompt, SamplingParams(**sp, stop=stop)),
                ("other", random_tokens(random.Random(58), 40), SamplingParams(**{**sp, "n": 1, "seed": 3}))]
    outs = {mode: final(drive(llm.engine, requests)[0]) for mode, llm in llms.items()}
    for mode in OVERLAPPED:
        assert_same_outputs(outs[mode], outs["sync"])
    completions = outs["async"]["stopped"][1]
    assert completions[0][3:5] == ("stop", stop) and len(completions[0][1]) < 16
    assert any(c[3] == "length" for c in completions[1:]), "the other completions were meant to run on"


def test_sampler_halves_equal_the_whole():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, seed=3, logprobs=0),
              SamplingParams(top_k=5), SamplingParams(temperature=1.2, top_p=0.8, min_p=0.02, seed=9),
              SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logprobs=1)]

    def seqs():
        return [Sequence(i, "r", 0, [10, 11], p, output_token_ids=[12, 12, 40]) for i, p in enumerate(params)]

    whole = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)(logits, seqs())
    halves = Sampler(torch.device("cpu"), seed=0, eos_token_id=None)
    device = halves.sample(logits, seqs())
    assert isinstance(device.token_ids, torch.Tensor)
    host = halves.to_host(device)
    assert host == whole
    assert [host.logprobs(i) is None for i in range(5)] == [False, False, True, True, False]
    assert len(host.logprobs(0)) == 3 and list(host.logprobs(1)) == [host.token_ids[1]]


@pytest.mark.parametrize("shape", [(50,), (6, 50)])
def test_exponential_race_is_torch_multinomial(shape):
    """The device-side draw is torch.multinomial's own algorithm: the same tokens, the same generator state."""
    probs = torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 3, dim=-1)
    for seed in range(10):
        a, b = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        expected = torch.multinomial(probs, 1, generator=a)[..., 0]
        assert torch.equal(exponential_race(probs, b), expected)
        assert torch.equal(a.get_state(), b.get_state())


# -- abort ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", OVERLAPPED)
def test_abort_with_a_step_in_flight(llms, mode):
    engine = llms[mode].engine
    bm = engine.block_manager
    rng = random.Random(3)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    short, long, kept = random_tokens(rng, 10), random_tokens(rng, 150), random_tokens(rng, 20)
    engine.add_request("decoding", short, sp)
    engine.add_request("prefilling", long, sp)
    engine.add_request("kept", kept, sp)
    assert engine.step() == []  # the first step's tokens are still on their way
    engine.step()
    in_flight = engine.overlapped.in_flight
    assert in_flight is not None and any(s.request_id == "decoding" for s in in_flight.seqs)
    doomed = [s for rid in ("decoding", "prefilling") for s in engine.requests[rid].seqs]
    engine.abort_request(["decoding", "prefilling"])
    bm.check_integrity()  # blocks back at once, though a step using some of them is in flight
    assert not any(s.seq_id in bm.tables for s in doomed) and all(not s.block_table for s in doomed)
    tokens = [len(s.output_token_ids) for s in doomed]
    seen = set()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.add(out.request_id)
            if out.finished:
                finished[out.request_id] = out
    assert seen == {"kept"}, "an aborted request produced an output"
    assert [len(s.output_token_ids) for s in doomed] == tokens, "a token in flight reached an aborted sequence"
    assert all(s.finish_reason.value == "abort" for s in doomed)
    ref = llms["sync"].generate({"prompt_token_ids": kept}, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert finished["kept"].outputs[0].token_ids == ref
    assert_all_blocks_free(llms[mode])

    # abort everything while a step is in flight: nothing is left running, and the next request is unaffected
    engine.add_request("gone", short, sp)
    engine.step()
    engine.step()
    engine.abort_request("gone")
    assert not engine.has_unfinished_requests() and engine.overlapped.in_flight is not None
    assert_all_blocks_free(llms[mode])
    again = llms[mode].generate({"prompt_token_ids": kept}, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == ref
    assert_all_blocks_free(llms[mode])


# -- CUDA graphs' static logits (emulated on the CPU) ---------------------------------------------------------

def test_emulated_decode_graphs_same_outputs():
    """The graph path returns a view of a static logits buffer that the next replay overwrites: the draw and
    the logprobs must come out the same as on the synchronous path. On the CPU the capture is emulated (each
    replay re-runs the forward over the static buffers), as in tests/bench/test_bench.py."""
    rng = random.Random(41)
    requests = [(f"g{i}", random_tokens(rng, n), SamplingParams(temperature=t, seed=i, max_tokens=10, logprobs=2,
                                                                ignore_eos=True))
                for i, (n, t) in enumerate([(12, 0.0), (30, 1.0), (7, 0.0)])]
    finals = {}
    for mode in MODES:
        llm = make_llm(mode, cuda_graphs=True, max_num_seqs=4, num_gpu_blocks_override=32)
        runner = llm.engine.executor.runner
        runner.graph_capture = lambda fn: fn
        streams, _ = drive(llm.engine, requests)
        assert runner.graphs is not None and runner.graphs.graphs, "no decode step replayed a graph"
        finals[mode] = streams
        llm.engine.shutdown()
    for mode in OVERLAPPED:  # async: the decode graphs' input ids come from the device (the staged list holds 0)
        assert finals[mode] == finals["sync"], mode


# -- the async server bridge ----------------------------------------------------------------------------------

def test_async_engine_finishes_every_request(llms, stop_requests):
    """AsyncLLMEngine steps the engine in its worker thread: with the switch on, every stream grows to the same
    finished output as the offline engine's, and a stream closed early aborts its request and frees its blocks.
    (tests/server/test_server.py runs the HTTP server with the switch on, its default.)"""
    ids = [rid for rid, *_ in stop_requests]
    offline = llms["sync"].generate([{"prompt_token_ids": p} for _, p, _ in stop_requests],
                                   [sp for *_, sp in stop_requests], use_tqdm=False)
    ref = {rid: snapshot(out) for rid, out in zip(ids, offline)}
    config = EngineConfig.from_kwargs(model="m3-tiny", optimizations=engine_opts(overlap_scheduling=True),
                                      max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=SMALL_POOL_BLOCKS,
                                      max_num_batched_tokens=SMALL_BUDGET)
    engine = AsyncLLMEngine.from_config(config)

    async def consume(rid: str, prompt: list[int], sp: SamplingParams) -> tuple[tuple, list[int]]:
        lengths, last = [], None
        async for out in engine.generate(rid, {"prompt_token_ids": prompt}, sp):
            lengths.append(len(out.outputs[0].token_ids))
            last = out
        return snapshot(last), lengths

    async def leave_early() -> None:
        stream = await engine.add_request("early", {"prompt_token_ids": [10, 11, 12]},
                                          SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await stream.aclose()

    async def main() -> list[tuple[tuple, list[int]]]:
        await engine.start()
        try:
            results = await asyncio.gather(*(consume(*r) for r in stop_requests), leave_early())
            for _ in range(1000):
                if not engine.engine.requests and not engine.num_in_flight:
                    break
                await asyncio.sleep(0.01)
            bm = engine.engine.block_manager
            await engine.run_on_engine_thread(bm.check_integrity)
            assert await engine.run_on_engine_thread(lambda: bm.num_free_blocks == bm.num_blocks)
            return results[:-1]
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    assert engine.engine.stats.num_aborted == 1
    got = {rid: snap for rid, (snap, _) in zip(ids, results)}
    assert_same_outputs(got, ref)
    for rid, (snap, lengths) in zip(ids, results):
        assert lengths == sorted(lengths) and lengths[-1] == len(snap[1][0][1]), rid
