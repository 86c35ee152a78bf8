"""The memory plan (model/memory_plan.py) against the released M3 config's numbers, and against the engine's own
KV pool sizing and the bytes a built model really holds."""

from __future__ import annotations

import torch

from nanoserve.model.m3_config import M3Config
from nanoserve.model.memory_plan import kv_bytes_per_token, memory_plan, weight_bytes_per_gpu
from nanoserve.parallel_state import set_tp
from nanoserve.presets.catalog import get_preset
from nanoserve.runner.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block

REAL = M3Config()  # the defaults are the released MiniMax-M3 text config


def test_real_config_kv_bytes_per_token():
    # 3 dense layers x (2 x 4 heads x 128 x 2 B) + 57 MSA layers x (2,048 + 256 B index key)
    assert kv_bytes_per_token(REAL, 2) == 137_472
    assert kv_bytes_per_token(REAL, 1) == 68_736
    # TP=4: one KV head per rank; TP=8: the 4 heads replicated twice; the index key replicated everywhere
    assert kv_bytes_per_token(REAL, 2, tp_size=4) == 45_312
    assert kv_bytes_per_token(REAL, 2, tp_size=8) == 45_312


def test_real_config_weight_bytes():
    bf16 = weight_bytes_per_gpu(REAL, 1)
    params = (bf16.quantized + bf16.embeddings) // 2 + bf16.other // 4  # norms and router: fp32
    assert params == 426_174_572_928  # the text model's parameter count
    mx = weight_bytes_per_gpu(REAL, 1, "mxfp8")
    assert mx.quantized == bf16.quantized // 2 and mx.scales == mx.quantized // 32
    assert mx.embeddings == bf16.embeddings
    tp8 = weight_bytes_per_gpu(REAL, 8, "mxfp8")
    assert 55e9 < tp8.total < 56e9
    plan = memory_plan(REAL, 141 * 10**9, 8, "mxfp8")
    assert plan.kv_per_token == 45_312 and plan.kv_tokens > 10 * 131_072


def test_plan_counts_the_bytes_the_built_model_holds():
    """weight_bytes_per_gpu equals the parameter bytes of the model the engine builds (on the meta device: shapes
    and dtypes only), per format, at tensor parallel sizes that split or replicate the KV heads, with and without
    expert parallelism."""
    from nanoserve.model.m3 import M3ForCausalLM

    # (m3-tiny's MXFP8 layers hold whole 32-column scale blocks up to TP=2; m3-slice's, like M3's, up to TP=8)
    for preset, layouts in (("m3-tiny", ((1, False), (2, False), (2, True))),
                            ("m3-slice", ((1, False), (8, False), (8, True)))):
        cfg = get_preset(preset).config
        for tp, ep in layouts:
            set_tp(0, tp, expert_parallel=ep)
            try:
                for quant in (None, "mxfp8"):
                    model = M3ForCausalLM(cfg, None, torch.bfloat16, "meta", quantization=quant)
                    held = sum(p.numel() * p.element_size() for p in model.parameters())
                    assert held == weight_bytes_per_gpu(cfg, tp, quant, expert_parallel=ep).total, \
                        (preset, tp, ep, quant)
            finally:
                set_tp(0, 1)


def test_engine_sizes_its_pool_with_the_plan():
    """kv_cache_bytes_per_block (what the runner divides free memory by) equals the bytes the pools allocate."""
    cfg = get_preset("m3-tiny").config
    for tp in (1, 2, 8):
        set_tp(0, tp)
        try:
            kv, idx = allocate_kv_caches(cfg, 3, 16, torch.bfloat16, "cpu")
            allocated = sum(t.numel() * t.element_size() for t in kv + [i for i in idx if i is not None])
            assert kv_cache_bytes_per_block(cfg, 16, torch.bfloat16) * 3 == allocated
            assert allocated == 3 * 16 * kv_bytes_per_token(cfg, 2, tp)
        finally:
            set_tp(0, 1)


def test_memory_table_comes_from_the_plan_of_the_real_config():
    """Every row of the docs/mxfp8.md memory table (`python -m nanoserve.bench --memory-plan`) is memory_plan() of
    the released config: KV bytes by part as counted by hand, the pool by the engine's rule (kv_pool_bytes), and
    the docs quote the table as the code prints it."""
    from pathlib import Path

    from nanoserve.model.memory_plan import ACTIVATION_RESERVE_BYTES, CONTEXTS, GPUS, kv_pool_bytes, markdown_table

    table = markdown_table(REAL)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert len(rows) == 2 * 2 * 2  # GPUs x layouts x formats
    for gpu, layout, fmt, weights, kv, pool, tokens, *seqs in rows:
        p = memory_plan(REAL, GPUS[gpu], 8, None if fmt == "bf16" else fmt, expert_parallel=layout == "TP=8+EP")
        # 3 dense layers x 2 (K, V) x 1 KV head per rank x 128 x 2 B; 57 MSA layers the same; 57 index keys x 256 B
        assert kv == "1,536 + 29,184 + 14,592 = 45,312" and p.kv.total == 45_312
        assert weights == f"{p.weights.total / 2**30:.1f} GiB"
        assert p.pool_bytes == kv_pool_bytes(GPUS[gpu], 0.9, p.weights.total + ACTIVATION_RESERVE_BYTES) \
            == int(GPUS[gpu] * 0.9) - p.weights.total - ACTIVATION_RESERVE_BYTES
        assert pool == f"{p.pool_bytes / 2**30:.1f} GiB" and tokens == f"{p.pool_bytes // 45_312:,}"
        assert seqs == [str(p.pool_bytes // 45_312 // c) for c in CONTEXTS]
    tp, ep = (weight_bytes_per_gpu(REAL, 8, "mxfp8", expert_parallel=e) for e in (False, True))
    assert tp == ep  # 128 experts / 8 ranks whole, or each expert's 3072 columns / 8: the same bytes
    doc = (Path(__file__).resolve().parents[2] / "docs" / "mxfp8.md").read_text()
    assert table in doc, "docs/mxfp8.md's memory table is stale: paste `python -m nanoserve.bench --memory-plan`"
