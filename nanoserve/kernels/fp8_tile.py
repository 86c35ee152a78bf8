"""The MXFP8 K-tile code shared by the fp8-weight kernels (kernels/fp8_linear.py, the fp8 path of kernels/moe.py).

    W[n, k] = fp8_e4m3[n, k] * 2^(S[n, k // 32] - 127)        (one E8M0 exponent per 1x32 block of a row)

Every helper here is `@triton.jit` and is inlined into the kernel that calls it; a kernel keeps its own grid,
pointer set-up and epilogue, and calls one of these per K step:

- `mx_tile_dot`: load a [BLOCK_N, BLOCK_K] fp8 weight tile and its [BLOCK_N, BLOCK_K / 32] scales (the K tail
  masked), then `acc += a @ W^T` as the variant says ("bcast", "swap", "scaled": `mx_dot`).
- `mx_tile_gemv`: the same load for the CUDA-core variant ("gemv"): rows of a few tokens times the tile in fp32,
  each 32-column block summed before its scale is applied, into per-block partial sums.
- `scaled_block_dot` ("acc") and `dequant_fp8_tile` ("gather") for the other two layouts.
- `tile_coords`: a program id -> (row tile, column tile), GROUP_M row tiles at a time, the grid order of every
  matrix kernel here (the linears and the MoE, in either weight format).

The factor 2^(S - 127) is built by placing S in fp32's exponent field (exact: no exp2, no table; S = 0 gives 0).
An e4m3 value times a power of two is exact in bf16, so every variant multiplies the very weights the
dequantise-at-load reference holds; results differ from it only by summation order.
"""

from __future__ import annotations

import triton
import triton.language as tl

MXFP8_BLOCK = 32
"""Input columns per E8M0 scale."""


