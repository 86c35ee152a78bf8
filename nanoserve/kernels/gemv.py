"""One-row matrix-vector product for 16-bit weights (switch `triton_gemv`): y = x @ W^T for x [1, K], W [N, K].

A decode step of one request multiplies a single activation row by every weight matrix, so each projection is a
pure stream of W. The library GEMM picks a split-K kernel for some of those shapes (M3's o_proj, [6144, 8192]),
which on an H200 ran at ~3 TB/s against the 4.26 TB/s copy ceiling, and then launches a second kernel to sum
the splits. This kernel streams W once, BLOCK_N rows per program: each program walks K in BLOCK_K steps,
accumulating w * x elementwise in an fp32 [BLOCK_N, BLOCK_K] tile (no reduction inside the loop), and sums the
tile's columns once at the end. The weight loads are marked evict-first: W is read once, x many times.

It runs only for the shapes in `GEMV_TILES` (kernels/configs.py), the ones where `scripts/tune_gemv.py` measured
it faster than F.linear on the card, with the tile it found; other shapes, and M > 1, keep F.linear. The reference
is F.linear: both accumulate in fp32 and round once, in a different order (tests/test_kernel_gemv.py states the
tolerances).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.configs import GEMV_INTERPRETER_TILES, gemv_tiles


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


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does y = x @ weight^T take the GEMV: one row, a weight of x's dtype or fp32 (M3's router), a tuned shape?"""
    return (x.dim() == 2 and x.shape[0] == 1 and weight.dtype in (x.dtype, torch.float32) and weight.dim() == 2
            and weight.stride(-1) == 1 and gemv_tiles(weight.shape[0], weight.shape[1], x.device) is not None)


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
