"""The Triton fused MoE (kernels/moe.py, kernels/moe_align.py) against the plain-torch per-expert loop.

Runs on the CPU under TRITON_INTERPRET=1 (tests/conftest.py), or compiled on a GPU when one is present, in fp32 and
fp16 (the interpreter computes bf16 wrongly; bf16 is checked on the GPU by tests/kernels/test_gpu_kernels.py). Every
case draws a fresh routing and compares with `reference.moe_experts` times the scaling factor, plus the shared expert
computed by the reference ops when it is folded. Scratch buffers and outputs the kernels allocate are poisoned (NaN /
a wild index), so a value the kernels should have written but did not shows up.

Tolerances, as max |fused - reference| <= RTOL x max |reference|:
    fp32: FP32_RTOL = 1e-5   (only the summation order differs; measured ~3e-7)
    fp16: FP16_RTOL = 1e-2   (the fused path keeps gate/up in fp32 where the reference rounds them to fp16;
                              both round the activation and each expert's output; measured ~1e-3)

Run: python -m pytest tests/kernels/test_kernel_moe.py -q
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from nanoserve.batch import AttentionMetadata
from nanoserve.config import Optimizations
from nanoserve.kernels import moe as moe_mod
from nanoserve.kernels import reference
from nanoserve.kernels.moe import GemmTiles, MoEConfig, fused_moe
from nanoserve.kernels.moe_align import max_tiles, moe_align
from nanoserve.model.loader import load_model
from nanoserve.runner.kv_cache import allocate_kv_caches

FP32_RTOL = 1e-5
FP16_RTOL = 1e-2
RTOL = {torch.float32: FP32_RTOL, torch.float16: FP16_RTOL}
ALPHA, LIMIT, SCALE = 1.702, 7.0, 2.0
"""M3's SwiGLU-OAI constants and routed_scaling_factor."""
POISON_INDEX = 2**30 - 1
"""Fill for int scratch: read as a pair id it is past every real pair (a pad), so a missed write loses outputs."""
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""Inputs are drawn on the CPU (seeded) and moved here; the reference runs on the same device."""
E2E_LOGIT_RTOL = 1e-5
"""End to end, fp32, fused vs reference MoE: max |logit diff| <= E2E_LOGIT_RTOL x max |logit| (measured ~3e-7)."""


# -- helpers ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def poisoned_allocations():
    """Inside: torch.empty / torch.empty_like return NaN-filled floats and POISON_INDEX-filled ints."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else POISON_INDEX)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
        mp.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
        yield


