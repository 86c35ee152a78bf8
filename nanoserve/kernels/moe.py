"""Triton fused MoE for M3: device-side alignment, two grouped GEMMs with fused epilogues, a top-k reduction.

    out[t] = routed_scaling_factor * sum_k w[t, k] * Expert_{id[t, k]}(x[t])   (+ SharedExpert(x[t]) when folded)
    Expert(x) = w2 @ swiglu_oai(gate, up),  [gate; up] = w13 @ x

The pipeline: five launches after the torch routing (four in all with fused routing), no host synchronisation
anywhere (launch grids come from shapes and upper bounds only, so a decode step can be captured in a CUDA/HIP
graph):

1. Routing (`reference.route`: fp32 sigmoid, biased top-k, renormalised weights). For decode-sized batches
   `fused_route_moe` runs it together with step 2 in one launch (moe_route.py, switch `fused_routing`).
2. Alignment (`moe_align.py`, two launches): the T * KP (token, slot) pairs are grouped by expert into runs padded to
   BLOCK_M rows, so each BLOCK_M-row tile belongs to one expert. KP = top_k, plus one with the folded shared expert.
3. GEMM 1 over the sorted rows: the program for tile (m, n) loads the tile's token rows of x once and multiplies
   them by BLOCK_N gate rows and the matching BLOCK_N up rows of w13 (two accumulators), then applies SwiGLU-OAI in
   fp32 before storing the activation tile, so gate/up never reach memory.
4. GEMM 2 with w2, multiplying each row by its pair's routing weight, writes one copy per pair: copies[t*KP + j].
5. Reduction: out[t] = sum_j copies[t*KP + j] in fp32 (deterministic, no atomics); pairs that no local expert
   computed (expert parallel) are skipped, so no buffer needs zeroing.

Tiles of experts with no tokens do not exist; tiles past the real end of the runs exit on their first load.
For decode (1-16 tokens) each expert's rows fit one BLOCK_M tile, so its weights are streamed exactly once, and a
narrow BLOCK_N splits each weight matrix over many programs to keep the memory system busy.

Shared-expert folding (`fold_shared=True`): the last weight slot holds the shared expert, which joins every token
as pair j = top_k. vLLM/AITER give that slot weight 1/routed_scaling_factor and scale the whole sum; here the
scale is folded into the routed weights instead (routed pairs weigh scaling * w, the shared pair 1), which is the
same sum, exact for M3's scale of 2, with one multiply fewer. One alignment + GEMM pair per layer instead of two.

Expert parallel: `expert_map` [E_global] sends a global expert id to a local slot or -1 (another rank's expert:
skipped, contributes 0). Tensor parallel experts just arrive with a smaller intermediate size. Both reuse the
kernels unchanged; the caller's all-reduce sums the ranks.

Tile configurations come from kernels/configs.py's MOE_TILES (H200, bf16: the data file kernels/tuned/moe.json),
keyed by (hidden, intermediate, routed experts) and a token bucket, written by `scripts/tune_moe.py` (re-runnable on
another card), and for AMD GPUs MOE_TILES["hip"] (M3's shapes, by the rule stated in configs.py); other shapes get a
portable heuristic (num_warps 4/8, 2 pipeline stages on ROCm, BLOCK sizes multiples of 16); the CPU interpreter
gets a small fixed tile. MXFP8 experts have their own table (kernels/fp8_configs.py's FP8_MOE_TILES, its CUDA
entries kernels/tuned/fp8.json, written by `scripts/tune_fp8.py`), whose entries also name how a weight tile is
dequantised (`fp8_variant`; the variants are those of fp8_linear.py, sharing the jitted K-tile helpers of
fp8_tile.py); shapes missing from it fall back to the bf16 table's tiles with "auto". Its "gemv" entries (batches of
up to MOE_GEMV_MAX_TOKENS tokens) multiply only the first next_pow2(tokens) rows of each tile, on CUDA cores: at one
token the tensor-core variants dequantise every weight tile for an MMA that is 15/16 padding.

On Hopper, MXFP8 calls of at least MOE_WGMMA_MIN_TOKENS tokens replace steps 3-4 with moe_wgmma.py's Gluon kernels
(switch moe_wgmma: warp-specialised, the weights dequantised straight into the warpgroup MMA's register operand);
alignment and reduction stay the ones here, with 128-row blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from nanoserve.kernels import moe_wgmma
from nanoserve.kernels.configs import MOE_TILES, backend
from nanoserve.kernels.fp8_configs import moe_entry
from nanoserve.kernels.fp8_linear import dequantize, variant_code
from nanoserve.kernels.fp8_tile import dequant_fp8_tile, mx_tile_dot, mx_tile_gemv, scaled_block_dot, tile_coords
from nanoserve.kernels.moe_align import MoEAlignment, moe_align, pair_expert
from nanoserve.kernels.moe_route import route_and_align

MAX_TOKENS_PER_CALL = 16384
"""Larger batches run in chunks of this many tokens, bounding the per-call scratch (activations and copies)."""
REDUCE_BLOCK_H = 512
"""Hidden columns per program of the top-k reduction."""
MOE_DEQUANT_MIN_TOKENS = 16384
"""With `dequant_min_tokens` (switch moe_dequant_prefill), MXFP8 experts called with at least this many tokens are
dequantised to the activations' dtype and run the 16-bit kernels: on one H100 (m3-slice's 129 slots) that is
1.09x the MXFP8 kernels' speed at 16,384 tokens in 2 GiB groups (1.25x in one group) and 0.88x at 8,192
(docs/optimizations.md)."""
MOE_DEQUANT_GROUP_BYTES = 2 << 30
"""The dequantised copy is made a group of expert slots at a time, each group at most this many bytes in 16 bits
(at least one slot), so the transient stays near 2 GiB however many experts a rank holds: one rank of M3 at
tensor parallel 8 (129 slots of 14 MB in bf16) takes one group; m3-slice on one GPU (113 MB a slot) groups of 18.
Each further group costs its GEMMs a whole grid of programs that exit (`_grouped_dequantised_gemms`)."""
MOE_WGMMA_MIN_TOKENS = 256
"""With `wgmma_min_tokens` (switch moe_wgmma), MXFP8 experts called with at least this many tokens run the Gluon
kernels of moe_wgmma.py where they apply (Hopper): on one H100 (m3-slice's 129 slots) 1.00-1.06x the Triton MXFP8
kernels at 256 tokens, 1.4-1.7x from 1,024 to 16,384 (docs/optimizations.md); decode-sized batches keep the
Triton kernels' small tiles."""
MOE_GEMV_MAX_TOKENS = 4
"""Largest batch the MXFP8 "gemv" variant takes (it multiplies a tile's first next_pow2(tokens) rows on CUDA
cores, the weight tile streamed once); larger batches run "bcast"."""


def mxfp8_thresholds(opts) -> dict[str, int | None]:
    """`fused_moe`'s dequant_min_tokens and wgmma_min_tokens as the switches moe_dequant_prefill and moe_wgmma of
    `opts` (an Optimizations) set them: what the model layer passes and what the micro-benchmark times."""
    return dict(dequant_min_tokens=MOE_DEQUANT_MIN_TOKENS if opts.moe_dequant_prefill else None,
                wgmma_min_tokens=MOE_WGMMA_MIN_TOKENS if opts.moe_wgmma else None)


# --------------------------------------------------------------------------------------------------------------
# Tile configurations
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTiles:
    """Tile of one grouped GEMM. For GEMM 1, block_n counts gate columns (the program also does as many up ones)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    """Rows per tile in both GEMMs, and the padding unit of each expert's run."""
    group_m: int
    """Consecutive row tiles that walk the column tiles together, so their shared weight tiles stay in L2."""
    up: GemmTiles
    """GEMM 1: x @ w13^T with the SwiGLU-OAI epilogue."""
    down: GemmTiles
    """GEMM 2: act @ w2^T with the routing-weight epilogue."""
    fp8_variant: str = "auto"
    """MXFP8 experts only: how both GEMMs dequantise a weight tile (fp8_configs.FP8_VARIANTS; "auto": "acc" for
    BLOCK_M up to SCALE_ACC_MAX_M on full K tiles, else "bcast")."""
    tma: bool = False
    """16-bit experts only (switch moe_tma): both GEMMs load their weight tiles, and GEMM 2 its activation tiles,
    through TMA tensor descriptors instead of pointer arithmetic (the token rows of GEMM 1 are a gather and stay
    pointer loads)."""


def _cfg(block_m: int, group_m: int, up: tuple[int, int, int, int], down: tuple[int, int, int, int],
         fp8_variant: str = "auto", tma: bool = False) -> MoEConfig:
    return MoEConfig(block_m, group_m, GemmTiles(*up), GemmTiles(*down), fp8_variant, tma)


def _table_cfg(entry: tuple) -> MoEConfig:
    """A MOE_TILES entry: (block_m, group_m, GEMM 1 tiles, GEMM 2 tiles[, "tma"])."""
    return _cfg(*entry[:4], tma=len(entry) > 4 and entry[4] == "tma")


H200_CONFIGS: dict[tuple[int, int, int], dict[int, MoEConfig]] = {
    # (hidden, intermediate, routed experts) -> {token bucket: config}; the entries, and the runs that measured
    # them, are in kernels/tuned/moe.json (configs.MOE_TILES["cuda"], written by scripts/tune_moe.py)
    shape: {bucket: _table_cfg(entry) for bucket, entry in buckets.items()}
    for shape, buckets in MOE_TILES["cuda"].items()
}
TOKEN_BUCKETS = tuple(sorted({b for buckets in H200_CONFIGS.values() for b in buckets}))
"""A batch of T tokens uses the entry of the smallest bucket >= T (the largest bucket beyond that)."""
HIP_CONFIGS: dict[tuple[int, int, int], dict[int, MoEConfig]] = {
    # AMD Instinct: kernels/configs.py's MOE_TILES["hip"] (chosen by the rule stated there, not measured)
    shape: {bucket: _table_cfg(entry) for bucket, entry in buckets.items()}
    for shape, buckets in MOE_TILES["hip"].items()
}


INTERPRETER_CONFIG = _cfg(16, 1, (32, 32, 4, 1), (32, 32, 4, 1))
"""CPU interpreter (tests): small tiles so that test shapes still span several tiles in every dimension."""


def token_bucket(tokens: int, buckets: tuple[int, ...] = TOKEN_BUCKETS) -> int:
    """The bucket a batch of `tokens` uses (of TOKEN_BUCKETS, the H200 table's, unless given)."""
    return next((b for b in buckets if tokens <= b), buckets[-1])


def default_config(tokens: int, top_k: int, experts: int, on_rocm: bool) -> MoEConfig:
    """Portable heuristic (any GPU, any shape): BLOCK_M from the mean rows per routed expert; small-M tiles are
    memory-bound (narrow BLOCK_N for many programs, long BLOCK_K per load), larger ones compute-bound. The tiles
    fit 64 KB of shared memory (MI300) with ROCm's 2 stages."""
    rows = tokens * top_k / max(experts, 1)
    stages = 2 if on_rocm else 3
    # GROUP_M 8 everywhere: it lets the shared expert's many row tiles share weight tiles in L2, and costs
    # nothing when every tile is a different expert.
    if rows <= 16:
        return _cfg(16, 8, (32, 128, 4, stages), (64, 128, 4, stages))
    if rows <= 32:
        return _cfg(32, 8, (32, 128, 4, stages), (64, 128, 4, stages))
    return _cfg(64, 8, (64, 64, 4, stages), (128, 64, 4, stages))


def select_config(tokens: int, hidden: int, inter: int, experts: int, top_k: int, device: torch.device,
                  dtype: torch.dtype = torch.bfloat16, w_fp8: bool = False) -> MoEConfig:
    """The tile configuration for this call: interpreter, the backend's table (H200_CONFIGS or HIP_CONFIGS; 16-bit
    operands: fp32 tiles would need twice their shared memory; MXFP8 experts use fp8_configs.py's table where it
    has the shape), or the portable heuristic."""
    kind = backend(device)
    if kind == "interpret":
        return INTERPRETER_CONFIG
    sixteen_bit = dtype.itemsize == 2
    if w_fp8 and sixteen_bit:
        entry = moe_entry(kind, hidden, inter, experts, tokens)
        if entry is not None:
            return _cfg(*entry[1:], fp8_variant=entry[0])
    tuned = (H200_CONFIGS if kind == "cuda" else HIP_CONFIGS).get((hidden, inter, experts)) if sixteen_bit else None
    if tuned is not None:
        return tuned[token_bucket(tokens, tuple(sorted(tuned)))]
    return default_config(tokens, top_k, experts, on_rocm=kind == "hip")


# --------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _swiglu_store(acc_gate, acc_up, act_ptr, rows, cols, inter, stride_ar, alpha, limit):
    """SwiGLU-OAI of a tile's fp32 gate/up sums, stored as its activation rows."""
    gate = tl.minimum(acc_gate, limit)
    up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    act = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_ar + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=cols[None, :] < inter)


