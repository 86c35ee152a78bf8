"""Fused row-wise kernels around attention, in Triton (switches `fused_qk_norm_rope`, `fused_add_rmsnorm` and
`fused_rmsnorm`).

`qk_norm_rope_insert` replaces the reference branch of `M3Attention._norm_rope_insert` with one launch per layer.
A program owns BLOCK_T tokens and one section of their fused projection rows [q | k | v | index_q | index_k]
(grid axis 1: q, k with v, index_q, index_k), which it walks BLOCK_R (token, head) rows at a time. One program
per section rather than one for all: at decode (one token) the sections' dependent loads then overlap instead of
running one after another.

    q, k, index_q, index_k:  per-head Gemma RMSNorm (fp32 inside, times 1 + w), rounded to the activation dtype
                             (as the released model), then NeoX partial RoPE in fp32 on the first rotary_dim dims
                             (the partner of dim i < half is i + half and vice versa), rounded again.
    v:                       copied as is.

q and index_q go to fresh [T, H, D] outputs; k and v to the paged KV cache, index_k to the index-key cache, at
the token's slot (slot -1 = padding: nothing is written). An fp8 pool (`kv_cache_dtype="fp8"`) takes each value
rounded to the activation dtype (what a 16-bit pool would hold), times the reciprocal of its scale (k_scale,
v_scale; 1 for index keys), saturated to +-448: `reference.to_cache`. RoPE reads the caller's fp32 (cos, sin) tables
[T, rotary_dim / 2], the reference's own tables (on a GPU, rsqrt and fused multiply-adds may still move the last
bit, so a 16-bit result can differ by one ulp now and then). The rotation needs each element's partner,
which lives in another lane; rather than shuffle registers, the program reloads each head vector at the partner
offsets (an L1 hit) and normalises that copy with the same statistic.

`fused_add_rmsnorm` is `reference.add_gemma_rmsnorm` in one pass over each row (block_m rows per program):
residual + x rounded to the activation dtype (stored as the new residual), then Gemma RMSNorm of it in fp32.
`fused_rmsnorm` is the same kernel without the residual: `reference.gemma_rmsnorm` (the first layer's input norm,
which has no residual stream yet), one launch where the reference takes about eight element-wise kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.configs import tiles
from nanoserve.kernels.reference import FP8_KV_DTYPE, FP8_KV_MAX

FP8_MAX = tl.constexpr(FP8_KV_MAX)


@triton.jit
def _head_rows(t0, r0, n_heads, n_tokens, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows r0 .. r0+BLOCK_R of a program's (token, head) grid: its BLOCK_T tokens from t0 times n_heads heads.
    Returns (token [R] int64, head [R], row in range)."""
    r = r0 + tl.arange(0, BLOCK_R)
    t = t0 + r // n_heads
    return t.to(tl.int64), r % n_heads, (r < BLOCK_T * n_heads) & (t < n_tokens)


