"""Fused QK-norm + RoPE + cache insert and fused residual-add + RMSNorm (kernels/norm_rope.py) against the
reference path, on the `device` fixture (the GPU where there is one, else the Triton interpreter on the CPU).

qk_norm_rope_insert is checked against the reference branch of M3Attention._norm_rope_insert, step for step:
per-head Gemma norm rounded to the activation dtype, partial NeoX RoPE in fp32, K/V and index-key cache writes,
with padding tokens (slot -1) that must write nothing. Caches start as NaN, so a slot written by mistake or left
unwritten shows up.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import reference
from nanoserve.kernels.norm_rope import fused_add_rmsnorm, qk_norm_rope_insert
from tests.kernels.test_kernel_attention import poisoned_outputs

EPS = 1e-6
TOLERANCE = {  # (rtol, atol) next to the dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),  # a rounding flip of the normed value before RoPE is one fp16 ulp
}

SHAPES = {
    # name: (q heads, kv heads, head_dim, index heads, index_dim, rotary_dim)
    "m3_tiny": (8, 4, 32, 4, 32, 16),
    "gqa_4_wider_heads": (8, 2, 64, 2, 32, 32),
    "one_kv_head_full_rotary": (4, 1, 32, 1, 32, 32),
}


def reference_norm_rope_insert(qkv, sizes, head_dim, weights, cos, sin, slots, kv, index_cache, sparse):
    """The reference branch of M3Attention._norm_rope_insert, with the layer's state passed in."""
    t = qkv.shape[0]
    pieces = torch.split(qkv, sizes, dim=-1)
    q, k = reference.qk_norm_rope(pieces[0].reshape(t, -1, head_dim), pieces[1].reshape(t, -1, head_dim),
                                  weights[0], weights[1], cos, sin, EPS)
    reference.write_kv(kv, k, pieces[2].reshape(t, -1, head_dim), slots)
    if not sparse:
        return q, None
    di = sizes[4]
    index_q, index_k = reference.qk_norm_rope(pieces[3].reshape(t, -1, di), pieces[4].reshape(t, 1, di),
                                              weights[2], weights[3], cos, sin, EPS)
    reference.write_index_keys(index_cache, index_k[:, 0], slots)
    return q, index_q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense_layer", "msa_layer"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_qk_norm_rope_insert_matches_reference(shape, sparse, dtype, device):
    hq, hkv, d, g, di, rotary = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    tokens, block_size, num_blocks = 21, 16, 4
    sizes = [hq * d, hkv * d, hkv * d] + ([g * di, di] if sparse else [])
    qkv = (3 * torch.randn(tokens, sum(sizes), generator=gen)).to(device, dtype)
    weights = [(0.3 * torch.randn(d if i < 2 else di, generator=gen)).to(device)  # fp32, as the layer keeps
               for i in range(4)]
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    cos, sin = reference.rope_cos_sin(positions, reference.rope_inv_freq(rotary, 5e6, device))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(device)
    slots[[2, 11, 20]] = -1  # padding tokens
    kv = torch.full((num_blocks, 2, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    index_cache = (torch.full((num_blocks, block_size, di), float("nan"), dtype=dtype, device=device) if sparse
                   else None)
    kv_ref = kv.clone()
    index_ref = index_cache.clone() if sparse else None

    with poisoned_outputs():
        q, index_q = qk_norm_rope_insert(qkv, sizes, d, weights[0], weights[1], weights[2] if sparse else None,
                                         weights[3] if sparse else None, positions, (cos, sin), EPS, slots, kv,
                                         index_cache)
    q_ref, index_q_ref = reference_norm_rope_insert(qkv, sizes, d, weights, cos, sin, slots, kv_ref, index_ref,
                                                    sparse)
    rtol, atol = TOLERANCE[dtype]
    assert not q.isnan().any()
    torch.testing.assert_close(q, q_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(kv, kv_ref, rtol=rtol, atol=atol, equal_nan=True)  # NaN = slot never written
    if sparse:
        assert not index_q.isnan().any()
        torch.testing.assert_close(index_q, index_q_ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(index_cache, index_ref, rtol=rtol, atol=atol, equal_nan=True)
    else:
        assert index_q is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(7, 128), (1, 96), (2, 3, 64), (37, 48)])
def test_fused_add_rmsnorm_matches_reference(shape, dtype, device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(device, dtype)
    residual = (4 * torch.randn(shape, generator=gen)).to(device, dtype)
    weight = (0.2 * torch.randn(shape[-1], generator=gen)).to(device)
    with poisoned_outputs():
        normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS)
    normed_ref, residual_ref = reference.add_gemma_rmsnorm(x, residual, weight, EPS)
    assert normed.dtype == normed_ref.dtype and normed.shape == normed_ref.shape
    torch.testing.assert_close(new_residual, residual_ref, rtol=0, atol=0)  # the add is rounded the same way
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(normed, normed_ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("real, padding", [(5, 3), (1, 7), (8, 0)])
def test_write_kv_padded_stores_what_write_kv_stores(real, padding):
    """reference.write_kv_padded (no host synchronisation: graph-safe) against write_kv on fresh random K/V and
    distinct random slots, padding rows (slot -1) after the real ones: the same pool, exactly (fp32)."""
    gen = torch.Generator().manual_seed(real * 10 + padding)
    blocks, block_size, heads, dim = 6, 4, 2, 8
    t = real + padding
    k, v = (torch.randn(t, heads, dim, generator=gen) for _ in range(2))
    slots = torch.cat([torch.randperm(blocks * block_size, generator=gen)[:real], torch.full((padding,), -1)])
    want = torch.randn(blocks, 2, block_size, heads, dim, generator=gen)
    got = want.clone()
    reference.write_kv(want, k, v, slots)
    reference.write_kv_padded(got, k, v, slots)
    assert torch.equal(got, want)
