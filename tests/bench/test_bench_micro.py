"""What the kernel micro-benchmarks build and count, on the CPU (their timings need a GPU: `python -m nanoserve.bench
--micro attention,route,...`): the attention batch is a valid paged batch the kernels and the references agree on,
the FLOP and byte counts are the sums they stand for, the MoE problem's fp32 oracle is the fused kernel's result,
and the command line refuses an unknown kind."""

from __future__ import annotations

import pytest
import torch

from nanoserve.bench.micro_attention import Batch, causal_flops, dense_decode_bytes, msa_decode_bytes
from nanoserve.kernels import reference
from nanoserve.presets.catalog import get_preset

CFG = get_preset("m3-tiny").config


def test_attention_batch_runs_the_kernels_as_the_references_do():
    """Decodes and chunks over a shuffled pool, fp32 under the interpreter."""
    b = Batch(CFG, [1, 1, 30, 9], [100, 16, 130, 57], torch.device("cpu"), dtype=torch.float32)
    used = [x for t, n in zip(b.meta.block_tables, b.meta.seq_lens_cpu) for x in t[:-(-n // b.block)].tolist()]
    assert len(used) == len(set(used)) == 7 + 1 + 9 + 4, "every sequence has blocks of its own"
    torch.testing.assert_close(b.dense(), reference.paged_attention(b.q, b.kv, b.meta, b.scale))
    selected = b.select()
    expected = reference.msa_select(b.index_q, b.index_cache, b.meta, CFG.index_topk_blocks, CFG.index_local_blocks)
    assert torch.equal(selected, expected)
    torch.testing.assert_close(b.sparse(selected), reference.sparse_attention(b.q, b.kv, b.meta, selected, b.scale))
    smooth = b.smooth_index_queries()
    assert smooth.shape == b.index_q.shape and (smooth[1:] - smooth[:-1]).abs().mean() < 0.1


def test_flop_and_byte_counts():
    d = CFG.head_dim
    for n, cap in ((300, None), (300, 48), (40, 48)):
        keys = sum(min(i + 1, cap or n) for i in range(n))
        assert causal_flops(CFG, n, 4, cap) == 4.0 * 4 * d * keys
    hkv, hq = CFG.num_key_value_heads, CFG.num_attention_heads
    assert dense_decode_bytes(CFG, [100, 7]) == 107 * hkv * d * 4 + 2 * hq * d * 4
    b, k = CFG.index_block_size, CFG.index_topk_blocks
    long_ctx = (k + 5) * b  # more blocks than top-k: only k are read
    per_seq = hq * d * 4 + CFG.index_n_heads * CFG.index_head_dim * 2
    assert msa_decode_bytes(CFG, [long_ctx]) == long_ctx * CFG.index_head_dim * 2 + k * b * hkv * d * 4 + per_seq


@pytest.mark.parametrize("fold", [True, False])
def test_moe_problem_oracle_is_the_fused_kernels_result(fold):
    from nanoserve.bench.moe_problem import MoEProblem, rel_err

    p = MoEProblem(128, 64, 16, 4, "cpu")
    x, weights, ids = p.inputs(24)
    assert rel_err(p.fused(x, weights, ids, fold=fold), p.exact(x, weights, ids, fold=fold)) < 1e-5
    assert p.flops(24) == 2.0 * 3 * 128 * 64 * 24 * 5
    assert p.bytes(ids) == (int(ids.unique().numel()) + 1) * 3 * 128 * 64 * 4


def test_micro_refuses_an_unknown_kind():
    from nanoserve.bench.__main__ import main

    with pytest.raises(SystemExit, match="--micro: unknown nope; choose from .*route.*attention"):
        main(["--micro", "route,nope", "--device", "cpu"])


def test_long_prefill_rows_time_both_pools(monkeypatch):
    """The long-prefill case: one chunk at the end of a longer context, over a bf16 pool and an fp8 pool, each row
    with the causal FLOPs of that chunk (keys 1 .. context for its last query)."""
    from nanoserve.bench import micro_attention

    calls = []
    monkeypatch.setattr(micro_attention, "eager_ms", lambda fn: calls.append(fn()) or 2.0)
    rows = micro_attention.long_prefill_rows(CFG, torch.device("cpu"), chunk=20, context=150)
    assert [r["kv_pool"] for r in rows] == ["bf16", "fp8"] and len(calls) == 2
    assert all(out.shape == (20, CFG.num_attention_heads, CFG.head_dim) for out in calls)
    keys = sum(range(131, 151))
    assert rows[1]["dense_tflop_s"] == 4.0 * CFG.num_attention_heads * CFG.head_dim * keys / 2.0 / 1e9


def test_align_rows_time_the_alignment_at_every_tile_height(monkeypatch):
    """`--micro align`: one timed call per (token count, tile height), each a whole alignment of the routed pairs
    plus the folded shared expert, padded to that height."""
    from nanoserve.bench import micro
    from nanoserve.kernels.moe_align import MoEAlignment

    aligned = []
    monkeypatch.setattr(micro, "graph_us", lambda call, **kw: aligned.append(call(0)) or 3.0)
    res = micro.align_micro(CFG, [3, 40], torch.device("cpu"))
    assert [r["tokens"] for r in res["rows"]] == [3, 40]
    assert all(r[f"block_m_{b}_us"] == 3.0 for r in res["rows"] for b in micro.ALIGN_BLOCK_M)
    assert [a.block_m for a in aligned] == list(micro.ALIGN_BLOCK_M) * 2
    k = CFG.num_experts_per_tok + 1
    for a, tokens in zip(aligned, [3] * 4 + [40] * 4):
        assert isinstance(a, MoEAlignment) and a.num_pairs == tokens * k
        assert int(a.num_padded) % a.block_m == 0 and int(a.num_padded) >= a.num_pairs
