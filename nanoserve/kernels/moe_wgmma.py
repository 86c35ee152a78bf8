"""The fused MoE's two GEMMs with MXFP8 experts on Hopper (sm_90), in Gluon: dequantisation beside the MMA.

moe.py's Triton kernels dequantise each fp8 weight tile in registers and multiply it on the tensor cores; the
compiled loop does one and then the other, so on an H100 they reach about half of the bf16 kernels' rate at prefill
sizes (docs/mxfp8.md). These kernels lay the work out by hand, one program per (128 token rows, 128 columns) tile,
in three warp-specialised partitions that meet at mbarriers:

    loader (4 warps)       TMA: the tile's fp8 weight rows (128 K columns a step) and, in GEMM 2, the activation
                           rows; cp.async: GEMM 1's token rows (a gather, which Hopper's TMA cannot do) and the
                           rows' E8M0 scales, four per row as one 32-bit word. Each step lands in a ring of
                           STAGES slots; ready[slot] completes when all of it has.
    2 x MMA (4 warps each) each owns 64 of the tile's weight rows (GEMM 1: 64 gate and the matching 64 up rows):
                           it dequantises them from the slot, 32 columns (one scale) at a time, straight into
                           the register operand A of Hopper's warpgroup MMA (weights x tokens^T, the token rows
                           as operand B in shared memory), waits for its MMAs, and frees the slot.

While one MMA warpgroup dequantises, the other's MMAs run: the two take turns on the tensor cores, the way
FlashAttention-3's ping-pong does, and nothing stalls for memory because the loader runs STAGES steps ahead. The
MMA warps touch shared memory only through the wgmma itself and the fp8 loads of their own slot, which is what
keeps ptxas from serialising the wgmmas (docs/mxfp8.md says what did not work).

Exact: each weight is fp8 x 2^(S - 127) computed in fp32 and rounded to bf16 (exact: the value the dequantised
reference holds), each output adds its K steps in increasing order, 16 columns per MMA instruction, and the
epilogues are moe.py's. On one H100 the outputs equal the bf16 kernels' on the dequantised stacks bit for bit
(tests/model/test_gpu_mxfp8.py).

Only for CUDA sm_90 with Triton >= 3.6 (its Gluon), bf16 activations, fp8 e4m3 experts whose hidden and
intermediate sizes are multiples of 128 (M3's are, also at tensor parallel 8), contiguous stacks; `supported` says
whether a call qualifies and moe.py's `fused_moe` falls back to its Triton kernels otherwise.
"""

from __future__ import annotations

import functools

import torch
import triton

# The Gluon API these kernels use is that of Triton 3.6 (run on the GPU) and 3.9 (compiled in the tests); earlier
# releases spell warp_specialize differently, so they keep moe.py's Triton kernels.
GLUON_MIN_TRITON = (3, 6)

try:  # without Gluon (or on another backend) the Triton kernels run
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < GLUON_MIN_TRITON:
        raise ImportError(f"Triton {triton.__version__} predates the Gluon API used here")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # Triton 3.7 renamed the copies (the old names raise); both spellings take the same arguments
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

BLOCK_M = 128
"""Token rows per tile: the padding unit of the alignment for calls these kernels take."""
BLOCK_N = 128
"""Output columns per tile (GEMM 1: gate columns, each with its up column)."""
BLOCK_K = 128
"""K columns per pipeline step: four E8M0 scales per weight row, one 32-bit copy."""
GROUP_M = 8
"""Row tiles that walk the column tiles together (their weight tiles shared through L2)."""
UP_STAGES, DOWN_STAGES = 3, 4
"""Ring slots: GEMM 1 moves 64 KB a step (256 weight rows and 128 token rows), GEMM 2 48 KB."""
MMA_REGS, LOADER_REGS = 232, 48
"""Registers per thread of the MMA and loader partitions (setmaxnreg): the MMA warps hold the accumulators (GEMM 1:
two 64 x 128 fp32 tiles) and four bf16 operand pieces; measured on one H100, fewer MMA registers spill."""

