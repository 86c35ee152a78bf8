"""Triton GEMM with MXFP8 weights: out = x @ dequant(W)^T, the weights dequantised in registers.

    W[n, k] = fp8_e4m3[n, k] * 2^(S[n, k // 32] - 127)        (one E8M0 exponent per 1x32 block of a row)

The weights stay in memory in their checkpoint form (fp8 [N, K] + uint8 scales [N, K / 32]), so a decode step
streams 1 byte per weight (+ 1/32 byte of scale) instead of bf16's 2. Each program loads fp8 weight tiles and
their scales, builds the power-of-two factors with an exponent-field shift (exact: no exp2, no table) and rounds
the products to the activation dtype. That rounding is exact (an e4m3 value times a power of two fits bf16's
8-bit mantissa and exponent), so the dot sees the very bf16 weights the dequantise-at-load path holds; results
differ only by accumulation order. The dot is the activation dtype's (bf16 tensor cores on the GPU, fp32/fp16
under the CPU interpreter), accumulating in fp32.

How a tile is dequantised and multiplied is a *variant* (fp8_configs.py lists them and holds the tuned tables):
"acc" scales the accumulator per 32-column block (`scaled_block_dot`), "gather" loads a scale per weight,
"bcast" loads the [BLOCK_N, BLOCK_K / 32] scales once and broadcasts them in registers (`dequant_rows`), "swap"
does the same with the weight tile as the dot's first operand, "scaled" hands the tile to `tl.dot_scaled`, and
"dequant" (large batches) writes a transient 16-bit copy of W in one pass and calls F.linear, and "gemv" (decode)
multiplies a few rows by the widened tile on CUDA cores (`mx_tile_gemv`). The per-K-step code of every variant
lives in fp8_tile.py, shared with the fused MoE. `select_tiles`
takes the variant and tiles from the tuned table for known shapes (`scripts/tune_fp8.py` writes it), else a
heuristic; a prefill (more than fp8_configs.PREFILL_ROWS rows) takes "dequant" either way, the same F.linear the
dequantised model calls.

Small batches (decode) are bandwidth-bound and have few output tiles, so K is split across programs (SPLIT_K)
until the grid covers the GPU a few times over; the fp32 partials are summed by one small kernel that also casts
(`sum_splits`: deterministic, no atomics). Large batches use square-ish tiles and no split. Activations are not
quantised: Hopper has no block-scaled MMA, and scaling each 32-column block of an fp8 dot on the fp32 accumulator takes
about as many CUDA-core operations as the bf16 MMA it would replace does tensor-core time. (On chips that have one,
the `mx_activations` approximation quantises them to MXFP8: kernels/mx_linear.py.)

The plain-PyTorch reference is `reference.fp8_linear` (dequantise, then F.linear).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanoserve.kernels import fp8_linear_wgmma
from nanoserve.kernels.configs import backend, sm_count
from nanoserve.kernels.fp8_configs import FP8_VARIANTS, PREFILL_ROWS, linear_entry
from nanoserve.kernels.fp8_tile import (
    MXFP8_BLOCK,
    dequant_fp8_tile,
    dequant_rows,
    mx_tile_dot,
    mx_tile_gemv,
    scaled_block_dot,
    tile_coords,
)

SCALE_ACC_MAX_M = 32
"""Row tiles up to this size scale the accumulator per 32-column block (few rows: the extra multiplies are cheap
and the scale loads shrink 32x); larger ones dequantise the weight tile before one dot (the multiplies amortise
over the rows)."""


FP8_WGMMA_MAX_ROWS = 256
"""With the switch fp8_linear_wgmma, calls of up to this many rows that dequantise in registers (decode steps: up to
fp8_configs.PREFILL_ROWS rows, or any captured batch) run fp8_linear_wgmma.py's Gluon kernel where it applies
(Hopper)."""


@dataclass(frozen=True)
class LinearTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    variant: str = "auto"
    """One of fp8_configs.FP8_VARIANTS, or "auto": "acc" for row tiles up to SCALE_ACC_MAX_M on full K tiles,
    else "bcast"."""
    split_waves: int = 4
    """Small batches split K until the grid has about this many programs per multiprocessor (`split_k_for`)."""

    @classmethod
    def from_entry(cls, entry: tuple) -> LinearTiles:
        """An fp8_configs.py table entry: (variant, block_m, block_n, block_k, warps, stages[, split_waves])."""
        return cls(*entry[1:6], variant=entry[0], **({"split_waves": entry[6]} if len(entry) > 6 else {}))


def select_tiles(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> LinearTiles:
    """Tiles by backend and batch size: the tuned table (fp8_configs.py) for known shapes, else a heuristic.
    Decode (M <= 16): one row tile, narrow N, long K (memory-bound); mid batches: 64-row tiles; prefill (more than
    fp8_configs.PREFILL_ROWS rows): "dequant", as every table entry there, so that a prefill of any shape calls the
    dequantised model's F.linear (its tiles serve only a captured graph, which dequantises in registers). BLOCK_K
    is a multiple of the 32-column scale block; ROCm keeps 2 pipeline stages and tl.dot dims >= 16."""
    kind = backend(device)
    if kind == "interpret":
        return LinearTiles(16, 32, 64, 4, 1)
    entry = linear_entry(kind, n, k, m) if dtype.itemsize == 2 else None
    if entry is not None:
        return LinearTiles.from_entry(entry)
    stages = 2 if kind == "hip" else None
    if m <= 16:
        t = LinearTiles(16, 64, 256, 4, 4)
    elif m <= 64:
        t = LinearTiles(64, 64, 128, 4, 4)
    elif m <= PREFILL_ROWS:
        t = LinearTiles(64, 128, 64, 4, 4)
    elif m <= 256:
        t = LinearTiles(64, 128, 64, 4, 4, "dequant")
    else:
        t = LinearTiles(128, 128, 64, 8, 3, "dequant")
    return t if stages is None else LinearTiles(t.block_m, t.block_n, t.block_k, t.num_warps, stages, t.variant)


def split_k_for(m: int, n: int, k: int, tiles: LinearTiles, device: torch.device) -> int:
    """K splits so that a small-M GEMM still gives every multiprocessor ~`tiles.split_waves` programs; each split
    gets a whole number of BLOCK_K steps. 1 for large M (enough output tiles already)."""
    programs = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    want = tiles.split_waves * sm_count(device)
    k_steps = triton.cdiv(k, tiles.block_k)
    split = 1
    while programs * split * 2 <= want and k_steps // (split * 2) >= 2:
        split *= 2
    return split


def variant_code(variant: str, block_m: int, even_k: bool, dtype: torch.dtype) -> int:
    """The kernels' VARIANT constexpr for a variant name. "acc" needs full K tiles and "scaled" bf16 activations
    (tl.dot_scaled's formats; its fp16 form would compute the scales in fp16, which cannot hold them all):
    otherwise they become "bcast", as does "dequant" (the linear's dequant path never launches the kernel; the
    fused MoE dequantises in registers). The fused MoE runs "gemv" only for batches of up to
    moe.MOE_GEMV_MAX_TOKENS tokens: it decides before calling this."""
    if variant == "auto":
        variant = "acc" if block_m <= SCALE_ACC_MAX_M else "bcast"
    if variant == "dequant":  # the in-kernel form (the linear's dequant path never launches the kernel)
        variant = "bcast"
    if variant not in FP8_VARIANTS:
        raise ValueError(f"unknown fp8 kernel variant {variant!r}; choose one of {FP8_VARIANTS} or 'auto'")
    if (variant == "acc" and not even_k) or (variant == "scaled" and dtype != torch.bfloat16):
        variant = "bcast"
    return FP8_VARIANTS.index(variant)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, k_per_split,
                       stride_xm, stride_wn, stride_sn, stride_os, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, VARIANT: tl.constexpr):
    """out[split, m, n] = sum over this split's K range of x[m, k] * W[n, k]. VARIANT: 0 acc, 1 gather,
    2 bcast, 3 swap, 4 scaled, 6 gemv (fp8_configs.FP8_VARIANTS)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = tile_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (cols % N).to(tl.int64)  # the ragged last tile re-reads valid rows; those columns are not stored
    x_rows = (rows % M).to(tl.int64)
    k0 = split * k_per_split
    k_end = tl.minimum(k0 + k_per_split, K)
    ks = k0 + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + ks[None, :]
    if VARIANT == 0:  # scales applied per 32-column block on the accumulator (full K tiles)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k32 = tl.arange(0, 32)
        a32 = x_ptr + x_rows[:, None] * stride_xm + k32[None, :]
        w32 = w_ptr + w_rows[None, :] * stride_wn + k32[:, None]
        s32 = s_ptr + w_rows * stride_sn
        for k in range(k0, k_end, BLOCK_K):
            acc = scaled_block_dot(acc, a32, None, w32, s32, k, BLOCK_K, x_ptr.dtype.element_ty)
    elif VARIANT == 1:  # the whole tile dequantised with a scale gathered per weight
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_ptrs = w_ptr + w_rows[None, :] * stride_wn + ks[:, None]
        s_ptrs = s_ptr + w_rows[None, :] * stride_sn + ks[:, None] // 32
        for k in range(k0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
                w = dequant_fp8_tile(w_ptrs, s_ptrs, None, x_ptr.dtype.element_ty, False)
            else:
                in_k = (k + tl.arange(0, BLOCK_K)) < k_end
                a = tl.load(x_ptrs, mask=in_k[None, :], other=0.0)
                w = dequant_fp8_tile(w_ptrs, s_ptrs, in_k[:, None], x_ptr.dtype.element_ty, True)
            acc = tl.dot(a, w, acc, input_precision="ieee")
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            s_ptrs += BLOCK_K // 32
    else:  # bcast / swap / scaled / gemv: [BLOCK_N, BLOCK_K] weight rows with their [BLOCK_N, BLOCK_K // 32] scales
        if VARIANT == 3:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        elif VARIANT == 6:  # per-32-column-block partial sums, reduced after the loop
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        w_ptrs = w_ptr + w_rows[:, None] * stride_wn + ks[None, :]
        s_ptrs = s_ptr + w_rows[:, None] * stride_sn + kb[None, :]
        for k in range(k0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
            else:
                a = tl.load(x_ptrs, mask=(k + tl.arange(0, BLOCK_K))[None, :] < k_end, other=0.0)
            if VARIANT == 6:
                acc = mx_tile_gemv(acc, a, w_ptrs, s_ptrs, k_end - k, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
            else:
                acc = mx_tile_dot(acc, a, w_ptrs, s_ptrs, k_end - k, BLOCK_N, BLOCK_K, EVEN_K, VARIANT)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            s_ptrs += BLOCK_K // 32
        if VARIANT == 6:
            acc = tl.sum(acc, axis=2)
    out_base = out_ptr + split.to(tl.int64) * stride_os
    if VARIANT == 3:  # acc is [BLOCK_N, BLOCK_M]: store it through transposed pointers
        mask = (cols[:, None] < N) & (rows[None, :] < M)
        tl.store(out_base + rows[None, :].to(tl.int64) * stride_om + cols[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out_base + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s, i] (fp32, in split order), stored in out's dtype: the split-K reduction and
    the cast in one launch."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    ptrs = part_ptr + offs
    for _ in tl.static_range(SPLIT):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += numel
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """part [split, M, N] fp32 -> [M, N] in `dtype`, summed in split order (deterministic, no atomics)."""
    split, m, n = part.shape
    out = torch.empty(m, n, dtype=dtype, device=part.device)
    block = 1024
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT=split, BLOCK=block)
    return out


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = W[n, k] in out's dtype, one [BLOCK_N, BLOCK_K] tile per program."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kb = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    r64 = rows.to(tl.int64)
    mask = (rows[:, None] < N) & (ks[None, :] < K)
    w = tl.load(w_ptr + r64[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + r64[:, None] * stride_sn + kb[None, :], mask=(rows[:, None] < N) & (kb[None, :] < K // 32),
                other=127)
    tl.store(out_ptr + r64[:, None] * stride_on + ks[None, :],
             dequant_rows(w, s, BLOCK_N, BLOCK_K, out_ptr.dtype.element_ty), mask=mask)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The MXFP8 weight [N, K] in `dtype`, in one pass (reads 1 + 1/32 bytes, writes 2 per weight): the
    "dequant" variant's first step, equal to `reference.dequantize_mxfp8`."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    bn, bk = (32, 64) if backend(weight.device) == "interpret" else (64, 256)
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        weight, scale, out, n, k, weight.stride(0), scale.stride(0), out.stride(0), BLOCK_N=bn, BLOCK_K=bk)
    return out


def linear_rows(name: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] as unit-stride rows [M, K], once its shapes are checked against an MXFP8 weight [N, K] fp8 e4m3
    and its scales [N, K/32] uint8 (`name` is the caller, for the error)."""
    if weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.uint8:
        raise ValueError(f"{name} needs float8_e4m3fn weights and uint8 scales, got {weight.dtype}, {scale.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k or k % MXFP8_BLOCK or tuple(scale.shape) != (n, k // MXFP8_BLOCK):
        raise ValueError(f"{name}: x {list(x.shape)}, weight {list(weight.shape)}, scale {list(scale.shape)} "
                         f"do not fit (K must be a multiple of {MXFP8_BLOCK}, scale [N, K/{MXFP8_BLOCK}])")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def split_plan(m: int, n: int, k: int, t: LinearTiles, split_k: int | None,
               x: torch.Tensor) -> tuple[int, int, bool, torch.Tensor]:
    """How a split-K launch covers K: (split, k_per_split, even_k, out), `split` programs along K of `k_per_split`
    columns each writing `out` [split, M, N] (x's dtype when split == 1, else fp32 partial sums for `sum_splits`);
    even_k when no K tile is ragged. `split_k` overrides split_k_for's choice."""
    split = split_k if split_k is not None else split_k_for(m, n, k, t, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split), t.block_k) * t.block_k
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((split, m, n), dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    return split, k_per_split, k % t.block_k == 0 and k_per_split % t.block_k == 0, out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               tiles: LinearTiles | None = None, split_k: int | None = None,
               wgmma_max_rows: int | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ dequant(weight [N, K] fp8 e4m3, scale [N, K/32] uint8 E8M0)^T -> [..., N]
    in x's dtype. `tiles` / `split_k` override the heuristics (benchmarks, tests). With `wgmma_max_rows` (switch
    fp8_linear_wgmma), a call of at most that many rows that would dequantise in registers (decode sizes, or any
    size in a captured graph) runs fp8_linear_wgmma.py's Gluon kernel where `fp8_linear_wgmma.supported` says it
    applies (Hopper); an eager prefill keeps the dequantised model's F.linear call."""
    x2 = linear_rows("fp8_linear", x, weight, scale)
    (m, k), n, lead = x2.shape, weight.shape[0], x.shape[:-1]
    if m == 0:
        return x.new_empty(*lead, n)
    weight, scale = weight.contiguous(), scale.contiguous()  # no-ops for the layer's parameters
    t = tiles or select_tiles(m, n, k, x.device, x.dtype)
    if t.variant == "dequant":  # large batches: a transient 16-bit copy of W, then the library GEMM
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return F.linear(x2, dequantize(weight, scale, x.dtype)).reshape(*lead, n)
        # A captured decode graph would keep that copy in its memory pool, which the KV-cache plan does not
        # count (it measures an eager step): dequantise in registers there.
        t = LinearTiles(t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, "bcast")
    if (wgmma_max_rows is not None and tiles is None and split_k is None and m <= wgmma_max_rows
            and fp8_linear_wgmma.supported(x2, weight, scale)):
        out = fp8_linear_wgmma.partial_sums(x2, weight, scale)
    else:
        split, k_per_split, even_k, out = split_plan(m, n, k, t, split_k, x)
        grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
        _fp8_linear_kernel[grid](
            x2, weight, scale, out, m, n, k, k_per_split,
            x2.stride(0), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1),
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=8, EVEN_K=even_k,
            VARIANT=variant_code(t.variant, t.block_m, even_k, x.dtype), num_warps=t.num_warps,
            num_stages=t.num_stages)
    # out: [split, M, N] partial sums (fp32), or the result itself in x's dtype when one split covers K
    y = out[0] if out.shape[0] == 1 else sum_splits(out, x.dtype)
    return y.reshape(*lead, n)
