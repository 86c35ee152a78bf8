"""M3's routing and the MoE alignment in one launch, for the smallest decode batches.

At decode, a MoE layer's routing works on a few tiny tensors ([T, 128] router logits), yet the torch path launches
about eight kernels for it (sigmoid, the bias add, top-k as a gather and a sort kernel, gather, sum, divide, cast)
and the alignment two more (kernels/moe_align.py: count, place), each a few microseconds of mostly latency, in
each of the MoE layers of every step. Here one program does all of it for up to ROUTE_ALIGN_MAX_TOKENS tokens:

1. Routing, the batch as one [T, E] fp32 tile: s = sigmoid(logits); top_k rounds of "take the largest s + bias"
   (ties go to the lower expert id), each round masking its pick; the weights are the picked s, renormalised to
   sum to 1. topk_ids / topk_weights are written in descending order of s + bias, as torch.topk returns them.
2. A barrier, so every thread of the program sees all the ids just written.
3. The alignment, without moe_align's histogram over all slots: a token picks an expert at most once (and
   expert_map is one-to-one), so no slot has more than T <= BLOCK_M pairs and every run is exactly one tile.
   Pair p's tile is the number of slots in use below its slot, its row the number of earlier pairs of its slot:
   two [pairs, pairs] comparisons. The block table and the pad rows come from a [tiles, pairs] one.

The reference is `reference.route` followed by `moe_align` (switch `fused_routing` off): the ids and the layout
are identical; the weights agree to within fp32 rounding (sigmoid's exp and the k-term sum may round differently:
tests/kernels/test_kernel_moe_route.py allows 1e-6). Larger batches keep the torch routing and moe_align.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.moe_align import MoEAlignment, empty_alignment, pair_expert

ROUTE_ALIGN_MAX_TOKENS = 16
"""Largest batch on the one-launch path. It is also the smallest BLOCK_M, so no expert's run outgrows one tile."""
ROUTE_ALIGN_MAX_PAIRS = 64
"""Most (token, slot) pairs on the one-launch path: its pair x pair matrices stay [64, 64] (M3: 12 tokens)."""
ROUTE_ALIGN_WARPS = ((2, 1), (8, 4), (ROUTE_ALIGN_MAX_TOKENS, 8))
"""(most tokens, warps): the fastest warp count by batch, from `scripts/gpu_route_bench.py` (in git at 8277a9c; now
`python -m nanoserve.bench --micro route --micro-tokens 1,4,12`) on an H200 (1 token: 2.2 us with 1 warp vs 3.0
with 4; 4 tokens: 2.9 us with 4; 12 tokens: 5.5 us with 8 vs 6.5 with 4)."""


def route_align_warps(tokens: int) -> int:
    return next(warps for most, warps in ROUTE_ALIGN_WARPS if tokens <= most)


