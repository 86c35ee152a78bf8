"""The reference attention and MSA paths (kernels/reference.py) process queries in chunks, so their memory stays
bounded at long context (reference.SCORE_BYTES): chunked, they give what one pass over all queries gives.

On fresh random batches in fp32 (decodes, whole prefills, chunks starting mid-block, GQA groups of 1, 2 and 4),
`paged_attention`, `msa_select` and `sparse_attention` with one query per chunk, three per chunk and the default
budget are compared with each other and with a plain full-matrix oracle written here (every query against the
whole context at once, KV heads repeated per query head, as the reference computed before it was chunked):
attention within fp32 rounding, block selections exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.kernels import reference
from tests.kernels.test_kernel_attention import make_batch

FP32 = dict(rtol=1e-5, atol=1e-6)


def random_batch(seed: int):
    """A batch of 1-4 sequences: random context lengths, each a decode, a whole prefill or a chunk."""
    rng = random.Random(seed)
    query_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 4)):
        seq_len = rng.randint(1, 90)
        kind = rng.choice(["decode", "prefill", "chunk"])
        query_lens.append(1 if kind == "decode" else seq_len if kind == "prefill" else rng.randint(1, seq_len))
        seq_lens.append(seq_len)
    heads, kv_heads = rng.choice([(4, 4), (8, 4), (8, 2)])
    meta, kv, q = make_batch(query_lens, seq_lens, device="cpu", num_heads=heads, num_kv_heads=kv_heads,
                             head_dim=16, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    index_q = torch.randn(meta.num_tokens, kv_heads, 16, generator=gen)
    index_cache = torch.randn(kv.shape[0], kv.shape[2], 16, generator=gen)
    return meta, kv, q, index_q, index_cache


def oracle_attention(q, kv, meta, allowed_of, scale):
    """Every query of a sequence against its whole context in one [Hq, Tq, L] softmax."""
    out = torch.empty_like(q)
    group = q.shape[1] // kv.shape[3]
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        k = reference.gather_context(kv[:, 0], meta.block_tables[s], seq_len).transpose(0, 1)
        v = reference.gather_context(kv[:, 1], meta.block_tables[s], seq_len).transpose(0, 1)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        tokens = slice(start, start + q_len)
        scores = q[tokens].transpose(0, 1) @ k.transpose(-1, -2) * scale  # [Hq, Tq, L]
        scores = scores.masked_fill(~allowed_of(s, tokens, seq_len), float("-inf"))
        out[tokens] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
        start += q_len
    return out


@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_in_chunks_is_one_pass(seed):
    meta, kv, q, _, _ = random_batch(seed)

    def causal(s, tokens, seq_len):
        return (torch.arange(seq_len)[None, :] <= meta.positions[tokens][:, None])[None]

    want = oracle_attention(q, kv, meta, causal, 0.25)
    for chunk in (1, 3, None):
        torch.testing.assert_close(reference.paged_attention(q, kv, meta, 0.25, query_chunk=chunk), want, **FP32)


@pytest.mark.parametrize("seed", range(6))
def test_msa_in_chunks_is_one_pass(seed):
    meta, kv, q, index_q, index_cache = random_batch(seed)
    block, topk, local = kv.shape[2], 3, 1
    # the selection: scores of every query at once, then the top-k
    want_sel = torch.full((meta.num_tokens, index_q.shape[1], topk), -1, dtype=torch.int32)
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        tokens = slice(start, start + q_len)
        keys = reference.gather_context(index_cache, meta.block_tables[s], seq_len)
        scores = reference.msa_block_scores(index_q[tokens], keys, meta.positions[tokens], block)
        want_sel[tokens] = reference.msa_topk_blocks(scores, meta.positions[tokens], block, topk, local)
        start += q_len
    for chunk in (1, 3, None):
        assert torch.equal(reference.msa_select(index_q, index_cache, meta, topk, local, query_chunk=chunk),
                           want_sel)

    group = q.shape[1] // kv.shape[3]

    def selected_blocks(s, tokens, seq_len):
        key_block = torch.arange(seq_len) // block
        sel = want_sel[tokens].long()  # [Tq, Hkv, k]
        keep = (key_block[None, None, :, None] == sel[:, :, None, :]).any(-1)  # [Tq, Hkv, L]
        causal = torch.arange(seq_len)[None, :] <= meta.positions[tokens][:, None]
        return (keep & causal[:, None]).repeat_interleave(group, 1).transpose(0, 1)

    want = oracle_attention(q, kv, meta, selected_blocks, 0.25)
    for chunk in (1, 3, None):
        got = reference.sparse_attention(q, kv, meta, want_sel, 0.25, query_chunk=chunk)
        torch.testing.assert_close(got, want, **FP32)


def test_the_default_chunk_bounds_the_scores(monkeypatch):
    """With the budget of a few queries' scores, the default path runs in chunks and still gives one pass's
    result; at M3's widths (64 query heads, 131,072 keys) the budget holds 32 queries."""
    meta, kv, q, index_q, index_cache = random_batch(3)
    whole = reference.paged_attention(q, kv, meta, 0.25)
    sel = reference.msa_select(index_q, index_cache, meta, 3, 1)
    sparse = reference.sparse_attention(q, kv, meta, sel, 0.25)
    calls = []
    real = reference._query_chunks
    monkeypatch.setattr(reference, "_query_chunks", lambda *a: calls.append(real(*a)) or calls[-1])
    monkeypatch.setattr(reference, "SCORE_BYTES", q.shape[1] * 90 * 4 * 2)  # two queries at the longest context
    torch.testing.assert_close(reference.paged_attention(q, kv, meta, 0.25), whole, **FP32)
    assert torch.equal(reference.msa_select(index_q, index_cache, meta, 3, 1), sel)
    torch.testing.assert_close(reference.sparse_attention(q, kv, meta, sel, 0.25), sparse, **FP32)
    assert any(len(c) > 1 for c in calls), "no sequence was split into chunks"
    monkeypatch.undo()
    assert reference._query_chunks(16384, 64 * 131072 * 4, None)[0] == (0, 32)
