"""The engine on the GPU at M3's real widths (m3-slice: 4 layers, bf16; marked `gpu`).

- Decode CUDA graphs replay the eager forward's logits on the real model, at batch 1, 3 (a padded bucket) and 64,
  two steps each (the second replays a graph captured at the first): the same tolerances as
  tests/test_cuda_graphs.py's bf16 case (max |diff| <= 5e-2 x max |logit|, >= 90% argmax agreement).
- Engines built one after another in one process get the same KV pool: the second does not count the first
  one's memory once the first is shut down.
"""

from __future__ import annotations

import gc

import pytest
import torch

from nanoserve.config import EngineConfig, Optimizations

pytestmark = pytest.mark.gpu

BF16_RTOL, BF16_MIN_ARGMAX = 5e-2, 0.9


def test_decode_graphs_replay_the_eager_logits_on_m3_slice():
    from nanoserve.bench.graph_check import compare_decode_logits
    from nanoserve.runner.model_runner import ModelRunner

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


def test_engines_one_after_another_get_the_same_kv_pool():
    from nanoserve import LLM

    blocks = []
    for _ in range(2):
        llm = LLM("m3-tiny", device="cuda", max_model_len=512, gpu_memory_utilization=0.5)
        blocks.append(llm.engine.executor.runner.num_blocks)
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert blocks[0] > 0 and abs(blocks[1] - blocks[0]) <= blocks[0] // 100, blocks
