"""Triton MSA kernels (kernels/msa.py) against reference.msa_select and reference.sparse_attention.

On the `device` fixture (the GPU where there is one, else the Triton interpreter on the CPU). Batches are ragged:
decode-only, prefill-only and mixed, contexts shorter and longer than topk x block_size (so selection keeps every
block, or really drops some), sequence lengths that are not multiples of the block size, chunks that start
mid-block against cached index keys, GQA groups of 2 and 4, local_blocks 1 and 2. Index data drawn from small
integers makes every dot product exact in any summation order and produces many equal block scores, so the tie rule
(score desc, then block index asc) is checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import configs, msa, reference
from nanoserve.kernels.msa import msa_select, sparse_attention
from tests.kernels.test_kernel_attention import make_batch, poisoned_outputs

TOLERANCE = {  # (rtol, atol) of sparse attention, next to the dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
}
BLOCK = 16

CASES = {
    # name: (query_lens, seq_lens, topk, local_blocks, heads (q, kv))
    "decode_short_and_long_contexts": ([1, 1, 1, 1, 1], [5, 40, 48, 49, 200], 3, 1, (8, 4)),
    "prefill_only_long": ([70], [70], 3, 1, (8, 4)),
    "mixed_chunks_mid_block": ([1, 1, 30, 9], [100, 16, 130, 57], 3, 1, (8, 4)),  # chunks start at 100 and 48
    "local_2_topk_4_gqa_4": ([1, 40], [90, 75], 4, 2, (8, 2)),
}


def make_msa_batch(case: str, dtype: torch.dtype, integer_index: bool, device: torch.device, seed: int = 0):
    """make_batch's metadata, K/V pool and queries for a case, plus index queries and index keys, on `device`."""
    query_lens, seq_lens, topk, local, (hq, hkv) = CASES[case]
    meta, kv, q = make_batch(query_lens, seq_lens, device=device, num_heads=hq, num_kv_heads=hkv, dtype=dtype,
                             seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    shape_q, shape_k = (meta.num_tokens, hkv, 32), (kv.shape[0], BLOCK, 32)
    if integer_index:
        index_q = torch.randint(-2, 3, shape_q, generator=gen).to(device, dtype)
        index_cache = torch.randint(-2, 3, shape_k, generator=gen).to(device, dtype)
    else:
        index_q = torch.randn(shape_q, generator=gen).to(device, dtype)
        index_cache = torch.randn(shape_k, generator=gen).to(device, dtype)
    return meta, kv, q, index_q, index_cache, topk, local


SELECT_VARIANTS = [(torch.float32, False), (torch.float32, True), (torch.float16, True)]


@pytest.mark.parametrize("dtype,integer_index", SELECT_VARIANTS, ids=["fp32", "fp32-ties", "fp16-ties"])
@pytest.mark.parametrize("case", list(CASES))
def test_msa_select_matches_reference(case, dtype, integer_index, device):
    meta, _, _, index_q, index_cache, topk, local = make_msa_batch(case, dtype, integer_index, device)
    selected = msa_select(index_q, index_cache, meta, topk, local)
    expected = reference.msa_select(index_q, index_cache, meta, topk, local)
    assert selected.dtype == torch.int32 and selected.shape == expected.shape
    assert torch.equal(selected, expected)


def test_msa_select_long_rows_workspace_passes_and_pinned_max_seq_len(monkeypatch, device):
    """Force the top-k kernel's multi-tile path (rows longer than its tile), several prefill workspace passes, and
    a decode workspace sized by a pinned max_seq_len (as under CUDA graphs)."""
    monkeypatch.setitem(configs.TABLES["msa_topk"], "interpret", configs.Tiles(64, 4, 1, 1))
    monkeypatch.setattr(msa, "MAX_SCORE_WORKSPACE_BYTES", 4 * 4 * 9 * 7)  # 7 rows of [4 groups, 9 blocks] per pass
    meta, _, _, index_q, index_cache, topk, local = make_msa_batch("mixed_chunks_mid_block", torch.float32, True,
                                                                   device)
    expected = reference.msa_select(index_q, index_cache, meta, topk, local)
    meta.max_seq_len = 1024
    assert torch.equal(msa_select(index_q, index_cache, meta, topk, local), expected)


def random_selection(meta, num_kv: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """Per (token, group): distinct causal blocks in random order, the own block among them, with -1 holes
    anywhere in the list (the kernel must not rely on the top-k's order or packing). Drawn on the CPU, returned
    on the metadata's device."""
    sel = torch.full((meta.num_tokens, num_kv, topk), -1, dtype=torch.int32)
    for t, pos in enumerate(meta.positions.tolist()):
        own = pos // BLOCK
        for g in range(num_kv):
            others = torch.randperm(own, generator=gen)[: topk - 2].tolist()
            picks = others + [own]
            slots = torch.randperm(topk, generator=gen)[: len(picks)]
            sel[t, g, slots] = torch.tensor(picks, dtype=torch.int32)
    return sel.to(meta.positions.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention_matches_reference(case, dtype, device):
    meta, kv, q, index_q, index_cache, topk, local = make_msa_batch(case, dtype, False, device)
    selected = reference.msa_select(index_q, index_cache, meta, topk, local)
    scale = q.shape[-1] ** -0.5
    with poisoned_outputs():
        out = sparse_attention(q, kv, meta, selected, scale)
    assert not out.isnan().any(), "some output element was never written"
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out, reference.sparse_attention(q, kv, meta, selected, scale), rtol=rtol, atol=atol)


def test_sparse_attention_unordered_selection_with_holes(device):
    meta, kv, q, _, _, topk, _ = make_msa_batch("mixed_chunks_mid_block", torch.float32, False, device)
    selected = random_selection(meta, kv.shape[3], topk + 1, torch.Generator().manual_seed(5))
    scale = q.shape[-1] ** -0.5
    with poisoned_outputs():
        out = sparse_attention(q, kv, meta, selected, scale)
    torch.testing.assert_close(out, reference.sparse_attention(q, kv, meta, selected, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_long_context_prefill_tiles_match_reference(monkeypatch, dtype, device):
    """The `_long` prefill entries (one query token per sparse program, the walk over each token's own selection
    list) on a mixed batch whose longest sequence crosses a lowered LONG_PREFILL_CONTEXT: dense attention, block
    scores + top-k, and block-sparse attention against the reference."""
    from nanoserve.kernels.attention import paged_attention

    monkeypatch.setattr(configs, "LONG_PREFILL_CONTEXT", 100)
    monkeypatch.setitem(configs.TABLES["sparse_prefill_long"], "interpret", configs.Tiles(1, 64, 1, 1))
    monkeypatch.setitem(configs.TABLES["paged_prefill_long"], "interpret", configs.Tiles(16, 16, 1, 1))
    meta, kv, q, index_q, index_cache, topk, local = make_msa_batch("mixed_chunks_mid_block", dtype, True, device,
                                                                   seed=3)
    assert configs.prefill_kernel("sparse_prefill", max(meta.seq_lens_cpu)) == "sparse_prefill_long"
    assert torch.equal(msa_select(index_q, index_cache, meta, topk, local),
                       reference.msa_select(index_q, index_cache, meta, topk, local))
    selected = reference.msa_select(index_q, index_cache, meta, topk, local)
    scale = q.shape[-1] ** -0.5
    rtol, atol = TOLERANCE[dtype]
    with poisoned_outputs():
        out = sparse_attention(q, kv, meta, selected, scale)
        dense = paged_attention(q, kv, meta, scale)
    assert not out.isnan().any() and not dense.isnan().any(), "some output element was never written"
    torch.testing.assert_close(out, reference.sparse_attention(q, kv, meta, selected, scale), rtol=rtol, atol=atol)
    torch.testing.assert_close(dense, reference.paged_attention(q, kv, meta, scale), rtol=rtol, atol=atol)


@pytest.mark.parametrize("case,dtype", [("mixed_chunks_mid_block", torch.float32),
                                        ("local_2_topk_4_gqa_4", torch.float16)], ids=["mixed-fp32", "gqa4-fp16"])
def test_sparse_prefill_by_block_matches_reference(monkeypatch, case, dtype, device):
    """The by-block prefill (switch msa_sparse_by_block): pairs grouped by block in tiles of 3 tokens (so blocks
    chosen by many tokens span several tiles, and a tile can end short), partial results written in several
    passes (a lowered MAX_PARTIAL_BYTES), selections from the indexer and random ones with holes."""
    monkeypatch.setitem(configs.TABLES["sparse_by_block"], "interpret", configs.Tiles(3, 16, 1, 1))
    meta, kv, q, index_q, index_cache, topk, local = make_msa_batch(case, dtype, False, device, seed=7)
    hq, d = q.shape[1], q.shape[2]
    monkeypatch.setattr(msa, "MAX_PARTIAL_BYTES", 13 * hq * (topk + 1) * (d * q.element_size() + 4))
    scale = d ** -0.5
    rtol, atol = TOLERANCE[dtype]
    for selected in (reference.msa_select(index_q, index_cache, meta, topk, local),
                     random_selection(meta, kv.shape[3], topk + 1, torch.Generator().manual_seed(11))):
        with poisoned_outputs():
            out = sparse_attention(q, kv, meta, selected, scale, by_block=True)
        assert not out.isnan().any(), "some output element was never written"
        expected = reference.sparse_attention(q, kv, meta, selected, scale)
        torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


def test_by_block_tiles_group_pairs_of_one_block(device):
    """Every selected (token, group, slot) pair lands in exactly one tile, a tile holds pairs of one key only and
    at most tok_tile of them, and unselected slots are in none."""
    gen = torch.Generator().manual_seed(3)
    selected = torch.randint(-1, 5, (23, 2, 3), generator=gen, dtype=torch.int32).to(device)
    seq_local = torch.tensor([0] * 10 + [1] * 13, device=device)
    sorted_key, order, tile_start, n_tiles, bound = msa.by_block_tiles(selected, seq_local, 2, 5, 4)
    n = int(n_tiles)
    assert n <= bound
    starts = tile_start[:n].tolist() + [int((sorted_key != torch.iinfo(torch.int64).max).sum())]
    seen = []
    for a, b in zip(starts, starts[1:]):
        assert 0 < b - a <= 4 and len(set(sorted_key[a:b].tolist())) == 1
        seen += order[a:b].tolist()
    flat = selected.flatten()
    assert sorted(seen) == [i for i in range(flat.numel()) if flat[i] >= 0]
    for p in seen:
        t, g, _ = p // 6, (p // 3) % 2, p % 3
        key = int(sorted_key[order.tolist().index(p)])
        assert key == (g * 2 + int(seq_local[t])) * 5 + int(flat[p])
