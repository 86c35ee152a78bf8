"""The vision tower's Triton kernels (kernels/vision_attention.py, kernels/layer_norm.py) against their references,
on fresh random inputs, on the `device` fixture (the GPU where there is one, else Triton's interpreter on the CPU;
bf16 arithmetic is not checked there: the interpreter computes it wrongly). Then the whole tower with the switches
on against the reference path.

Tolerances (rtol, atol) stand beside the dtype in TOLERANCE.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import Optimizations
from nanoserve.kernels import reference
from nanoserve.kernels.layer_norm import add_layer_norm, layer_norm
from nanoserve.kernels.vision_attention import head_dim_parts, rope_split, varlen_attention
from nanoserve.model.vision import grid
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.model import M3VisionModel

TOLERANCE = {  # (rtol, atol) next to the dtype
    torch.float32: (1e-5, 1e-5),  # ieee dots: only summation order differs
    torch.float16: (2e-3, 2e-3),  # probabilities rounded to fp16 before the P @ V product, as flash attention does
}
DTYPES = [torch.float32, torch.float16]
SEGMENTS = [(1, 2, 4), (1, 6, 6), (2, 2, 2), (1, 2, 2), (1, 8, 10)]
"""(t, h, w) of the test batch's segments: lengths 8, 36, 8, 4, 80 - shorter than a tile, a tile and a bit, several
tiles with a ragged end."""


def rope_tables(segs, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    band = 2 * ((head_dim // 3) // 2)
    cos, sin = grid.rope_cos_sin(grid.positions(segs, 2), grid.rope_inv_freq(band, 10000.0))
    return cos.to(device), sin.to(device)


def test_head_dim_parts():
    assert head_dim_parts(80) == (64, 16)  # M3: two exact dots instead of one padded to 128
    assert head_dim_parts(64) == (64, 0)
    assert head_dim_parts(24) == (16, 16)  # the remainder (8) padded to tl.dot's minimum


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [80, 24])
def test_rope_split_matches_reference(head_dim, dtype, device):
    heads, n = 3, sum(t * h * w for t, h, w in SEGMENTS)
    gen = torch.Generator().manual_seed(0)
    qkv = (2 * torch.randn(n, 3 * heads * head_dim, generator=gen)).to(device, dtype)
    cos, sin = rope_tables(SEGMENTS, head_dim, device)
    got = rope_split(qkv, cos, sin, heads, head_dim)
    q, k, v = (t.view(n, heads, head_dim) for t in qkv.chunk(3, dim=-1))
    want = [reference.apply_partial_rope(q, cos, sin), reference.apply_partial_rope(k, cos, sin), v]
    rtol, atol = TOLERANCE[dtype]
    for i in range(3):
        torch.testing.assert_close(got[i].transpose(0, 1), want[i], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", [80, 16, 24])
def test_varlen_attention_matches_reference(head_dim, dtype, device):
    heads = 2
    lens = [t * h * w for t, h, w in SEGMENTS]
    n = sum(lens)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, heads, head_dim, generator=gen).to(device, dtype) for _ in range(3))
    cu = grid.cu_seqlens(SEGMENTS, device)
    got = varlen_attention(torch.stack([q, k, v]).transpose(1, 2).contiguous(), cu, max(lens), head_dim ** -0.5)
    want = reference.varlen_attention(q, k, v, cu, head_dim ** -0.5).reshape(n, -1)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    # no attention across segments: changing the last segment's keys leaves the others' rows alone
    k2 = k.clone()
    k2[n - lens[-1]:] += 1.0
    again = varlen_attention(torch.stack([q, k2, v]).transpose(1, 2).contiguous(), cu, max(lens), head_dim ** -0.5)
    assert torch.equal(again[: n - lens[-1]], got[: n - lens[-1]])
    assert not torch.equal(again[n - lens[-1]:], got[n - lens[-1]:])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("width", [1280, 40])
def test_layer_norm_matches_reference(width, dtype, device):
    gen = torch.Generator().manual_seed(2)
    x, res = ((3 * torch.randn(37, width, generator=gen) + 1).to(device, dtype) for _ in range(2))
    w, b = (torch.randn(width, generator=gen).to(device) for _ in range(2))
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(layer_norm(x, w, b, 1e-5), reference.layer_norm(x, w, b, 1e-5), rtol=rtol, atol=atol)
    got, got_res = add_layer_norm(x, res, w, b, 1e-5)
    want, want_res = reference.add_layer_norm(x, res, w, b, 1e-5)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_tower_with_kernels_matches_reference_path(device):
    """The switches on (Triton) against every vision switch off, fp32, one batch of two images and a video."""
    cfg = VisionConfig(hidden_size=80, intermediate_size=96, num_hidden_layers=2, num_attention_heads=1,
                       projector_hidden_size=48, text_hidden_size=32)
    fast = M3VisionModel(cfg, Optimizations(), torch.float32, device)
    slow = M3VisionModel(cfg, Optimizations().replace(triton_vision_attention=False, fused_layer_norm=False),
                         torch.float32, device)
    gen = torch.Generator().manual_seed(3)
    for p_fast, p_slow in zip(fast.parameters(), slow.parameters()):
        p_fast.copy_((0.1 * torch.randn(p_fast.shape, generator=gen)).to(device))
        p_slow.copy_(p_fast)
    grids = [(1, 4, 6), (5, 2, 2), (1, 2, 2)]
    pix = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, generator=gen).to(device)
    torch.testing.assert_close(fast(pix, grids), slow(pix, grids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score_bytes", [1 << 30, 2 * 36 * 36 * 4 * 2, 2 * 80 * 4 * 10],
                         ids=["grouped", "pairs", "alone-in-chunks"])
def test_reference_varlen_attention_is_softmax_attention_per_segment(score_bytes, monkeypatch):
    """The reference (segments of one length together, as many as SCORE_BYTES holds; a longer one alone in query
    chunks) against PyTorch's SDPA run segment by segment, fp32 on the CPU within 1e-5, outputs and the gradients
    training takes through it. The batch repeats lengths (8 twice, 36 twice) and has an empty segment."""
    monkeypatch.setattr(reference, "SCORE_BYTES", score_bytes)
    heads, head_dim = 2, 16
    lens = [8, 36, 0, 8, 4, 36, 80]
    n = sum(lens)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, heads, head_dim, generator=gen).requires_grad_(True) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    got = reference.varlen_attention(q, k, v, cu, head_dim ** -0.5)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=head_dim ** -0.5).transpose(0, 1)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = torch.randn(n, heads, head_dim, generator=gen)
    grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
