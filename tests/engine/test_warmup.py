"""Warm-up before ready (engine/warmup.py): the shapes it plans are the ones it runs, its budget bounds it (0
skips, a short one stops early and the log line names what was left), it gives back every KV block and registers
no prefix, later outputs are the same with and without it (greedy, and unseeded sampling from the engine's shared
generator), with decode graphs on it captures every batch bucket (on the CPU through the emulated capture; on a GPU
for real, marked `gpu`), and a real server process started with it logs the line and then serves."""

from __future__ import annotations

import logging
import random

import httpx
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.engine.llm_engine import EngineStats
from nanoserve.engine.warmup import Shape, plan, warm_up
from nanoserve.kernels.configs import LONG_PREFILL_CONTEXT
from nanoserve.runner.cuda_graphs import batch_buckets
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts, random_tokens
from tests.helpers.server_utils import ServerProcess

MAX_MODEL_LEN, BUDGET_TOKENS, MAX_SEQS = 512, 256, 8


def tiny_llm(**switches: bool) -> LLM:
    return LLM("m3-tiny", optimizations=engine_opts().replace(**switches), max_model_len=MAX_MODEL_LEN,
               kv_cache_tokens=4096, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET_TOKENS, cpu_threads=1)


@pytest.fixture(scope="module")
def llm():
    with tiny_llm() as llm:
        yield llm


def record_steps(engine, monkeypatch) -> list[tuple[int, int, int]]:
    """(sequences, new tokens, context) of every step the executor runs from now on."""
    seen: list[tuple[int, int, int]] = []
    execute = engine.executor.execute_model

    def recording(step):
        inp = step.model
        seen.append((len(inp.query_lens), len(inp.input_ids), max(inp.seq_lens)))
        return execute(step)

    monkeypatch.setattr(engine.executor, "execute_model", recording)
    return seen


def planned_steps(shapes: list[Shape]) -> list[tuple[int, int, int]]:
    return [(s.batch, s.batch * q, ctx) for s in shapes for q, ctx in s.steps]


def test_plan_covers_the_buckets_of_a_real_deployment():
    """M3-sized limits: every decode batch bucket (largest first), every power of two up to the token budget and
    the budget, an MSA prompt past the top-k, and chunks of long prompts (the long-context prefill tiles)."""
    shapes = plan(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=65536, block_size=128,
                  topk_blocks=16, has_msa=True)
    decode = [s for s in shapes if s.kind == "decode" and s.context <= 4096]  # (the longer buckets' come last)
    assert [s.batch for s in decode] == list(reversed(batch_buckets(256)))
    msa_len = 18 * 128  # index_topk_blocks + 2 blocks
    assert {s.context for s in decode} == {msa_len + 1}
    prefill = [s.context for s in shapes if s.kind == "prefill"]
    assert prefill == [2 ** i for i in range(14)] + [msa_len]
    # past the budget, one chunk ending at 2x and 4x the budget (there the long-context tiles start) and at the
    # longest prompt
    chunks = [s.steps for s in shapes if s.kind == "chunk"]
    assert chunks == [[(8192, 16384)], [(8192, LONG_PREFILL_CONTEXT)], [(8192, 65535)]]
    assert [s.kind for s in shapes[-5:-2]] == ["chunk"] * 3
    # last, one sequence decoding at the end of each longer context bucket (its graphs are keyed by it)
    assert [(s.kind, s.batch, s.context) for s in shapes[-2:]] == [("decode", 1, 16384), ("decode", 1, 65536)]
    # with speculation, that sequence's verify and draft shapes too, ending k - 1 positions before the bucket's end
    spec = plan(max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=65536, block_size=128, topk_blocks=16,
                has_msa=True, spec_tokens=3, draft_model=True)
    tail = [(s.kind, s.batch, s.chunk, s.context) for s in spec
            if s.context > 4096 and s.kind in ("decode", "verify", "draft")]
    assert tail == [(kind, 1, q, ctx) for bucket in (16384, 65536) for kind, q, ctx in
                    [("decode", 1, bucket)] + [("verify", q, bucket - 3) for q in (2, 3, 4)] +
                    [("draft", q, bucket - 3) for q in (1, 2, 3, 4)]]
    # a short context: nothing past max_model_len - 1, no long-context shape, the budget is the last bucket
    small = plan(max_num_seqs=5, max_num_batched_tokens=300, max_model_len=200, block_size=16, topk_blocks=3,
                 has_msa=False)
    assert [s.batch for s in small if s.kind == "decode"] == [5, 4, 2, 1]
    assert [s.context for s in small if s.kind == "prefill"] == [1, 2, 4, 8, 16, 32, 64, 128, 199]
    assert not [s for s in small if s.kind == "chunk"]
    # a prompt up to 3x the budget: one chunk, ending at the longest prompt
    assert [s.steps for s in plan(1, 100, 301, 16, 3, False) if s.kind == "chunk"] == [[(100, 200)], [(100, 300)]]


