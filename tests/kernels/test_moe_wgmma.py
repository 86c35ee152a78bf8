"""Switch moe_wgmma on the CPU: the Gluon MXFP8 MoE kernels (kernels/moe_wgmma.py) compile for Hopper ahead of
time with the installed Triton and fit an H100's shared memory, and a call they do not take (here: a CPU tensor)
runs the Triton kernels unchanged. Their results are checked on the GPU (tests/model/test_gpu_mxfp8.py, marked gpu)."""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import moe_wgmma
from tests.helpers.gluon_compile import HOPPER_SHARED_BYTES, compile_for_hopper


@pytest.mark.skipif(not moe_wgmma.HAVE_GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("kernel", ["up", "down"])
def test_kernels_compile_for_hopper_and_fit_its_shared_memory(kernel):
    types = dict(x_ptr="*bf16", act_ptr="*bf16", copies_ptr="*bf16", sorted_ids_ptr="*i32",
                 block_expert_ptr="*i32", topk_weights_ptr="*fp32", s13_ptr="*i32", s2_ptr="*i32", alpha="fp32",
                 limit="fp32", routed_scale="fp32", w13_desc=["fp8e4nv", [64, moe_wgmma.BLOCK_K]],
                 w2_desc=["fp8e4nv", [moe_wgmma.BLOCK_N, moe_wgmma.BLOCK_K]],
                 act_desc=["bf16", [moe_wgmma.BLOCK_M, 64]])
    common = dict(BM=moe_wgmma.BLOCK_M, GROUP=moe_wgmma.GROUP_M, MMA_REGS=moe_wgmma.MMA_REGS,
                  LOADER_REGS=moe_wgmma.LOADER_REGS, num_warps=4)
    if kernel == "up":  # M3: top-8 plus the folded shared expert
        name, constexprs = "_up_swiglu_kernel", dict(KP=9, STAGES=moe_wgmma.UP_STAGES, **common)
    else:
        name, constexprs = "_down_weighted_kernel", dict(TOPK=8, FOLD=True, STAGES=moe_wgmma.DOWN_STAGES, **common)
    compiled = compile_for_hopper("nanoserve.kernels.moe_wgmma", name, constexprs, types,
                                  aligned=("stride_xt", "stride_ar", "stride_ct", "hidden", "inter"))
    assert 0 < compiled["shared"] <= HOPPER_SHARED_BYTES
    # the MMA warps' wgmmas take their A operand from registers (the dequantised weights)
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in compiled["ptx"]


def test_a_call_the_kernels_do_not_take_runs_the_triton_kernels(monkeypatch):
    """On the CPU `supported` is false: with the switch's threshold at one token the result equals the call
    without it bit for bit, and the Gluon entry point is never reached."""
    from nanoserve.kernels import reference
    from nanoserve.kernels.moe import fused_moe
    from nanoserve.model.mxfp8 import quantize_mxfp8

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(moe_wgmma, "gemms", lambda *a, **k: pytest.fail("the Gluon kernels ran on the CPU"))
    gen = torch.Generator().manual_seed(0)
    slots, h, inter, tokens, k = 5, 128, 128, 6, 2
    q13, s13 = zip(*(quantize_mxfp8(torch.randn(2 * inter, h, generator=gen) * 0.05) for _ in range(slots)))
    q2, s2 = zip(*(quantize_mxfp8(torch.randn(h, inter, generator=gen) * 0.05) for _ in range(slots)))
    q13, s13, q2, s2 = (torch.stack(t) for t in (q13, s13, q2, s2))
    x = torch.randn(tokens, h, generator=gen)
    weights, ids = reference.route(torch.randn(tokens, slots - 1, generator=gen), torch.zeros(slots - 1), k)
    args = dict(alpha=1.702, limit=7.0, routed_scaling_factor=2.0, fold_shared=True, w13_scale=s13, w2_scale=s2)
    assert not moe_wgmma.supported(x, q13, q2, s13, s2)
    plain = fused_moe(x, q13, q2, weights, ids, **args)
    switched = fused_moe(x, q13, q2, weights, ids, wgmma_min_tokens=1, **args)
    assert torch.equal(plain, switched)


def test_a_triton_older_than_the_gluon_api_keeps_the_triton_kernels(monkeypatch):
    """Triton releases before 3.6 spell Gluon's warp_specialize differently: there the kernels are not offered (no
    compile error in a forward) and `supported` is false."""
    import importlib

    import triton

    monkeypatch.setattr(triton, "__version__", "3.5.1")
    try:
        old = importlib.reload(moe_wgmma)
        assert not old.HAVE_GLUON
        x = torch.empty(256, 6144, dtype=torch.bfloat16)
        assert not old.supported(x, x, x, x, x)
    finally:
        monkeypatch.undo()
        importlib.reload(moe_wgmma)
    assert moe_wgmma.HAVE_GLUON == (tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 6))
