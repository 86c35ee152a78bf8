"""Decode-graph replay against the eager forward, on a live ModelRunner (used by tests/engine/test_cuda_graphs.py and
tests/kernels/test_kv_fp8.py on m3-tiny, tests/engine/test_gpu_engine.py on m3-slice, and with an emulated capture
on the CPU by tests/bench/test_bench.py).

For each batch size: prefill that many random prompts into fresh blocks of the runner's pool, then run two decode
steps, each once through the graph path and once eagerly, and compare the logits. The second step replays a graph
captured at the first, so it checks that new inputs reach the static buffers. Writing a step's K/V twice is
harmless: both paths write the same values to the same slots.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.runner.model_runner import ModelRunner
from nanoserve.step import ModelInput


def compare_decode_logits(runner: ModelRunner, batch_sizes: tuple[int, ...] = (1, 3, 8), prompt_len: int = 40,
                          seed: int = 0, steps: int = 2) -> list[dict]:
    opts = runner.config.optimizations
    saved = opts.cuda_graphs
    rng = np.random.default_rng(seed)
    vocab = min(runner.cfg.vocab_size, 1000)
    page = runner.block_size
    out = []
    try:
        for bs in batch_sizes:
            per_seq = -(-(prompt_len + steps) // page)
            if bs * per_seq > runner.num_blocks:
                raise ValueError(f"batch {bs} needs {bs * per_seq} KV blocks, the pool has {runner.num_blocks}")
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(bs)]
            ids = rng.integers(0, vocab, bs * prompt_len).tolist()
            opts.cuda_graphs = False
            runner.execute(ModelInput(ids, [prompt_len] * bs, [prompt_len] * bs, tables, list(range(bs))))
            for step in range(steps):
                lens = [prompt_len + step + 1] * bs
                inp = ModelInput(rng.integers(0, vocab, bs).tolist(), [1] * bs, lens, tables, list(range(bs)))
                opts.cuda_graphs = True
                graphed = runner.execute(inp).float().clone()
                used_graph = runner.graphs is not None and runner.graphs.disabled is None and bool(runner.graphs.graphs)
                opts.cuda_graphs = False
                eager = runner.execute(inp).float()
                diff = (graphed - eager).abs().max().item()
                scale = eager.abs().max().item() or 1.0
                out.append({"batch": bs, "step": step, "graph_used": used_graph,
                            "graph_keys": sorted(runner.graphs.graphs) if runner.graphs is not None else [],
                            "disabled": runner.graphs.disabled if runner.graphs is not None else None,
                            "max_abs_diff": diff, "max_rel_diff": diff / scale,
                            "argmax_agreement": (graphed.argmax(-1) == eager.argmax(-1)).float().mean().item()})
    finally:
        opts.cuda_graphs = saved
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
    return out