@triton.jit
def _rows_gemv(acc, a_ptrs, a_mask, w_ptrs, s_ptrs, k_total, stride_wn, stride_sn,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The "gemv" variant's K loop: acc [ROWS, BLOCK_N, BLOCK_K // 32] += per-32-column-block sums of the ROWS
    activation rows at a_ptrs times the fp8 weight rows at w_ptrs, each block times its 2^(S - 127)
    (fp8_tile.mx_tile_gemv). a_mask [ROWS] drops pad rows."""
    ks = tl.arange(0, BLOCK_K)
    for k in range(0, k_total, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_mask[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=a_mask[:, None] & (ks < k_total - k)[None, :], other=0.0)
        acc = mx_tile_gemv(acc, a, w_ptrs, s_ptrs, k_total - k, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        s_ptrs += BLOCK_K // 32
    return acc


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _up_swiglu_kernel(x_ptr, w13_ptr, act_ptr, sorted_ids_ptr, block_expert_ptr,
                      num_pairs, num_blocks, inter, hidden, stride_xt, stride_we, stride_wn, stride_ar,
                      alpha, limit, s13_ptr, stride_se, stride_sn, w13_desc,
                      KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, W_FP8: tl.constexpr,
                      VARIANT: tl.constexpr, TMA: tl.constexpr, ROWS: tl.constexpr):
    """act[row, n] = swiglu_oai(x[token(row)] . w13[e, n], x[token(row)] . w13[e, inter + n]) for one tile.
    MXFP8 weights (W_FP8) are dequantised as VARIANT says (fp8_linear.py: 0 acc, 1 gather, 2 bcast, 3 swap,
    4 scaled, 6 gemv: only the tile's first ROWS rows, on CUDA cores). TMA: 16-bit weight tiles through w13_desc,
    a descriptor over w13 viewed as [S * 2I, H]."""
    pid_m, pid_n = tile_coords(tl.program_id(0), num_blocks, tl.cdiv(inter, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    if VARIANT == 6:  # a batch of at most ROWS tokens: every tile's real rows are among its first ROWS
        rows = pid_m * BLOCK_M + tl.arange(0, ROWS)
        pair = tl.load(sorted_ids_ptr + rows)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = (cols % inter).to(tl.int64)
        x_ptrs = x_ptr + (pair // KP).to(tl.int64)[:, None] * stride_xt + tl.arange(0, BLOCK_K)[None, :]
        g_rows = w13_ptr + expert.to(tl.int64) * stride_we + w_rows[:, None] * stride_wn \
            + tl.arange(0, BLOCK_K)[None, :]
        gs_rows = s13_ptr + expert.to(tl.int64) * stride_se + w_rows[:, None] * stride_sn \
            + tl.arange(0, BLOCK_K // 32)[None, :]
        zero = tl.zeros((ROWS, BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        real = pair < num_pairs
        acc_gate = _rows_gemv(zero, x_ptrs, real, g_rows, gs_rows, hidden, stride_wn, stride_sn,
                              ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        acc_up = _rows_gemv(zero, x_ptrs, real, g_rows + inter * stride_wn, gs_rows + inter * stride_sn, hidden,
                            stride_wn, stride_sn, ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        _swiglu_store(tl.sum(acc_gate, axis=2), tl.sum(acc_up, axis=2), act_ptr, rows, cols, inter, stride_ar,
                      alpha, limit)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    real = pair < num_pairs
    token = (pair // KP).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (cols % inter).to(tl.int64)  # the ragged last tile re-reads valid rows; those columns are not stored
    ks = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * stride_xt + ks[None, :]
    gate_ptrs = w13_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + ks[:, None]
    up_ptrs = gate_ptrs + inter * stride_wn
    # MXFP8 weights (W_FP8): the matching E8M0 scales, one per 32 K columns, dequantised in registers.
    gate_s_ptrs = s13_ptr + expert.to(tl.int64) * stride_se + w_rows[None, :] * stride_sn + ks[:, None] // 32
    up_s_ptrs = gate_s_ptrs + inter * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = hidden
    if VARIANT >= 2:  # [BLOCK_N, BLOCK_K] weight rows + [BLOCK_N, BLOCK_K // 32] scales (fp8_linear.py)
        if VARIANT == 3:
            acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        # Each K step as PARTS dots of PART_K columns. "scaled" 128-column steps run as two halves: Triton 3.9
        # widens the whole weight tile to bf16 in registers before the MMA, which beside the two fp32 accumulators
        # of a 128 x 128 tile spills on sm_90; halves fit, with the same loads per step and the same MMAs in the
        # same order (so the same sums).
        PARTS: tl.constexpr = 2 if VARIANT == 4 and BLOCK_K >= 128 else 1
        PART_K: tl.constexpr = BLOCK_K // PARTS
        kp = tl.arange(0, PART_K)
        xp_ptrs = x_ptr + token[:, None] * stride_xt + kp[None, :]
        g_rows = w13_ptr + expert.to(tl.int64) * stride_we + w_rows[:, None] * stride_wn + kp[None, :]
        gs_rows = s13_ptr + expert.to(tl.int64) * stride_se + w_rows[:, None] * stride_sn \
            + tl.arange(0, PART_K // 32)[None, :]
        for k in range(0, hidden, BLOCK_K):
            for part in tl.static_range(PARTS):
                k_left = hidden - k - part * PART_K
                if EVEN_K:
                    a = tl.load(xp_ptrs + part * PART_K, mask=real[:, None], other=0.0)
                else:
                    a = tl.load(xp_ptrs + part * PART_K, mask=real[:, None] & (kp < k_left)[None, :], other=0.0)
                g_part = g_rows + part * PART_K
                gs_part = gs_rows + part * (PART_K // 32)
                acc_gate = mx_tile_dot(acc_gate, a, g_part, gs_part, k_left, BLOCK_N, PART_K, EVEN_K, VARIANT)
                acc_up = mx_tile_dot(acc_up, a, g_part + inter * stride_wn, gs_part + inter * stride_sn, k_left,
                                     BLOCK_N, PART_K, EVEN_K, VARIANT)
            xp_ptrs += BLOCK_K
            g_rows += BLOCK_K
            gs_rows += BLOCK_K // 32
        if VARIANT == 3:
            acc_gate = tl.trans(acc_gate)
            acc_up = tl.trans(acc_up)
        k_end = 0
    if VARIANT == 0:  # small BLOCK_M, full K tiles: scales on the accumulator per 32 columns
        k32 = tl.arange(0, 32)
        a32 = x_ptr + token[:, None] * stride_xt + k32[None, :]
        g32 = w13_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + k32[:, None]
        gs32 = s13_ptr + expert.to(tl.int64) * stride_se + w_rows * stride_sn
        for k in range(0, hidden, BLOCK_K):
            acc_gate = scaled_block_dot(acc_gate, a32, real[:, None], g32, gs32, k, BLOCK_K,
                                        x_ptr.dtype.element_ty)
            acc_up = scaled_block_dot(acc_up, a32, real[:, None], g32 + inter * stride_wn, gs32 + inter * stride_sn,
                                      k, BLOCK_K, x_ptr.dtype.element_ty)
        k_end = 0
    if TMA:
        # [BLOCK_N, BLOCK_K] tiles of the expert's gate rows and of its up rows. The descriptor reads zeros past H
        # (no K mask); a ragged last column tile reads rows of the next part or expert, whose columns are not
        # stored.
        w_row = expert * (2 * inter) + pid_n * BLOCK_N
        for k in range(0, hidden, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=real[:, None], other=0.0)
            else:
                a = tl.load(x_ptrs, mask=real[:, None] & (ks[None, :] < hidden - k), other=0.0)
            gate_w = w13_desc.load([w_row, k])
            up_w = w13_desc.load([w_row + inter, k])
            acc_gate = tl.dot(a, tl.trans(gate_w), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, tl.trans(up_w), acc_up, input_precision="ieee")
            x_ptrs += BLOCK_K
        k_end = 0
    for k in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=real[:, None], other=0.0)
            if W_FP8:
                gate_w = dequant_fp8_tile(gate_ptrs, gate_s_ptrs, None, x_ptr.dtype.element_ty, False)
                up_w = dequant_fp8_tile(up_ptrs, up_s_ptrs, None, x_ptr.dtype.element_ty, False)
            else:
                gate_w = tl.load(gate_ptrs)
                up_w = tl.load(up_ptrs)
        else:
            in_k = ks < hidden - k
            a = tl.load(x_ptrs, mask=real[:, None] & in_k[None, :], other=0.0)
            if W_FP8:
                gate_w = dequant_fp8_tile(gate_ptrs, gate_s_ptrs, in_k[:, None], x_ptr.dtype.element_ty, True)
                up_w = dequant_fp8_tile(up_ptrs, up_s_ptrs, in_k[:, None], x_ptr.dtype.element_ty, True)
            else:
                gate_w = tl.load(gate_ptrs, mask=in_k[:, None], other=0.0)
                up_w = tl.load(up_ptrs, mask=in_k[:, None], other=0.0)
        # "ieee" only matters for fp32 operands (exact products instead of TF32); 16-bit operands ignore it.
        acc_gate = tl.dot(a, gate_w, acc_gate, input_precision="ieee")
        acc_up = tl.dot(a, up_w, acc_up, input_precision="ieee")
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        gate_s_ptrs += BLOCK_K // 32
        up_s_ptrs += BLOCK_K // 32

    # Pad rows are stored too (as swiglu(0) = 0): GEMM 2 reads whole, finite tiles without row masks.
    _swiglu_store(acc_gate, acc_up, act_ptr, rows, cols, inter, stride_ar, alpha, limit)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_weighted_kernel(act_ptr, w2_ptr, copies_ptr, sorted_ids_ptr, block_expert_ptr, topk_weights_ptr,
                          num_pairs, num_blocks, hidden, inter, stride_ar, stride_we, stride_wn, stride_ct,
                          routed_scale, s2_ptr, stride_se, stride_sn, act_desc, w2_desc,
                          TOPK: tl.constexpr, FOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, W_FP8: tl.constexpr,
                          VARIANT: tl.constexpr, TMA: tl.constexpr, ROWS: tl.constexpr):
    """copies[pair, n] = weight(pair) * act[row] . w2[e, n] for one tile; weight = scale * w (routed) or 1 (shared).
    TMA: 16-bit tiles through act_desc (over act [rows, I]) and w2_desc (over w2 viewed as [S * H, I]). VARIANT 6
    (MXFP8 "gemv"): only the tile's first ROWS rows, on CUDA cores, as in GEMM 1."""
    pid_m, pid_n = tile_coords(tl.program_id(0), num_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    if VARIANT == 6:
        rows = pid_m * BLOCK_M + tl.arange(0, ROWS)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = (cols % hidden).to(tl.int64)
        a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar + tl.arange(0, BLOCK_K)[None, :]
        w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + w_rows[:, None] * stride_wn \
            + tl.arange(0, BLOCK_K)[None, :]
        s_ptrs = s2_ptr + expert.to(tl.int64) * stride_se + w_rows[:, None] * stride_sn \
            + tl.arange(0, BLOCK_K // 32)[None, :]
        acc = _rows_gemv(tl.zeros((ROWS, BLOCK_N, BLOCK_K // 32), dtype=tl.float32), a_ptrs,
                         tl.full((ROWS,), 1, tl.int1), w_ptrs, s_ptrs, inter, stride_wn, stride_sn,
                         ROWS, BLOCK_N, BLOCK_K, EVEN_K)
        _store_weighted(tl.sum(acc, axis=2), copies_ptr, sorted_ids_ptr, topk_weights_ptr, rows, cols, num_pairs,
                        hidden, stride_ct, routed_scale, TOPK, FOLD)
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = (cols % hidden).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)

    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_ar + ks[None, :]
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + ks[:, None]
    s_ptrs = s2_ptr + expert.to(tl.int64) * stride_se + w_rows[None, :] * stride_sn + ks[:, None] // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = inter
    if VARIANT >= 2:
        if VARIANT == 3:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        kb = tl.arange(0, BLOCK_K // 32)
        w_rows_ptrs = w2_ptr + expert.to(tl.int64) * stride_we + w_rows[:, None] * stride_wn + ks[None, :]
        s_rows_ptrs = s2_ptr + expert.to(tl.int64) * stride_se + w_rows[:, None] * stride_sn + kb[None, :]
        for k in range(0, inter, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=(ks < inter - k)[None, :], other=0.0)
            acc = mx_tile_dot(acc, a, w_rows_ptrs, s_rows_ptrs, inter - k, BLOCK_N, BLOCK_K, EVEN_K, VARIANT)
            a_ptrs += BLOCK_K
            w_rows_ptrs += BLOCK_K
            s_rows_ptrs += BLOCK_K // 32
        if VARIANT == 3:
            acc = tl.trans(acc)
        k_end = 0
    if VARIANT == 0:
        k32 = tl.arange(0, 32)
        a32 = act_ptr + rows[:, None].to(tl.int64) * stride_ar + k32[None, :]
        w32 = w2_ptr + expert.to(tl.int64) * stride_we + w_rows[None, :] * stride_wn + k32[:, None]
        s32 = s2_ptr + expert.to(tl.int64) * stride_se + w_rows * stride_sn
        for k in range(0, inter, BLOCK_K):
            acc = scaled_block_dot(acc, a32, None, w32, s32, k, BLOCK_K, act_ptr.dtype.element_ty)
        k_end = 0
    if TMA:  # zeros past I (no K mask); a ragged last column tile's extra rows are not stored
        w_row = expert * hidden + pid_n * BLOCK_N
        a_row = pid_m * BLOCK_M
        for k in range(0, inter, BLOCK_K):
            a = act_desc.load([a_row, k])
            w = w2_desc.load([w_row, k])
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        k_end = 0
    for k in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            if W_FP8:
                w = dequant_fp8_tile(w_ptrs, s_ptrs, None, act_ptr.dtype.element_ty, False)
            else:
                w = tl.load(w_ptrs)
        else:
            in_k = ks < inter - k
            a = tl.load(a_ptrs, mask=in_k[None, :], other=0.0)
            if W_FP8:
                w = dequant_fp8_tile(w_ptrs, s_ptrs, in_k[:, None], act_ptr.dtype.element_ty, True)
            else:
                w = tl.load(w_ptrs, mask=in_k[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision="ieee")
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        s_ptrs += BLOCK_K // 32

    _store_weighted(acc, copies_ptr, sorted_ids_ptr, topk_weights_ptr, rows, cols, num_pairs, hidden, stride_ct,
                    routed_scale, TOPK, FOLD)


@triton.jit
def _store_weighted(acc, copies_ptr, sorted_ids_ptr, topk_weights_ptr, rows, cols, num_pairs, hidden, stride_ct,
                    routed_scale, TOPK: tl.constexpr, FOLD: tl.constexpr):
    """copies[pair(row)] = weight(pair) * acc[row] for a tile's real rows (GEMM 2's epilogue)."""
    KP: tl.constexpr = TOPK + FOLD
    pair = tl.load(sorted_ids_ptr + rows)
    real = pair < num_pairs
    token = pair // KP
    choice = pair % KP
    weight = tl.load(topk_weights_ptr + token * TOPK + choice, mask=real & (choice < TOPK), other=0.0) * routed_scale
    if FOLD:
        weight = tl.where(choice == TOPK, 1.0, weight)
    out = acc * weight[:, None]
    tl.store(copies_ptr + pair[:, None].to(tl.int64) * stride_ct + cols[None, :],
             out.to(copies_ptr.dtype.element_ty), mask=real[:, None] & (cols[None, :] < hidden))


@triton.jit(do_not_specialize=["num_pairs"])
def _sum_copies_kernel(copies_ptr, out_ptr, topk_ids_ptr, expert_map_ptr, num_pairs, hidden, shared_slot,
                       TOPK: tl.constexpr, FOLD: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over the token's computed pairs of copies[pair], accumulated in fp32."""
    KP: tl.constexpr = TOPK + FOLD
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = cols < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(KP):
        pair = token * KP + j
        slot = pair_expert(pair, num_pairs, topk_ids_ptr, expert_map_ptr, shared_slot, TOPK, FOLD, HAS_MAP)
        computed = tl.where(slot >= 0, in_h, False)  # not `in_h & (slot >= 0)`: the interpreter mistypes it
        acc += tl.load(copies_ptr + pair.to(tl.int64) * hidden + cols, mask=computed, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=in_h)


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------


def _tma_fits(w13: torch.Tensor, w2: torch.Tensor, act: torch.Tensor) -> bool:
    """TMA descriptors need 16-bit (or fp32, in the interpreter's tests) contiguous operands whose rows start on
    16-byte boundaries; MXFP8 weights are dequantised through registers and never use them."""
    return all(t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.is_contiguous()
               and (t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (w13, w2, act))


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    """A host-side TMA descriptor over the 2-D tensor t, for [block_rows, block_cols] tiles (zeros past its edges)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, t.shape, t.stride(), [block_rows, block_cols])



def _gemms(x, w13, w2, s13, s2, sorted_ids, block_expert, num_blocks, num_pairs, topk_weights, act, copies, cfg,
           w_fp8, fp8_variant, tma, *, alpha, limit, routed_scaling_factor, fold) -> None:
    """GEMM 1 (gate/up + SwiGLU into `act`) and GEMM 2 (down, weighted, into `copies`) over `num_blocks` aligned
    blocks: block b holds the pairs sorted_ids[b * BLOCK_M:][:BLOCK_M] (pad rows: num_pairs) of slot
    block_expert[b] (-1: skipped), its SwiGLU rows at act[b * BLOCK_M:]."""
    tokens, hidden = x.shape
    slots, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_weights.shape[-1]
    rows = triton.next_power_of_2(min(tokens, MOE_GEMV_MAX_TOKENS))
    up, down = cfg.up, cfg.down
    use_tma = tma and cfg.tma and _tma_fits(w13, w2, act)
    w13_desc = _descriptor(w13.view(slots * two_inter, hidden), up.block_n, up.block_k) if use_tma else w13
    w2_desc = _descriptor(w2.view(slots * hidden, inter), down.block_n, down.block_k) if use_tma else w2
    act_desc = _descriptor(act, cfg.block_m, down.block_k) if use_tma else act
    _up_swiglu_kernel[(num_blocks * triton.cdiv(inter, up.block_n),)](
        x, w13, act, sorted_ids, block_expert,
        num_pairs, num_blocks, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        float(alpha), float(limit), s13, s13.stride(0), s13.stride(1), w13_desc,
        KP=top_k + int(fold), BLOCK_M=cfg.block_m, BLOCK_N=up.block_n, BLOCK_K=up.block_k, GROUP_M=cfg.group_m,
        EVEN_K=hidden % up.block_k == 0, W_FP8=w_fp8,
        VARIANT=variant_code(fp8_variant, cfg.block_m, hidden % up.block_k == 0, x.dtype)
        if w_fp8 else 1,
        TMA=use_tma, ROWS=rows, num_warps=up.num_warps, num_stages=up.num_stages)

    _down_weighted_kernel[(num_blocks * triton.cdiv(hidden, down.block_n),)](
        act, w2, copies, sorted_ids, block_expert, topk_weights,
        num_pairs, num_blocks, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
        copies.stride(0), float(routed_scaling_factor), s2, s2.stride(0), s2.stride(1), act_desc, w2_desc,
        TOPK=top_k, FOLD=fold, BLOCK_M=cfg.block_m, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        GROUP_M=cfg.group_m, EVEN_K=inter % down.block_k == 0, W_FP8=w_fp8,
        VARIANT=variant_code(fp8_variant, cfg.block_m, inter % down.block_k == 0, x.dtype)
        if w_fp8 else 1,
        TMA=use_tma, ROWS=rows, num_warps=down.num_warps, num_stages=down.num_stages)


def _grouped_dequantised_gemms(x, w13, w2, s13, s2, align, topk_weights, act, copies, cfg, tma, group_bytes, *,
                               alpha, limit, routed_scaling_factor, fold) -> None:
    """The GEMMs of a long call with MXFP8 experts (switch moe_dequant_prefill): a group of slots at a time, both
    stacks of the group dequantised to x's dtype (`fp8_linear.dequantize`: the values the MXFP8 kernels multiply)
    and the 16-bit kernels run with the group's slots renumbered from 0 and every other block marked -1, so its
    programs exit at once. The copy of one group is freed before the next is made: the transient is one group's.

    The grids stay whole because which blocks a group owns is known on the device only; reading their ranges back
    to size the grids would stall the host once per MoE layer, and with async scheduling that cost more (W2's TTFT
    p50 on one H100: 502 ms against 419 ms with whole grids, groups of 2 GiB) than the exiting programs do."""
    slots, two_inter, hidden = w13.shape
    inter = two_inter // 2
    group = max(1, min(slots, group_bytes // (3 * inter * hidden * x.element_size())))
    firsts = range(0, slots, group)
    if len(firsts) == 1:
        local = align.block_expert[None]
    else:  # every group's renumbered block table at once: [groups, max_blocks], -1 outside the group
        # (made on the device: a tensor copied from the host would wait for the GPU, stalling async scheduling)
        starts = torch.arange(0, slots, group, dtype=torch.int32, device=x.device)
        local = align.block_expert[None] - starts[:, None]
        local = torch.where((local >= 0) & (local < group), local, -1).to(torch.int32)
    for i, first in enumerate(firsts):
        last = min(slots, first + group)
        n = last - first
        g13 = dequantize(w13[first:last].reshape(n * two_inter, hidden), s13[first:last].reshape(n * two_inter, -1),
                         x.dtype).view(n, two_inter, hidden)
        g2 = dequantize(w2[first:last].reshape(n * hidden, inter), s2[first:last].reshape(n * hidden, -1),
                        x.dtype).view(n, hidden, inter)
        _gemms(x, g13, g2, g13, g2, align.sorted_pair_ids, local[i], align.max_blocks, align.num_pairs,
               topk_weights, act, copies, cfg, False, "auto", tma, alpha=alpha, limit=limit,
               routed_scaling_factor=routed_scaling_factor, fold=fold)
        del g13, g2


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, alpha: float, limit: float, expert_map: torch.Tensor | None = None,
              routed_scaling_factor: float = 1.0, fold_shared: bool = False,
              config: MoEConfig | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, tma: bool = True,
              alignment: MoEAlignment | None = None, dequant_min_tokens: int | None = None,
              dequant_group_bytes: int = MOE_DEQUANT_GROUP_BYTES,
              wgmma_min_tokens: int | None = None) -> torch.Tensor:
    """routed_scaling_factor * sum_k topk_weights[t, k] * Expert_{topk_ids[t, k]}(x[t])  (+ shared expert).

    x [T, H]; w13 [S, 2I, H] (per slot: I gate rows, then I up rows); w2 [S, H, I]; topk_ids [T, k] int32 global
    expert ids; topk_weights [T, k] fp32. With fold_shared, slot S-1 is the shared expert and is added with
    weight 1 for every token. expert_map [E_global] int32: global id -> local slot, -1 = skip. `config` overrides
    the tile table (benchmarks). MXFP8 experts: w13 / w2 in float8_e4m3fn with w13_scale [S, 2I, H/32] and
    w2_scale [S, H, I/32] (uint8 E8M0, one per 32 input columns), dequantised in registers (fp8_linear.py);
    x stays in its dtype. tma=False (switch moe_tma off): pointer loads even where the tile entry asks for TMA
    descriptors. `alignment`: the pairs already aligned (by moe_route.py's route_and_align, with the config's
    block_m), instead of running moe_align here. dequant_min_tokens (switch moe_dequant_prefill): MXFP8 experts
    called with at least this many tokens are dequantised to x's dtype and run the 16-bit kernels, a group of
    slots of at most `dequant_group_bytes` (in 16 bits) at a time (`_grouped_dequantised_gemms`). wgmma_min_tokens
    (switch moe_wgmma): MXFP8 experts called with at least this many tokens run moe_wgmma.py's Gluon kernels where
    `moe_wgmma.supported` says they apply (before dequant_min_tokens is considered). Returns [T, H] in x's
    dtype."""
    tokens, hidden = x.shape
    slots, two_inter, w13_hidden = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[-1]
    if w13_hidden != hidden or two_inter % 2 or tuple(w2.shape) != (slots, hidden, inter):
        raise ValueError(f"expert weights w13 {list(w13.shape)} / w2 {list(w2.shape)} do not fit hidden {hidden}")
    if tuple(topk_weights.shape) != (tokens, top_k) or tuple(topk_ids.shape) != (tokens, top_k):
        raise ValueError(f"topk_ids {list(topk_ids.shape)} / topk_weights {list(topk_weights.shape)} must be "
                         f"[{tokens}, k]")
    w_fp8 = w13_scale is not None
    if w_fp8 != (w2_scale is not None):
        raise ValueError("w13_scale and w2_scale must be given together (MXFP8 experts) or not at all")
    if w_fp8:
        if not (w13.dtype == w2.dtype == torch.float8_e4m3fn) or w13_scale.dtype != torch.uint8 \
                or w2_scale.dtype != torch.uint8:
            raise ValueError(f"MXFP8 experts need float8_e4m3fn weights and uint8 scales, got {w13.dtype}, "
                             f"{w2.dtype}, {w13_scale.dtype}, {w2_scale.dtype}")
        if tuple(w13_scale.shape) != (slots, two_inter, hidden // 32) or hidden % 32 or inter % 32 \
                or tuple(w2_scale.shape) != (slots, hidden, inter // 32):
            raise ValueError(f"MXFP8 scales w13_scale {list(w13_scale.shape)} / w2_scale {list(w2_scale.shape)} "
                             f"do not fit w13 {list(w13.shape)} / w2 {list(w2.shape)} (one per 32 columns)")
    elif not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13, w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if tokens == 0:
        return x.new_empty((0, hidden))
    if alignment is not None and (tokens > MAX_TOKENS_PER_CALL
                                  or alignment.num_pairs != tokens * (top_k + int(fold_shared))):
        raise ValueError(f"alignment holds {alignment.num_pairs} pairs; {tokens} tokens x {top_k} experts "
                         f"(+ shared: {fold_shared}) need {tokens * (top_k + int(fold_shared))}, in one call")
    if tokens > MAX_TOKENS_PER_CALL:
        out = torch.empty_like(x)
        for start in range(0, tokens, MAX_TOKENS_PER_CALL):
            part = slice(start, start + MAX_TOKENS_PER_CALL)
            out[part] = fused_moe(x[part], w13, w2, topk_weights[part], topk_ids[part], alpha=alpha, limit=limit,
                                  expert_map=expert_map, routed_scaling_factor=routed_scaling_factor,
                                  fold_shared=fold_shared, config=config, w13_scale=w13_scale,
                                  w2_scale=w2_scale, tma=tma, dequant_min_tokens=dequant_min_tokens,
                                  dequant_group_bytes=dequant_group_bytes, wgmma_min_tokens=wgmma_min_tokens)
        return out

    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no-ops for the layer's parameters
    # Without MXFP8 scales the scale pointers are placeholders the kernels never read (W_FP8=False).
    s13 = w13_scale.contiguous() if w_fp8 else w13
    s2 = w2_scale.contiguous() if w_fp8 else w2
    topk_ids = topk_ids.to(torch.int32).contiguous()
    topk_weights = topk_weights.to(torch.float32).contiguous()
    if expert_map is not None:
        expert_map = expert_map.to(torch.int32).contiguous()
    fold = bool(fold_shared)
    wgmma = (w_fp8 and wgmma_min_tokens is not None and tokens >= wgmma_min_tokens
             and (alignment is None or alignment.block_m == moe_wgmma.BLOCK_M)
             and moe_wgmma.supported(x, w13, w2, s13, s2))
    dequant = w_fp8 and not wgmma and dequant_min_tokens is not None and tokens >= dequant_min_tokens
    # a call that dequantises first runs the 16-bit kernels, with the 16-bit table's tiles
    cfg = config or select_config(tokens, hidden, inter, slots - int(fold), top_k, x.device, x.dtype,
                                  w_fp8 and not dequant)
    if wgmma:  # the Gluon kernels' row tiles set the alignment's padding unit
        cfg = replace(cfg, block_m=moe_wgmma.BLOCK_M)

    if alignment is not None and alignment.block_m != cfg.block_m:
        raise ValueError(f"alignment has block_m {alignment.block_m}; this call's tiles use {cfg.block_m}")
    align = alignment or moe_align(topk_ids, slots, cfg.block_m, expert_map=expert_map, fold_shared=fold)
    # MXFP8 "gemv" computes only the first ROWS rows of a tile: every real row is among them when the whole batch
    # has at most ROWS tokens (a token sends at most one row to an expert). Larger batches take "bcast".
    fp8_variant = cfg.fp8_variant
    if fp8_variant == "gemv" and tokens > MOE_GEMV_MAX_TOKENS:
        fp8_variant = "bcast"
    act = torch.empty(align.max_blocks * cfg.block_m, inter, dtype=x.dtype, device=x.device)
    copies = torch.empty(align.num_pairs, hidden, dtype=x.dtype, device=x.device)
    if wgmma:
        moe_wgmma.gemms(x, w13, w2, s13, s2, align.sorted_pair_ids, align.block_expert, align.max_blocks,
                        align.num_pairs, topk_weights, act, copies, alpha=alpha, limit=limit,
                        routed_scaling_factor=routed_scaling_factor, fold=fold)
    elif dequant:
        _grouped_dequantised_gemms(x, w13, w2, s13, s2, align, topk_weights, act, copies, cfg, tma,
                                   dequant_group_bytes, alpha=alpha, limit=limit,
                                   routed_scaling_factor=routed_scaling_factor, fold=fold)
    else:
        _gemms(x, w13, w2, s13, s2, align.sorted_pair_ids, align.block_expert, align.max_blocks, align.num_pairs,
               topk_weights, act, copies, cfg, w_fp8, fp8_variant, tma, alpha=alpha, limit=limit,
               routed_scaling_factor=routed_scaling_factor, fold=fold)

    out = torch.empty_like(x)
    emap = expert_map if expert_map is not None else topk_ids  # a placeholder pointer when there is no map
    _sum_copies_kernel[(tokens, triton.cdiv(hidden, REDUCE_BLOCK_H))](
        copies, out, topk_ids, emap, align.num_pairs, hidden, slots - 1,
        TOPK=top_k, FOLD=fold, HAS_MAP=expert_map is not None, BLOCK_H=REDUCE_BLOCK_H)
    return out


def fused_route_moe(x: torch.Tensor, router_logits: torch.Tensor, correction_bias: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, *, top_k: int, alpha: float, limit: float,
                    expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                    fold_shared: bool = False, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None,
                    tma: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Route and align in one launch (moe_route.py), then the fused MoE on that alignment: the same result as
    `reference.route` followed by `fused_moe`, for the batches moe_route.route_align_fits admits.
    router_logits [T, E] fp32 and correction_bias [E] fp32; the rest as in fused_moe. Returns
    (out [T, H], topk_weights [T, k] fp32, topk_ids [T, k] int32)."""
    slots, two_inter, hidden = w13.shape
    fold = bool(fold_shared)
    cfg = select_config(x.shape[0], hidden, two_inter // 2, slots - int(fold), top_k, x.device, x.dtype,
                        w13_scale is not None)
    weights, ids, align = route_and_align(router_logits, correction_bias, top_k, slots, cfg.block_m,
                                          expert_map=expert_map, fold_shared=fold)
    out = fused_moe(x, w13, w2, weights, ids, alpha=alpha, limit=limit, expert_map=expert_map,
                    routed_scaling_factor=routed_scaling_factor, fold_shared=fold, config=cfg,
                    w13_scale=w13_scale, w2_scale=w2_scale, tma=tma, alignment=align)
    return out, weights, ids
