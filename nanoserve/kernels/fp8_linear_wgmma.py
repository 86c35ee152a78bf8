"""The MXFP8 linear at decode batch sizes on Hopper (sm_90), in Gluon: out = x @ dequant(W)^T, streaming W once.

A decode step multiplies a few dozen token rows by each projection's weights, so the linear is bound by reading
the weights (1 byte each, plus a scale per 32) and fp8_linear.py's Triton kernels reach only about a third of the
copy ceiling there: each program loads a tile, turns it into bf16 and then multiplies, one after the other
(docs/mxfp8.md). This kernel uses the layout of moe_wgmma.py's GEMM 2 - the same ring, pieces and MMA loop - with
the roles it needs for a dense weight:

    loader (4 warps)       TMA: ROWS fp8 weight rows x 128 K columns a step, and the BM token rows of x for
                           those columns (rows past the batch read as zeros); cp.async: the rows' scale words.
    2 x MMA (4 warps each) each owns half of the slot's weight rows (ROWS = 256: two 64-row accumulators), and
                           dequantises them 32 columns at a time into the register operand A of the warpgroup
                           MMA (weights x tokens^T, so the batch is the MMA's N: 16 to 128 tokens).

The weights go from memory to the tensor cores through one shared-memory slot, the loader stays STAGES steps
ahead, and the two MMA warpgroups take turns. A batch's column tiles are few (a 6,144-wide projection has 48 of
128 rows), so K is split as many ways as one wave of programs allows (`plan`), each split writing fp32 partial
sums that fp8_linear.py's `sum_splits` adds in split order (deterministic). On one H100 the kernel reads its
weights at about half the copy ceiling, 1.4-2.2x the Triton kernels at 64 rows: the dequantisation in the MMA
warps bounds it (docs/optimizations.md).

Exact per product (each weight is fp8 x 2^(S - 127) rounded to bf16, which is the dequantised weight itself); the
sums are in fp32 in K order within a split, so results differ from fp8_linear.py's only by accumulation order.
Only for CUDA sm_90 with Triton >= 3.6, bf16 activations, K a multiple of 128; `supported` says whether a call
qualifies and fp8_linear.fp8_linear keeps its Triton kernels otherwise.
"""

from __future__ import annotations

import torch
import triton

from nanoserve.kernels import moe_wgmma
from nanoserve.kernels.configs import sm_count

