"""Fused row-wise kernels around attention, in Triton (switches `fused_qk_norm_rope` and `fused_add_rmsnorm`).

`qk_norm_rope_insert` replaces the reference branch of `M3Attention._norm_rope_insert` with one launch per layer.
A program owns one token and walks the sections of its fused projection row [q | k | v | index_q | index_k]:

    q, k, index_q, index_k:  per-head Gemma RMSNorm (fp32 inside, times 1 + w), rounded to the activation dtype
                             (m3_spec.md 2.4 step 2), then NeoX partial RoPE in fp32 on the first rotary_dim dims
                             (the partner of dim i < half is i + half and vice versa), rounded again.
    v:                       copied as is.

q and index_q go to fresh [T, H, D] outputs; k and v to the paged KV cache, index_k to the index-key cache, at
the token's slot (slot -1 = padding: nothing is written). RoPE reads the caller's fp32 (cos, sin) tables
[T, rotary_dim / 2], so it is bit-for-bit the reference's rotation. The rotation needs each element's partner,
which lives in another lane; rather than shuffle registers, the program reloads the row at the partner offsets
(an L1 hit) and normalises that copy with the same statistic.

`fused_add_rmsnorm` is `reference.add_gemma_rmsnorm` in one pass per row: residual + x rounded to the activation
dtype (stored as the new residual), then Gemma RMSNorm of it in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.configs import tiles


@triton.jit
def _gemma_norm_rows(x, inv_rms, w_ptr, dims, dim_ok, ROUND_TO: tl.constexpr):
    """x * inv_rms * (1 + w[dims]) in fp32, rounded to ROUND_TO (the activation dtype) and widened back."""
    w = tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
    return (x * inv_rms[:, None] * (1.0 + w)[None, :]).to(ROUND_TO).to(tl.float32)


@triton.jit
def _norm_rope_heads(src_ptr, n_heads, w_ptr, cos_ptr, sin_ptr, dst_ptr, dst_head_stride, eps,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     NORM_ROPE: tl.constexpr):
    """Process n_heads consecutive heads of one token starting at src_ptr, writing head h at
    dst_ptr + h * dst_head_stride. NORM_ROPE: Gemma norm + partial RoPE; otherwise a plain copy."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    act_dtype = src_ptr.dtype.element_ty
    for h0 in range(0, n_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < n_heads)[:, None] & d_ok[None, :]
        x = tl.load(src_ptr + h[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM_ROPE:
            inv_rms = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
            y = _gemma_norm_rows(x, inv_rms, w_ptr, d, d_ok, act_dtype)
            rotated = d < 2 * HALF
            partner = tl.where(d < HALF, d + HALF, d - HALF)
            xp = tl.load(src_ptr + h[:, None] * HEAD_DIM + partner[None, :], mask=mask & rotated[None, :],
                         other=0.0).to(tl.float32)
            yp = _gemma_norm_rows(xp, inv_rms, w_ptr, partner, d_ok & rotated, act_dtype)
            freq = d % HALF
            cos = tl.load(cos_ptr + freq, mask=rotated, other=1.0)
            sin = tl.load(sin_ptr + freq, mask=rotated, other=0.0)
            # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin; dims >= rotary_dim pass through
            y = tl.where(rotated[None, :], y * cos[None, :] + tl.where(d < HALF, -yp, yp) * sin[None, :], y)
        else:
            y = x
        tl.store(dst_ptr + h[:, None] * dst_head_stride + d[None, :], y.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_insert_kernel(
        qkv_ptr, q_out_ptr, iq_out_ptr, kv_ptr, icache_ptr, slot_ptr, cos_ptr, sin_ptr,
        q_w_ptr, k_w_ptr, iq_w_ptr, ik_w_ptr,
        stride_qkv, stride_q_out, stride_iq_out, stride_cos, stride_sin,
        stride_kv_block, stride_kv_kind, stride_kv_tok, stride_kv_head, stride_ic_block, stride_ic_tok,
        num_heads, num_kv_heads, num_index_heads, eps,
        HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, SPARSE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * stride_qkv
    cos = cos_ptr + t * stride_cos
    sin = sin_ptr + t * stride_sin
    k_src = row + num_heads * HEAD_DIM
    v_src = k_src + num_kv_heads * HEAD_DIM
    _norm_rope_heads(row, num_heads, q_w_ptr, cos, sin, q_out_ptr + t * stride_q_out, HEAD_DIM, eps,
                     HEAD_DIM, BLOCK_D, HALF, BLOCK_H, True)
    if SPARSE:
        _norm_rope_heads(v_src + num_kv_heads * HEAD_DIM, num_index_heads, iq_w_ptr, cos, sin,
                         iq_out_ptr + t * stride_iq_out, INDEX_DIM, eps, INDEX_DIM, BLOCK_DI, HALF, BLOCK_H, True)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cache_k = kv_ptr + (slot // PAGE) * stride_kv_block + (slot % PAGE) * stride_kv_tok
        _norm_rope_heads(k_src, num_kv_heads, k_w_ptr, cos, sin, cache_k, stride_kv_head, eps,
                         HEAD_DIM, BLOCK_D, HALF, BLOCK_H, True)
        _norm_rope_heads(v_src, num_kv_heads, k_w_ptr, cos, sin, cache_k + stride_kv_kind, stride_kv_head, eps,
                         HEAD_DIM, BLOCK_D, HALF, BLOCK_H, False)
        if SPARSE:
            cache_ik = icache_ptr + (slot // PAGE) * stride_ic_block + (slot % PAGE) * stride_ic_tok
            _norm_rope_heads(v_src + num_kv_heads * HEAD_DIM + num_index_heads * INDEX_DIM, 1, ik_w_ptr, cos, sin,
                             cache_ik, INDEX_DIM, eps, INDEX_DIM, BLOCK_DI, HALF, BLOCK_H, True)


def qk_norm_rope_insert(qkv: torch.Tensor, split_sizes: list[int], head_dim: int, q_norm_w: torch.Tensor,
                        k_norm_w: torch.Tensor, index_q_norm_w: torch.Tensor | None,
                        index_k_norm_w: torch.Tensor | None, positions: torch.Tensor,
                        rope: tuple[torch.Tensor, torch.Tensor], eps: float, slot_mapping: torch.Tensor,
                        kv_cache: torch.Tensor, index_cache: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv [T, q | k | v (| index_q | index_k)] -> (q [T, Hq, D], index_q [T, G, Di] or None), writing K/V (and
    the index key) into the caches. Matches the reference branch of M3Attention._norm_rope_insert. `positions` is
    accepted for the call's symmetry; the rotation uses the (cos, sin) tables in `rope`."""
    del positions
    t = qkv.shape[0]
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    sparse = len(split_sizes) == 5
    num_heads, num_kv = split_sizes[0] // head_dim, split_sizes[1] // head_dim
    index_dim = split_sizes[4] if sparse else head_dim
    num_index = split_sizes[3] // index_dim if sparse else 0
    cos, sin = rope
    q = torch.empty(t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    index_q = torch.empty(t, num_index, index_dim, dtype=qkv.dtype, device=qkv.device) if sparse else None
    if t == 0:
        return q, index_q
    iq_out = index_q if sparse else q  # placeholders: never touched when not sparse
    icache = index_cache if sparse else kv_cache
    iq_w = index_q_norm_w if sparse else q_norm_w
    ik_w = index_k_norm_w if sparse else k_norm_w
    cfg = tiles("qk_norm_rope", qkv.device)
    _qk_norm_rope_insert_kernel[(t,)](
        qkv, q, iq_out, kv_cache, icache, slot_mapping, cos, sin, q_norm_w, k_norm_w, iq_w, ik_w,
        qkv.stride(0), q.stride(0), iq_out.stride(0), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        icache.stride(0), icache.stride(1),
        num_heads, num_kv, num_index, eps,
        HEAD_DIM=head_dim, INDEX_DIM=index_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DI=triton.next_power_of_2(index_dim), HALF=cos.shape[-1], BLOCK_H=cfg.block_m,
        PAGE=kv_cache.shape[2], SPARSE=sparse, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return q, index_q


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                        stride_res_out, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + cols, mask=ok, other=0.0).to(tl.float32)
    s = (x + r).to(res_out_ptr.dtype.element_ty)  # the residual stream is kept in the activation dtype
    tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=ok)
    s = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (s * inv_rms * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=ok)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemma_rmsnorm(x + residual), x + residual) for x, residual [..., H]; same as reference.add_gemma_rmsnorm."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = residual.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    dtype = torch.result_type(x, residual)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    new_res = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if x2.shape[0]:
        cfg = tiles("add_rmsnorm", x.device)
        _add_rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, w, out, new_res, x2.stride(0), r2.stride(0), out.stride(0), new_res.stride(0), shape[-1], eps,
            BLOCK=triton.next_power_of_2(shape[-1]), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(shape), new_res.view(shape)