def make_weights(slots: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    """w13 [S, 2I, H] (gate rows then up rows), w2 [S, H, I]; scaled so some activations reach the clamp."""
    w13 = torch.randn(slots, 2 * inter, hidden, generator=gen) * (3.0 / hidden**0.5)
    w2 = torch.randn(slots, hidden, inter, generator=gen) / inter**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def random_routing(tokens: int, experts: int, top_k: int, gen: torch.Generator, allowed: int | None = None):
    """Route with reference.route on random logits; experts >= `allowed` get a large negative bias (no tokens)."""
    logits = torch.randn(tokens, experts, generator=gen)
    bias = torch.zeros(experts)
    if allowed is not None:
        bias[allowed:] = -100.0
    return reference.route(logits.to(DEVICE), bias.to(DEVICE), top_k)


def shared_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    inter = w2.shape[-1]
    gate_up = F.linear(x, w13)
    act = reference.swiglu_oai(gate_up[:, :inter], gate_up[:, inter:], ALPHA, LIMIT).to(x.dtype)
    return F.linear(act, w2).float()


def expected(x, w13, w2, weights, ids, fold, expert_map=None) -> torch.Tensor:
    """SCALE * routed (reference loop) + shared (when folded: the last slot), in fp32."""
    routed_slots = w13.shape[0] - int(fold)
    out = reference.moe_experts(x, w13[:routed_slots], w2[:routed_slots], ids, weights, ALPHA, LIMIT,
                                expert_map).float() * SCALE
    return out + shared_reference(x, w13[-1], w2[-1]) if fold else out


def run_fused(x, w13, w2, weights, ids, fold, expert_map=None, config=None) -> torch.Tensor:
    with poisoned_allocations():
        return fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, expert_map=expert_map,
                         routed_scaling_factor=SCALE, fold_shared=fold, config=config)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "non-finite output: a row was never written"
    diff = (out.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert diff <= RTOL[dtype] * scale, f"max |diff| {diff:.3e} > {RTOL[dtype]} x {scale:.3e}"


def check_case(tokens, hidden, inter, experts, top_k, dtype, fold, seed, allowed=None, config=None):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = make_weights(experts + int(fold), hidden, inter, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = random_routing(tokens, experts, top_k, gen, allowed)
    out = run_fused(x, w13, w2, weights, ids, fold, config=config)
    assert_close(out, expected(x, w13, w2, weights, ids, fold), dtype)


DTYPES = [torch.float32, torch.float16]
FOLDS = [False, True]


# -- alignment --------------------------------------------------------------------------------------------------


def expected_layout(local: torch.Tensor, num_slots: int, block_m: int) -> tuple[list[int], list[int]]:
    """Python version of the alignment layout for flat local slots [num_pairs] (-1 = skip): pair ids grouped by
    slot in original order, each run padded to block_m with num_pairs; and each tile's slot."""
    num_pairs = local.numel()
    rows, owners = [], []
    for e in range(num_slots):
        pairs = [p for p in range(num_pairs) if local[p] == e]
        n_tiles = -(-len(pairs) // block_m)
        rows += pairs + [num_pairs] * (n_tiles * block_m - len(pairs))
        owners += [e] * n_tiles
    return rows, owners


@pytest.mark.parametrize("tokens,experts,top_k,block_m,fold,allowed,use_map", [
    (37, 8, 3, 16, False, None, False),     # uniform; token count not a multiple of the tile
    (37, 8, 3, 16, True, None, False),      # + the folded shared slot on every token
    (1, 8, 4, 16, True, None, False),       # one decode token
    (50, 16, 2, 32, False, 3, False),       # 13 experts without tokens, big runs over several tiles
    (300, 16, 4, 16, True, None, False),    # several alignment chunks (1200+ pairs)
    (29, 8, 3, 16, True, None, True),       # expert parallel: half the experts skipped
    (40, 8, 3, 128, True, None, False),     # prefill-sized tiles: pad tails of up to 127 rows, marked in steps
    (23, 8, 3, 64, False, None, True),      # 64-row tiles with expert parallel
])
def test_alignment_layout(tokens, experts, top_k, block_m, fold, allowed, use_map):
    """Every computed (token, slot) pair appears exactly once, grouped by slot in original order; runs are padded
    to block_m with marked pads; the block table names each tile's slot and -1 past the end."""
    gen = torch.Generator().manual_seed(tokens + experts)
    _, ids = random_routing(tokens, experts, top_k, gen, allowed)
    expert_map = None
    local_routed = ids.long().cpu()
    num_routed = experts
    if use_map:  # this rank owns global experts 2..5 as local slots 0..3
        expert_map = torch.full((experts,), -1, dtype=torch.int32)
        expert_map[2:6] = torch.arange(4, dtype=torch.int32)
        local_routed = expert_map[local_routed]
        expert_map = expert_map.to(DEVICE)
        num_routed = 4
    num_slots = num_routed + int(fold)
    local = torch.cat([local_routed, torch.full((tokens, 1), num_routed)], 1) if fold else local_routed
    with poisoned_allocations():
        align = moe_align(ids, num_slots, block_m, expert_map=expert_map, fold_shared=fold)

    rows, owners = expected_layout(local.flatten(), num_slots, block_m)
    assert align.num_pairs == local.numel()
    assert align.max_blocks == max_tiles(local.numel(), num_slots, block_m) >= len(owners)
    assert int(align.num_padded) == len(rows) == len(owners) * block_m
    assert align.sorted_pair_ids[: len(rows)].tolist() == rows
    assert align.block_expert.tolist() == owners + [-1] * (align.max_blocks - len(owners))
    computed = sorted(p for p in rows if p < align.num_pairs)
    assert computed == [p for p in range(local.numel()) if local.flatten()[p] >= 0], "each pair exactly once"


# -- fused MoE against the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fold", FOLDS)
def test_uniform_routing(dtype, fold):
    """37 tokens (not a multiple of the 16-row tile), hidden 80 and intermediate 48 (ragged K and N tiles)."""
    check_case(37, 80, 48, 8, 3, dtype, fold, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fold", FOLDS)
def test_one_token(dtype, fold):
    check_case(1, 64, 32, 8, 4, dtype, fold, seed=2)


@pytest.mark.parametrize("fold", FOLDS)
def test_experts_without_tokens(fold):
    """Only 3 of 16 experts receive tokens; the other 13 have no tile at all."""
    check_case(24, 64, 32, 16, 2, torch.float32, fold, seed=3, allowed=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_tokens_on_one_expert(dtype):
    """top-1 routing with every token on expert 5: one run over several tiles, every other expert empty."""
    gen = torch.Generator().manual_seed(4)
    tokens, hidden, inter, experts = 40, 64, 32, 8
    w13, w2 = make_weights(experts + 1, hidden, inter, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    ids = torch.full((tokens, 1), 5, dtype=torch.int32, device=DEVICE)
    weights = torch.ones(tokens, 1, device=DEVICE)
    for fold in FOLDS:
        ws13, ws2 = (w13, w2) if fold else (w13[:experts], w2[:experts])
        out = run_fused(x, ws13, ws2, weights, ids, fold)
        assert_close(out, expected(x, ws13, ws2, weights, ids, fold), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fold", FOLDS)
def test_expert_parallel_map(dtype, fold):
    """EP: this rank holds global experts 4..7 of 8 as slots 0..3 (+ the shared slot); pairs routed elsewhere
    contribute nothing, including tokens whose every choice lives on another rank."""
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, experts, top_k = 33, 64, 48, 8, 2
    w13, w2 = make_weights(4 + int(fold), hidden, inter, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = random_routing(tokens, experts, top_k, gen)
    ids[0] = torch.tensor([0, 1], dtype=torch.int32)  # a token with no local expert
    expert_map = torch.full((experts,), -1, dtype=torch.int32, device=DEVICE)
    expert_map[4:] = torch.arange(4, dtype=torch.int32)
    out = run_fused(x, w13, w2, weights, ids, fold, expert_map=expert_map)
    ref = expected(x, w13, w2, weights, ids, fold, expert_map)
    assert_close(out, ref, dtype)
    if not fold:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("fold", FOLDS)
def test_tensor_parallel_shard(fold):
    """A TP shard of the intermediate dim narrower than one column tile (16 < 32)."""
    check_case(19, 64, 16, 8, 4, torch.float32, fold, seed=6)


CONFIGS = {
    "m32-grouped": MoEConfig(32, 3, GemmTiles(16, 16, 4, 2), GemmTiles(16, 32, 4, 2)),
    "m64-wide": MoEConfig(64, 2, GemmTiles(64, 64, 4, 2), GemmTiles(64, 16, 4, 2)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("fold", FOLDS)
def test_other_tile_configs(name, fold):
    """Other tile shapes, including the row-tile swizzle with a ragged last group and K tiles that divide."""
    check_case(45, 64, 32, 8, 3, torch.float32, fold, seed=7, config=CONFIGS[name])


TMA_CONFIGS = {
    # ragged N and K tiles in both GEMMs (hidden 80 and intermediate 48 against 32-wide tiles), row-tile swizzle
    "ragged": MoEConfig(16, 2, GemmTiles(32, 32, 4, 1), GemmTiles(32, 32, 4, 1), tma=True),
    # tiles that divide both dims; 32-row tiles over experts whose runs span several of them
    "even": MoEConfig(32, 1, GemmTiles(16, 16, 4, 1), GemmTiles(16, 16, 4, 1), tma=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(TMA_CONFIGS))
@pytest.mark.parametrize("fold", FOLDS)
def test_tma_tiles_match_reference(dtype, name, fold):
    """Switch moe_tma: weight tiles (and GEMM 2's activation tiles) through TMA descriptors over the flattened
    expert stacks, on fresh routings; the same entry with tma=False (the switch off) gives the pointer-load
    path's result. Tolerances as above (fp32 1e-5, fp16 1e-2 of max |reference|)."""
    seed = 11 + sorted(TMA_CONFIGS).index(name)
    gen = torch.Generator().manual_seed(seed)
    tokens, hidden, inter, experts, top_k = 45, 80, 48, 8, 3
    if name == "even":
        hidden, inter = 64, 32
    w13, w2 = make_weights(experts + int(fold), hidden, inter, dtype, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = random_routing(tokens, experts, top_k, gen)
    ref = expected(x, w13, w2, weights, ids, fold)
    cfg = TMA_CONFIGS[name]
    out = run_fused(x, w13, w2, weights, ids, fold, config=cfg)
    assert_close(out, ref, dtype)
    with poisoned_allocations():
        off = fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE,
                        fold_shared=fold, config=cfg, tma=False)
    assert_close(off, ref, dtype)


def test_large_batches_run_in_chunks(monkeypatch):
    """Batches above MAX_TOKENS_PER_CALL are split into chunks with the same result."""
    monkeypatch.setattr(moe_mod, "MAX_TOKENS_PER_CALL", 16)
    check_case(37, 64, 32, 8, 3, torch.float32, True, seed=8)


def test_empty_batch():
    gen = torch.Generator().manual_seed(9)
    w13, w2 = make_weights(8, 64, 32, torch.float32, gen)
    out = fused_moe(torch.empty(0, 64, device=DEVICE), w13, w2, torch.empty(0, 2, device=DEVICE),
                    torch.empty(0, 2, dtype=torch.int32, device=DEVICE), alpha=ALPHA, limit=LIMIT)
    assert out.shape == (0, 64)


def test_shape_errors():
    gen = torch.Generator().manual_seed(10)
    w13, w2 = make_weights(8, 64, 32, torch.float32, gen)
    x = torch.randn(3, 64, device=DEVICE)
    weights, ids = random_routing(3, 8, 2, gen)
    with pytest.raises(ValueError, match="expert weights"):
        fused_moe(x, w13, w2[:, :, :16], weights, ids, alpha=ALPHA, limit=LIMIT)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights[:2], ids, alpha=ALPHA, limit=LIMIT)


def test_config_table_is_well_formed():
    """Every tile is a multiple of 16 (tl.dot and AMD MFMA minimum) with a power-of-two size; 4 or 8 warps."""
    tables = [cfg for per_bucket in moe_mod.H200_CONFIGS.values() for cfg in per_bucket.values()]
    tables += [moe_mod.default_config(t, 4, 128, rocm) for t in moe_mod.TOKEN_BUCKETS for rocm in (False, True)]
    for cfg in tables:
        for size in (cfg.block_m, cfg.up.block_n, cfg.up.block_k, cfg.down.block_n, cfg.down.block_k):
            assert size >= 16 and size & (size - 1) == 0, cfg
        assert cfg.up.num_warps in (4, 8) and cfg.down.num_warps in (4, 8), cfg
        assert not cfg.tma or all(b <= 256 for b in (cfg.block_m, cfg.up.block_n, cfg.down.block_n)), cfg
    for per_bucket in moe_mod.H200_CONFIGS.values():
        assert sorted(per_bucket) == list(moe_mod.TOKEN_BUCKETS)


# -- end to end: m3-tiny with the fused MoE on and off ----------------------------------------------------------

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 8, 64, 21, 33], [400, 2, 81, 19, 6, 77, 150, 9]]
DECODE_STEPS = 3
NUM_BLOCKS = 16


def generate(tiny_dir: str, opts: Optimizations) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill both prompts in one batch, then DECODE_STEPS greedy decode steps of both. Returns the generated
    tokens per sequence and the logits of every step."""
    model, _ = load_model(tiny_dir, opts, torch.float32, device=DEVICE)
    bs = model.cfg.index_block_size
    kv, index = allocate_kv_caches(model.cfg, NUM_BLOCKS, bs, torch.float32, DEVICE)
    model.bind_kv_caches(kv, index)
    tables = [list(range(0, NUM_BLOCKS // 2)), list(range(NUM_BLOCKS // 2, NUM_BLOCKS))]
    lens = [len(p) for p in PROMPTS]
    step_ids, query_lens = [t for p in PROMPTS for t in p], lens
    generated: list[list[int]] = [[], []]
    all_logits = []
    for _ in range(DECODE_STEPS + 1):
        meta = AttentionMetadata.build(query_lens, lens, tables, bs, device=DEVICE)
        hidden = model(torch.tensor(step_ids, device=DEVICE), meta.positions, meta)
        last = torch.cumsum(torch.tensor(query_lens, device=DEVICE), 0) - 1
        logits = model.compute_logits(hidden[last])
        all_logits.append(logits)
        step_ids = logits.argmax(-1).tolist()
        for s, tok in enumerate(step_ids):
            generated[s].append(tok)
        query_lens = [1, 1]
        lens = [n + 1 for n in lens]
    return generated, all_logits


@pytest.fixture(scope="module")
def reference_generation(tiny_dir):
    opts = Optimizations(triton_attention=False, triton_msa=False, fused_qk_norm_rope=False,
                         fused_add_rmsnorm=False, fused_rmsnorm=False, fused_moe=False, fold_shared_expert=False)
    return generate(tiny_dir, opts)


@pytest.mark.parametrize("fold", FOLDS)
def test_m3_tiny_end_to_end(tiny_dir, reference_generation, fold, monkeypatch):
    """m3-tiny (3 MoE layers, 16 experts top-4 + shared), two sequences: a batched prefill then greedy decode
    steps give the same tokens and logits within E2E_LOGIT_RTOL with the fused MoE as with the reference loop."""
    opts = Optimizations(triton_attention=False, triton_msa=False, fused_qk_norm_rope=False,
                         fused_add_rmsnorm=False, fused_rmsnorm=False, fused_moe=True, fold_shared_expert=fold)
    folds_seen = []

    def spy(*args, **kwargs):
        folds_seen.append(kwargs["fold_shared"])
        return real_fused_moe(*args, **kwargs)

    real_fused_moe = moe_mod.fused_moe
    monkeypatch.setattr(moe_mod, "fused_moe", spy)
    tokens, logits = generate(tiny_dir, opts)
    assert folds_seen == [fold] * (3 * (DECODE_STEPS + 1)), "the layer must call the fused kernel"
    ref_tokens, ref_logits = reference_generation
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        diff = (ours - ref).abs().max().item()
        assert diff <= E2E_LOGIT_RTOL * ref.abs().max().item(), diff
