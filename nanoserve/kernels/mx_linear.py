"""MXFP8 x MXFP8 GEMM for the `mx_activations` switch: out = dequant(quantize_mx(x)) @ dequant(W)^T.

With MXFP8 weights, the activations entering a quantized linear are quantized to MXFP8 as well, per token and per
32 consecutive values along K (the OCP MX rule, `reference.quantize_mx_activations`), and both fp8 operands go to
`tl.dot_scaled(a, a_scale, "e4m3", w, w_scale, "e4m3")`. Two launches:

- `_mx_quantize_kernel`: x [M, K] -> e4m3 [M, K] + E8M0 [M, K / 32]. floor(log2(amax)) is read from fp32's
  exponent field; the scaled values are saturated to +-448 and rounded to e4m3's grid in fp32 arithmetic (ties
  to even) before the cast, which is then exact - so the bytes equal the reference's on every backend, the
  CPU interpreter included (whose fp32 -> fp8 conversion does not round to nearest).
- `_mx_linear_kernel`: K tiles of both operands with their scales, one `tl.dot_scaled` per tile, fp32
  accumulation; small batches split K (`fp8_linear.split_k_for`) and sum the partials with `sum_splits`.

`tl.dot_scaled` with two e4m3 operands compiles to the block-scaled MFMA on gfx950 (`v_mfma_scale_f32_*_f8f6f4`)
and to the block-scaled `tcgen05.mma` (`kind::mxf8f6f4.block_scale`) on sm_100 when the row tile is 128;
on sm_90 and gfx942 Triton decomposes it (both operands scaled to bf16, then a bf16 MMA): the same MMA as the
bf16-activation kernels of fp8_linear.py plus a quantize launch and a rounding, nothing to gain there - so the
switch is off by default (no card with native MX has timed it). It is an approximation: e4m3
keeps 3 fraction bits, so each activation moves by up to 1/16 of itself (1/8 for values the saturation clips).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.configs import backend
from nanoserve.kernels.fp8_linear import LinearTiles, linear_rows, split_plan, sum_splits
from nanoserve.kernels.fp8_tile import MXFP8_BLOCK, load_mx_tile, tile_coords
from nanoserve.kernels.reference import E8M0_BIAS, MX_E4M3_EMAX, MX_MIN_EXPONENT

MX_LINEAR_TILES: dict[str, dict[int, LinearTiles]] = {
    # by backend, then the largest batch (rows) a tile serves. Not measured on a card with native MX; chosen so
    # that the native instruction is used and the tiles fit each chip (the compile gate checks both):
    # - "cuda": 128-row tiles, the row count the block-scaled tcgen05.mma takes on sm_100 (smaller tiles fall
    #   back to a bf16 mma.sync); small batches split K instead. 8 warps: with 4, sm_90's decomposed build of
    #   128 x 64 tiles spills registers;
    # - "hip": MFMA-scale shapes 16x16x128 / 32x32x64 (row tiles of 16 or more, K steps of 128), at most 2
    #   stages, the LDS within gfx942's 64 KiB (it compiles the same tiles, decomposed).
    "cuda": {64: LinearTiles(128, 64, 256, 8, 3, "mx"), 1 << 62: LinearTiles(128, 128, 128, 8, 3, "mx")},
    "hip": {16: LinearTiles(16, 64, 256, 4, 2, "mx"), 64: LinearTiles(32, 64, 256, 4, 2, "mx"),
            1 << 62: LinearTiles(128, 128, 128, 8, 2, "mx")},
    "interpret": {1 << 62: LinearTiles(16, 32, 64, 4, 1, "mx")},
}
QUANTIZE_BLOCK = (16, 256)
"""(rows, columns) of x per program of the quantize kernel."""


def select_mx_tiles(m: int, device: torch.device) -> LinearTiles:
    """The MX_LINEAR_TILES entry of this backend for a batch of m rows."""
    buckets = MX_LINEAR_TILES[backend(device)]
    return buckets[min(b for b in buckets if m <= b)]


@triton.jit
def _mx_quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EMAX: tl.constexpr, MIN_EXP: tl.constexpr,
                        BIAS: tl.constexpr):
    """q, s = the OCP MX quantization of one [BLOCK_M, BLOCK_K] tile of x (reference.quantize_mx_activations)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kb = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    r64 = rows.to(tl.int64)
    mask = (rows[:, None] < M) & (ks[None, :] < K)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    blocks = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))
    amax = tl.max(tl.abs(blocks), axis=2)
    exp = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - BIAS - EMAX  # floor(log2(amax)) - 8
    exp = tl.minimum(tl.maximum(exp, MIN_EXP), 127)
    inv = ((BIAS - exp) << 23).to(tl.float32, bitcast=True)  # 2^-exp, exact (a normal fp32 for finite x)
    v = tl.minimum(tl.maximum(blocks * inv[:, :, None], -448.0), 448.0)
    # Round |v| to e4m3's grid: 3 fraction bits, i.e. a spacing of 2^(e - 3) for |v| in [2^e, 2^(e+1)), and
    # 2^-9 below 2^-6 (subnormals). |v| / spacing lies in [0, 16) and is exact; round it to an integer, ties to
    # even, with floor (exact) rather than a conversion whose rounding mode differs between backends.
    a = tl.abs(v)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 0xFF, BIAS - 6)  # biased exponent, at least 2^-6's
    spacing = ((e - 3) << 23).to(tl.float32, bitcast=True)
    t = a * (((2 * BIAS + 3) - e) << 23).to(tl.float32, bitcast=True)  # a / spacing
    f = tl.floor(t)
    r = t - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    f = tl.where((r > 0.5) | ((r == 0.5) & odd), f + 1.0, f)
    q = tl.where(v < 0, -(f * spacing), f * spacing)
    out = tl.reshape(q, (BLOCK_M, BLOCK_K))
    tl.store(q_ptr + r64[:, None] * stride_qm + ks[None, :], out.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + r64[:, None] * stride_sm + kb[None, :], (exp + BIAS).to(tl.uint8),
             mask=(rows[:, None] < M) & (kb[None, :] < K // 32))


def quantize_mx(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32, unit stride along K) -> (fp8 e4m3 [M, K], uint8 E8M0 [M, K / 32]), equal
    to `reference.quantize_mx_activations(x)` byte for byte (up to the sign of zero)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // MXFP8_BLOCK, dtype=torch.uint8, device=x.device)
    bm, bk = QUANTIZE_BLOCK
    _mx_quantize_kernel[(triton.cdiv(m, bm), triton.cdiv(k, bk))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_M=bm, BLOCK_K=bk,
        EMAX=MX_E4M3_EMAX, MIN_EXP=MX_MIN_EXPONENT, BIAS=E8M0_BIAS)
    return q, s


@triton.jit(do_not_specialize=["M"])
def _mx_linear_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, k_per_split,
                      stride_am, stride_asm, stride_wn, stride_wsn, stride_os, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    """out[split, m, n] = sum over this split's K range of A[m, k] * W[n, k], both MXFP8 (fp8 e4m3 with an
    E8M0 exponent per 32 columns of a row), by `tl.dot_scaled`."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = tile_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = (rows % M).to(tl.int64)  # ragged last tiles re-read valid rows; those outputs are not stored
    w_rows = (cols % N).to(tl.int64)
    k0 = split * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    ks = k0 + tl.arange(0, BLOCK_K)
    kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :]
    as_ptrs = as_ptr + a_rows[:, None] * stride_asm + kb[None, :]
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + ks[None, :]
    ws_ptrs = ws_ptr + w_rows[:, None] * stride_wsn + kb[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        a, a_scale = load_mx_tile(a_ptrs, as_ptrs, k_end - k, BLOCK_K, EVEN_K)
        w, w_scale = load_mx_tile(w_ptrs, ws_ptrs, k_end - k, BLOCK_K, EVEN_K)
        acc = tl.dot_scaled(a, a_scale, "e4m3", w.T, w_scale, "e4m3", acc)
        a_ptrs += BLOCK_K
        as_ptrs += BLOCK_K // 32
        w_ptrs += BLOCK_K
        ws_ptrs += BLOCK_K // 32
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def mx_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, tiles: LinearTiles | None = None,
              split_k: int | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) quantized to MXFP8, @ dequant(weight [N, K] fp8 e4m3, scale [N, K/32] uint8
    E8M0)^T -> [..., N] in x's dtype (`reference.mx_linear`). `tiles` / `split_k` override the table (tests)."""
    x2 = linear_rows("mx_linear", x, weight, scale)
    (m, k), n, lead = x2.shape, weight.shape[0], x.shape[:-1]
    if m == 0:
        return x.new_empty(*lead, n)
    weight, scale = weight.contiguous(), scale.contiguous()
    a, a_scale = quantize_mx(x2)
    t = tiles or select_mx_tiles(m, x.device)
    split, k_per_split, even_k, out = split_plan(m, n, k, t, split_k, x)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
    _mx_linear_kernel[grid](
        a, a_scale, weight, scale, out, m, n, k, k_per_split,
        a.stride(0), a_scale.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8, EVEN_K=even_k,
        num_warps=t.num_warps, num_stages=t.num_stages)
    y = out[0] if split == 1 else sum_splits(out, x.dtype)
    return y.reshape(*lead, n)
