"""model/shapes.py: the weight shapes one rank multiplies by, read off the model the engine builds for it - what
the tuning scripts time (scripts/tune_gemv.py, scripts/tune_fp8.py --tp/--ep). Checked against M3's widths
(m3-slice) by hand, at TP=1, TP=8 and TP=8 with expert parallelism."""

from __future__ import annotations

from nanoserve.model.shapes import rank_shapes
from nanoserve.parallel_state import get_tp
from nanoserve.presets.catalog import get_preset

CFG = get_preset("m3-slice").config  # M3's widths: 64 query heads and 4 KV heads of 128, hidden 6144


def test_tp1_shapes():
    r = rank_shapes(CFG)
    assert r.projections == {
        "L0 qkv_proj": (8192 + 2 * 512, 6144),       # dense attention: q, k, v
        "L0 o_proj": (6144, 8192),
        "L0 gate_up_proj": (2 * 12288, 6144),        # the dense MLP
        "L0 down_proj": (6144, 12288),
        "L1 qkv_proj": (9216 + 5 * 128, 6144),       # MSA: + the indexer's 4 query heads and its key head
        "L1 gate": (128, 6144),                      # the router (fp32)
        "lm_head": (200064, 6144),
    }
    assert r.router == "L1 gate" and r.lm_head == "lm_head"
    assert r.experts == (6144, 3072, 128)
    assert set(r.quantizable) == set(r.projections) - {"L1 gate", "lm_head"}


def test_tp8_shapes_and_the_layout_is_restored():
    before = get_tp()
    r = rank_shapes(CFG, 8)
    assert get_tp() == before
    # a rank holds 8 query heads, one KV head (4 heads over 8 ranks: replicated), 1/8 of the dense MLP and of
    # each expert's intermediate columns, 1/8 of the vocabulary
    assert r.projections["L0 qkv_proj"] == (1024 + 2 * 128, 6144)
    assert r.projections["L0 o_proj"] == (6144, 1024)
    assert r.projections["L0 gate_up_proj"] == (3072, 6144) and r.projections["L0 down_proj"] == (6144, 1536)
    assert r.projections["lm_head"] == (25008, 6144)
    assert r.experts == (6144, 384, 128)
    ep = rank_shapes(CFG, 8, expert_parallel=True)
    assert ep.experts == (6144, 3072, 16)  # whole experts; the shared expert is its own MLP, sharded
    assert ep.projections["L1 shared.gate_up_proj"] == (768, 6144)
