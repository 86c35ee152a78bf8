"""Decode CUDA/HIP graphs (runner/cuda_graphs.py): replayed logits equal the eager forward's, at several batch
sizes including padded ones, and greedy generation is unchanged. The capture tests need a GPU and the Triton
kernels (skipped otherwise); the bucket logic and the applicability rules are checked everywhere. The graph
plumbing itself is also exercised on the CPU with an emulated capture (tests/bench/test_bench.py).

Tolerances: fp32 max |diff| <= 1e-4 x max |logit| (the graph's attention splits its context for the bucket's
length, not the batch's, so sums are ordered differently); bf16 <= 5e-2 x max |logit| with >= 90% argmax agreement
(cuBLAS may pick other GEMM tiles for the padded batch)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import EngineConfig, Optimizations
from nanoserve.runner import cuda_graphs
from nanoserve.runner.cuda_graphs import batch_buckets, seq_len_buckets, unsupported_reason

FP32_RTOL, BF16_RTOL, BF16_MIN_ARGMAX = 1e-4, 5e-2, 0.9


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(64)[-3:] == [32, 48, 64]
    assert batch_buckets(100)[-2:] == [96, 100]
    assert batch_buckets(10_000)[-1] == cuda_graphs.BATCH_BUCKETS[-1]
    assert seq_len_buckets(1024) == [1024]
    assert seq_len_buckets(131136) == [4096, 16384, 65536, 131136]


def test_not_applicable_on_cpu_or_with_reference_kernels():
    from nanoserve.presets.catalog import get_preset

    class Fake:
        cfg = get_preset("m3-tiny").config

    assert "not CUDA" in unsupported_reason(Fake(), Optimizations(), torch.device("cpu"))
    if torch.cuda.is_available():
        why = unsupported_reason(Fake(), Optimizations(fused_moe=False, triton_msa=False), torch.device("cuda"))
        assert "fused_moe" in why and "triton_msa" in why


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA/HIP device"
    from nanoserve.bench.offline import unavailable_kernel_switches

    missing = unavailable_kernel_switches()
    if missing:
        return f"kernels unavailable: {missing}"
    return None


gpu = pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))


def _runner(tiny_dir: str, dtype: str):
    from nanoserve.runner.model_runner import ModelRunner

    cfg = EngineConfig(model=tiny_dir, device="cuda", dtype=dtype, max_model_len=512, max_num_seqs=32,
                       num_gpu_blocks_override=400, optimizations=Optimizations())
    runner = ModelRunner(cfg)
    runner.allocate_kv_cache(runner.determine_num_blocks(512, 2048, 32))
    return runner


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_matches_eager(tiny_dir, dtype):
    from tests.helpers.graph_check import compare_decode_logits

    runner = _runner(tiny_dir, dtype)
    rows = compare_decode_logits(runner, (1, 3, 8, 17), prompt_len=40, steps=2)
    for r in rows:
        assert r["graph_used"] and r["disabled"] is None, r
        assert r["max_rel_diff"] <= (FP32_RTOL if dtype == "float32" else BF16_RTOL), r
    if dtype == "bfloat16":  # over every row of every batch (a batch of 1 is one near-tie away from 0%)
        agree = sum(r["argmax_agreement"] * r["batch"] for r in rows) / sum(r["batch"] for r in rows)
        assert agree >= BF16_MIN_ARGMAX, rows
    assert {k[0] for k in runner.graphs.graphs} == {1, 4, 8, 24}  # 3 -> 4, 17 -> 24
    assert runner.graph_capture is None  # real torch.cuda.CUDAGraph captures, not the CPU emulation
    runner.shutdown()


@gpu
@pytest.mark.gpu
def test_capture_all_and_switch_change(tiny_dir):
    runner = _runner(tiny_dir, "float32")
    n = runner.capture_decode_graphs(100, 5)
    assert n == 4 and sorted(k[0] for k in runner.graphs.graphs) == [1, 2, 4, 8]
    runner.config.optimizations.fused_add_rmsnorm = False  # a model-side switch: graphs are rebuilt
    assert runner.capture_decode_graphs(100, 1) == 1 and list(runner.graphs.graphs) == [(1, 512)]
    runner.config.optimizations.fused_moe = False  # reference MoE is not graph-safe: eager
    assert runner.capture_decode_graphs(100, 1) == 0 and runner.graphs is None
    runner.shutdown()


@gpu
@pytest.mark.gpu
def test_greedy_generation_same_with_and_without_graphs(tiny_dir):
    from nanoserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 for j in range(20 + 9 * i)]} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(tiny_dir, device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=200,
                  enforce_eager=eager)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.engine.executor.runner
        assert (runner.graphs is not None and bool(runner.graphs.graphs)) == (not eager)
        llm.engine.shutdown()
    assert outs[False] == outs[True]


@gpu
@pytest.mark.gpu
def test_captured_argmax_under_real_graphs(tiny_dir):
    """Switch captured_argmax under real CUDA graphs: the replayed step's static tokens are the argmax of its
    static logits (integers: exact), and greedy generation gives the same tokens with the switch on and off
    (with it on, the engine takes the captured tokens)."""
    from nanoserve import LLM, SamplingParams
    from tests.helpers.graph_check import compare_decode_logits

    runner = _runner(tiny_dir, "float32")
    assert runner.config.optimizations.captured_argmax
    compare_decode_logits(runner, (1, 3), prompt_len=24, steps=1)
    graphs = runner.graphs
    assert graphs.captured_argmax and graphs.graphs
    bs = max(k[0] for k in graphs.graphs)
    torch.cuda.synchronize()
    assert torch.equal(graphs.tokens[:bs], graphs.logits[:bs].argmax(-1))
    runner.shutdown()

    prompts = [{"prompt_token_ids": [(5 * i + j) % 500 for j in range(17 + 11 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for on in (True, False):
        opts = Optimizations(captured_argmax=on)
        llm = LLM(tiny_dir, device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=200,
                  optimizations=opts)
        used = []
        execute = llm.engine.executor.runner.execute

        def spy(inp, feed=None, *args, execute=execute, runner=llm.engine.executor.runner, used=used, **kwargs):
            out = execute(inp, feed, *args, **kwargs)
            used.append(runner.last_argmax is not None)
            return out

        llm.engine.executor.runner.execute = spy
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert any(used) == on
        llm.engine.shutdown()
    assert outs[True] == outs[False]


@gpu
@pytest.mark.gpu
def test_async_scheduling_under_real_graphs(tiny_dir):
    """Switch async_scheduling under real CUDA graphs: a decode step's input tokens are copied into the graph's
    static input ids on the device from the previous step's sampled tokens (a TokenFeed); greedy and seeded
    sampled generation give the same tokens with the switch on and off, and the fed replays happened."""
    from nanoserve import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [(3 * i + j) % 500 for j in range(15 + 13 * i)]} for i in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True, logprobs=2)]
    outs = {}
    for on in (True, False):
        llm = LLM(tiny_dir, device="cuda", dtype="float32", max_model_len=512, num_gpu_blocks_override=200,
                  optimizations=Optimizations(async_scheduling=on))
        runner = llm.engine.executor.runner
        fed_replays = []
        execute = runner.execute

        def spy(inp, feed=None, *args, execute=execute, fed_replays=fed_replays, **kwargs):
            fed_replays.append(feed is not None and len(inp.input_ids) == len(inp.query_lens))
            return execute(inp, feed, *args, **kwargs)

        runner.execute = spy
        outs[on] = [[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] for p in params]
        assert runner.graphs is not None and runner.graphs.graphs
        assert any(fed_replays) == on
        llm.engine.shutdown()
    assert outs[True] == outs[False]


@gpu
@pytest.mark.gpu
def test_a_replay_keeps_alive_what_the_captured_function_made_before_the_capture():
    """A captured function may hold a tensor it made before the capture (the MTP draft graphs' index of each
    sequence's last row); the graph reads it by address, so the replay must keep the function - and that tensor -
    alive after every other reference is gone, or the allocator reuses its memory and the replays read garbage."""
    import gc

    def make():
        src = torch.arange(8, dtype=torch.float32, device="cuda")
        out = torch.zeros(2, device="cuda")
        index = torch.tensor([1, 7], device="cuda")  # made outside the capture, held only by the closure

        def fn() -> None:
            out.copy_(src[index])
        fn()
        torch.cuda.synchronize()
        return cuda_graphs.cuda_graph_capture(torch.cuda.graph_pool_handle())(fn), src, out

    replay, src, out = make()
    gc.collect()
    torch.cuda.empty_cache()
    clobber = [torch.full((4096,), 5, dtype=torch.int64, device="cuda") for _ in range(64)]
    replay()
    torch.cuda.synchronize()
    assert out.tolist() == [1.0, 7.0]
    del clobber