def test_warm_up_runs_the_planned_steps_and_gives_every_block_back(llm, monkeypatch, caplog):
    engine = llm.engine
    cfg = engine.model_config
    shapes = plan(MAX_SEQS, BUDGET_TOKENS, MAX_MODEL_LEN, engine.block_size, cfg.index_topk_blocks, True)
    assert any(s.label.startswith("MSA prompt") for s in shapes)  # m3-tiny has MSA layers: a prompt past their top-k
    seen = record_steps(engine, monkeypatch)
    with caplog.at_level(logging.INFO, logger="nanoserve.engine.warmup"):
        report = warm_up(engine, budget_s=600)
    assert seen == planned_steps(shapes)
    assert report.built == shapes and not report.skipped and report.graphs == 0
    line = caplog.messages[-1]
    assert line.startswith(f"warm-up: built 4 decode batch sizes (1-8), {len(shapes) - 4} prefill shapes (1-511 "
                           f"tokens), 0 CUDA graphs captured in ")
    assert "not built" not in line
    assert_all_blocks_free(llm)
    assert not engine.block_manager.cached  # the scratch blocks registered no prefix
    assert engine.stats == EngineStats()  # no step, request or token counted


def test_budget_zero_skips(llm, monkeypatch, caplog):
    seen = record_steps(llm.engine, monkeypatch)
    with caplog.at_level(logging.INFO, logger="nanoserve.engine.warmup"):
        report = warm_up(llm.engine, budget_s=0)
    assert seen == [] and not report.built and report.skipped
    assert caplog.messages[-1].startswith("warm-up skipped (budget 0 s)")
    assert_all_blocks_free(llm)


def test_a_spent_budget_stops_and_names_what_was_left(llm, monkeypatch, caplog):
    """A clock that advances 1 s per reading: the budget of 2.5 s allows two shapes (readings at 1 and 2 s), the
    third check (3 s) stops, and the log line lists the rest."""
    ticks = iter(range(1000))
    seen = record_steps(llm.engine, monkeypatch)
    with caplog.at_level(logging.INFO, logger="nanoserve.engine.warmup"):
        report = warm_up(llm.engine, budget_s=2.5, clock=lambda: float(next(ticks)))
    assert [s.label for s in report.built] == ["decode batch 8", "decode batch 4"]
    assert len(seen) == 2
    line = caplog.messages[-1]
    assert "built 2 decode batch sizes (4-8), 0 prefill shapes, 0 CUDA graphs captured in 4.0 s" in line
    assert line.endswith("; not built, the budget of 2.5 s was spent: " +
                         ", ".join(s.label for s in report.skipped))
    assert report.skipped[0].label == "decode batch 2" and report.skipped[-1].label == "256-token chunk at context 511"
    assert_all_blocks_free(llm)


