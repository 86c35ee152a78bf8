"""Switch fp8_linear_wgmma on the CPU: the Gluon MXFP8 linear (kernels/fp8_linear_wgmma.py) compiles for Hopper
ahead of time with the installed Triton for the tiles it launches and fits an H100's shared memory, its launch plan
covers K exactly in one wave of programs, and a call it does not take (here: a CPU tensor) runs the Triton GEMM
unchanged.
Its results are checked on the GPU (tests/model/test_gpu_mxfp8.py, marked gpu)."""

from __future__ import annotations

import pytest
import torch
import triton

from nanoserve.kernels import fp8_linear_wgmma as wg
from tests.helpers.gluon_compile import HOPPER_SHARED_BYTES, compile_for_hopper


@pytest.mark.skipif(not wg.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("bm,rows", [(16, 128), (64, 128), (64, 256), (wg.MAX_BM, 256)])
def test_kernel_compiles_for_hopper_and_fits_its_shared_memory(bm, rows):
    constexprs = dict(BM=bm, ROWS=rows, GROUP=8, STAGES=wg.stages_for(bm, rows), MMA_REGS=wg.moe_wgmma.MMA_REGS,
                      LOADER_REGS=wg.moe_wgmma.LOADER_REGS, num_warps=4)
    types = dict(x_desc=["bf16", [bm, 64]], w_desc=["fp8e4nv", [rows, wg.BLOCK_K]], s_ptr="*i32", out_ptr="*fp32")
    compiled = compile_for_hopper("nanoserve.kernels.fp8_linear_wgmma", "_fp8_linear_wgmma_kernel", constexprs,
                                  types, aligned=("stride_sn", "stride_os", "stride_om"))
    assert 0 < compiled["shared"] <= HOPPER_SHARED_BYTES
    # the batch is the MMA's N; the dequantised weights its register operand A
    assert f"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.bf16.bf16" in compiled["ptx"]


@pytest.mark.parametrize("m,n,k", [(1, 256, 6144), (64, 6144, 8192), (64, 9856, 6144), (64, 24576, 6144),
                                   (256, 24576, 6144), (16, 6144, 12288), (1, 128, 128), (200, 1232, 6144)])
def test_the_plan_fills_one_wave_and_covers_k_once(m, n, k):
    """Every K step belongs to exactly one split and no split is empty; the grid fits in one wave of programs
    unless its output tiles alone exceed it (then K is not split); the token tile covers the batch (or MAX_BM)."""
    sms = 132
    bm, rows, split = wg.plan(m, n, k, sms)
    assert bm >= min(m, wg.MAX_BM) and bm in (16, 32, 64, 128) and rows in wg.ROW_CHOICES
    k_steps = k // wg.BLOCK_K
    steps = triton.cdiv(k_steps, split)
    assert 1 <= split <= k_steps
    assert (split - 1) * steps < k_steps <= split * steps
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, rows)
    assert tiles * split <= sms or split == 1
    if tiles * 2 <= sms and k_steps >= 2:
        assert split > 1


def test_the_plan_picks_the_measured_fastest_tiles_for_m3_projections():
    """At 64 rows on an H100 (132 multiprocessors): the (rows, split) that timed fastest for each projection."""
    shapes = {"qkv + index": (9856, 6144), "o_proj": (6144, 8192), "dense gate/up": (24576, 6144),
              "dense down": (6144, 12288)}
    fastest = {"qkv + index": (128, 1), "o_proj": (128, 2), "dense gate/up": (256, 1), "dense down": (128, 2)}
    assert {name: wg.plan(64, n, k, 132)[1:] for name, (n, k) in shapes.items()} == fastest


def test_the_ring_fits_hopper_shared_memory():
    for bm in (16, 32, 64, 128):
        for rows in wg.ROW_CHOICES:
            per_slot = rows * wg.BLOCK_K + rows * 4 + bm * wg.BLOCK_K * 2
            assert wg.stages_for(bm, rows) >= 3
            assert wg.stages_for(bm, rows) * per_slot <= HOPPER_SHARED_BYTES


def test_a_call_the_kernel_does_not_take_runs_the_triton_gemm(monkeypatch):
    """On the CPU `supported` is false: the switch's row limit changes nothing, bit for bit, and the Gluon entry
    point is never reached - neither by fp8_linear nor by the model's linear layer with the switch on."""
    from nanoserve.config import Optimizations
    from nanoserve.kernels.fp8_linear import fp8_linear
    from nanoserve.model.layers.linear import linear
    from nanoserve.model.mxfp8 import quantize_mxfp8

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(wg, "partial_sums", lambda *a, **k: pytest.fail("the Gluon kernel ran on the CPU"))
    gen = torch.Generator().manual_seed(0)
    q, s = quantize_mxfp8(torch.randn(96, 256, generator=gen) * 0.05)
    x = torch.randn(5, 256, generator=gen)
    assert not wg.supported(x.to(torch.bfloat16), q, s)
    plain = fp8_linear(x, q, s)
    assert torch.equal(fp8_linear(x, q, s, wgmma_max_rows=256), plain)
    on, off = Optimizations(), Optimizations(fp8_linear_wgmma=False)
    assert on.fp8_linear_wgmma
    assert torch.equal(linear(x, q, s, on), linear(x, q, s, off))
