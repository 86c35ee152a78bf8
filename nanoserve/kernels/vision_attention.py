"""The vision tower's attention in Triton: partial 3-D RoPE, then bidirectional attention within each segment (an
image, or up to 4 temporal patches of a video) of a flat varlen batch, one launch for the whole batch (switch
`triton_vision_attention`; reference: `reference.apply_partial_rope` on q and k, then `reference.varlen_attention`).

Two kernels:

1. `_rope_split_kernel` reads the fused projection rows [N, q | k | v] (the qkv GEMM's output, bias added) and
   writes q, k and v head-major, [3, H, N, D], rotating the first 2 x half dims of q and k (NeoX rotate-half:
   the partner of dim i < half is i + half and vice versa; the angles come from the caller's fp32 cos / sin
   tables [N, half]). The rotation is computed in fp32 and rounded once, as the reference does. Rotating here,
   once per token, rather than as the attention loads each K tile (once per query tile that reads it) keeps the
   attention's inner loop to its two products: the cos / sin rows of a key cost twice the key itself.

2. `_varlen_attention_kernel`: one program per (tile of BLOCK_M queries, segment, head); programs past their
   segment's length return at once. The program streams the segment's keys in tiles of BLOCK_N with an online
   softmax (scores in log2 units, exp2) and writes its rows token-major, [N, H x D], ready for the out
   projection. Keys past the segment's end are masked with a large finite negative score, so no row ever
   computes (-inf) - (-inf).

Head dims that are not a power of two (M3's 80) are split into two power-of-two parts, 64 + 16, each its own
tl.dot: padding 80 to 128 would waste a third of every product. A part narrower than 16 is padded to 16 (tl.dot's
minimum), masked. Every tl.dot passes input_precision="ieee": fp32 operands multiply exactly (no TF32), so the
fp32 tests match the reference to ~1e-6, while 16-bit operands still run on the tensor / matrix cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.configs import Tiles, backend

LOG2E = 1.4426950408889634
MASKED_SCORE = tl.constexpr(-1.0e30)

TILES = {
    # backend -> attention tiles: block_m queries x block_n keys per step, warps, pipeline stages.
    # "cuda": 128 x 64 with 8 warps, the largest tile that compiles for sm_90 without spilling (Triton 3.9: 232
    # registers; with 4 warps it spills 184 bytes per thread); not yet timed on a card - the throughput test
    # (tests/model/test_vision_throughput.py) times the alternatives. "hip": the dense prefill's rule tile
    # (kernels/configs.py rules 1-5; compiles for gfx942 without spilling).
    "cuda": Tiles(128, 64, 8, 3),
    "hip": Tiles(128, 32, 4, 2),
    "interpret": Tiles(32, 32, 1, 1),
}
ROPE_ROWS = {"cuda": (32, 8), "hip": (32, 8), "interpret": (64, 1)}
"""backend -> ((token, head) rows per program, warps) of the rotation kernel (32 rows of 128 lanes over 4 warps
spill on sm_90; over 8 they take 146 registers)."""


def head_dim_parts(head_dim: int) -> tuple[int, int]:
    """(a, b): the head dim as a power of two a plus a padded remainder b (a power of two >= 16, or 0)."""
    a = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - a
    return a, (0 if rest == 0 else max(16, triton.next_power_of_2(rest)))


@triton.jit(do_not_specialize=["n_tokens"])
def _rope_split_kernel(qkv_ptr, cos_ptr, sin_ptr, out_ptr, n_tokens, num_heads, stride_qkv, stride_cos, stride_sin,
                       HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    section = tl.program_id(1)  # 0: q, 1: k, 2: v
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    t = (r // num_heads).to(tl.int64)
    h = r % num_heads
    ok = t < n_tokens
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    mask = ok[:, None] & d_ok[None, :]
    src = qkv_ptr + t * stride_qkv + (section * num_heads + h) * HEAD_DIM
    x = tl.load(src[:, None] + d[None, :], mask=mask, other=0.0)
    if section < 2:
        xf = x.to(tl.float32)
        rotated = d < 2 * HALF
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        rot_mask = mask & rotated[None, :]
        xp = tl.load(src[:, None] + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
        freq = (d % HALF)[None, :]
        c = tl.load(cos_ptr + t[:, None] * stride_cos + freq, mask=rot_mask, other=1.0)
        s = tl.load(sin_ptr + t[:, None] * stride_sin + freq, mask=rot_mask, other=0.0)
        # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin; dims >= 2 x HALF pass through
        y = tl.where(rotated[None, :], xf * c + tl.where((d < HALF)[None, :], -xp, xp) * s, xf)
        x = y.to(out_ptr.dtype.element_ty)
    dst = out_ptr + ((section * num_heads + h).to(tl.int64) * n_tokens + t) * HEAD_DIM
    tl.store(dst[:, None] + d[None, :], x, mask=mask)


@triton.jit
def _load_rows(base, rows, row_ok, d0, n_dims, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr):
    """[len(rows), WIDTH] of a head-major [tokens, HEAD_DIM] matrix: dims d0 .. d0 + WIDTH (masked to n_dims)."""
    d = tl.arange(0, WIDTH)
    return tl.load(base + rows[:, None] * HEAD_DIM + d0 + d[None, :],
                   mask=row_ok[:, None] & (d < n_dims)[None, :], other=0.0)


@triton.jit
def _load_cols(base, rows, row_ok, d0, n_dims, HEAD_DIM: tl.constexpr, WIDTH: tl.constexpr):
    """The transpose of `_load_rows`: [WIDTH, len(rows)], for the K operand of q @ k^T."""
    d = tl.arange(0, WIDTH)
    return tl.load(base + rows[None, :] * HEAD_DIM + d0 + d[:, None],
                   mask=row_ok[None, :] & (d < n_dims)[:, None], other=0.0)


@triton.jit
def _varlen_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, n_tokens, num_heads, stride_out, qk_scale,
                             HEAD_DIM: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, ACC_B: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    seg = tl.program_id(1)
    h = tl.program_id(2)
    start = tl.load(cu_ptr + seg)
    seg_len = tl.load(cu_ptr + seg + 1) - start
    if m0 >= seg_len:
        return
    head = h.to(tl.int64) * n_tokens * HEAD_DIM + start.to(tl.int64) * HEAD_DIM  # this head, this segment
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < seg_len
    q_a = _load_rows(q_ptr + head, rows, row_ok, 0, DA, HEAD_DIM, DA)
    if DB > 0:
        q_b = _load_rows(q_ptr + head, rows, row_ok, DA, HEAD_DIM - DA, HEAD_DIM, DB)
    m_i = tl.full([BLOCK_M], MASKED_SCORE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_M, ACC_B], tl.float32)  # ACC_B = DB, or a dummy 16 when there is no second part
    for n0 in range(0, seg_len, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < seg_len
        s = tl.dot(q_a, _load_cols(k_ptr + head, keys, key_ok, 0, DA, HEAD_DIM, DA), input_precision="ieee")
        if DB > 0:
            s += tl.dot(q_b, _load_cols(k_ptr + head, keys, key_ok, DA, HEAD_DIM - DA, HEAD_DIM, DB),
                        input_precision="ieee")
        s = tl.where(key_ok[None, :], s * qk_scale, MASKED_SCORE)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(v_ptr.dtype.element_ty)
        acc_a = acc_a * alpha[:, None] + tl.dot(p, _load_rows(v_ptr + head, keys, key_ok, 0, DA, HEAD_DIM, DA),
                                                input_precision="ieee")
        if DB > 0:
            acc_b = acc_b * alpha[:, None] + tl.dot(
                p, _load_rows(v_ptr + head, keys, key_ok, DA, HEAD_DIM - DA, HEAD_DIM, DB), input_precision="ieee")
    inv_l = 1.0 / l_i
    tokens = (start + rows).to(tl.int64)
    dst = out_ptr + tokens[:, None] * stride_out + h * HEAD_DIM
    da = tl.arange(0, DA)
    tl.store(dst + da[None, :], (acc_a * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if DB > 0:
        db = tl.arange(0, DB)
        tl.store(dst + DA + db[None, :], (acc_b * inv_l[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (db < HEAD_DIM - DA)[None, :])


def rope_split(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
               head_dim: int) -> torch.Tensor:
    """qkv [N, 3 x H x D] -> [3, H, N, D]: q and k with partial RoPE (cos / sin [N, half] fp32), v copied."""
    n = qkv.shape[0]
    out = torch.empty(3, num_heads, n, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return out
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    rows, warps = ROPE_ROWS[backend(qkv.device)]
    grid = (triton.cdiv(n * num_heads, rows), 3)
    _rope_split_kernel[grid](qkv, cos, sin, out, n, num_heads, qkv.stride(0), cos.stride(0), sin.stride(0),
                             HEAD_DIM=head_dim, HALF=cos.shape[-1], BLOCK_R=rows,
                             BLOCK_D=triton.next_power_of_2(head_dim), num_warps=warps)
    return out


def varlen_attention(qkv_heads: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                     tiles: Tiles | None = None) -> torch.Tensor:
    """Bidirectional attention within segments: qkv_heads [3, H, N, D] (from `rope_split`), cu_seqlens
    [segments + 1] int32 on the device, max_seqlen its longest segment -> [N, H x D]."""
    _, num_heads, n, head_dim = qkv_heads.shape
    out = torch.empty(n, num_heads * head_dim, dtype=qkv_heads.dtype, device=qkv_heads.device)
    num_segments = cu_seqlens.shape[0] - 1
    if n == 0 or num_segments == 0:
        return out
    t = tiles or TILES[backend(qkv_heads.device)]
    da, db = head_dim_parts(head_dim)
    grid = (triton.cdiv(max_seqlen, t.block_m), num_segments, num_heads)
    _varlen_attention_kernel[grid](qkv_heads[0], qkv_heads[1], qkv_heads[2], out, cu_seqlens, n, num_heads,
                                   out.stride(0), scale * LOG2E, HEAD_DIM=head_dim, DA=da, DB=db, ACC_B=db or 16,
                                   BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
                                   num_stages=t.num_stages)
    return out


def vision_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, num_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """The tower's attention on the fused projection qkv [N, 3 x H x D]: RoPE on q and k, then attention within
    each segment -> [N, H x D]."""
    return varlen_attention(rope_split(qkv, cos, sin, num_heads, head_dim), cu_seqlens, max_seqlen, scale)