def test_outputs_are_the_same_with_and_without_warm_up():
    """Greedy and unseeded sampled tokens (the engine's shared generator) of a batch with a prefix shared between
    prompts: the same token for token after a warm-up as on a fresh engine."""
    rng = random.Random(7)
    shared = random_tokens(rng, 40)
    prompts = [shared + random_tokens(rng, n) for n in (3, 20, 70)] + [random_tokens(rng, 130)]
    params = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=1.0, max_tokens=12)]

    def run(warm: bool) -> list[list[int]]:
        with tiny_llm() as llm:
            if warm:
                assert warm_up(llm.engine, budget_s=600).built
            out = []
            for p in params:
                out += [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
            assert_all_blocks_free(llm)
            return out

    assert run(warm=True) == run(warm=False)


def test_every_decode_graph_is_captured_ahead():
    """With decode graphs on (the capture emulated on the CPU: the graph runner re-runs the forward at each replay)
    the warm-up captures the graph of every batch bucket, and later decodes capture none."""
    with tiny_llm(cuda_graphs=True) as llm:
        runner = llm.engine.executor.runner
        runner.graph_capture = lambda fn: fn
        report = warm_up(llm.engine, budget_s=600)
        assert report.graphs == len(batch_buckets(MAX_SEQS)) == runner.num_decode_graphs
        rng = random.Random(3)
        llm.generate([random_tokens(rng, n) for n in (5, 9, 30)], SamplingParams(temperature=0.0, max_tokens=6),
                     use_tqdm=False)
        assert runner.num_decode_graphs == report.graphs
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("chain", [False, True])
def test_speculative_graphs_are_captured_ahead(mtp_dir, chain):
    """With an MTP drafter of k = 2 and spec_cuda_graphs (emulated capture): the warm-up runs a verify step of
    every query length 2 .. k + 1 and a draft step from every number of final positions 1 .. k + 1 per batch
    bucket, capturing their graphs (verify and MTP first-pass graphs per length, the one-token draft pass); later
    requests capture none, their greedy output is the output of an engine without the warm-up, and every block
    comes back."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    rng = random.Random(5)
    prompts = [random_tokens(rng, n) for n in (6, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(warm: bool):
        opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True, spec_draft_chain=chain)
        llm = LLM(mtp_dir, optimizations=opts,
                  max_model_len=MAX_MODEL_LEN, kv_cache_tokens=4096, max_num_seqs=2,
                  max_num_batched_tokens=BUDGET_TOKENS, cpu_threads=1, speculative_config=spec)
        with llm:
            runner = llm.engine.executor.runner
            runner.graph_capture = lambda fn: fn
            report = warm_up(llm.engine, budget_s=600) if warm else None
            captured = runner.num_graphs
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.engine.stats.spec_decode_num_drafts > 0
            assert_all_blocks_free(llm)
            return outs, report, captured, runner.num_graphs

    outs, report, captured, after = run(warm=True)
    kinds = [(s.kind, s.batch, s.chunk) for s in report.built if s.kind in ("verify", "draft")]
    assert kinds == [(kind, b, q) for b in (2, 1) for kind, q in
                     [("verify", 2), ("verify", 3), ("draft", 1), ("draft", 2), ("draft", 3)]]
    # per batch bucket: a decode graph, verify graphs of 2 and 3 tokens, MTP first passes from 1, 2 and 3
    # positions (1: a decode-like pass, shared with the later passes), and with spec_draft_chain its graph
    assert report.graphs == captured == 2 * (1 + 2 + 3 + chain)
    assert after == captured, "a request met a graph the warm-up had not captured"
    cold_outs, _, _, cold_graphs = run(warm=False)
    assert cold_outs == outs
    assert cold_graphs >= 3, "without the warm-up the requests were meant to capture decode, verify and draft graphs"


@pytest.mark.gpu
def test_gpu_warm_up_captures_every_decode_graph():
    """On a GPU (m3-slice, real graphs and compiled kernels): every batch bucket's graph is captured before the
    first request, and decodes afterwards (contexts in the same bucket) capture none."""
    with LLM("m3-slice", max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=2048,
             num_gpu_blocks_override=256) as llm:
        runner = llm.engine.executor.runner
        report = warm_up(llm.engine, budget_s=600)
        assert not report.skipped
        assert report.graphs == len(batch_buckets(16)) == runner.num_decode_graphs
        llm.generate([[100 + i] * (20 + i) for i in range(3)], SamplingParams(temperature=0.0, max_tokens=8),
                     use_tqdm=False)
        assert runner.num_decode_graphs == report.graphs
        assert_all_blocks_free(llm)


def test_server_warms_up_before_it_serves(tiny_dir, tmp_path):
    """A real server process with a warm-up budget: the log line comes before uvicorn listens, then it serves."""
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--warmup-budget-s", "120", "--max-num-seqs", "4",
                       "--max-num-batched-tokens", "128", "--cpu-threads", "1") as server:
        log = server.log()
        assert "warm-up: built 3 decode batch sizes (1-4)" in log and "not built" not in log
        assert log.index("warm-up: built") < log.index("Uvicorn running")
        r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4,
                                                             "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_server_on_the_cpu_skips_by_default(tiny_dir, tmp_path):
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--cpu-threads", "1") as server:
        assert "warm-up skipped (budget 0 s)" in server.log()


@pytest.mark.parametrize("flags, message", [
    (["--warmup-budget-s", "-1"], "--warmup-budget-s must be >= 0, got -1"),
    (["--no-warmup", "--warmup-budget-s", "5"], "--no-warmup contradicts --warmup-budget-s 5"),
])
def test_bad_warmup_flags_stop_the_start(flags, message, capsys):
    """Refused with exit code 2 before the model loads."""
    from nanoserve.server.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "m3-tiny", *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_long_request_meets_no_graph_the_warm_up_left(mtp_dir, monkeypatch):
    """Context buckets from 256 (monkeypatched: m3-tiny's positions stop at 4,096, the first real bucket), so
    max_model_len 2048 has three (256, 1024, 2048): the warm-up also captures, at each bucket past the decode
    context's, one sequence's decode graph and its verify and draft graphs, so a greedy request whose context
    crosses 1024 captures nothing while it decodes, and its tokens are those of an engine without the warm-up."""
    monkeypatch.setattr("nanoserve.runner.cuda_graphs.SEQ_LEN_BUCKET_FIRST", 256)
    rng = random.Random(11)
    prompt = random_tokens(rng, 1014)  # decodes from 1015 to 1030 tokens of context: across the bucket edge
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(warm: bool):
        opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True)
        with LLM(mtp_dir, optimizations=opts, max_model_len=2048, kv_cache_tokens=2048 + 512, max_num_seqs=1,
                 max_num_batched_tokens=BUDGET_TOKENS, cpu_threads=1,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
            runner = llm.engine.executor.runner
            runner.graph_capture = lambda fn: fn
            report = warm_up(llm.engine, budget_s=600) if warm else None
            captured = runner.num_graphs
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            assert_all_blocks_free(llm)
            return out, report, captured, runner.num_graphs

    out, report, captured, after = run(warm=True)
    labels = [s.label for s in report.built]
    assert {"decode batch 1 at context 1024", "decode batch 1 at context 2048"} <= set(labels) and not report.skipped
    assert after == captured, "the long request captured a graph the warm-up had not"
    assert "one sequence at 2 longer context buckets (1024, 2048 tokens)" in report.summary()
    assert report.summary().startswith("warm-up: built 1 decode batch sizes (1-1), 15 speculative verify")
    cold, _, cold_before, cold_after = run(warm=False)
    assert cold == out and cold_after > cold_before
