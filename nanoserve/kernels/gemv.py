"""One-row matrix-vector products (switch `triton_gemv`): y = x @ W^T for x [1, K], W [N, K] in 16 bits (or fp32:
the MoE router), and the same for an MXFP8 weight (fp8 e4m3 [N, K] + E8M0 exponents [N, K / 32]).

A decode step of one request multiplies a single activation row by every weight matrix, so each projection is a
pure stream of W. The library GEMM picks a split-K kernel for some of those shapes (M3's o_proj, [6144, 8192]),
which on an H200 ran at ~3 TB/s against the 4.26 TB/s copy ceiling, and then launches a second kernel to sum
the splits. This kernel streams W once, BLOCK_N rows per program: each program walks K in BLOCK_K steps,
accumulating w * x elementwise in an fp32 [BLOCK_N, BLOCK_K] tile (no reduction inside the loop), and sums the
tile's columns once at the end. The weight loads are marked evict-first: W is read once, x many times.

It runs only for the shapes in `GEMV_TILES` (kernels/configs.py), the ones where `scripts/tune_gemv.py` measured
it faster than F.linear on the card, with the tile it found; other shapes, and M > 1, keep F.linear. The reference
is F.linear: both accumulate in fp32 and round once, in a different order (tests/kernels/test_kernel_gemv.py states the
tolerances).

`gemv_mxfp8` is the same stream for MXFP8 weights, one byte per weight: the fp8 tile is widened to fp32 (exact),
each 32-column block of w * x is summed and then multiplied by its 2^(S - 127) (`fp8_tile.e8m0_to_float`), and the
[BLOCK_N, BLOCK_K / 32] block sums accumulate elementwise until the end. Unlike kernels/fp8_linear.py's "gemv"
variant it does not split K (no second launch to sum the splits) and marks the weight evict-first. Its table is
`GEMV_MXFP8_TILES` (`scripts/tune_gemv.py --mxfp8`, against fp8_linear); its reference `reference.fp8_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.configs import GEMV_INTERPRETER_TILES, gemv_tiles
from nanoserve.kernels.fp8_tile import MXFP8_BLOCK, e8m0_to_float


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + k)
            w = tl.load(rows + k[None, :], mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Does x @ W^T take a one-row GEMV: one row, a tuned shape, and a weight of x's dtype or fp32 (M3's router),
    or an MXFP8 one (`scale` given: gemv_mxfp8)?"""
    if not (x.dim() == 2 and x.shape[0] == 1 and weight.dim() == 2 and weight.stride(-1) == 1):
        return False
    if scale is None and weight.dtype not in (x.dtype, torch.float32):
        return False
    if scale is not None and scale.stride(-1) != 1:
        return False
    return gemv_tiles(weight.shape[0], weight.shape[1], x.device, mxfp8=scale is not None) is not None


def gemv(x: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int, int] | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T -> [1, N] in out_dtype (default x's), fp32 accumulation. The weight is x's dtype
    or fp32 (the router: F.linear(x.float(), W) without the copy of x). `tiles` (block_n, block_k, warps, stages)
    overrides the table (tuning, tests); an untuned shape without it gets GEMV_INTERPRETER_TILES."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv takes x [1, K] and weight [N, K], got {list(x.shape)} and {list(weight.shape)}")
    if weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"weight must have x's dtype or float32, got {x.dtype} and {weight.dtype}")
    n, k = weight.shape
    block_n, block_k, warps, stages = tiles or gemv_tiles(n, k, x.device) or GEMV_INTERPRETER_TILES
    x = x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(1, n, dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, out, n, k, weight.stride(0), BLOCK_N=block_n,
                                             BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps,
                                             num_stages=stages)
    return out


@triton.jit
def _gemv_mxfp8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_K // 32
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + n.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        g = k0 // 32 + tl.arange(0, GROUPS)
        if EVEN_K:
            x = tl.load(x_ptr + k)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            sc = tl.load(s_rows + g[None, :], mask=n_ok[:, None], other=0)
        else:  # K is a multiple of 32 (MXFP8), so a block is wholly in or out
            x = tl.load(x_ptr + k, mask=k < K, other=0.0)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
            sc = tl.load(s_rows + g[None, :], mask=n_ok[:, None] & (g * 32 < K)[None, :], other=0)
        prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
        blocks = tl.sum(tl.reshape(prod, (BLOCK_N, GROUPS, 32)), axis=2)
        acc += blocks * e8m0_to_float(sc)
    tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


def gemv_mxfp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ dequant(weight [N, K] fp8 e4m3, scale [N, K / 32] uint8 E8M0)^T -> [1, N] in x's dtype, fp32
    accumulation; equal to reference.fp8_linear up to summation order. `tiles` as in gemv (BLOCK_K a multiple of
    32)."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv_mxfp8 takes x [1, K] and weight [N, K], got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8 or tuple(scale.shape) != (n, k // 32) \
            or k % MXFP8_BLOCK:
        raise ValueError(f"gemv_mxfp8 needs an fp8 e4m3 weight [N, K] (K a multiple of 32) and uint8 scales "
                         f"[N, K / 32], got {weight.dtype} {list(weight.shape)} and {scale.dtype} {list(scale.shape)}")
    block_n, block_k, warps, stages = tiles or gemv_tiles(n, k, x.device, mxfp8=True) or GEMV_INTERPRETER_TILES
    if block_k % 32:
        raise ValueError(f"gemv_mxfp8's block_k must be a multiple of 32, got {block_k}")
    x = x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_mxfp8_kernel[(triton.cdiv(n, block_n),)](x, weight, scale, out, n, k, weight.stride(0), scale.stride(0),
                                                   BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                                                   num_warps=warps, num_stages=stages)
    return out