if HAVE_GLUON:
    _BK = gl.constexpr(BLOCK_K)
    _SUB = gl.constexpr(32)

    @gluon.jit
    def _loader(x_ptr, x_desc, w_desc, s_base, sorted_ids_ptr, num_pairs, k_total, stride_xt, stride_sn,
                row0, w_row0, n_total, x_smem, w_smem, s_smem, ready, free,
                UP: gl.constexpr, KP: gl.constexpr, BM: gl.constexpr, W_ROWS: gl.constexpr, STAGES: gl.constexpr):
        """Fill ring slot i % STAGES with step i once the MMA warps have freed it. GEMM 1 (UP) gathers its token
        rows from x_ptr and ignores x_desc; GEMM 2 loads them through x_desc and ignores x_ptr's gather."""
        a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        s_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        half: gl.constexpr = W_ROWS // 2
        if UP:  # the tile's token rows, gathered: pad rows (pair >= num_pairs) read zeros
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, a_layout))
            pair = gl.load(sorted_ids_ptr + rows)
            a_mask = (pair < num_pairs)[:, None]
            a_ptrs = x_ptr + (pair // KP).to(gl.int64)[:, None] * stride_xt \
                + gl.arange(0, 64, layout=gl.SliceLayout(0, a_layout))[None, :]
        sr = gl.arange(0, W_ROWS, layout=s_layout)
        if UP:  # slot rows: MMA warpgroup g's 64 gate rows, then its 64 up rows
            quarter: gl.constexpr = W_ROWS // 4
            s_rows = (w_row0 + (sr // half) * quarter + sr % quarter) % n_total + ((sr % half) // quarter) * n_total
        else:
            s_rows = (w_row0 + sr) % n_total
        s_ptrs = s_base + s_rows.to(gl.int64) * stride_sn
        w_bytes: gl.constexpr = W_ROWS * _BK
        x_bytes: gl.constexpr = 0 if UP else BM * _BK * 2
        for i in range(k_total // _BK):
            slot = i % STAGES
            mbarrier.wait(free.index(slot), ((i // STAGES) - 1) & 1, pred=i >= STAGES)
            bar = ready.index(slot)
            mbarrier.expect(bar, w_bytes + x_bytes)
            w_stage = w_smem.index(slot)
            if UP:
                for q in gl.static_range(4):  # gate rows of warpgroup 0, its up rows, then warpgroup 1's
                    _tma_load(w_desc, [w_row0 + (q % 2) * n_total + (q // 2) * 64, i * _BK],
                                                    bar, w_stage.slice(q * 64, 64, dim=0))
                for h in gl.static_range(2):
                    _cp_async(x_smem.index(slot * 2 + h), a_ptrs + (i * _BK + h * 64),
                                                           mask=a_mask)
            else:
                _tma_load(w_desc, [w_row0, i * _BK], bar, w_stage)
                for h in gl.static_range(2):
                    _tma_load(x_desc, [row0, i * _BK + h * 64], bar, x_smem.index(slot * 2 + h))
            _cp_async(s_smem.index(slot), s_ptrs + i)
            # every loader thread arrives once its own cp.async copies have landed (ready's count: 128 + 1)
            async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _piece(w_stage, words, j: gl.constexpr, row0: gl.constexpr, dot: gl.constexpr):
        """Weight rows row0..row0+64, columns 32j..32j+32 of the slot, dequantised into the MMA's A layout."""
        w8 = w_stage.slice(row0, 64, dim=0).slice(j * _SUB, _SUB, dim=1).load(dot)
        scale = (((words >> (8 * j)) & 0xFF) << 23).to(gl.float32, bitcast=True)  # 2^(S - 127); S = 0 gives 0
        return (w8.to(gl.float32) * scale[:, None]).to(gl.bfloat16)

    @gluon.jit
    def _mma(x_smem, w_smem, s_smem, ready, free, k_total, ROW0: gl.constexpr, BM: gl.constexpr,
             STAGES: gl.constexpr, TWO: gl.constexpr):
        """acc0 [64 weight rows from ROW0, BM tokens] (and acc1 for the 64 rows after them when TWO)."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        dot: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        acc0 = gl.zeros([64, BM], gl.float32, layout=mma)
        acc1 = gl.zeros([64, BM], gl.float32, layout=mma)
        for i in range(k_total // _BK):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            w_stage = w_smem.index(slot)
            x0 = x_smem.index(slot * 2)
            x1 = x_smem.index(slot * 2 + 1)
            words0 = s_smem.index(slot).slice(ROW0, 64).load(gl.SliceLayout(1, dot))
            a0 = _piece(w_stage, words0, 0, ROW0, dot)
            acc0 = warpgroup_mma(a0, x0.slice(0, _SUB, dim=1).permute((1, 0)), acc0, is_async=True)
            a1 = _piece(w_stage, words0, 1, ROW0, dot)
            acc0 = warpgroup_mma(a1, x0.slice(32, _SUB, dim=1).permute((1, 0)), acc0, is_async=True)
            a2 = _piece(w_stage, words0, 2, ROW0, dot)
            acc0 = warpgroup_mma(a2, x1.slice(0, _SUB, dim=1).permute((1, 0)), acc0, is_async=True)
            a3 = _piece(w_stage, words0, 3, ROW0, dot)
            acc0 = warpgroup_mma(a3, x1.slice(32, _SUB, dim=1).permute((1, 0)), acc0, is_async=True)
            if TWO:
                words1 = s_smem.index(slot).slice(ROW0 + 64, 64).load(gl.SliceLayout(1, dot))
                b0 = _piece(w_stage, words1, 0, ROW0 + 64, dot)
                acc1 = warpgroup_mma(b0, x0.slice(0, _SUB, dim=1).permute((1, 0)), acc1, is_async=True)
                b1 = _piece(w_stage, words1, 1, ROW0 + 64, dot)
                acc1 = warpgroup_mma(b1, x0.slice(32, _SUB, dim=1).permute((1, 0)), acc1, is_async=True)
                b2 = _piece(w_stage, words1, 2, ROW0 + 64, dot)
                acc1 = warpgroup_mma(b2, x1.slice(0, _SUB, dim=1).permute((1, 0)), acc1, is_async=True)
                b3 = _piece(w_stage, words1, 3, ROW0 + 64, dot)
                acc1 = warpgroup_mma(b3, x1.slice(32, _SUB, dim=1).permute((1, 0)), acc1, is_async=True)
                # an in-flight wgmma reads its A registers: keep every piece alive until the wait
                acc0, acc1, a0, a1, a2, a3, b0, b1, b2, b3 = warpgroup_mma_wait(
                    0, deps=(acc0, acc1, a0, a1, a2, a3, b0, b1, b2, b3))
            else:
                acc0, a0, a1, a2, a3 = warpgroup_mma_wait(0, deps=(acc0, a0, a1, a2, a3))
            mbarrier.arrive(free.index(slot))  # free's count: 2, one per MMA warpgroup
        return acc0, acc1

    @gluon.jit
    def _up_part(x_smem, w_smem, s_smem, ready, free, hidden, act_ptr, stride_ar, inter, row0, col0, alpha, limit,
                 G: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr):
        """MMA warpgroup G of GEMM 1 and its epilogue: act[row, col] = swiglu_oai(gate, up) for its 64 columns."""
        acc_g, acc_u = _mma(x_smem, w_smem, s_smem, ready, free, hidden, G * 128, BM, STAGES, True)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        gate = gl.minimum(acc_g, limit)
        up = gl.minimum(gl.maximum(acc_u, -limit), limit)
        act = gate * (1.0 / (1.0 + gl.exp(-alpha * gate))) * (up + 1.0)  # moe.py's tl.sigmoid, spelled out
        cols = col0 + G * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        toks = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        # pad rows are stored too (swiglu(0) = 0): GEMM 2 reads whole, finite tiles
        gl.store(act_ptr + toks[None, :].to(gl.int64) * stride_ar + cols[:, None], act.to(gl.bfloat16),
                 mask=cols[:, None] < inter)

    @gluon.jit
    def _down_part(x_smem, w_smem, s_smem, ready, free, inter, copies_ptr, sorted_ids_ptr, topk_weights_ptr,
                   num_pairs, stride_ct, hidden, routed_scale, row0, col0,
                   G: gl.constexpr, TOPK: gl.constexpr, FOLD: gl.constexpr, BM: gl.constexpr, STAGES: gl.constexpr):
        """MMA warpgroup G of GEMM 2 and its epilogue: copies[pair, col] = weight(pair) * act[row] . w2[e, col]."""
        acc, _ = _mma(x_smem, w_smem, s_smem, ready, free, inter, G * 64, BM, STAGES, False)
        KP: gl.constexpr = TOPK + FOLD
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BM, 16])
        cols = col0 + G * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
        toks = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
        pair = gl.load(sorted_ids_ptr + toks)
        real = pair < num_pairs
        token = pair // KP
        choice = pair % KP
        weight = gl.load(topk_weights_ptr + token * TOPK + choice, mask=real & (choice < TOPK), other=0.0) \
            * routed_scale
        if FOLD:
            weight = gl.where(choice == TOPK, 1.0, weight)
        gl.store(copies_ptr + pair[None, :].to(gl.int64) * stride_ct + cols[:, None],
                 (acc * weight[None, :]).to(gl.bfloat16), mask=real[None, :] & (cols[:, None] < hidden))

    @gluon.jit
    def _tile(pid, num_blocks, n_total, BN: gl.constexpr, GROUP: gl.constexpr):
        """fp8_tile.tile_coords, spelled in Gluon: that @triton.jit helper compiles into these kernels to the same
        PTX, but under TRITON_INTERPRET (the CPU tests) it becomes an interpreted function a Gluon kernel cannot
        call."""
        num_pid_n = gl.cdiv(n_total, BN)
        per_group = GROUP * num_pid_n
        first_m = (pid // per_group) * GROUP
        group_rows = gl.minimum(num_blocks - first_m, GROUP)
        return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows

    @gluon.jit
    def _barriers(n: gl.constexpr, count: gl.constexpr):
        bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n):
            mbarrier.init(bars.index(i), count=count)
        return bars

    @gluon.jit
    def _ring(BM: gl.constexpr, W_ROWS: gl.constexpr, STAGES: gl.constexpr):
        """The loader's ring of STAGES slots - token rows [BM, 128] as two 64-column halves, fp8 weight rows
        [W_ROWS, 128], their scale words - and its barriers: ready (TMA bytes + 128 loader threads' cp.async
        arrivals) and free (one arrival per MMA warpgroup)."""
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 2, BM, 64],
                                           gl.NVMMASharedLayout.get_default_for([BM, 64], gl.bfloat16))
        w_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, W_ROWS, _BK],
                                           gl.NVMMASharedLayout.get_default_for([W_ROWS, _BK], gl.float8e4nv))
        s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, W_ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        return x_smem, w_smem, s_smem, _barriers(STAGES, 129), _barriers(STAGES, 2)

    @gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _up_swiglu_kernel(x_ptr, w13_desc, act_ptr, sorted_ids_ptr, block_expert_ptr,
                          num_pairs, num_blocks, inter, hidden, stride_xt, stride_ar, alpha, limit,
                          s13_ptr, stride_se, stride_sn,
                          KP: gl.constexpr, BM: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                          MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
        """GEMM 1 + SwiGLU-OAI for BM token rows x 128 gate (and 128 up) columns of one expert."""
        pid_m, pid_n = _tile(gl.program_id(0), num_blocks, inter, 128, GROUP)
        expert = gl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        x_smem, w_smem, s_smem, ready, free = _ring(BM, 256, STAGES)
        s_base = s13_ptr + expert.to(gl.int64) * stride_se
        row0 = pid_m * BM
        col0 = pid_n * 128
        gl.warp_specialize([
            (_up_part, (x_smem, w_smem, s_smem, ready, free, hidden, act_ptr, stride_ar, inter, row0, col0,
                        alpha, limit, 0, BM, STAGES)),
            (_up_part, (x_smem, w_smem, s_smem, ready, free, hidden, act_ptr, stride_ar, inter, row0, col0,
                        alpha, limit, 1, BM, STAGES)),
            (_loader, (x_ptr, w13_desc, w13_desc, s_base, sorted_ids_ptr, num_pairs, hidden, stride_xt, stride_sn,
                       row0, expert * (2 * inter) + col0, inter, x_smem, w_smem, s_smem, ready, free, True, KP,
                       BM, 256, STAGES)),
        ], [4, 4], [MMA_REGS, LOADER_REGS])

    @gluon.jit(do_not_specialize=["num_pairs", "num_blocks"])
    def _down_weighted_kernel(act_ptr, act_desc, w2_desc, copies_ptr, sorted_ids_ptr, block_expert_ptr,
                              topk_weights_ptr, num_pairs, num_blocks, hidden, inter, stride_ar, stride_ct,
                              routed_scale, s2_ptr, stride_se, stride_sn,
                              TOPK: gl.constexpr, FOLD: gl.constexpr, BM: gl.constexpr, GROUP: gl.constexpr,
                              STAGES: gl.constexpr, MMA_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                              num_warps: gl.constexpr):
        """GEMM 2 with the routing-weight epilogue for BM rows x 128 hidden columns of one expert."""
        pid_m, pid_n = _tile(gl.program_id(0), num_blocks, hidden, 128, GROUP)
        expert = gl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        x_smem, w_smem, s_smem, ready, free = _ring(BM, 128, STAGES)
        s_base = s2_ptr + expert.to(gl.int64) * stride_se
        row0 = pid_m * BM
        col0 = pid_n * 128
        gl.warp_specialize([
            (_down_part, (x_smem, w_smem, s_smem, ready, free, inter, copies_ptr, sorted_ids_ptr, topk_weights_ptr,
                          num_pairs, stride_ct, hidden, routed_scale, row0, col0, 0, TOPK, FOLD, BM, STAGES)),
            (_down_part, (x_smem, w_smem, s_smem, ready, free, inter, copies_ptr, sorted_ids_ptr, topk_weights_ptr,
                          num_pairs, stride_ct, hidden, routed_scale, row0, col0, 1, TOPK, FOLD, BM, STAGES)),
            (_loader, (act_ptr, act_desc, w2_desc, s_base, sorted_ids_ptr, num_pairs, inter, stride_ar, stride_sn,
                       row0, expert * hidden + col0, hidden, x_smem, w_smem, s_smem, ready, free, False,
                       TOPK + FOLD, BM, 128, STAGES)),
        ], [4, 4], [MMA_REGS, LOADER_REGS])


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def hopper_gluon(x: torch.Tensor) -> bool:
    """Whether Gluon kernels of this kind can run on x: Triton >= 3.6's Gluon, bf16 x on a CUDA sm_90 device (the
    device check every `supported` here and in fp8_linear_wgmma.py starts with)."""
    if not HAVE_GLUON or x.device.type != "cuda" or torch.version.hip or x.dtype != torch.bfloat16:
        return False
    return _sm90(x.device.index if x.device.index is not None else torch.cuda.current_device())


def supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor,
              w2_scale: torch.Tensor) -> bool:
    """Whether these kernels take a fused-MoE call: Triton >= 3.6's Gluon, a CUDA sm_90 device, bf16 x, fp8 e4m3
    experts with contiguous stacks, hidden and intermediate sizes multiples of 128."""
    if not hopper_gluon(x):
        return False
    hidden, inter = w13.shape[2], w2.shape[2]
    return (w13.dtype == w2.dtype == torch.float8_e4m3fn and hidden % BLOCK_K == 0 and inter % BLOCK_K == 0
            and all(t.is_contiguous() for t in (w13, w2, w13_scale, w2_scale)))


def gemms(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
          sorted_ids: torch.Tensor, block_expert: torch.Tensor, num_blocks: int, num_pairs: int,
          topk_weights: torch.Tensor, act: torch.Tensor, copies: torch.Tensor, *, alpha: float, limit: float,
          routed_scaling_factor: float, fold: bool) -> None:
    """moe.py's `_gemms` for a call `supported` accepts, aligned with BLOCK_M rows per block: GEMM 1 (gate/up +
    SwiGLU into `act`) and GEMM 2 (down, weighted, into `copies`)."""
    tokens, hidden = x.shape
    slots, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_weights.shape[-1]
    fp8 = gl.float8e4nv
    w13_desc = TensorDescriptor.from_tensor(w13.view(slots * two_inter, hidden), [64, BLOCK_K],
                                            gl.NVMMASharedLayout.get_default_for([64, BLOCK_K], fp8))
    w2_desc = TensorDescriptor.from_tensor(w2.view(slots * hidden, inter), [BLOCK_N, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], fp8))
    act_desc = TensorDescriptor.from_tensor(act, [BLOCK_M, 64],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16))
    # the scales as 32-bit words: four E8M0 exponents of a row per 128 columns, one cp.async each
    s13, s2 = w13_scale.view(torch.int32), w2_scale.view(torch.int32)
    _up_swiglu_kernel[(num_blocks * triton.cdiv(inter, BLOCK_N),)](
        x, w13_desc, act, sorted_ids, block_expert, num_pairs, num_blocks, inter, hidden,
        x.stride(0), act.stride(0), float(alpha), float(limit), s13, s13.stride(0), s13.stride(1),
        KP=top_k + int(fold), BM=BLOCK_M, GROUP=GROUP_M, STAGES=UP_STAGES, MMA_REGS=MMA_REGS,
        LOADER_REGS=LOADER_REGS, num_warps=4)
    _down_weighted_kernel[(num_blocks * triton.cdiv(hidden, BLOCK_N),)](
        act, act_desc, w2_desc, copies, sorted_ids, block_expert, topk_weights, num_pairs, num_blocks, hidden, inter,
        act.stride(0), copies.stride(0), float(routed_scaling_factor), s2, s2.stride(0), s2.stride(1),
        TOPK=top_k, FOLD=fold, BM=BLOCK_M, GROUP=GROUP_M, STAGES=DOWN_STAGES, MMA_REGS=MMA_REGS,
        LOADER_REGS=LOADER_REGS, num_warps=4)
