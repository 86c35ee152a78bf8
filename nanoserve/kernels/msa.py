"""MSA (MiniMax Sparse Attention) in Triton: the indexer's block selection and the block-sparse attention over the
selected blocks (switch `triton_msa`; references: `reference.msa_select`, `reference.sparse_attention`).

Selection, for every query row t and index head g (one per KV group), in two kernels:

1. Block scores (`_index_score_kernel`). Token score s_g(t, j) = <index_q_g(t), index_k(j)> in fp32 for the
   causally visible keys j <= p_t; a block's score is the max over its visible keys. A program holds a tile of
   (token, index head) rows of one sequence and walks KV blocks one at a time (a tile of keys = one KV block, so
   the max-pool is a row max), writing block maxima into an fp32 workspace [rows, G, n_blocks]. Only blocks up
   to each row's own block are written; later blocks are never read. Decode rows (one token, G heads) split the
   blocks of a sequence over many programs so one long context fills the GPU; prefill rows tile the queries.
2. Top-k (`_block_topk_kernel`), a tile of (token, group) rows per program. Each valid block becomes one int64
   key (orderable bits of its fp32 score) << 32 | (2^31 - 1 - block), so a plain max over keys picks the highest
   score and, among equal scores, the LOWEST block index. Forced blocks (the row's own block and the
   local_blocks - 1 before it) get score +inf. k passes each take the max key below the previous pass's key, so
   the output is ordered by (score desc, block index asc) exactly like the reference's stable descending sort,
   left-packed, padded with -1 where a row has fewer than topk valid blocks. -0.0 is read as +0.0 so that equal
   scores of either sign tie as they do in the reference.

The selected logical blocks index the block table directly (KV block = MSA block).

Block-sparse attention (`_sparse_attention_kernel`): a program holds the GQA group's query heads of BLOCK_T
consecutive query tokens of one sequence as the rows of one tile, for one KV group, and runs an exact online
softmax over the union of blocks its rows selected; a row only attends to blocks its own token selected, keys
after its position masked. Decode (BLOCK_T = 1) walks the token's selection list, split across programs
(flash-decoding, merged by `attention.combine_splits`) so a single sequence still fills the GPU. Prefill walks the
candidate blocks of the tile once each, so a block that several neighbouring tokens selected is read once for all
of them. A selection list must not repeat a block (top-k never does).

Prefill grouped by KV block (`_sparse_by_block_kernel`, switch `msa_sparse_by_block`): the prefill's (token,
group, slot) pairs are sorted by (group, sequence, block) and cut into tiles of up to block_m tokens that selected
the same block (`by_block_tiles`, on the device, no host synchronisation; the grid is an upper bound and extra
programs exit). A program reads its block once for all its tokens' query heads and writes each row's softmax
over that block as a partial result (normalised output in the query dtype, log2-sum-exp) at (token, head,
slot); `_combine_slots_kernel` merges a token's slots, unselected slots (lse -inf) weighing nothing. At 128k
context a token's 16 blocks are mostly its own, so the per-token kernel reads ~1 MiB per token and group; grouped
by block, each block is read about once per tile.

An fp8 pool (`kv_cache_dtype="fp8"`): index keys, K and V tiles are widened to the query's dtype as they are
loaded; the K scale is folded into the score scale and the V scale into the epilogue, as in kernels/attention.py
(index keys are stored at scale 1: their scores only rank blocks). The sparse decode then takes its own tiles
(`sparse_decode_fp8`; kernels/configs.py says why).

Decode is CUDA-graph capturable: grids and workspaces depend only on the number of sequences, head counts and
meta.max_seq_len. Prefill may use the host-side query lengths (it chunks its queries so the score workspace stays
under MAX_SCORE_WORKSPACE_BYTES).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.batch import AttentionMetadata
from nanoserve.kernels.attention import (
    LOG2E,
    MASKED_SCORE,
    MIN_DOT_ROWS,
    _softmax_step,
    _store_partial,
    combine_splits,
    num_decode_splits,
    split_buffers,
)
from nanoserve.kernels.configs import prefill_kernel, sm_count, tiles
from nanoserve.kernels.reference import FP8_KV_DTYPE

MAX_SCORE_WORKSPACE_BYTES = 512 * 2**20
"""Prefill block scores are computed for at most this many bytes of [rows, G, n_blocks] fp32 at a time."""
# Ranking keys of the top-k kernel (globals a kernel reads must be tl.constexpr):
LOW_BITS = tl.constexpr(2**31 - 1)
"""Low half of a key: LOW_BITS - block (block indices < 2^31), so on equal scores the lower block ranks higher."""
NO_KEY = tl.constexpr(-(2**63))
"""Key of an invalid block (after the row's own block, or past the sequence): below every real key."""
MAX_KEY = tl.constexpr(2**63 - 1)
SIGN_FLIP = tl.constexpr(2**31 - 1)
"""XOR with the int32 bits of a negative float makes int32 order agree with float order."""
MIN_TOPK_CHUNK = 128
"""Smallest block-score tile of the top-k kernel (contexts up to 128 blocks share one compiled variant)."""


# --------------------------------------------------------------------------------------------------------------
# 1. Block scores
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["first_seq", "tok_lo", "tok_hi", "n_blocks_ws", "blocks_per_split"])
def _index_score_kernel(
        iq_ptr, icache_ptr, block_tables_ptr, seq_lens_ptr, positions_ptr, query_start_ptr, score_ptr,
        stride_iq_t, stride_iq_g, stride_ic_block, stride_ic_tok, stride_bt,
        first_seq, tok_lo, tok_hi, n_blocks_ws, blocks_per_split,
        G: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Block maxima for rows (token, head) of one sequence whose flat token lies in [tok_lo, tok_hi), over the
    KV blocks [split * blocks_per_split, ...) of that sequence. score[token - tok_lo, head, block]."""
    seq = first_seq + tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = (q_start + r // G).to(tl.int64)
    head = r % G
    row_ok = (r < q_len * G) & (tok >= tok_lo) & (tok < tok_hi)
    if tl.max(row_ok.to(tl.int32), 0) > 0:
        pos = tl.load(positions_ptr + tok, mask=row_ok, other=0).to(tl.int32)
        own = pos // PAGE
        seq_len = tl.load(seq_lens_ptr + seq)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < INDEX_DIM
        q = tl.load(iq_ptr + tok[:, None] * stride_iq_t + head[:, None] * stride_iq_g + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        out_row = score_ptr + ((tok - tok_lo) * G + head) * n_blocks_ws
        b_lo = split * blocks_per_split
        b_hi = tl.minimum(tl.minimum(b_lo + blocks_per_split, n_blocks_ws),
                          tl.max(tl.where(row_ok, own, -1), 0) + 1)
        n = tl.arange(0, BLOCK_N)
        in_block = n < PAGE
        for b in range(b_lo, b_hi):
            page = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
            k = tl.load(icache_ptr + page * stride_ic_block + n[:, None] * stride_ic_tok + d[None, :],
                        mask=in_block[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            keys = b * PAGE + n
            visible = (keys[None, :] <= pos[:, None]) & (in_block & (keys < seq_len))[None, :]
            s = tl.where(visible, s, float("-inf"))
            tl.store(out_row + b, tl.max(s, 1), mask=row_ok & (b <= own))


def _launch_scores(index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, scores: torch.Tensor,
                   first_seq: int, num_seqs: int, max_rows: int, tok_lo: int, tok_hi: int, n_splits: int,
                   kernel_tiles: str) -> None:
    g, di = index_q.shape[1], index_q.shape[2]
    page = index_cache.shape[1]
    n_blocks_ws = scores.shape[2]
    cfg = tiles(kernel_tiles, index_q.device)
    grid = (num_seqs, triton.cdiv(max_rows * g, cfg.block_m), n_splits)
    _index_score_kernel[grid](
        index_q, index_cache, meta.block_tables, meta.seq_lens, meta.positions, meta.query_start_loc, scores,
        index_q.stride(0), index_q.stride(1), index_cache.stride(0), index_cache.stride(1),
        meta.block_tables.stride(0),
        first_seq, tok_lo, tok_hi, n_blocks_ws, triton.cdiv(n_blocks_ws, n_splits),
        G=g, INDEX_DIM=di, BLOCK_D=triton.next_power_of_2(di), BLOCK_M=cfg.block_m,
        BLOCK_N=max(16, triton.next_power_of_2(page)), PAGE=page,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# --------------------------------------------------------------------------------------------------------------
# 2. Top-k blocks per (token, group) row
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _block_keys(score_rows, b0, own, local_blocks, n_valid, CHUNK: tl.constexpr):
    """int64 ranking keys [R, CHUNK] of blocks b0 .. b0+CHUNK of R rows (score_rows [R] point at each row's
    block scores; own / n_valid [R]); NO_KEY where a block is invalid. See the module docstring."""
    b = b0 + tl.arange(0, CHUNK)
    valid = b[None, :] < n_valid[:, None]
    score = tl.load(score_rows[:, None] + b[None, :], mask=valid, other=0.0)
    forced = b[None, :] > (own - local_blocks)[:, None]  # the own block and the local_blocks - 1 before it
    score = tl.where(forced, float("inf"), score)
    valid = valid & (score > float("-inf"))
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: equal scores must tie whatever their sign
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits >= 0, bits, bits ^ SIGN_FLIP)  # now int32 order == float order
    key = (bits.to(tl.int64) << 32) | ((~b) & LOW_BITS).to(tl.int64)[None, :]  # low half: LOW_BITS - b
    return tl.where(valid, key, NO_KEY)


@triton.jit(do_not_specialize=["n_rows", "tok_lo", "n_blocks_ws"])
def _block_topk_kernel(score_ptr, positions_ptr, sel_ptr, stride_sel_t, stride_sel_g, n_rows, tok_lo, n_blocks_ws,
                       local_blocks,
                       G: tl.constexpr, TOPK: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                       CHUNK: tl.constexpr, PAGE: tl.constexpr):
    """Top-k for ROWS workspace rows (token, group) = (tok_lo + r // G, r % G) at a time."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = r < n_rows
    tok = (tok_lo + r // G).to(tl.int64)
    own = tl.load(positions_ptr + tok, mask=row_ok, other=0).to(tl.int32) // PAGE
    n_valid = tl.where(row_ok, tl.minimum(own + 1, n_blocks_ws), 0)
    score_rows = score_ptr + r.to(tl.int64) * n_blocks_ws
    slot = tl.arange(0, BLOCK_K)
    picked = tl.full([ROWS, BLOCK_K], -1, tl.int32)
    prev = tl.full([ROWS], MAX_KEY, tl.int64)
    if tl.max(n_valid, 0) <= CHUNK:  # every row fits one tile: rank once, then k passes in registers
        keys = _block_keys(score_rows, 0, own, local_blocks, n_valid, CHUNK)
        for i in range(TOPK):
            best = tl.max(tl.where(keys < prev[:, None], keys, NO_KEY), 1)
            block = tl.where(best == NO_KEY, -1, ((~best) & LOW_BITS).to(tl.int32))
            picked = tl.where(slot[None, :] == i, block[:, None], picked)
            prev = best
    else:  # long rows: every pass re-reads the rows (from L2) in CHUNK-sized tiles
        for i in range(TOPK):
            best = tl.full([ROWS], NO_KEY, tl.int64)
            for b0 in range(0, tl.max(n_valid, 0), CHUNK):
                keys = _block_keys(score_rows, b0, own, local_blocks, n_valid, CHUNK)
                best = tl.maximum(best, tl.max(tl.where(keys < prev[:, None], keys, NO_KEY), 1))
            block = tl.where(best == NO_KEY, -1, ((~best) & LOW_BITS).to(tl.int32))
            picked = tl.where(slot[None, :] == i, block[:, None], picked)
            prev = best
    tl.store(sel_ptr + tok[:, None] * stride_sel_t + (r % G)[:, None] * stride_sel_g + slot[None, :], picked,
             mask=row_ok[:, None] & (slot < TOPK)[None, :])


def _launch_topk(scores: torch.Tensor, meta: AttentionMetadata, selected: torch.Tensor, tok_lo: int, n_tok: int,
                 page: int, topk: int, local_blocks: int) -> None:
    g, n_blocks_ws = scores.shape[1], scores.shape[2]
    cfg = tiles("msa_topk", scores.device)
    # CHUNK is a compile-time tile: a floor keeps short contexts (which grow by a block every few decode steps)
    # on one compiled variant instead of a new compile at every power of two
    chunk = min(max(triton.next_power_of_2(n_blocks_ws), MIN_TOPK_CHUNK), cfg.block_n)
    rows = max(1, cfg.block_m // chunk)
    while rows > 1 and triton.cdiv(n_tok * g, rows) < sm_count(scores.device):  # keep every SM busy
        rows //= 2
    _block_topk_kernel[(triton.cdiv(n_tok * g, rows),)](
        scores, meta.positions, selected, selected.stride(0), selected.stride(1), n_tok * g, tok_lo, n_blocks_ws,
        local_blocks,
        G=g, TOPK=topk, BLOCK_K=triton.next_power_of_2(topk), ROWS=rows, CHUNK=chunk, PAGE=page,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def msa_select(index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, topk: int,
               local_blocks: int) -> torch.Tensor:
    """MSA indexer: index_q [T, G, Di] (normed + roped) -> selected logical blocks [T, G, topk] int32.

    Same contract as `reference.msa_select`: per (row, group) the top-k blocks by block score with the own block
    and the (local_blocks - 1) before it forced; ordered by (score desc, block index asc); left-packed; -1 pads.
    Rows of padding tokens (beyond the batch's sequences) are left as -1."""
    t, g = index_q.shape[0], index_q.shape[1]
    page = index_cache.shape[1]
    selected = torch.full((t, g, topk), -1, dtype=torch.int32, device=index_q.device)
    nd = meta.num_decode_seqs
    if nd:
        n_blocks = triton.cdiv(max(meta.max_seq_len, 1), page)
        scores = torch.empty(nd, g, n_blocks, dtype=torch.float32, device=index_q.device)
        n_splits = num_decode_splits(nd, n_blocks, index_q.device)
        _launch_scores(index_q, index_cache, meta, scores, 0, nd, 1, 0, nd, n_splits, "msa_score_decode")
        _launch_topk(scores, meta, selected, 0, nd, page, topk, local_blocks)
    if meta.num_seqs > nd:
        q_lens, seq_lens = meta.query_lens_cpu[nd:], meta.seq_lens_cpu[nd:]
        n_blocks = triton.cdiv(max(seq_lens), page)
        rows_per_pass = max(1, MAX_SCORE_WORKSPACE_BYTES // (g * n_blocks * 4))
        first_tok = sum(meta.query_lens_cpu[:nd])
        last_tok = first_tok + sum(q_lens)
        scores = torch.empty(min(rows_per_pass, last_tok - first_tok), g, n_blocks, dtype=torch.float32,
                             device=index_q.device)
        for lo in range(first_tok, last_tok, rows_per_pass):
            hi = min(lo + rows_per_pass, last_tok)
            _launch_scores(index_q, index_cache, meta, scores, nd, meta.num_seqs - nd, max(q_lens), lo, hi, 1,
                           prefill_kernel("msa_score_prefill", max(seq_lens)))
            _launch_topk(scores, meta, selected, lo, hi - lo, page, topk, local_blocks)
    return selected


# --------------------------------------------------------------------------------------------------------------
# Block-sparse attention
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _attend_block(q, kv_head, page, b, row_selected, pos, m_i, l_i, acc, d, d_ok, qk_scale,
                  stride_kv_block, stride_kv_kind, stride_kv_tok,
                  BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Fold logical block b (physical `page`) into the running softmax of the rows that selected it, keys after
    each row's position masked. K and V are widened to the query's dtype (an fp8 pool's tiles)."""
    for n0 in range(0, PAGE, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        key_ok = n < PAGE
        offs = page * stride_kv_block + n * stride_kv_tok
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_head + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        visible = row_selected[:, None] & key_ok[None, :] & (b * PAGE + n[None, :] <= pos[:, None])
        s = tl.where(visible, s, MASKED_SCORE)
        v = tl.load(kv_head + stride_kv_kind + offs[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _query_rows(q_ptr, kv_ptr, positions_ptr, tok, kvh, rows, in_tile, stride_qt, stride_qh,
                GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The query side of a sparse-attention tile whose row r is (token tok[r], query head r % GROUP_PAD of KV group
    kvh): the rows' heads, which rows are real (in_tile and not GQA padding), the head dims d / d_ok, the [rows, d]
    mask, the queries (in their own dtype: the K and V tiles are widened to it) and each row's position."""
    heads = kvh * GROUP + rows % GROUP_PAD
    row_ok = in_tile & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qd_mask, other=0.0)
    pos = tl.load(positions_ptr + tok, mask=row_ok, other=0).to(tl.int32)
    return heads, row_ok, d, d_ok, qd_mask, q, pos


@triton.jit
def _softmax_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """An empty online softmax for ROWS rows: running max -inf, running sum 0, accumulator 0."""
    return (tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, BLOCK_D], tl.float32))


@triton.jit(do_not_specialize=["first_seq", "tiles_per_seq", "slots_per_split", "num_splits"])
def _sparse_attention_kernel(
        q_ptr, kv_ptr, block_tables_ptr, positions_ptr, query_start_ptr, sel_ptr, out_ptr, part_out_ptr,
        part_lse_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kv_block, stride_kv_kind, stride_kv_tok, stride_kv_head, stride_bt, stride_sel_t, stride_sel_g,
        first_seq, tiles_per_seq, num_heads, slots_per_split, num_splits, qk_scale, v_scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, SPLIT_OUTPUT: tl.constexpr):
    """Rows (token, query head of the group) of BLOCK_T consecutive query tokens of one sequence, for one KV
    group. Decode (BLOCK_T == 1): walk this split's slots of the token's selection list. Prefill: walk the
    candidate blocks from the smallest selected to the last own block of the tile once each; a row attends only
    to the blocks its own token selected, so a block shared by several tokens is read once."""
    seq = first_seq + tl.program_id(0) // tiles_per_seq
    t0 = (tl.program_id(0) % tiles_per_seq) * BLOCK_T
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    n_tok = tl.minimum(tl.load(query_start_ptr + seq + 1) - q_start - t0, BLOCK_T)
    if n_tok > 0:
        rows = tl.arange(0, ROWS)
        t = rows // GROUP_PAD
        tok = (q_start + t0 + t).to(tl.int64)
        heads, row_ok, d, d_ok, qd_mask, q, pos = _query_rows(q_ptr, kv_ptr, positions_ptr, tok, kvh, rows,
                                                               t < n_tok, stride_qt, stride_qh,
                                                               GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D)
        sel_rows = sel_ptr + tok * stride_sel_t + kvh * stride_sel_g  # [ROWS] each row's token's selection
        bt_row = block_tables_ptr + seq * stride_bt
        kv_head = kv_ptr + kvh * stride_kv_head

        m_i, l_i, acc = _softmax_start(ROWS, BLOCK_D)
        if BLOCK_T == 1:
            slot_lo = split * slots_per_split
            for slot in range(slot_lo, tl.minimum(slot_lo + slots_per_split, TOPK)):
                b = tl.load(sel_ptr + (q_start + t0) * stride_sel_t + kvh * stride_sel_g + slot)
                if b >= 0:
                    page = tl.load(bt_row + b).to(tl.int64)
                    m_i, l_i, acc = _attend_block(q, kv_head, page, b, row_ok, pos, m_i, l_i, acc, d, d_ok,
                                                  qk_scale, stride_kv_block, stride_kv_kind, stride_kv_tok,
                                                  BLOCK_N, PAGE)
        else:
            slot = tl.arange(0, TOPK_PAD)
            row_sel = tl.load(sel_rows[:, None] + slot[None, :], mask=row_ok[:, None] & (slot < TOPK)[None, :],
                              other=-1)
            b_first = tl.min(tl.where(row_sel >= 0, row_sel, 2**30), 1)
            b_first = tl.min(tl.where(row_ok, b_first, 2**30), 0)
            b_last = tl.max(tl.where(row_ok, pos, 0), 0) // PAGE
            for b in range(b_first, b_last + 1):
                row_selected = tl.max((row_sel == b).to(tl.int32), 1) > 0
                if tl.max(row_selected.to(tl.int32), 0) > 0:
                    page = tl.load(bt_row + b).to(tl.int64)
                    m_i, l_i, acc = _attend_block(q, kv_head, page, b, row_selected, pos, m_i, l_i, acc, d, d_ok,
                                                  qk_scale, stride_kv_block, stride_kv_kind, stride_kv_tok,
                                                  BLOCK_N, PAGE)

        part_row = (tok * num_heads + heads) * num_splits + split
        _store_partial(acc, m_i, l_i,
                       out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :], qd_mask,
                       part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :], part_lse_ptr + part_row, row_ok,
                       v_scale, SPLIT_OUTPUT)


def _launch_sparse(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, selected: torch.Tensor,
                   scale: float, out: torch.Tensor, first_seq: int, num_seqs: int, max_q_len: int, block_t: int,
                   num_splits: int, kernel_tiles: str, k_scale: float, v_scale: float) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv, page = kv_cache.shape[3], kv_cache.shape[2]
    topk = selected.shape[2]
    group = num_heads // num_kv
    group_pad = triton.next_power_of_2(group)
    cfg = tiles(kernel_tiles, q.device)
    tiles_per_seq = triton.cdiv(max_q_len, block_t)
    # split-K partials are indexed by flat token; decode tokens are the first num_seqs of the batch
    part_out, part_lse = split_buffers(num_seqs, num_heads, num_splits, head_dim, q.device)
    _sparse_attention_kernel[(num_seqs * tiles_per_seq, num_kv, num_splits)](
        q, kv_cache, meta.block_tables, meta.positions, meta.query_start_loc, selected, out, part_out, part_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), meta.block_tables.stride(0),
        selected.stride(0), selected.stride(1),
        first_seq, tiles_per_seq, num_heads, triton.cdiv(topk, num_splits), num_splits, scale * LOG2E * k_scale,
        v_scale,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, ROWS=max(MIN_DOT_ROWS, block_t * group_pad),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=min(cfg.block_n, max(16, triton.next_power_of_2(page))), PAGE=page, TOPK=topk,
        TOPK_PAD=triton.next_power_of_2(topk), SPLIT_OUTPUT=num_splits > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        combine_splits(part_out, part_lse, out)


# --------------------------------------------------------------------------------------------------------------
# Block-sparse prefill grouped by KV block (switch `msa_sparse_by_block`)
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["tok_lo", "n_pairs", "n_keyed_seqs", "n_blocks_key", "first_seq"])
def _sparse_by_block_kernel(
        q_ptr, kv_ptr, block_tables_ptr, positions_ptr, sorted_key_ptr, order_ptr, tile_start_ptr, n_tiles_ptr,
        part_out_ptr, part_lse_ptr,
        stride_qt, stride_qh, stride_kv_block, stride_kv_kind, stride_kv_tok, stride_kv_head, stride_bt,
        tok_lo, n_pairs, n_keyed_seqs, n_blocks_key, first_seq, num_heads, qk_scale, v_scale,
        NUM_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOK_TILE: tl.constexpr,
        ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr, TOPK: tl.constexpr):
    """One tile of the (token, KV group, slot) pairs sorted by (KV group, sequence, block): up to TOK_TILE pairs
    that selected the same block, times the GQA group's query heads, as the rows of one tile. The block is read
    once for all of them; each row's softmax over this block alone is written as a partial result (normalised
    output + log2-sum-exp) at its (token, head, slot), for `combine_splits`."""
    tile = tl.program_id(0)
    if tile < tl.load(n_tiles_ptr):
        start = tl.load(tile_start_ptr + tile)
        key = tl.load(sorted_key_ptr + start)
        b = (key % n_blocks_key).to(tl.int32)
        rest = key // n_blocks_key
        seq = first_seq + rest % n_keyed_seqs
        kvh = (rest // n_keyed_seqs).to(tl.int32)
        rows = tl.arange(0, ROWS)
        e = rows // GROUP_PAD
        idx = start + e
        in_tile = (e < TOK_TILE) & (idx < n_pairs)
        in_tile = in_tile & (tl.load(sorted_key_ptr + idx, mask=in_tile, other=-1) == key)
        pair = tl.load(order_ptr + idx, mask=in_tile, other=0)  # flat index of [tokens, NUM_KV, TOPK]
        t_local = pair // (NUM_KV * TOPK)
        slot = pair % TOPK
        tok = tok_lo + t_local
        heads, row_ok, d, d_ok, qd_mask, q, pos = _query_rows(q_ptr, kv_ptr, positions_ptr, tok, kvh, rows, in_tile,
                                                               stride_qt, stride_qh,
                                                               GROUP, GROUP_PAD, HEAD_DIM, BLOCK_D)
        page = tl.load(block_tables_ptr + seq * stride_bt + b).to(tl.int64)
        m_i, l_i, acc = _softmax_start(ROWS, BLOCK_D)
        m_i, l_i, acc = _attend_block(q, kv_ptr + kvh * stride_kv_head, page, b, row_ok, pos, m_i, l_i, acc, d,
                                      d_ok, qk_scale, stride_kv_block, stride_kv_kind, stride_kv_tok, BLOCK_N, PAGE)
        part_row = (t_local * num_heads + heads) * TOPK + slot
        _store_partial(acc, m_i, l_i, part_out_ptr, qd_mask, part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :],
                       part_lse_ptr + part_row, row_ok, v_scale, True)


def by_block_tiles(selected: torch.Tensor, seq_local: torch.Tensor, n_seqs: int, n_blocks: int,
                   tok_tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Group the (token, KV group, slot) pairs of selected [n, G, topk] (-1 = none) by KV block, on the device and
    without a host synchronisation. Key of a pair: (group * n_seqs + sequence) * n_blocks + block; pairs sorted by
    key (stable), then cut into tiles of at most tok_tile pairs of one key. Returns (sorted keys with unselected
    slots last, the flat pair index of each sorted entry, tile start offsets, the number of tiles as a device
    scalar, an upper bound of that number for the grid)."""
    n, g, topk = selected.shape
    dev = selected.device
    group = torch.arange(g, device=dev, dtype=torch.int64)[None, :, None]
    key = (group * n_seqs + seq_local.to(torch.int64)[:, None, None]) * n_blocks + selected.to(torch.int64)
    key = torch.where(selected >= 0, key, torch.iinfo(torch.int64).max).flatten()
    sorted_key, order = torch.sort(key, stable=True)
    i = torch.arange(key.numel(), device=dev)
    seg_start = torch.searchsorted(sorted_key, sorted_key)  # first entry of each entry's key
    starts = ((i - seg_start) % tok_tile == 0) & (sorted_key != torch.iinfo(torch.int64).max)
    bound = triton.cdiv(key.numel(), tok_tile) + min(key.numel(), g * n_seqs * n_blocks)
    # tile k starts at the k-th start; the other entries scatter into a spare last slot (a boolean index would
    # synchronise with the host)
    slot = torch.where(starts, torch.cumsum(starts, 0) - 1, bound)
    tile_start = torch.empty(bound + 1, dtype=torch.int64, device=dev).scatter_(0, slot, i)
    n_tiles = starts.sum(dtype=torch.int32).reshape(1)
    return sorted_key, order, tile_start, n_tiles, bound


MAX_PARTIAL_BYTES = 2**30
"""The by-block prefill writes partial results [tokens, heads, topk, D] of at most this many bytes at a time."""


def _sparse_prefill_by_block(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                             selected: torch.Tensor, scale: float, out: torch.Tensor, k_scale: float,
                             v_scale: float) -> None:
    nd = meta.num_decode_seqs
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv, page = kv_cache.shape[3], kv_cache.shape[2]
    topk = selected.shape[2]
    group = num_heads // num_kv
    group_pad = triton.next_power_of_2(group)
    cfg = tiles(prefill_kernel("sparse_by_block", max(meta.seq_lens_cpu[nd:])), q.device)
    tok_tile = max(1, cfg.block_m)
    n_seqs = meta.num_seqs - nd
    n_blocks = triton.cdiv(max(meta.seq_lens_cpu[nd:]), page)
    first_tok = sum(meta.query_lens_cpu[:nd])
    last_tok = first_tok + sum(meta.query_lens_cpu[nd:])
    per_token = num_heads * topk * (head_dim * q.element_size() + 4)
    step = max(1, MAX_PARTIAL_BYTES // per_token)
    bounds = meta.query_start_loc[nd + 1:]
    for lo in range(first_tok, last_tok, step):
        hi = min(lo + step, last_tok)
        toks = torch.arange(lo, hi, device=q.device, dtype=bounds.dtype)
        seq_local = torch.searchsorted(bounds, toks, right=True)
        sorted_key, order, tile_start, n_tiles, bound = by_block_tiles(selected[lo:hi], seq_local, n_seqs,
                                                                        n_blocks, tok_tile)
        part_out = torch.empty(hi - lo, num_heads, topk, head_dim, dtype=q.dtype, device=q.device)
        part_lse = torch.full((hi - lo, num_heads, topk), float("-inf"), dtype=torch.float32, device=q.device)
        _sparse_by_block_kernel[(bound,)](
            q, kv_cache, meta.block_tables, meta.positions, sorted_key, order, tile_start, n_tiles, part_out,
            part_lse,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            meta.block_tables.stride(0),
            lo, sorted_key.numel(), n_seqs, n_blocks, nd, num_heads, scale * LOG2E * k_scale, v_scale,
            NUM_KV=num_kv, GROUP=group, GROUP_PAD=group_pad, TOK_TILE=tok_tile,
            ROWS=max(MIN_DOT_ROWS, tok_tile * group_pad), HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_N=min(cfg.block_n, max(16, triton.next_power_of_2(page))), PAGE=page, TOPK=topk,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _combine_slots(part_out, part_lse, out[lo:hi])


@triton.jit
def _combine_slots_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_heads,
                          HEADS: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """out[t, h] = sum_s w_s * part_out[t, h, s] with w_s = 2^lse_s / sum 2^lse, for HEADS heads of one token per
    program (an unselected slot has lse -inf, weighs 0 and its partial output is not read)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    s = tl.arange(0, SLOTS_PAD)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < num_heads
    row = (t * num_heads + h) * SLOTS  # [HEADS]
    lse = tl.load(part_lse_ptr + row[:, None] + s[None, :], mask=h_ok[:, None] & (s < SLOTS)[None, :],
                  other=float("-inf"))
    m = tl.max(lse, 1)
    used = lse > float("-inf")
    w = tl.where(used, tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)[:, None]), 0.0)
    parts = tl.load(part_out_ptr + (row[:, None, None] + s[None, :, None]) * HEAD_DIM + d[None, None, :],
                    mask=used[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)
    acc = tl.sum(parts.to(tl.float32) * w[:, :, None], 1)
    norm = tl.sum(w, 1)
    o = acc / tl.where(norm > 0.0, norm, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & (d < HEAD_DIM)[None, :])


def _combine_slots(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge the by-block partial results [T, H, topk, D] into out [T, H, D], several heads per program (the
    decode merge's one (token, head) per program is launch-bound at prefill sizes)."""
    t, h, slots, d = part_out.shape
    cfg = tiles("slot_combine", out.device)
    heads = min(cfg.block_m, triton.next_power_of_2(h))
    _combine_slots_kernel[(t, triton.cdiv(h, heads))](
        part_out, part_lse, out, out.stride(0), out.stride(1), h,
        HEADS=heads, SLOTS=slots, SLOTS_PAD=triton.next_power_of_2(slots), HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, selected: torch.Tensor,
                     scale: float, by_block: bool = False, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Exact attention of q [T, Hq, D] over the blocks its KV group selected (selected [T, Hkv, topk], logical
    block indices, -1 = none, no block twice in one list), keys after the query's position masked. Same contract
    as `reference.sparse_attention` (an fp8 pool read as fp8 x k_scale / v_scale). by_block (switch
    `msa_sparse_by_block`): prefill tokens are grouped by the blocks they selected, so each selected block is read
    once per tile of tokens that chose it."""
    out = torch.empty_like(q)
    nd = meta.num_decode_seqs
    topk = selected.shape[2]
    if nd:
        n_splits = num_decode_splits(nd * kv_cache.shape[3], topk, q.device)
        name = "sparse_decode_fp8" if kv_cache.dtype == FP8_KV_DTYPE else "sparse_decode"
        _launch_sparse(q, kv_cache, meta, selected, scale, out, 0, nd, 1, 1, n_splits, name, k_scale, v_scale)
    if meta.num_seqs > nd and by_block:
        _sparse_prefill_by_block(q, kv_cache, meta, selected, scale, out, k_scale, v_scale)
    elif meta.num_seqs > nd:
        name = prefill_kernel("sparse_prefill", max(meta.seq_lens_cpu[nd:]))
        _launch_sparse(q, kv_cache, meta, selected, scale, out, nd, meta.num_seqs - nd,
                       max(meta.query_lens_cpu[nd:]), tiles(name, q.device).block_m, 1, name, k_scale, v_scale)
    return out