@triton.jit
def tile_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (row tile, column tile), GROUP_M row tiles at a time across all column tiles."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def e8m0_to_float(s):
    """2^(s - 127) for a uint8 E8M0 exponent, built by placing s in fp32's exponent field (s = 0 gives 0)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def dequant_fp8_tile(w_ptrs, s_ptrs, mask, out_dtype: tl.constexpr, MASKED: tl.constexpr):
    """Load an fp8 weight tile and its per-element scale pointers (k // 32 gathered), return it dequantised in
    `out_dtype` (the "gather" variant)."""
    if MASKED:
        w = tl.load(w_ptrs, mask=mask, other=0.0)
        s = tl.load(s_ptrs, mask=mask, other=127)
    else:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    return (w.to(tl.float32) * e8m0_to_float(s)).to(out_dtype)


@triton.jit
def dequant_rows(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, out_dtype: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] fp8 with s [BLOCK_N, BLOCK_K // 32] E8M0 -> W in `out_dtype`, each scale broadcast
    over its 32 columns in registers. bf16 multiplies in bf16 (a power of two times an e4m3 value is exact there);
    other dtypes in fp32 (fp16 cannot hold every scale)."""
    f = e8m0_to_float(s)
    if out_dtype == tl.bfloat16:
        blocks = tl.reshape(w.to(tl.bfloat16), (BLOCK_N, BLOCK_K // 32, 32)) * f.to(tl.bfloat16)[:, :, None]
    else:
        blocks = tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * f[:, :, None]
    return tl.reshape(blocks, (BLOCK_N, BLOCK_K)).to(out_dtype)


@triton.jit
def mx_dot(acc, a, w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VARIANT: tl.constexpr):
    """acc += a [BLOCK_M, BLOCK_K] @ dequant(w [BLOCK_N, BLOCK_K] fp8, s [BLOCK_N, BLOCK_K // 32])^T for the
    "bcast" (2), "swap" (3, acc is [BLOCK_N, BLOCK_M] and gets W @ a^T) and "scaled" (4) variants."""
    # One return at the end: the compiler also traces statements after a return inside a constexpr branch.
    if VARIANT == 4:
        out = tl.dot_scaled(a, None, "bf16", w.T, s, "e4m3", acc, fast_math=True)
    else:
        wd = dequant_rows(w, s, BLOCK_N, BLOCK_K, a.dtype)
        # "ieee" only matters for fp32 operands (exact products instead of TF32); 16-bit operands ignore it.
        if VARIANT == 3:
            out = tl.dot(wd, a.T, acc, input_precision="ieee")
        else:
            out = tl.dot(a, wd.T, acc, input_precision="ieee")
    return out


@triton.jit
def load_mx_tile(w_ptrs, s_ptrs, k_left, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The fp8 tile at `w_ptrs` [BLOCK_N, BLOCK_K] and its scales at `s_ptrs` [BLOCK_N, BLOCK_K // 32]; unless
    EVEN_K, only the first `k_left` columns are read (the rest: weight 0, scale 2^0)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
        s = tl.load(s_ptrs)
    else:
        in_k = tl.arange(0, BLOCK_K) < k_left
        in_kb = tl.arange(0, BLOCK_K // 32) < tl.cdiv(k_left, 32)
        w = tl.load(w_ptrs, mask=in_k[None, :], other=0.0)
        s = tl.load(s_ptrs, mask=in_kb[None, :], other=127)
    return w, s


@triton.jit
def mx_tile_dot(acc, a, w_ptrs, s_ptrs, k_left, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, VARIANT: tl.constexpr):
    """One K step of the "bcast" / "swap" / "scaled" variants: load the MXFP8 weight tile and its scales
    (`load_mx_tile`), return acc + a @ W^T (`mx_dot`; "swap": acc + W @ a^T). `a` [BLOCK_M, BLOCK_K] is the
    caller's activation tile, zero past `k_left` unless EVEN_K."""
    w, s = load_mx_tile(w_ptrs, s_ptrs, k_left, BLOCK_K, EVEN_K)
    return mx_dot(acc, a, w, s, BLOCK_N, BLOCK_K, VARIANT)


@triton.jit
def mx_tile_gemv(acc, a, w_ptrs, s_ptrs, k_left, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step of the "gemv" variant, on CUDA cores: acc [BLOCK_M, BLOCK_N, BLOCK_K // 32] fp32 gets, per
    32-column block, 2^(S - 127) * sum_j a[m, j] * fp8[n, j]; the caller sums acc over its last axis once, after
    the K loop (so the loop does no cross-lane reduction over K).

    The fp8 tile is widened to fp32 (exact) and each 32-column block is summed before its scale is applied: one
    scale multiply per 32 weights and row, and the products (e4m3 x bf16/fp16: at most 15 significant bits) are
    exact in fp32, as in the reference. For a few rows: BLOCK_M x BLOCK_N x BLOCK_K products sit in registers."""
    w, s = load_mx_tile(w_ptrs, s_ptrs, k_left, BLOCK_K, EVEN_K)
    w4 = tl.reshape(w.to(tl.float32), (1, BLOCK_N, BLOCK_K // 32, 32))
    a4 = tl.reshape(a.to(tl.float32), (BLOCK_M, 1, BLOCK_K // 32, 32))
    blocks = tl.sum(w4 * a4, axis=3)  # [BLOCK_M, BLOCK_N, BLOCK_K // 32]
    return acc + blocks * e8m0_to_float(s)[None, :, :]


@triton.jit
def scaled_block_dot(acc, a_ptrs, a_mask, w_ptrs, s_ptrs, k, BLOCK_K: tl.constexpr, dot_dtype: tl.constexpr):
    """acc += sum over the BLOCK_K // 32 scale blocks from column k of (a_blk @ fp8_blk) * 2^(s - 127).

    The "acc" variant: each 32-column block is a bf16 dot of exact fp8 values, scaled on the fp32 accumulator by
    a [BLOCK_N] vector of factors, so the scales are BLOCK_N byte loads per block (not one per weight) and every
    load is a contiguous 32-byte row. `a_ptrs` [BLOCK_M, 32], `w_ptrs` [32, BLOCK_N], `s_ptrs` [BLOCK_N] point at
    column block 0; full K tiles only (no K mask)."""
    for j in tl.static_range(BLOCK_K // 32):
        if a_mask is None:
            a = tl.load(a_ptrs + k + j * 32)
        else:
            a = tl.load(a_ptrs + k + j * 32, mask=a_mask, other=0.0)
        w = tl.load(w_ptrs + k + j * 32).to(dot_dtype)
        f = e8m0_to_float(tl.load(s_ptrs + k // 32 + j))
        acc += tl.dot(a, w, input_precision="ieee") * f[None, :]
    return acc
