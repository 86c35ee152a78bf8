"""Paged causal GQA attention for the dense layers, in Triton (switch `triton_attention`; reference:
`reference.paged_attention`).

The batch is flat: the first `meta.num_decode_seqs` sequences are decodes (one query token each), the rest are
prefills or prefill chunks. This step's K/V are already in the paged cache, so every query reads its keys from the
cache; a query at position p sees keys 0..p (keys past the sequence length never exist).

Decode: flash-decoding. One program per (sequence, KV head, split) holds all the query heads of that KV head's
GQA group as the rows of one tile (16 in M3, padded to >= 16 for tl.dot), walks its share of the context in
tiles of BLOCK_N keys with an online softmax, and writes a partial result normalised by its own sum plus the
log-sum-exp. A second kernel merges the splits. The number of splits depends only on the number of sequences,
the head counts and `meta.max_seq_len` (which the graph runner pins to max_model_len), never on the data, so the
decode path has no host synchronisation and is CUDA-graph capturable; one long sequence still spreads over the
whole GPU.

Prefill: one program per (sequence, tile of BLOCK_M query rows, query head). Keys visible to every row of the
tile (below the tile's smallest position) are streamed without a mask; the rest, up to the tile's largest
position, with the causal mask. Grid cells past a sequence's query length do nothing.

Every tl.dot passes input_precision="ieee": fp32 operands then multiply exactly (no TF32), so fp32 runs match
the reference to ~1e-6, while 16-bit operands still go to the tensor cores (wgmma) / matrix cores (MFMA).
Operands are in the query's dtype (the model dtype); accumulation is fp32.

An fp8 pool (`kv_cache_dtype="fp8"`, e4m3): K and V tiles are widened to the query's dtype as they are loaded
(exact: every e4m3 value is a bf16 / fp16 / fp32 value), the K scale is folded into the score scale and the V
scale into the epilogue (softmax weights sum to 1, so scaling the output is scaling V). With the scales at 1.0
(a 16/32-bit pool) both multiplications are exact, and the widening is a no-op. An fp8 prefill takes its own
tiles (`paged_prefill_fp8`, and `paged_prefill_fp8_long` from LONG_PREFILL_CONTEXT on: fp8 tiles loaded through
TMA and widened in registers need fewer warps and stages than the bf16 pool's; kernels/configs.py says why).

Scores are kept in log2 units (scale * log2(e) folded into one multiply, exp2 instead of exp). Masked scores are
a large finite negative number rather than -inf, so a tile whose keys are all masked for some row never computes
(-inf) - (-inf) = NaN; the first real key then rescales that row's running state to zero.

The partial-result merge (`combine_splits`) and the softmax step are shared with the MSA block-sparse kernel in
kernels/msa.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.batch import AttentionMetadata
from nanoserve.kernels.configs import prefill_kernel, sm_count, tiles
from nanoserve.kernels.reference import FP8_KV_DTYPE

LOG2E = 1.4426950408889634
MASKED_SCORE = tl.constexpr(-1.0e30)
"""Score (log2 units) of a masked key: finite, so all-masked rows stay NaN-free (see the module docstring).
(Globals a kernel reads must be tl.constexpr.)"""
MIN_DOT_ROWS = 16
"""tl.dot needs M, N, K >= 16 (NVIDIA mma and AMD MFMA alike): a decode program's query-head rows pad up to this."""
PROGRAMS_PER_SM = 4
"""Split-K decode aims for this many programs per multiprocessor, to hide memory latency while streaming KV."""
MIN_KEYS_PER_SPLIT = 256
"""A split shorter than this costs more in the merge than it gains in parallelism."""
MAX_SPLITS = 256
"""Cap on splits per sequence: the merge reads every split's partial result for every query head."""


