"""M3's routing and the MoE alignment in one launch, for decode-sized batches.

At decode, a MoE layer's routing works on a few tiny tensors ([T, 128] router logits), yet the torch path launches
about eight kernels for it (sigmoid, the bias add, top-k as a gather and a sort kernel, gather, sum, divide, cast)
and the alignment two more (kernels/moe_align.py: count, place). Each is a few microseconds of mostly latency,
three MoE layers per step: at one token that is ~0.1 ms of a ~1.7 ms step. Here a single program does all of it:

1. Routing, TOKENS_STEP tokens at a time, all fp32: s = sigmoid(logits); top_k rounds of "take the largest
   s + bias" (ties go to the lower expert id), each round masking its pick; the weights are the picked s,
   renormalised to sum to 1. topk_ids / topk_weights are written in descending order of s + bias, as torch.topk
   returns them.
2. A barrier, so every thread of the program sees all the ids just written.
3. The alignment of kernels/moe_align.py as one chunk: `count_pairs` (a histogram of the pairs' weight slots),
   then `place_pairs` (padded runs, each pair's row, the pad rows, the block table).

The reference is `reference.route` followed by `moe_align` (switch `fused_routing` off): the ids and the layout
are identical; the weights agree to within fp32 rounding (sigmoid's exp and the 4-term sum may round differently:
tests/test_kernel_moe_route.py allows 1e-6 relative). Larger batches (prefill chunks) keep the torch routing and
the multi-program alignment, which scales with the pair count where one program would not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.moe_align import (ALIGN_WARPS, TABLE_STEP, MoEAlignment, align_lanes, count_pairs,
                                         empty_alignment, place_pairs)

ROUTE_ALIGN_MAX_TOKENS = 128
"""Largest batch routed by the single-program kernel (decode batches; the engine's default max_num_seqs is 256,
whose steps take the torch routing)."""
TOKENS_STEP = 16
"""Tokens one routing step scores at once: a [16, padded experts] fp32 tile."""


@triton.jit(do_not_specialize=["tokens", "num_pairs", "max_blocks"])
def _route_align_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, expert_map_ptr, sorted_ids_ptr,
                        block_expert_ptr, num_padded_ptr, tokens, num_experts, num_pairs, max_blocks, shared_slot,
                        TOPK: tl.constexpr, K_PAD: tl.constexpr, FOLD: tl.constexpr, HAS_MAP: tl.constexpr,
                        E_PAD: tl.constexpr, TOKENS_STEP: tl.constexpr, LANES: tl.constexpr,
                        S_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TABLE_STEP: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    real_expert = experts < num_experts
    bias = tl.load(bias_ptr + experts, mask=real_expert, other=0.0)
    choice = tl.arange(0, K_PAD)

    # 1. Routing.
    for t0 in range(0, tokens, TOKENS_STEP):
        t = t0 + tl.arange(0, TOKENS_STEP)
        live = t < tokens
        logit = tl.load(logits_ptr + t[:, None] * num_experts + experts[None, :],
                        mask=live[:, None] & real_expert[None, :], other=0.0)
        score = tl.sigmoid(logit)
        rank = tl.where(real_expert[None, :], score + bias[None, :], float("-inf"))
        ids = tl.zeros([TOKENS_STEP, K_PAD], dtype=tl.int32)
        weights = tl.zeros([TOKENS_STEP, K_PAD], dtype=tl.float32)
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

    # 2. The alignment reads the ids back: every thread must see every other thread's stores.
    tl.debug_barrier()

    # 3. The alignment, all pairs as one chunk.
    total = count_pairs(0, num_pairs, num_pairs, ids_ptr, expert_map_ptr, shared_slot,
                        TOPK, FOLD, HAS_MAP, LANES, S_PAD)
    place_pairs(total, tl.zeros([S_PAD], dtype=tl.int32), 0, 1, 0, num_pairs, num_pairs, max_blocks,
                ids_ptr, expert_map_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shared_slot,
                TOPK, FOLD, HAS_MAP, LANES, S_PAD, BLOCK_M, TABLE_STEP)


def route_align_fits(tokens: int) -> bool:
    """Does a batch of this many tokens take the single-program routing + alignment?"""
    return 1 <= tokens <= ROUTE_ALIGN_MAX_TOKENS


def route_and_align(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, num_slots: int,
                    block_m: int, *, expert_map: torch.Tensor | None = None,
                    fold_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, MoEAlignment]:
    """`reference.route(router_logits, correction_bias, top_k)` then `moe_align(ids, num_slots, block_m, ...)`,
    in one launch. router_logits [T, E] fp32 with 1 <= T <= ROUTE_ALIGN_MAX_TOKENS; correction_bias [E] fp32;
    num_slots, expert_map and fold_shared as in moe_align. Returns (topk_weights [T, k] fp32, topk_ids [T, k]
    int32, the alignment)."""
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32:
        raise ValueError(f"router_logits must be fp32 [T, E], got {router_logits.dtype} "
                         f"{list(router_logits.shape)}")
    tokens, num_experts = router_logits.shape
    if not route_align_fits(tokens):
        raise ValueError(f"router_logits has {tokens} tokens; route_and_align takes 1..{ROUTE_ALIGN_MAX_TOKENS}")
    if tuple(correction_bias.shape) != (num_experts,) or correction_bias.dtype != torch.float32:
        raise ValueError(f"correction_bias must be fp32 [{num_experts}], got {correction_bias.dtype} "
                         f"{list(correction_bias.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    align = empty_alignment(tokens * (top_k + int(fold_shared)), num_slots, block_m, device)
    emap = expert_map.to(torch.int32).contiguous() if expert_map is not None else ids  # placeholder pointer
    _route_align_kernel[(1,)](
        router_logits.contiguous(), correction_bias.contiguous(), weights, ids, emap, align.sorted_pair_ids,
        align.block_expert, align.num_padded, tokens, num_experts, align.num_pairs, align.max_blocks, num_slots - 1,
        TOPK=top_k, K_PAD=triton.next_power_of_2(top_k), FOLD=fold_shared, HAS_MAP=expert_map is not None,
        E_PAD=triton.next_power_of_2(num_experts), TOKENS_STEP=min(TOKENS_STEP, triton.next_power_of_2(tokens)),
        LANES=align_lanes(num_slots), S_PAD=triton.next_power_of_2(num_slots), BLOCK_M=block_m,
        TABLE_STEP=TABLE_STEP, num_warps=ALIGN_WARPS)
    return weights, ids, align
