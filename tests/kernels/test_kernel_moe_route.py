"""Routing + alignment in one launch (kernels/moe_route.py) against its reference: `reference.route` followed by
`moe_align`, and the fused MoE fed by it against the same MoE fed by the torch routing.

Runs on the CPU under TRITON_INTERPRET=1 (tests/conftest.py) or compiled on a GPU. Every case draws fresh router
logits (and a correction bias); ties between experts have probability zero there, so the selections must agree
exactly. Tolerances, fp32 (the routing is fp32 whatever the model's dtype):
    ids, sorted pair ids, block table, padded row count: equal
    weights: max |fused - reference| <= WEIGHT_ATOL = 1e-6 (they sum to 1; sigmoid's exp and the k-term sum may
             round differently; measured <= 6e-8)

Run: python -m pytest tests/kernels/test_kernel_moe_route.py -q
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import Optimizations
from nanoserve.kernels import reference
from nanoserve.kernels.moe import fused_moe, fused_route_moe
from nanoserve.kernels.moe_align import moe_align
from nanoserve.kernels.moe_route import ROUTE_ALIGN_MAX_PAIRS, ROUTE_ALIGN_MAX_TOKENS, route_align_fits, route_and_align
from nanoserve.model.layers.moe import M3MoE
from nanoserve.presets.catalog import get_preset

from .test_kernel_moe import ALPHA, DEVICE, LIMIT, SCALE, make_weights, poisoned_allocations

WEIGHT_ATOL = 1e-6


def draw(tokens: int, experts: int, seed: int, bias_scale: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) * bias_scale
    return logits.to(DEVICE), bias.to(DEVICE)


def assert_same_routing(tokens, experts, top_k, block_m, fold, seed, expert_map=None, num_slots=None):
    logits, bias = draw(tokens, experts, seed)
    slots = num_slots if num_slots is not None else experts + int(fold)
    with poisoned_allocations():
        weights, ids, align = route_and_align(logits, bias, top_k, slots, block_m, expert_map=expert_map,
                                              fold_shared=fold)
    ref_weights, ref_ids = reference.route(logits, bias, top_k)
    ref = moe_align(ref_ids, slots, block_m, expert_map=expert_map, fold_shared=fold)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    assert weights.dtype == torch.float32 and (weights - ref_weights).abs().max().item() <= WEIGHT_ATOL
    rows = int(ref.num_padded)
    assert int(align.num_padded) == rows
    assert (align.num_pairs, align.max_blocks, align.block_m) == (ref.num_pairs, ref.max_blocks, ref.block_m)
    assert torch.equal(align.sorted_pair_ids[:rows], ref.sorted_pair_ids[:rows])
    assert torch.equal(align.block_expert, ref.block_expert)


@pytest.mark.parametrize("tokens,experts,top_k,block_m,fold", [
    (1, 128, 4, 16, True),       # M3 decode, one request
    (12, 128, 4, 16, True),      # M3's largest batch on this path (60 pairs)
    (3, 16, 4, 16, False),       # no folded shared expert
    (ROUTE_ALIGN_MAX_TOKENS, 8, 3, 16, True),   # the most tokens: experts shared by up to 16 pairs, full tiles
    (7, 16, 1, 32, True),        # top-1, a token count that is no power of two, a larger tile
    (5, 24, 8, 16, False),       # experts that are no power of two
])
def test_matches_torch_routing_and_alignment(tokens, experts, top_k, block_m, fold):
    assert_same_routing(tokens, experts, top_k, block_m, fold, seed=tokens * 31 + experts)


@pytest.mark.parametrize("fold", [False, True])
def test_expert_parallel_map(fold):
    """Rank 1 of 2 under expert parallelism: experts 8..15 are its slots 0..7, the rest are skipped."""
    experts = 16
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[8:] = torch.arange(8, dtype=torch.int32)
    assert_same_routing(12, experts, 4, 16, fold, seed=5, expert_map=expert_map.to(DEVICE),
                        num_slots=8 + int(fold))


def test_ties_go_to_the_lower_expert():
    logits = torch.zeros(2, 16, device=DEVICE)
    weights, ids, _ = route_and_align(logits, torch.zeros(16, device=DEVICE), 4, 16, 16)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2
    assert torch.allclose(weights, torch.full((2, 4), 0.25, device=DEVICE))


def test_argument_errors():
    logits, bias = draw(2, 16, seed=0)
    with pytest.raises(ValueError, match="router_logits"):
        route_and_align(logits.half(), bias, 4, 16, 16)
    with pytest.raises(ValueError, match="router_logits has 0 tokens"):
        route_and_align(logits[:0], bias, 4, 16, 16)
    with pytest.raises(ValueError, match=f"router_logits has {ROUTE_ALIGN_MAX_TOKENS + 1} tokens"):
        route_and_align(torch.zeros(ROUTE_ALIGN_MAX_TOKENS + 1, 16, device=DEVICE), bias, 1, 16, 16)
    with pytest.raises(ValueError, match=f"at most {ROUTE_ALIGN_MAX_PAIRS} "):  # 13 tokens x (4 + shared)
        route_and_align(torch.zeros(13, 16, device=DEVICE), bias, 4, 17, 16, fold_shared=True)
    with pytest.raises(ValueError, match="correction_bias"):
        route_and_align(logits, bias[:8], 4, 16, 16)
    with pytest.raises(ValueError, match="top_k"):
        route_and_align(logits, bias, 17, 16, 16)
    with pytest.raises(ValueError, match="block_m"):
        route_and_align(logits, bias, 4, 16, 24)
    with pytest.raises(ValueError, match="block_m"):  # a run of 16 pairs would not fit one tile of 8
        route_and_align(logits, bias, 4, 16, 8)
    assert not route_align_fits(0, 5) and route_align_fits(1, 5) and route_align_fits(12, 5)
    assert not route_align_fits(13, 5) and not route_align_fits(ROUTE_ALIGN_MAX_TOKENS + 1, 1)


@pytest.mark.parametrize("fold", [False, True])
def test_fused_route_moe_matches_torch_routing(fold):
    """The whole layer's math: fused routing + fused MoE equals torch routing + fused MoE (fp32)."""
    tokens, hidden, inter, experts, top_k = 5, 64, 32, 16, 4
    gen = torch.Generator().manual_seed(11)
    w13, w2 = make_weights(experts + int(fold), hidden, inter, torch.float32, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    logits, bias = draw(tokens, experts, seed=12)
    kw = dict(alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE, fold_shared=fold)
    with poisoned_allocations():
        out, weights, ids = fused_route_moe(x, logits, bias, w13, w2, top_k=top_k, **kw)
    ref_weights, ref_ids = reference.route(logits, bias, top_k)
    ref = fused_moe(x, w13, w2, ref_weights, ref_ids, **kw)
    assert torch.equal(ids, ref_ids)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_alignment_must_fit_the_call():
    tokens, hidden, inter, experts = 3, 64, 32, 16
    gen = torch.Generator().manual_seed(3)
    w13, w2 = make_weights(experts, hidden, inter, torch.float32, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    logits, bias = draw(tokens, experts, seed=4)
    weights, ids, align = route_and_align(logits, bias, 4, experts, 32)
    with pytest.raises(ValueError, match="block_m"):  # the interpreter's tiles use block_m 16
        fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, alignment=align)
    _, _, other = route_and_align(logits[:2], bias, 4, experts, 16)
    with pytest.raises(ValueError, match="alignment holds 8 pairs"):
        fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, alignment=other)


def test_layer_output_with_and_without_the_switch():
    """M3MoE on m3-tiny's shapes, fp32: the switch changes no routing and the output within fp32 rounding."""
    cfg = get_preset("m3-tiny").config
    outs, routes = [], []
    for on in (True, False):
        torch.manual_seed(0)
        layer = M3MoE(cfg, Optimizations(fused_routing=on), torch.float32, DEVICE)
        for p in layer.parameters():
            p.data.normal_(0, 0.05)
        x = torch.randn(7, cfg.hidden_size, device=DEVICE)
        seen = []
        layer.trace = lambda event, **kw: seen.append(kw["topk_ids"].clone())
        outs.append(layer(x))
        routes.append(seen[0])
    assert torch.equal(routes[0], routes[1])
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-5 * outs[1].abs().max().item()
