"""Token/expert alignment for the fused MoE: group the (token, slot) pairs by expert, each expert's run padded to
the GEMM tile height, entirely on the device.

A *pair* p = t * KP + j is token t's j-th expert choice (KP = top_k, plus 1 when the shared expert is folded in:
its pair j = top_k always goes to the last weight slot). The grouped GEMMs want the pairs of one expert to sit
next to each other, in runs whose length is a multiple of BLOCK_M, so that every BLOCK_M-row tile belongs to
exactly one expert. The layout this module produces, for a `block_m` of 4 and experts 0..2:

    sorted_pair_ids  [ p p p - | p p p p p - - - | (expert 1 has no pairs) ...]   - = pad (value num_pairs)
    block_expert     [ 0       | 2       2       | -1 -1 ... ]                    -1 = no tile here

Pairs routed to an expert another rank owns (expert_map -> -1) are left out. Within an expert, pairs keep their
original order (the layout is deterministic).

Nothing here reads a device value back to the host: the buffers are sized from the upper bound
`num_pairs + min(num_slots, num_pairs) * (block_m - 1)` rows (every non-empty expert wastes at most block_m - 1
pad rows), so the launch grids depend on shapes only and a decode step can be captured in a CUDA/HIP graph. Tiles
past the real end are marked -1 in `block_expert` and the GEMM programs there exit at once.

Two launches:
  1. `_count_kernel`, one program per chunk of pairs (about ALIGN_PROGRAMS chunks): a histogram of the chunk's
     experts -> chunk_counts[c, e].
  2. `_place_kernel`, one program per chunk again: from all chunk counts it derives every expert's padded run
     (an exclusive scan over experts) and the chunk's offset inside each run (the counts of earlier chunks),
     then writes each pair to run_start[e] + (earlier pairs of e). Program 0 also marks the pad rows; all
     programs share the block table.
A one-hot [lanes, experts] matrix stands in for gathers and scatters that Triton has no register form of.

Decode batches of up to 16 tokens skip both launches: kernels/moe_route.py routes and aligns them in a single
program, where every expert's run fits one tile (no histogram needed). Both fill the buffers `empty_alignment`
sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 1024
"""Most pairs one alignment program handles (8192 tokens x 5 pairs = 40 programs)."""
ALIGN_PROGRAMS = 16
"""Programs a smaller batch is spread over (chunks of at least one one-hot step each): a decode batch in one chunk
would walk all its one-hot steps and the whole block table in a single program, whose latency is the launch's."""
ALIGN_LANES_BUDGET = 16384
"""Elements of the one-hot [lanes, experts] matrix per step: lanes = budget / padded experts, in [16, 64]."""
COUNT_ROWS = 32
"""Chunk-count rows the placing kernel reads per step."""
TABLE_STEP = 64
"""Block-table entries one program writes per step."""
PAD_STEP = 16
"""Pad rows of every run the placing kernel marks per step (block_m is at least 16)."""
ALIGN_WARPS = 4
"""Warps per alignment program (128 threads on NVIDIA, 256 on AMD's wave-64): the one-hot steps are small."""


@dataclass
class MoEAlignment:
    """Where every (token, slot) pair goes in the grouped GEMMs. All tensors live on the device."""

    sorted_pair_ids: torch.Tensor
    """[max_blocks * block_m] int32: pair ids grouped by expert; pad rows hold num_pairs. Rows past num_padded are
    unwritten (no tile reads them)."""
    block_expert: torch.Tensor
    """[max_blocks] int32: the local expert slot of each BLOCK_M-row tile, -1 past the last run."""
    num_padded: torch.Tensor
    """[1] int32: rows in use (sum of the padded runs)."""
    num_pairs: int
    max_blocks: int
    block_m: int


def max_tiles(num_pairs: int, num_slots: int, block_m: int) -> int:
    """Upper bound on BLOCK_M tiles: each non-empty expert adds at most block_m - 1 pad rows."""
    return triton.cdiv(num_pairs + min(num_slots, num_pairs) * (block_m - 1), block_m)