@triton.jit(do_not_specialize=["tokens", "num_pairs", "max_blocks"])
def _route_align_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, expert_map_ptr, sorted_ids_ptr,
                        block_expert_ptr, num_padded_ptr, tokens, num_experts, num_pairs, max_blocks, shared_slot,
                        TOPK: tl.constexpr, K_PAD: tl.constexpr, FOLD: tl.constexpr, HAS_MAP: tl.constexpr,
                        E_PAD: tl.constexpr, T_PAD: tl.constexpr, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # 1. Routing, the whole batch as one [T_PAD, E_PAD] tile.
    experts = tl.arange(0, E_PAD)
    real_expert = experts < num_experts
    bias = tl.load(bias_ptr + experts, mask=real_expert, other=0.0)
    choice = tl.arange(0, K_PAD)
    t = tl.arange(0, T_PAD)
    live = t < tokens
    logit = tl.load(logits_ptr + t[:, None] * num_experts + experts[None, :],
                    mask=live[:, None] & real_expert[None, :], other=0.0)
    score = tl.sigmoid(logit)
    rank = tl.where(real_expert[None, :], score + bias[None, :], float("-inf"))
    ids = tl.zeros([T_PAD, K_PAD], dtype=tl.int32)
    weights = tl.zeros([T_PAD, K_PAD], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(rank, axis=1)
        pick = tl.min(tl.where(rank == best[:, None], experts[None, :], E_PAD), axis=1)
        hit = experts[None, :] == pick[:, None]
        picked_score = tl.sum(tl.where(hit, score, 0.0), axis=1)
        ids = tl.where(choice[None, :] == j, pick[:, None], ids)
        weights = tl.where(choice[None, :] == j, picked_score[:, None], weights)
        rank = tl.where(hit, float("-inf"), rank)
    weights = weights / tl.sum(weights, axis=1)[:, None]
    out = t[:, None] * TOPK + choice[None, :]
    keep = live[:, None] & (choice[None, :] < TOPK)
    tl.store(ids_ptr + out, ids, mask=keep)
    tl.store(weights_ptr + out, weights, mask=keep)

    # 2. The pairs read the ids back: every thread must see every other thread's stores.
    tl.debug_barrier()

    # 3. The alignment. Every slot has at most `tokens` <= BLOCK_M pairs (a token picks an expert once), so every
    # run is one tile: tile(p) = slots in use below p's slot, row(p) = earlier pairs of p's slot.
    p = tl.arange(0, P_PAD)
    slot = pair_expert(p, num_pairs, ids_ptr, expert_map_ptr, shared_slot, TOPK, FOLD, HAS_MAP)
    used = slot >= 0
    same = (slot[:, None] == slot[None, :]) & used[:, None]
    row = tl.sum((same & (p[None, :] < p[:, None])).to(tl.int32), axis=1)
    first = used & (row == 0)  # the first pair of each slot in use
    tile = tl.sum((first[None, :] & (slot[None, :] < slot[:, None])).to(tl.int32), axis=1)
    num_tiles = tl.sum(first.to(tl.int32), axis=0)
    tl.store(sorted_ids_ptr + tile * BLOCK_M + row, p, mask=used)

    # The block table (max_blocks <= P_PAD) and each tile's pad rows, marked with num_pairs.
    b = tl.arange(0, P_PAD)
    in_tile = (tile[None, :] == b[:, None]) & used[None, :]  # [tiles, pairs]
    owner = tl.sum(tl.where(in_tile & first[None, :], slot[None, :], 0), axis=1)
    tl.store(block_expert_ptr + b, tl.where(b < num_tiles, owner, -1), mask=b < max_blocks)
    count = tl.sum(in_tile.to(tl.int32), axis=1)
    i = tl.arange(0, BLOCK_M)
    pad = (b < num_tiles)[:, None] & (i[None, :] >= count[:, None])
    tl.store(sorted_ids_ptr + b[:, None] * BLOCK_M + i[None, :], tl.zeros([P_PAD, BLOCK_M], tl.int32) + num_pairs,
             mask=pad)
    tl.store(num_padded_ptr, num_tiles * BLOCK_M)


def route_align_fits(tokens: int, pairs_per_token: int) -> bool:
    """Does a batch of this many tokens (each with top_k + folded-shared pairs) take the one-launch path?"""
    return 1 <= tokens <= ROUTE_ALIGN_MAX_TOKENS and tokens * pairs_per_token <= ROUTE_ALIGN_MAX_PAIRS


def route_and_align(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_slots: int,
                    block_m: int, *, expert_map: torch.Tensor | None = None,
                    fold_shared: bool = False, num_warps: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, MoEAlignment]:
    """`reference.route(router_logits, correction_bias, top_k)` then `moe_align(ids, num_slots, block_m, ...)`,
    in one launch. router_logits [T, E] fp32 with route_align_fits(T, top_k + fold_shared); correction_bias [E]
    fp32; num_slots, expert_map and fold_shared as in moe_align. Returns (topk_weights [T, k] fp32, topk_ids
    [T, k] int32, the alignment). num_warps overrides ROUTE_ALIGN_WARPS (benchmarks)."""
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise ValueError(f"router_logits must be fp32 [T, E], got {router_logits.dtype} "
                         f"{list(router_logits.shape)}")
    tokens, num_experts = router_logits.shape
    kp = top_k + int(fold_shared)
    if not route_align_fits(tokens, kp):
        raise ValueError(f"router_logits has {tokens} tokens; route_and_align takes 1..{ROUTE_ALIGN_MAX_TOKENS}, "
                         f"at most {ROUTE_ALIGN_MAX_PAIRS} (token, expert) pairs")
    if tuple(correction_bias.shape) != (num_experts,) or correction_bias.dtype != torch.float32:
        raise ValueError(f"correction_bias must be fp32 [{num_experts}], got {correction_bias.dtype} "
                         f"{list(correction_bias.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if block_m < ROUTE_ALIGN_MAX_TOKENS or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {ROUTE_ALIGN_MAX_TOKENS}, got {block_m}")
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    align = empty_alignment(tokens * kp, num_slots, block_m, device)
    emap = expert_map.to(torch.int32).contiguous() if expert_map is not None else ids  # placeholder pointer
    _route_align_kernel[(1,)](
        router_logits.contiguous(), correction_bias.contiguous(), weights, ids, emap, align.sorted_pair_ids,
        align.block_expert, align.num_padded, tokens, num_experts, align.num_pairs, align.max_blocks, num_slots - 1,
        TOPK=top_k, K_PAD=triton.next_power_of_2(top_k), FOLD=fold_shared, HAS_MAP=expert_map is not None,
        E_PAD=triton.next_power_of_2(num_experts), T_PAD=triton.next_power_of_2(tokens),
        P_PAD=triton.next_power_of_2(align.num_pairs), BLOCK_M=block_m,
        num_warps=num_warps or route_align_warps(tokens))
    return weights, ids, align