HAVE_GLUON = moe_wgmma.HAVE_GLUON
BLOCK_K = moe_wgmma.BLOCK_K
ROW_CHOICES = (128, 256)
"""Weight rows (output columns) per program: each MMA warpgroup multiplies half of them (256: as two 64-row MMAs).
`plan` takes the narrower tile when the grid still fits in one wave."""
MAX_BM = 128
"""Token rows per program at most; a larger batch takes several row tiles, which share each weight tile in L2."""
SHARED_BYTES = 232_448
"""Shared memory an H100/H200 block may use (227 KB): the ring takes as many slots as fit (`stages_for`)."""

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # moe_wgmma's building blocks: the TMA / cp.async copies, the ring, the MMA loop and the tile order
    from nanoserve.kernels.moe_wgmma import _cp_async, _mma, _ring, _tile, _tma_load

    _BK = gl.constexpr(BLOCK_K)

    @gluon.jit
    def _loader(x_desc, w_desc, s_ptr, stride_sn, n_total, row0, w_row0, k_first, steps,
                x_smem, w_smem, s_smem, ready, free, BM: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr):
        """Fill ring slot i % STAGES with K step k_first + i once both MMA warpgroups have freed it."""
        s_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        s_rows = (w_row0 + gl.arange(0, ROWS, layout=s_layout)) % n_total  # a ragged last tile: TMA reads zeros
        s_ptrs = s_ptr + s_rows.to(gl.int64) * stride_sn + k_first
        for i in range(steps):
            slot = i % STAGES
            mbarrier.wait(free.index(slot), ((i // STAGES) - 1) & 1, pred=i >= STAGES)
            bar = ready.index(slot)
            mbarrier.expect(bar, ROWS * _BK + BM * _BK * 2)
            k = (k_first + i) * _BK
            _tma_load(w_desc, [w_row0, k], bar, w_smem.index(slot))
            for h in gl.static_range(2):
                _tma_load(x_desc, [row0, k + h * 64], bar, x_smem.index(slot * 2 + h))
            _cp_async(s_smem.index(slot), s_ptrs + i)
            async_copy.mbarrier_arrive(bar, increment_count=False)  # ready's count: 128 loader threads + 1

    @gluon.jit
    def _store(acc, out_base, stride_om, m_total, n_total, row0, col0, BM: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        cols = col0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        toks = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        gl.store(out_base + toks[None, :].to(gl.int64) * stride_om + cols[:, None],
                 acc.to(out_base.dtype.element_ty), mask=(toks[None, :] < m_total) & (cols[:, None] < n_total))

    @gluon.jit
    def _part(x_smem, w_smem, s_smem, ready, free, steps, out_base, stride_om, m_total, n_total, row0, col0,
              G: gl.constexpr, BM: gl.constexpr, ROWS: gl.constexpr, STAGES: gl.constexpr):
        """MMA warpgroup G: out[token, column] for its ROWS // 2 weight rows of the tile, over this split's K."""
        half: gl.constexpr = ROWS // 2
        acc0, acc1 = _mma(x_smem, w_smem, s_smem, ready, free, steps * _BK, G * half, BM, STAGES, half == 128)
        _store(acc0, out_base, stride_om, m_total, n_total, row0, col0 + G * half, BM)
        if half == 128:
            _store(acc1, out_base, stride_om, m_total, n_total, row0, col0 + G * half + 64, BM)

    @gluon.jit(do_not_specialize=["m_total"])
    def _fp8_linear_wgmma_kernel(x_desc, w_desc, s_ptr, out_ptr, m_total, n_total, k_steps, steps_per_split,
                                 stride_sn, stride_os, stride_om,
                                 BM: gl.constexpr, ROWS: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                                 MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """out[split, token, column] = sum over split's K steps of x[token, k] * W[column, k], for BM tokens x ROWS
        columns."""
        pid_m, pid_n = _tile(gl.program_id(0), gl.cdiv(m_total, BM), n_total, ROWS, GROUP)
        split = gl.program_id(1)
        k_first = split * steps_per_split
        steps = gl.minimum(steps_per_split, k_steps - k_first)
        x_smem, w_smem, s_smem, ready, free = _ring(BM, ROWS, STAGES)
        row0 = pid_m * BM
        col0 = pid_n * ROWS
        out_base = out_ptr + split.to(gl.int64) * stride_os
        gl.warp_specialize([
            (_part, (x_smem, w_smem, s_smem, ready, free, steps, out_base, stride_om, m_total, n_total, row0, col0,
                     0, BM, ROWS, STAGES)),
            (_part, (x_smem, w_smem, s_smem, ready, free, steps, out_base, stride_om, m_total, n_total, row0, col0,
                     1, BM, ROWS, STAGES)),
            (_loader, (x_desc, w_desc, s_ptr, stride_sn, n_total, row0, col0, k_first, steps, x_smem, w_smem,
                       s_smem, ready, free, BM, ROWS, STAGES)),
        ], [4, 4], [MMA_REGS, LOADER_REGS])


def supported(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether this kernel takes a linear: Triton >= 3.6's Gluon on a CUDA sm_90 device, bf16 rows x [M, K] with
    16-byte aligned rows (TMA), fp8 e4m3 weights [N, K] with K a multiple of 128, contiguous, and scales whose
    rows can be read as 32-bit words."""
    if not moe_wgmma.hopper_gluon(x2):
        return False
    k = weight.shape[1]
    return (weight.dtype == torch.float8_e4m3fn and k % BLOCK_K == 0 and weight.is_contiguous()
            and scale.is_contiguous() and scale.storage_offset() % 4 == 0 and x2.stride(1) == 1
            and (x2.stride(0) * 2) % 16 == 0 and x2.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def stages_for(bm: int, rows: int) -> int:
    """Ring slots that fit the shared memory: a slot holds `rows` x 128 fp8 weights, their scale words and `bm` x
    128 bf16 token rows (plus 1 KB for the barriers and the compiler's scratch)."""
    return min(8, (SHARED_BYTES - 1024) // (rows * BLOCK_K + rows * 4 + bm * BLOCK_K * 2))


def plan(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(token rows, weight rows, K splits) per program for an [m, k] x [n, k]^T call. One program runs per
    multiprocessor at a time (the ring takes most of its shared memory), and a second wave of programs costs more
    than the multiprocessors it would add: so 128 weight rows where their tiles fit in one wave, else 256, and K
    split as many ways as still fits in that wave. The token rows are the batch rounded up to a power of two from
    16 (the MMA's N), at most MAX_BM. On one H100 this picks the fastest of ten (rows, split) candidates for each
    of m3-slice's four projections at 64 rows (docs/optimizations.md)."""
    bm = min(MAX_BM, max(16, triton.next_power_of_2(m)))
    row_tiles = triton.cdiv(m, bm)
    rows = next((r for r in ROW_CHOICES if row_tiles * triton.cdiv(n, r) <= sms), ROW_CHOICES[-1])
    tiles = row_tiles * triton.cdiv(n, rows)
    k_steps = k // BLOCK_K
    split = max(1, min(k_steps, sms // tiles))
    return bm, rows, triton.cdiv(k_steps, triton.cdiv(k_steps, split))  # no empty split


def partial_sums(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, split: int | None = None,
                 rows: int | None = None) -> torch.Tensor:
    """x2 [M, K] bf16 @ dequant(weight [N, K], scale [N, K/32])^T -> fp32 partial sums [split, M, N] (bf16 [1, M,
    N] when one split covers K), for a call `supported` accepts; `split` and `rows` override `plan` (benchmarks)."""
    m, k = x2.shape
    n = weight.shape[0]
    bm, planned_rows, planned_split = plan(m, n, k, sm_count(x2.device))
    rows, split = rows or planned_rows, split or planned_split
    k_steps = k // BLOCK_K
    steps = triton.cdiv(k_steps, split)
    split = triton.cdiv(k_steps, steps)
    out = torch.empty((split, m, n), dtype=torch.bfloat16 if split == 1 else torch.float32, device=x2.device)
    x_desc = TensorDescriptor.from_tensor(x2, [bm, 64], gl.NVMMASharedLayout.get_default_for([bm, 64], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(weight, [rows, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.float8e4nv))
    words = scale.view(torch.int32)  # four E8M0 exponents of a row per 128 columns, one cp.async each
    _fp8_linear_wgmma_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, rows), split)](
        x_desc, w_desc, words, out, m, n, k_steps, steps, words.stride(0), out.stride(0), out.stride(1),
        BM=bm, ROWS=rows, GROUP=moe_wgmma.GROUP_M, STAGES=stages_for(bm, rows), MMA_REGS=moe_wgmma.MMA_REGS,
        LOADER_REGS=moe_wgmma.LOADER_REGS, num_warps=4)
    return out
