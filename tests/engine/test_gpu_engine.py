"""The engine on the GPU at M3's real widths (m3-slice: 4 layers, bf16; marked `gpu`).

- Decode CUDA graphs replay the eager forward's logits on the real model, at batch 1, 3 (a padded bucket) and 64,
  two steps each (the second replays a graph captured at the first): the same tolerances as
  tests/engine/test_cuda_graphs.py's bf16 case (max |diff| <= 5e-2 x max |logit|, >= 90% argmax agreement).
- Engines in one process get the same KV pool: a second one beside the first, or one built after both are shut
  down, does not count the others' memory against its share (tests/engine/test_kv_pool_budget.py has the accounting).
"""

from __future__ import annotations

import gc

import pytest
import torch

from nanoserve.config import EngineConfig, Optimizations

pytestmark = pytest.mark.gpu

BF16_RTOL, BF16_MIN_ARGMAX = 5e-2, 0.9


def test_decode_graphs_replay_the_eager_logits_on_m3_slice():
    from nanoserve.runner.model_runner import ModelRunner
    from tests.helpers.graph_check import compare_decode_logits

    cfg = EngineConfig(model="m3-slice", device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
                       num_gpu_blocks_override=64 * 3 + 8, optimizations=Optimizations())
    runner = ModelRunner(cfg)
    try:
        runner.allocate_kv_cache(runner.determine_num_blocks(1024, 2048, 64))
        rows = compare_decode_logits(runner, (1, 3, 64), prompt_len=200)
    finally:
        runner.shutdown()
    assert len(rows) == 6
    for r in rows:
        assert r["graph_used"] and r["disabled"] is None, r
        assert r["max_rel_diff"] <= BF16_RTOL and r["argmax_agreement"] >= BF16_MIN_ARGMAX, r


def test_engines_in_one_process_size_their_kv_pools_alike():
    """m3-tiny at gpu_memory_utilization 0.3, three times: alone, then a second engine beside the first (its
    memory is not counted against the second's share, and the device has room for both), then after both are shut
    down. Every pool is the same size (within 1 %: the warm-up's activations vary a little)."""
    from nanoserve import LLM

    def build():
        return LLM("m3-tiny", device="cuda", max_model_len=512, gpu_memory_utilization=0.3)

    def blocks(llm):
        return llm.engine.executor.runner.num_blocks

    first = build()
    second = build()
    sizes = [blocks(first), blocks(second)]
    for llm in (first, second):
        llm.engine.shutdown()
    del first, second, llm
    gc.collect()
    torch.cuda.empty_cache()
    third = build()
    sizes.append(blocks(third))
    third.engine.shutdown()
    assert sizes[0] > 0 and all(abs(n - sizes[0]) <= sizes[0] // 100 for n in sizes), sizes