# --------------------------------------------------------------------------------------------------------------
# Shared device helpers
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    """One online-softmax update with a tile of scores s [M, N] (log2 units, masked = MASKED_SCORE) and values
    v [N, D]. Returns the new (running max, running sum, unnormalised accumulator)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _store_partial(acc, m_i, l_i, out_ptrs, mask, part_out_ptrs, part_lse_ptrs, row_mask, v_scale,
                   SPLIT_OUTPUT: tl.constexpr):
    """Epilogue of a split-K program. Without splits: write acc / l (times the V scale) to the output. With
    splits: write that and the log2-sum-exp (m + log2 l, or -inf for an empty split) for `combine_splits`."""
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale
    if SPLIT_OUTPUT:
        tl.store(part_out_ptrs, o.to(part_out_ptrs.dtype.element_ty), mask=mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptrs, lse, mask=row_mask)
    else:
        tl.store(out_ptrs, o.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_S: tl.constexpr):
    """out[t, h] = sum_i w_i * part_out[t, h, i] with w_i = 2^lse_i / sum_j 2^lse_j; empty splits weigh 0.
    The split count is a runtime argument (one compiled kernel whatever the batch), and the partials are read
    CHUNK_S splits at a time: a first pass finds the largest lse, a second accumulates."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    row = (t * num_heads + h).to(tl.int64) * num_splits
    m_chunk = tl.full([CHUNK_S], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        sc = s0 + tl.arange(0, CHUNK_S)
        m_chunk = tl.maximum(m_chunk, tl.load(part_lse_ptr + row + sc, mask=sc < num_splits, other=float("-inf")))
    m = tl.max(m_chunk, 0)
    total = tl.zeros([CHUNK_S], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        sc = s0 + tl.arange(0, CHUNK_S)
        lse = tl.load(part_lse_ptr + row + sc, mask=sc < num_splits, other=float("-inf"))
        used = lse > float("-inf")  # an empty split's partial output may never have been written
        w = tl.where(used, tl.exp2(lse - m), 0.0)
        parts = tl.load(part_out_ptr + (row + sc[:, None]) * HEAD_DIM + d[None, :],
                        mask=(used & (sc < num_splits))[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        total += w
        acc += tl.sum(parts * w[:, None], 0)
    norm = tl.sum(total, 0)
    o = acc / tl.where(norm > 0.0, norm, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def split_buffers(num_tokens: int, num_heads: int, num_splits: int, head_dim: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Workspace of a split-K launch: partial outputs [T, H, splits, D] and log2-sum-exps [T, H, splits], fp32."""
    if num_splits == 1:  # the kernel writes the output directly; pass placeholders
        empty = torch.empty(1, dtype=torch.float32, device=device)
        return empty, empty
    return (torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device))


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge split-K partial results into out [T, H, D]. part_out may be fp32 or the output's dtype; a split whose
    log-sum-exp is -inf is empty and its partial output is not read."""
    t, h, num_splits, d = part_out.shape
    if t == 0:
        return
    cfg = tiles("split_combine", out.device)
    _combine_splits_kernel[(t, h)](
        part_out, part_lse, out, out.stride(0), out.stride(1), h, num_splits,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), CHUNK_S=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gqa_rows(group: int) -> int:
    """Rows of a tile that holds one GQA group's query heads: the group padded to a power of two >= 16."""
    return max(MIN_DOT_ROWS, triton.next_power_of_2(group))


def num_decode_splits(work_items: int, max_items_per_split: int, device: torch.device) -> int:
    """Split count for a split-K decode launch of `work_items` programs per split, each split covering at least
    one unit (keys / selected blocks) of at most `max_items_per_split` units in total. Depends only on shapes."""
    want = -(-PROGRAMS_PER_SM * sm_count(device) // max(work_items, 1))
    return max(1, min(want, max_items_per_split, MAX_SPLITS))


# --------------------------------------------------------------------------------------------------------------
# Decode: split-K over the context
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def _paged_decode_kernel(
        q_ptr, kv_ptr, block_tables_ptr, seq_lens_ptr, positions_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv_block, stride_kv_kind, stride_kv_tok, stride_kv_head, stride_bt,
        num_heads, split_len, num_splits, qk_scale, v_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SPLIT_OUTPUT: tl.constexpr):
    seq = tl.program_id(0)  # decode sequence s owns flat token s
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)

    seq_len = tl.load(seq_lens_ptr + seq)
    n_keys = tl.minimum(seq_len, tl.load(positions_ptr + seq).to(tl.int32) + 1)
    start = split * split_len
    end = tl.minimum(start + split_len, n_keys)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq * stride_bt
    kv_head = kv_ptr + kvh * stride_kv_head
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        key_ok = toks < end
        page = tl.load(bt_row + toks // PAGE, mask=key_ok, other=0).to(tl.int64)
        offs = page * stride_kv_block + (toks % PAGE) * stride_kv_tok
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_head + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(key_ok[None, :], s, MASKED_SCORE)
        v = tl.load(kv_head + stride_kv_kind + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)

    part_row = (seq * num_heads + heads).to(tl.int64) * num_splits + split
    _store_partial(acc, m_i, l_i,
                   out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], qd_mask,
                   part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], part_lse_ptr + part_row, row_ok,
                   v_scale, SPLIT_OUTPUT)


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            out: torch.Tensor, k_scale: float, v_scale: float) -> None:
    n = meta.num_decode_seqs
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = kv_cache.shape[3]
    page = kv_cache.shape[2]
    group = num_heads // num_kv
    cfg = tiles("paged_decode", q.device)
    max_len = max(meta.max_seq_len, 1)
    num_splits = num_decode_splits(n * num_kv, triton.cdiv(max_len, MIN_KEYS_PER_SPLIT), q.device)
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), cfg.block_n) * cfg.block_n
    part_out, part_lse = split_buffers(n, num_heads, num_splits, head_dim, q.device)
    _paged_decode_kernel[(n, num_kv, num_splits)](
        q, kv_cache, meta.block_tables, meta.seq_lens, meta.positions, out, part_out, part_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        num_heads, split_len, num_splits, scale * LOG2E * k_scale, v_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_H=gqa_rows(group),
        BLOCK_N=cfg.block_n, PAGE=page, SPLIT_OUTPUT=num_splits > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        combine_splits(part_out, part_lse, out)


# --------------------------------------------------------------------------------------------------------------
# Prefill: query tiles over a ragged batch with cached prefixes
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _attend_key_tile(q, kv_head, k_desc, v_desc, desc_col, bt_row, n0, rows_pos, seq_len, m_i, l_i, acc, d, d_ok,
                     qk_scale, stride_kv_block, stride_kv_kind, stride_kv_tok,
                     BLOCK_N: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr):
    """Fold keys n0 .. n0+BLOCK_N of one sequence into the running softmax of a query tile. CAUSAL: mask key j
    for the rows whose position is < j (and keys past the sequence); otherwise every key is visible to every row.
    TMA: K and V come through tensor descriptors over the cache viewed as [blocks * 2 * PAGE, kv heads * D]
    (BLOCK_N divides PAGE, so a key tile lies in one KV block); keys past the sequence are then read too, and
    zeroed in V (a never-written cache slot may hold NaN). The scale is folded into the exponent's FMA. K and V
    are widened to the query's dtype (an fp8 pool's tiles)."""
    toks = n0 + tl.arange(0, BLOCK_N)
    key_ok = toks < seq_len
    if TMA:
        page = tl.load(bt_row + n0 // PAGE).to(tl.int32)
        row = page * (2 * PAGE) + n0 % PAGE
        k = k_desc.load([row, desc_col]).to(q.dtype)
    else:
        page = tl.load(bt_row + toks // PAGE, mask=key_ok, other=0).to(tl.int64)
        offs = page * stride_kv_block + (toks % PAGE) * stride_kv_tok
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_head + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if CAUSAL:
        s = tl.where((toks[None, :] <= rows_pos[:, None]) & key_ok[None, :], s, MASKED_SCORE)
    if TMA:
        v = v_desc.load([row + PAGE, desc_col]).to(q.dtype)
        if CAUSAL:
            v = tl.where(key_ok[:, None], v, 0.0)
    else:
        v = tl.load(kv_head + stride_kv_kind + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["first_seq"])
def _paged_prefill_kernel(
        q_ptr, kv_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr, positions_ptr, query_start_ptr, out_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv_block, stride_kv_kind, stride_kv_tok, stride_kv_head, stride_bt,
        first_seq, qk_scale, v_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr, TMA: tl.constexpr):
    seq = first_seq + tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        qd_mask = row_ok[:, None] & d_ok[None, :]
        tok = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :], mask=qd_mask, other=0.0)
        pos = tl.load(positions_ptr + tok, mask=row_ok, other=0).to(tl.int32)
        seq_len = tl.load(seq_lens_ptr + seq)
        # keys [0, shared_end) are visible to every row of the tile; [shared_end, end) need the causal mask
        end = tl.minimum(tl.max(tl.where(row_ok, pos, 0), 0) + 1, seq_len)
        shared_end = tl.minimum(tl.min(tl.where(row_ok, pos, end), 0) + 1, end) // BLOCK_N * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = block_tables_ptr + seq * stride_bt
        kv_head = kv_ptr + (head // GROUP) * stride_kv_head
        desc_col = (head // GROUP) * HEAD_DIM
        for n0 in range(0, shared_end, BLOCK_N):
            m_i, l_i, acc = _attend_key_tile(q, kv_head, k_desc, v_desc, desc_col, bt_row, n0, pos, seq_len, m_i,
                                             l_i, acc, d, d_ok, qk_scale, stride_kv_block, stride_kv_kind,
                                             stride_kv_tok, BLOCK_N, PAGE, False, TMA)
        for n0 in range(shared_end, end, BLOCK_N):
            m_i, l_i, acc = _attend_key_tile(q, kv_head, k_desc, v_desc, desc_col, bt_row, n0, pos, seq_len, m_i,
                                             l_i, acc, d, d_ok, qk_scale, stride_kv_block, stride_kv_kind,
                                             stride_kv_tok, BLOCK_N, PAGE, True, TMA)
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None] * v_scale
        tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qd_mask)


def _kv_descriptors(kv_cache: torch.Tensor, block_n: int, block_d: int):
    """TMA descriptors for K and V tiles of [block_n keys, block_d] over the cache [blocks, 2, PAGE, kv heads, D]
    viewed as [blocks * 2 * PAGE, kv heads * D]; None where that view does not work (non-contiguous cache, a head
    dim that is not a power of two, or key tiles that would cross a KV block)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    blocks, _, page, num_kv, d = kv_cache.shape
    if not kv_cache.is_contiguous() or d != block_d or page % block_n:
        return None
    flat = kv_cache.view(blocks * 2 * page, num_kv * d)
    return TensorDescriptor(flat, flat.shape, flat.stride(), [block_n, block_d])


def _prefill(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
             out: torch.Tensor, k_scale: float, v_scale: float) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = kv_cache.shape[3]
    first = meta.num_decode_seqs
    max_q = max(meta.query_lens_cpu[first:])
    name = prefill_kernel("paged_prefill_fp8" if kv_cache.dtype == FP8_KV_DTYPE else "paged_prefill",
                          max(meta.seq_lens_cpu[first:]))
    cfg = tiles(name, q.device)
    block_d = triton.next_power_of_2(head_dim)
    desc = _kv_descriptors(kv_cache, cfg.block_n, block_d) if cfg.tma else None
    grid = (meta.num_seqs - first, triton.cdiv(max_q, cfg.block_m), num_heads)
    _paged_prefill_kernel[grid](
        q, kv_cache, desc or kv_cache, desc or kv_cache, meta.block_tables, meta.seq_lens, meta.positions,
        meta.query_start_loc, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        first, scale * LOG2E * k_scale, v_scale,
        GROUP=num_heads // num_kv, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAGE=kv_cache.shape[2], TMA=desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal GQA attention of q [T, Hq, D] over each sequence's paged context; same contract as
    `reference.paged_attention` (an fp8 pool read as fp8 x k_scale / v_scale). Decodes use split-K
    (graph-capturable), prefills use query tiles."""
    out = torch.empty_like(q)
    if meta.num_decode_seqs:
        _decode(q, kv_cache, meta, scale, out, k_scale, v_scale)
    if meta.num_seqs > meta.num_decode_seqs:
        _prefill(q, kv_cache, meta, scale, out, k_scale, v_scale)
    return out