@triton.jit
def pair_expert(pair, num_pairs, topk_ids_ptr, expert_map_ptr, shared_slot,
                TOPK: tl.constexpr, FOLD: tl.constexpr, HAS_MAP: tl.constexpr):
    """Local weight slot of pair id(s) `pair`, or -1 (out of range, or an expert another rank owns)."""
    KP: tl.constexpr = TOPK + FOLD
    token = pair // KP
    choice = pair % KP
    real = pair < num_pairs
    routed = real & (choice < TOPK)
    slot = tl.load(topk_ids_ptr + token * TOPK + choice, mask=routed, other=-1)
    if HAS_MAP:
        slot = tl.load(expert_map_ptr + slot, mask=routed & (slot >= 0), other=-1)
    if FOLD:
        slot = tl.where(real & (choice == TOPK), shared_slot, slot)
    return tl.where(real, slot, -1)


@triton.jit(do_not_specialize=["num_pairs", "chunk_size"])
def _count_kernel(topk_ids_ptr, expert_map_ptr, chunk_counts_ptr, num_pairs, chunk_size, shared_slot,
                  TOPK: tl.constexpr, FOLD: tl.constexpr, HAS_MAP: tl.constexpr, LANES: tl.constexpr,
                  E_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, chunk_size, LANES):
        pair = chunk * chunk_size + start + tl.arange(0, LANES)
        slot = pair_expert(pair, num_pairs, topk_ids_ptr, expert_map_ptr, shared_slot, TOPK, FOLD, HAS_MAP)
        counts += tl.sum((slot[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + chunk * E_PAD + experts, counts)


@triton.jit(do_not_specialize=["num_pairs", "chunk_size", "num_chunks", "max_blocks"])
def _place_kernel(topk_ids_ptr, expert_map_ptr, chunk_counts_ptr, sorted_ids_ptr, block_expert_ptr,
                  num_padded_ptr, num_pairs, chunk_size, num_chunks, max_blocks, shared_slot,
                  TOPK: tl.constexpr, FOLD: tl.constexpr, HAS_MAP: tl.constexpr, LANES: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, COUNT_ROWS: tl.constexpr,
                  TABLE_STEP: tl.constexpr, PAD_STEP: tl.constexpr):
    chunk = tl.program_id(0)
    experts = tl.arange(0, E_PAD)

    # Every expert's total, and how many of its pairs sit in chunks before this one.
    total = tl.zeros([E_PAD], dtype=tl.int32)
    earlier = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, COUNT_ROWS):
        c = c0 + tl.arange(0, COUNT_ROWS)
        rows = tl.load(chunk_counts_ptr + c[:, None] * E_PAD + experts[None, :],
                       mask=(c < num_chunks)[:, None], other=0)
        total += tl.sum(rows, axis=0)
        earlier += tl.sum(tl.where((c < chunk)[:, None], rows, 0), axis=0)

    # Runs padded to BLOCK_M, laid out in expert order (empty experts get an empty run).
    padded = tl.cdiv(total, BLOCK_M) * BLOCK_M
    run_end = tl.cumsum(padded, axis=0)
    run_start = run_end - padded
    num_padded = tl.sum(padded, axis=0)

    # This chunk's pairs: position = run start + pairs of the same expert before it (earlier chunks, earlier
    # steps of this chunk, earlier lanes of this step).
    next_row = run_start + earlier
    lane = tl.arange(0, LANES)
    for start in range(0, chunk_size, LANES):
        pair = chunk * chunk_size + start + lane
        slot = pair_expert(pair, num_pairs, topk_ids_ptr, expert_map_ptr, shared_slot, TOPK, FOLD, HAS_MAP)
        one_hot = slot[:, None] == experts[None, :]
        base = tl.sum(tl.where(one_hot, next_row[None, :], 0), axis=1)
        same_before = (slot[:, None] == slot[None, :]) & (lane[None, :] < lane[:, None])
        row = base + tl.sum(same_before.to(tl.int32), axis=1)
        tl.store(sorted_ids_ptr + row, pair, mask=slot >= 0)
        next_row += tl.sum(one_hot.to(tl.int32), axis=0)

    # The pad tail of every run (fewer than BLOCK_M rows) is marked with num_pairs (no such pair: the GEMMs mask
    # it), PAD_STEP rows of every run per step of a loop: one [E_PAD, BLOCK_M] tile, or the steps unrolled, would
    # hold 2 * BLOCK_M values a thread at 256 experts and 128 threads, which spills at BLOCK_M 64 and 128.
    if chunk == 0:
        fill_start = run_start + total
        for p0 in range(0, BLOCK_M, PAD_STEP):
            rows_2d = fill_start[:, None] + (p0 + tl.arange(0, PAD_STEP))[None, :]
            tl.store(sorted_ids_ptr + rows_2d, tl.full([E_PAD, PAD_STEP], 0, tl.int32) + num_pairs,
                     mask=rows_2d < run_end[:, None])
        tl.store(num_padded_ptr, num_padded)

    # Block table: the expert whose run holds tile b's first row is the number of runs ending at or before it.
    for b0 in range(chunk * TABLE_STEP, max_blocks, num_chunks * TABLE_STEP):
        b = b0 + tl.arange(0, TABLE_STEP)
        first_row = b * BLOCK_M
        owner = tl.sum((run_end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first_row < num_padded, owner, -1)
        tl.store(block_expert_ptr + b, owner, mask=b < max_blocks)


def moe_align(topk_ids: torch.Tensor, num_slots: int, block_m: int, *, expert_map: torch.Tensor | None = None,
              fold_shared: bool = False) -> MoEAlignment:
    """Group the pairs of topk_ids [T, k] (global expert ids, int32) by local weight slot, runs padded to block_m.

    num_slots counts the weight slots (the shared expert's last slot included when fold_shared). expert_map
    [E_global] int32 maps global ids to local slots or -1 (skip); None = identity."""
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be int32 [T, k], got {topk_ids.dtype} {list(topk_ids.shape)}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    topk_ids = topk_ids.contiguous()
    tokens, top_k = topk_ids.shape
    align = empty_alignment(tokens * (top_k + int(fold_shared)), num_slots, block_m, topk_ids.device)
    num_pairs = align.num_pairs
    e_pad = triton.next_power_of_2(num_slots)
    lanes = max(16, min(64, ALIGN_LANES_BUDGET // e_pad))
    # a whole number of one-hot steps per chunk, about ALIGN_PROGRAMS chunks, each at most ALIGN_CHUNK pairs
    chunk_size = min(ALIGN_CHUNK, triton.cdiv(triton.cdiv(max(num_pairs, 1), ALIGN_PROGRAMS), lanes) * lanes)
    num_chunks = max(1, triton.cdiv(num_pairs, chunk_size))
    chunk_counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=topk_ids.device)
    emap = expert_map if expert_map is not None else topk_ids  # a placeholder pointer when there is no map
    flags = dict(TOPK=top_k, FOLD=fold_shared, HAS_MAP=expert_map is not None, LANES=lanes, E_PAD=e_pad)
    _count_kernel[(num_chunks,)](topk_ids, emap, chunk_counts, num_pairs, chunk_size, num_slots - 1,
                                 num_warps=ALIGN_WARPS, **flags)
    _place_kernel[(num_chunks,)](topk_ids, emap, chunk_counts, align.sorted_pair_ids, align.block_expert,
                                 align.num_padded, num_pairs, chunk_size, num_chunks, align.max_blocks,
                                 num_slots - 1, BLOCK_M=block_m, COUNT_ROWS=COUNT_ROWS, TABLE_STEP=TABLE_STEP,
                                 PAD_STEP=PAD_STEP, num_warps=ALIGN_WARPS, **flags)
    return align


def empty_alignment(num_pairs: int, num_slots: int, block_m: int, device: torch.device) -> MoEAlignment:
    """The alignment's buffers, sized from the upper bound (max_tiles), for a kernel to fill."""
    blocks = max_tiles(num_pairs, num_slots, block_m)
    return MoEAlignment(torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                        torch.empty(blocks, dtype=torch.int32, device=device),
                        torch.empty(1, dtype=torch.int32, device=device), num_pairs, blocks, block_m)