@triton.jit
def _norm_rope_store(src, dst, ok, w_ptr, cos, sin, eps, inv_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     HALF: tl.constexpr, NORM_ROPE: tl.constexpr, FP8: tl.constexpr):
    """For rows whose head vectors start at src [R] (pointers): Gemma norm + partial RoPE (NORM_ROPE) or a plain
    copy, stored at dst [R]. cos / sin [R] point at each row's token's table row. FP8: dst is an fp8 pool, which
    takes the value rounded to the activation dtype, times inv_scale, saturated."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = ok[:, None] & d_ok[None, :]
    x = tl.load(src[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM_ROPE:
        act_dtype = src.dtype.element_ty
        inv_rms = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        y = (x * inv_rms[:, None] * (1.0 + w)[None, :]).to(act_dtype).to(tl.float32)  # rounded before RoPE
        rotated = d < 2 * HALF
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        rot_mask = mask & rotated[None, :]
        xp = tl.load(src[:, None] + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=d_ok & rotated, other=0.0).to(tl.float32)
        yp = (xp * inv_rms[:, None] * (1.0 + wp)[None, :]).to(act_dtype).to(tl.float32)
        freq = (d % HALF)[None, :]
        c = tl.load(cos[:, None] + freq, mask=rot_mask, other=1.0)
        sn = tl.load(sin[:, None] + freq, mask=rot_mask, other=0.0)
        # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin; dims >= rotary_dim pass through
        y = tl.where(rotated[None, :], y * c + tl.where((d < HALF)[None, :], -yp, yp) * sn, y)
    else:
        y = x
    if FP8:
        y = y.to(src.dtype.element_ty).to(tl.float32) * inv_scale
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    tl.store(dst[:, None] + d[None, :], y.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_tokens"])
def _qk_norm_rope_insert_kernel(
        qkv_ptr, q_out_ptr, iq_out_ptr, kv_ptr, icache_ptr, slot_ptr, cos_ptr, sin_ptr,
        q_w_ptr, k_w_ptr, iq_w_ptr, ik_w_ptr,
        stride_qkv, stride_q_out, stride_iq_out, stride_cos, stride_sin,
        stride_kv_block, stride_kv_kind, stride_kv_tok, stride_kv_head, stride_ic_block, stride_ic_tok,
        n_tokens, num_heads, num_kv_heads, num_index_heads, eps, k_inv_scale, v_inv_scale,
        HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DI: tl.constexpr,
        HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, PAGE: tl.constexpr,
        SPARSE: tl.constexpr, KV_FP8: tl.constexpr, INDEX_FP8: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK_T
    section = tl.program_id(1)  # 0: q, 1: k and v, 2: index_q, 3: index_k (the last two only when SPARSE)
    k_off = num_heads * HEAD_DIM  # offsets of the sections in a qkv row
    v_off = k_off + num_kv_heads * HEAD_DIM
    iq_off = v_off + num_kv_heads * HEAD_DIM
    ik_off = iq_off + num_index_heads * INDEX_DIM
    if section == 0:
        for r0 in range(0, BLOCK_T * num_heads, BLOCK_R):
            t, h, ok = _head_rows(t0, r0, num_heads, n_tokens, BLOCK_T, BLOCK_R)
            _norm_rope_store(qkv_ptr + t * stride_qkv + h * HEAD_DIM, q_out_ptr + t * stride_q_out + h * HEAD_DIM,
                             ok, q_w_ptr, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, eps, 1.0,
                             HEAD_DIM, BLOCK_D, HALF, True, False)
    elif section == 1:
        for r0 in range(0, BLOCK_T * num_kv_heads, BLOCK_R):
            t, h, ok = _head_rows(t0, r0, num_kv_heads, n_tokens, BLOCK_T, BLOCK_R)
            slot = tl.load(slot_ptr + t, mask=ok, other=-1)
            ok = ok & (slot >= 0)  # padding tokens write nothing
            k_dst = kv_ptr + (slot // PAGE) * stride_kv_block + (slot % PAGE) * stride_kv_tok + h * stride_kv_head
            src = qkv_ptr + t * stride_qkv + h * HEAD_DIM
            _norm_rope_store(src + k_off, k_dst, ok, k_w_ptr, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin,
                             eps, k_inv_scale, HEAD_DIM, BLOCK_D, HALF, True, KV_FP8)
            _norm_rope_store(src + v_off, k_dst + stride_kv_kind, ok, k_w_ptr, cos_ptr, sin_ptr, eps, v_inv_scale,
                             HEAD_DIM, BLOCK_D, HALF, False, KV_FP8)
    elif section == 2:
        if SPARSE:
            for r0 in range(0, BLOCK_T * num_index_heads, BLOCK_R):
                t, h, ok = _head_rows(t0, r0, num_index_heads, n_tokens, BLOCK_T, BLOCK_R)
                _norm_rope_store(qkv_ptr + t * stride_qkv + iq_off + h * INDEX_DIM,
                                 iq_out_ptr + t * stride_iq_out + h * INDEX_DIM, ok,
                                 iq_w_ptr, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, eps, 1.0,
                                 INDEX_DIM, BLOCK_DI, HALF, True, False)
    else:
        if SPARSE:
            for r0 in range(0, BLOCK_T, BLOCK_R):
                t, h, ok = _head_rows(t0, r0, 1, n_tokens, BLOCK_T, BLOCK_R)
                slot = tl.load(slot_ptr + t, mask=ok, other=-1)
                ok = ok & (slot >= 0)
                _norm_rope_store(qkv_ptr + t * stride_qkv + ik_off,
                                 icache_ptr + (slot // PAGE) * stride_ic_block + (slot % PAGE) * stride_ic_tok, ok,
                                 ik_w_ptr, cos_ptr + t * stride_cos, sin_ptr + t * stride_sin, eps, 1.0,
                                 INDEX_DIM, BLOCK_DI, HALF, True, INDEX_FP8)


def qk_norm_rope_insert(qkv: torch.Tensor, split_sizes: list[int], head_dim: int, q_norm_w: torch.Tensor,
                        k_norm_w: torch.Tensor, index_q_norm_w: torch.Tensor | None,
                        index_k_norm_w: torch.Tensor | None, positions: torch.Tensor,
                        rope: tuple[torch.Tensor, torch.Tensor], eps: float, slot_mapping: torch.Tensor,
                        kv_cache: torch.Tensor, index_cache: torch.Tensor | None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """qkv [T, q | k | v (| index_q | index_k)] -> (q [T, Hq, D], index_q [T, G, Di] or None), writing K/V (and
    the index key) into the caches (an fp8 pool's K / k_scale and V / v_scale). Matches the reference branch of
    M3Attention._norm_rope_insert. `positions` is accepted for the call's symmetry; the rotation uses the
    (cos, sin) tables in `rope`."""
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
    _qk_norm_rope_insert_kernel[(triton.cdiv(t, cfg.block_m), 4 if sparse else 2)](
        qkv, q, iq_out, kv_cache, icache, slot_mapping, cos, sin, q_norm_w, k_norm_w, iq_w, ik_w,
        qkv.stride(0), q.stride(0), iq_out.stride(0), cos.stride(0), sin.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        icache.stride(0), icache.stride(1),
        t, num_heads, num_kv, num_index, eps, 1.0 / k_scale, 1.0 / v_scale,
        HEAD_DIM=head_dim, INDEX_DIM=index_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DI=triton.next_power_of_2(index_dim), HALF=cos.shape[-1], BLOCK_T=cfg.block_m, BLOCK_R=cfg.block_n,
        PAGE=kv_cache.shape[2], SPARSE=sparse, KV_FP8=kv_cache.dtype == FP8_KV_DTYPE,
        INDEX_FP8=icache.dtype == FP8_KV_DTYPE, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return q, index_q


@triton.jit(do_not_specialize=["n_rows"])
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_res, stride_out,
                        stride_res_out, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_RESIDUAL: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x.to(tl.float32) + r).to(res_out_ptr.dtype.element_ty)  # the residual stream stays in the act dtype
        tl.store(res_out_ptr + rows * stride_res_out + cols[None, :], s, mask=mask)
        s = s.to(tl.float32)
    else:
        s = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s * s, 1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = s * inv_rms[:, None] * (1.0 + w)[None, :]
    tl.store(out_ptr + rows * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rmsnorm(x2: torch.Tensor, r2: torch.Tensor | None, w: torch.Tensor, out: torch.Tensor,
                    new_res: torch.Tensor | None, eps: float) -> None:
    n_rows, n_cols = x2.shape
    if not n_rows:
        return
    cfg = tiles("add_rmsnorm", x2.device)
    has_res = r2 is not None
    r2 = r2 if has_res else x2  # placeholders: never touched without a residual
    new_res = new_res if has_res else out
    _add_rmsnorm_kernel[(triton.cdiv(n_rows, cfg.block_m),)](
        x2, r2, w, out, new_res, x2.stride(0), r2.stride(0), out.stride(0), new_res.stride(0), n_rows,
        n_cols, eps, ROWS=cfg.block_m, BLOCK=triton.next_power_of_2(n_cols), HAS_RESIDUAL=has_res,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(gemma_rmsnorm(x + residual), x + residual) for x, residual [..., H]; same as reference.add_gemma_rmsnorm."""
    shape = x.shape
    x2, r2 = _rows(x), _rows(residual)
    dtype = torch.result_type(x, residual)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    new_res = torch.empty(x2.shape, dtype=dtype, device=x.device)
    _launch_rmsnorm(x2, r2, w, out, new_res, eps)
    return out.view(shape), new_res.view(shape)


def fused_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """gemma_rmsnorm(x) for x [..., H] in one launch (switch `fused_rmsnorm`); same as reference.gemma_rmsnorm."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch_rmsnorm(x2, None, w, out, None, eps)
    return out.view(x.shape)
