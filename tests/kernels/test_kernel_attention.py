"""Triton paged attention (kernels/attention.py) against reference.paged_attention, plus the end-to-end check of
every attention-side switch on the m3-tiny model.

Runs on the `device` fixture: the GPU where there is one, else the Triton interpreter on the CPU
(tests/conftest.py). Shapes are small but ragged: decode-only, prefill-only and mixed batches, context lengths that
are not multiples of the block size, a chunk that starts in the middle of a block, cached prefixes, GQA groups of
1, 2 and 4. Outputs are poisoned with NaN before the kernel runs so an element it forgot to write fails the test.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from nanoserve.batch import AttentionMetadata
from nanoserve.kernels import configs, reference
from nanoserve.kernels.attention import paged_attention

TOLERANCE = {  # (rtol, atol) next to the dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),  # K, V, q in fp16 and probabilities rounded to fp16 for the PV product
}


@contextlib.contextmanager
def poisoned_outputs():
    """Fresh float tensors from torch.empty / empty_like start as NaN while the block runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def make_batch(query_lens, seq_lens, *, device, block_size=16, num_heads=8, num_kv_heads=4, head_dim=32,
               dtype=torch.float32, seed=0):
    """Metadata with shuffled physical blocks (plus spares), a random K/V pool and random queries, on `device`
    (drawn on the CPU, so a seed gives the same batch everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    total = sum(per_seq) + 3
    perm = torch.randperm(total, generator=gen).tolist()
    tables, i = [], 0
    for n in per_seq:
        tables.append(perm[i:i + n])
        i += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
    kv = torch.randn(total, 2, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(device, dtype)
    return meta, kv, q


CASES = {
    # name: (query_lens, seq_lens, overrides)
    "decode_only": ([1, 1, 1, 1], [1, 17, 40, 100], {}),
    "prefill_only": ([33, 16], [33, 16], {}),
    "mixed_chunk_mid_block": ([1, 1, 20, 9], [50, 3, 45, 60], {}),  # chunks start at positions 25 and 51
    "gqa_4_head_dim_48": ([1, 12], [29, 40], dict(num_heads=8, num_kv_heads=2, head_dim=48)),
    "mha_block_8": ([1, 1, 19], [9, 70, 19], dict(num_heads=4, num_kv_heads=4, block_size=8)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, dtype, device):
    query_lens, seq_lens, overrides = CASES[case]
    meta, kv, q = make_batch(query_lens, seq_lens, device=device, dtype=dtype, **overrides)
    scale = q.shape[-1] ** -0.5
    with poisoned_outputs():
        out = paged_attention(q, kv, meta, scale)
    assert not out.isnan().any(), "some output element was never written"
    ref = reference.paged_attention(q, kv, meta, scale)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def test_decode_with_pinned_max_seq_len(device):
    """The graph runner pins max_seq_len to max_model_len: most splits are then empty and must weigh nothing."""
    meta, kv, q = make_batch([1, 1, 1], [3, 64, 33], device=device)
    meta.max_seq_len = 2048
    scale = q.shape[-1] ** -0.5
    with poisoned_outputs():
        out = paged_attention(q, kv, meta, scale)
    torch.testing.assert_close(out, reference.paged_attention(q, kv, meta, scale), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# End to end: m3-tiny with the attention-side switches on vs the reference path
# --------------------------------------------------------------------------------------------------------------

KERNEL_SWITCHES = dict(triton_attention=True, triton_msa=True, fused_qk_norm_rope=True, fused_add_rmsnorm=True)


class TinyRunner:
    """An m3-tiny model with its own paged caches, fed step by step like the model runner would."""

    def __init__(self, tiny_dir: str, opts, device: torch.device, num_blocks: int = 24):
        from nanoserve.model.loader import load_model
        from nanoserve.runner.kv_cache import allocate_kv_caches

        self.device = device
        self.model, _ = load_model(tiny_dir, opts, torch.float32, device=device)
        self.block_size = self.model.cfg.index_block_size
        kv, index = allocate_kv_caches(self.model.cfg, num_blocks, self.block_size, torch.float32, device)
        self.model.bind_kv_caches(kv, index)

    def step(self, tokens: list[list[int]], seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Run one flat batch (decodes first); return the fp32 logits of each sequence's last token."""
        meta = AttentionMetadata.build([len(t) for t in tokens], seq_lens, tables, self.block_size,
                                       device=self.device)
        ids = torch.tensor([tok for seq in tokens for tok in seq], device=self.device)
        hidden = self.model(ids, meta.positions, meta)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last]).float()


def test_m3_tiny_kernels_match_reference_end_to_end(tiny_dir, device):
    """Prefill A (70 tokens: beyond topk x block = 48, so MSA drops blocks) beside the first chunk of B, then B's
    second chunk (starting mid-block) beside A's decode, then greedy decodes of both: logits agree with the
    reference path in fp32 and the greedy tokens are identical."""
    from nanoserve.config import Optimizations

    ref_opts = Optimizations.reference()
    runners = [TinyRunner(tiny_dir, ref_opts, device),
               TinyRunner(tiny_dir, ref_opts.replace(**KERNEL_SWITCHES), device)]
    gen = torch.Generator().manual_seed(0)
    vocab = runners[0].model.cfg.vocab_size
    prompt_a = torch.randint(0, vocab, (70,), generator=gen).tolist()
    prompt_b = torch.randint(0, vocab, (58,), generator=gen).tolist()
    tables = [[3, 7, 1, 9, 11, 2], [5, 0, 8, 12, 4, 6]]  # 6 blocks of 16 each: room for the decodes
    schedule = [  # (tokens per sequence, seq_lens); decodes first; None = next greedy token
        ([prompt_a, prompt_b[:24]], [70, 24]),
        ([None, prompt_b[24:]], [71, 58]),
        ([None, None], [72, 59]),
        ([None, None], [73, 60]),
    ]
    last_tokens: list[list[int]] = [[], []]
    for step_tokens, seq_lens in schedule:
        logits = []
        for r, runner in enumerate(runners):
            toks = [t if t is not None else [last_tokens[r][s]] for s, t in enumerate(step_tokens)]
            logits.append(runner.step(toks, seq_lens, tables))
            last_tokens[r] = logits[-1].argmax(-1).tolist()
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
        assert last_tokens[1] == last_tokens[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_prefill_tma_tiles_match_reference(monkeypatch, dtype, device):
    """Dense prefill with K/V through tensor descriptors (Tiles.tma): chunks that start mid-block, a sequence whose
    last block is partly past its end, and never-written cache slots holding NaN (the descriptor reads whole key
    tiles, so those keys must be masked out of the scores and zeroed in V)."""
    monkeypatch.setitem(configs.TABLES["paged_prefill"], "interpret", configs.Tiles(16, 8, 1, 1, True))
    meta, kv, q = make_batch([1, 20, 9, 33], [50, 45, 60, 33], device=device, dtype=dtype, seed=4)
    for table, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu):
        last = n // 16
        if n % 16:
            kv[table[last], :, n % 16:] = float("nan")
    scale = q.shape[-1] ** -0.5
    with poisoned_outputs():
        out = paged_attention(q, kv, meta, scale)
    assert not out.isnan().any()
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out, reference.paged_attention(q, kv, meta, scale), rtol=rtol, atol=atol)
