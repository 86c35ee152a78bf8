"""The Triton kernels in bf16 at M3's real widths, against kernels/reference.py (marked `gpu`: compiled kernels; the
CPU runs the same kernels at small widths in fp32/fp16 under Triton's interpreter in tests/test_kernel_*.py, which
computes bf16 wrongly).

Attention: 64 query heads and 4 KV heads of 128, MSA's 4 index heads of 128 over 128-token blocks, top-16 blocks
with the local one; a mixed batch (decodes at short and long contexts, a whole prefill, a chunk starting mid-block),
and a chunk at the end of a 32,768-token context (the long-context tiles), over a bf16 and over an fp8 KV pool.
The MoE: hidden 6144, 128 experts of 3072, top-4 and the folded shared expert. Every output tensor a kernel
allocates starts as NaN (so an element it forgot to write shows), and the decode paths are captured in a CUDA graph
and replayed on new inputs, as the engine runs them.

Tolerances: bf16 relative error (||kernel - reference|| / ||reference|| for attention, max |diff| / max |ref| for
the MoE) <= 2e-2; the norm + rope outputs, rounded to bf16 once, <= 1e-2. MSA block selection is compared as
sets: a block may differ from the reference's only where fp32 scores tie within 1e-3 (the kernel and the reference
sum in different orders).
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.model.m3_config import M3Config

pytestmark = pytest.mark.gpu

BF16_REL_TOL = 2e-2
MIXED = ([1, 1, 1, 1, 700, 300, 77], [1000, 5000, 129, 17, 700, 2300, 3000])
"""4 decodes (one at context 17, one at 129), a whole prefill, a chunk starting mid-block, a short chunk."""


def rel_norm_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def cfg() -> M3Config:
    return M3Config()


def batch(cfg, query_lens, seq_lens, seed=0):
    from nanoserve.bench.micro_attention import Batch

    return Batch(cfg, query_lens, seq_lens, torch.device("cuda"), seed=seed)


def selection_mismatches(b, selected: torch.Tensor, ref_selected: torch.Tensor, index_q: torch.Tensor) -> int:
    """Rows whose selected blocks differ from the reference's beyond fp32 near-ties of their block scores: a
    different count, a missing own (local) block, a repeated block, or a picked block scoring clearly below one
    the reference picked."""
    from nanoserve.kernels import reference

    meta, block = b.meta, b.block
    differs = (selected != ref_selected).any(-1)  # [T, G]
    bad, start = 0, 0
    for s, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        rows = differs[start:start + ql]
        if rows.any():
            keys = reference.gather_context(b.index_cache, meta.block_tables[s], sl)
            pos = meta.positions[start:start + ql]
            scores = reference.msa_block_scores(index_q[start:start + ql], keys, pos, block)  # [G, Tq, nb]
            for t, g in rows.nonzero().tolist():
                sc = scores[g, t]
                picked = [x for x in selected[start + t, g].tolist() if x >= 0]
                wanted = [x for x in ref_selected[start + t, g].tolist() if x >= 0]
                own = int(pos[t]) // block
                unforced = [x for x in wanted if x != own]
                others = [x for x in picked if x != own]
                tol = 1e-3 * sc[: own + 1].abs().max() + 1e-3
                if (len(picked) != len(wanted) or own not in picked or len(set(picked)) != len(picked)
                        or (unforced and (sc[others] < sc[unforced].min() - tol).any())):
                    bad += 1
        start += ql
    return bad


def test_paged_attention_bf16(cfg):
    from nanoserve.kernels import reference
    from tests.kernels.test_kernel_attention import poisoned_outputs

    b = batch(cfg, *MIXED)
    with poisoned_outputs():
        out = b.dense()
    assert not out.isnan().any()
    assert rel_norm_err(out, reference.paged_attention(b.q, b.kv, b.meta, b.scale)) < BF16_REL_TOL


def test_msa_select_and_sparse_attention_bf16(cfg):
    from nanoserve.kernels import reference
    from tests.kernels.test_kernel_attention import poisoned_outputs

    b = batch(cfg, *MIXED)
    ref_sel = reference.msa_select(b.index_q, b.index_cache, b.meta, cfg.index_topk_blocks, cfg.index_local_blocks)
    assert selection_mismatches(b, b.select(), ref_sel, b.index_q) == 0
    with poisoned_outputs():
        out = b.sparse(ref_sel)
    assert not out.isnan().any()
    assert rel_norm_err(out, reference.sparse_attention(b.q, b.kv, b.meta, ref_sel, b.scale)) < BF16_REL_TOL


@pytest.mark.parametrize("by_block", [True, False], ids=["by-block", "per-token"])
def test_long_context_prefill_bf16(cfg, by_block):
    """A chunk of 256 queries at the end of a 32,768-token context: the `_long` tiles of kernels/configs.py (dense
    prefill, MSA scores and top-k), and the sparse attention grouped by block (switch msa_sparse_by_block) or
    per token."""
    from nanoserve.kernels import configs, reference
    from nanoserve.kernels.msa import sparse_attention
    from tests.kernels.test_kernel_attention import poisoned_outputs

    context = configs.LONG_PREFILL_CONTEXT
    b = batch(cfg, [256], [context], seed=5)
    with poisoned_outputs():
        dense = b.dense()
    assert not dense.isnan().any()
    assert rel_norm_err(dense, reference.paged_attention(b.q, b.kv, b.meta, b.scale)) < BF16_REL_TOL
    ref_sel = reference.msa_select(b.index_q, b.index_cache, b.meta, cfg.index_topk_blocks, cfg.index_local_blocks)
    assert selection_mismatches(b, b.select(), ref_sel, b.index_q) == 0
    with poisoned_outputs():
        sparse = sparse_attention(b.q, b.kv, b.meta, ref_sel, b.scale, by_block=by_block)
    assert not sparse.isnan().any()
    assert rel_norm_err(sparse, reference.sparse_attention(b.q, b.kv, b.meta, ref_sel, b.scale)) < BF16_REL_TOL


def test_long_context_prefill_over_an_fp8_pool(cfg):
    """The same chunk over an fp8 e4m3 pool with scales: `paged_prefill_fp8_long`'s tile (fp8 K/V tiles through
    TMA, widened in registers) against the reference reading the same fp8 values."""
    from nanoserve.kernels import configs, reference
    from nanoserve.kernels.attention import paged_attention
    from tests.kernels.test_kernel_attention import poisoned_outputs
    from tests.kernels.test_kv_fp8 import fp8_pool_pair

    b = batch(cfg, [256], [configs.LONG_PREFILL_CONTEXT], seed=6)
    pool, _ = fp8_pool_pair(b.kv, 0.5, 2.0)
    with poisoned_outputs():
        out = paged_attention(b.q, pool, b.meta, b.scale, k_scale=0.5, v_scale=2.0)
    assert not out.isnan().any()
    ref = reference.paged_attention(b.q, pool, b.meta, b.scale, k_scale=0.5, v_scale=2.0)
    assert rel_norm_err(out, ref) < BF16_REL_TOL


def test_qk_norm_rope_insert_bf16(cfg):
    """An MSA layer's q | k | v | index_q | index_k split, normed, roped and written to shuffled slots, some of
    them padding (-1): the written slots match the reference, the others stay untouched."""
    from nanoserve.kernels import reference
    from nanoserve.kernels.norm_rope import qk_norm_rope_insert
    from tests.kernels.test_kernel_attention import poisoned_outputs

    hq, hkv, d, g, di = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.index_n_heads,
                         cfg.index_head_dim)
    block, t, dev = cfg.index_block_size, 300, "cuda"
    sizes = [hq * d, hkv * d, hkv * d, g * di, di]
    gen = torch.Generator(device=dev).manual_seed(1)
    qkv = (torch.randn(t, sum(sizes), device=dev, generator=gen) * 2).to(torch.bfloat16)
    w = [torch.randn(d, device=dev, generator=gen) * 0.1 for _ in range(4)]
    pos = torch.randint(0, 100000, (t,), device=dev, generator=gen)
    cos, sin = reference.rope_cos_sin(pos, reference.rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, dev))
    n_blocks = max(8, -(-2 * t // block))  # room for every token, half the slots left untouched
    slots = torch.randperm(n_blocks * block, device=dev, generator=gen)[:t]
    slots[::7] = -1
    kv = torch.full((n_blocks, 2, block, hkv, d), float("nan"), dtype=torch.bfloat16, device=dev)
    ic = torch.full((n_blocks, block, di), float("nan"), dtype=torch.bfloat16, device=dev)
    kv_ref, ic_ref = kv.clone(), ic.clone()
    with poisoned_outputs():
        q, iq = qk_norm_rope_insert(qkv, sizes, d, w[0], w[1], w[2], w[3], pos, (cos, sin), cfg.rms_norm_eps,
                                    slots, kv, ic)
    p = torch.split(qkv, sizes, -1)
    q_ref, k_ref = reference.qk_norm_rope(p[0].reshape(t, -1, d), p[1].reshape(t, -1, d), w[0], w[1], cos, sin,
                                          cfg.rms_norm_eps)
    reference.write_kv(kv_ref, k_ref, p[2].reshape(t, -1, d), slots)
    iq_ref, ik_ref = reference.qk_norm_rope(p[3].reshape(t, -1, di), p[4].reshape(t, 1, di), w[2], w[3], cos, sin,
                                            cfg.rms_norm_eps)
    reference.write_index_keys(ic_ref, ik_ref[:, 0], slots)
    assert torch.equal(kv.isnan(), kv_ref.isnan()) and torch.equal(ic.isnan(), ic_ref.isnan())
    written_kv, written_ic = ~kv_ref.isnan(), ~ic_ref.isnan()
    assert not q.isnan().any() and not iq.isnan().any()
    for got, want in ((q, q_ref), (iq, iq_ref), (kv[written_kv], kv_ref[written_kv]),
                      (ic[written_ic], ic_ref[written_ic])):
        assert rel_norm_err(got, want) < 1e-2


def test_fused_add_rmsnorm_bf16(cfg):
    from nanoserve.kernels import reference
    from nanoserve.kernels.norm_rope import fused_add_rmsnorm
    from tests.kernels.test_kernel_attention import poisoned_outputs

    gen = torch.Generator(device="cuda").manual_seed(2)
    x, r = (torch.randn(257, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(cfg.hidden_size, device="cuda", generator=gen) * 0.1
    with poisoned_outputs():
        out, res = fused_add_rmsnorm(x, r, w, cfg.rms_norm_eps)
    out_ref, res_ref = reference.add_gemma_rmsnorm(x, r, w, cfg.rms_norm_eps)
    assert not out.isnan().any()
    assert rel_norm_err(out, out_ref) < 1e-2
    assert torch.equal(res, res_ref), "the residual sum is one bf16 add in both"


def test_decode_attention_replayed_from_a_cuda_graph(cfg):
    """Dense and MSA decode captured once (max_seq_len pinned, as the graph runner does), replayed on new queries:
    the outputs are the reference's for the new inputs."""
    from nanoserve.kernels import reference

    b = batch(cfg, [1] * 8, [100, 3000, 129, 17, 8000, 5, 640, 2049])
    b.meta.max_seq_len = 16384

    def step():
        sel = b.select()
        return b.dense(), b.sparse(sel), sel

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dense, sparse, sel = step()
    gen = torch.Generator(device="cuda").manual_seed(7)
    b.q.copy_(torch.randn(b.q.shape, device="cuda", generator=gen))
    b.index_q.copy_(torch.randn(b.index_q.shape, device="cuda", generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    ref_sel = reference.msa_select(b.index_q, b.index_cache, b.meta, cfg.index_topk_blocks, cfg.index_local_blocks)
    assert selection_mismatches(b, sel, ref_sel, b.index_q) == 0
    assert rel_norm_err(dense, reference.paged_attention(b.q, b.kv, b.meta, b.scale)) < BF16_REL_TOL
    assert rel_norm_err(sparse, reference.sparse_attention(b.q, b.kv, b.meta, sel, b.scale)) < BF16_REL_TOL


@pytest.fixture(scope="module")
def moe_problem(cfg):
    from nanoserve.bench.moe_problem import MoEProblem

    return MoEProblem(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                      "cuda", seed=0)


@pytest.mark.parametrize("fold", [True, False], ids=["shared-folded", "routed-only"])
@pytest.mark.parametrize("tokens", [1, 64, 1024])
def test_fused_moe_bf16(moe_problem, tokens, fold):
    from nanoserve.bench.moe_problem import BF16_REL_TOL as MOE_TOL
    from nanoserve.bench.moe_problem import rel_err

    x, weights, ids = moe_problem.inputs(tokens)
    out = moe_problem.fused(x, weights, ids, fold=fold)
    assert torch.isfinite(out).all()
    assert rel_err(out, moe_problem.exact(x, weights, ids, fold=fold)) <= MOE_TOL


@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_fused_moe_replayed_from_a_cuda_graph_equals_eager(moe_problem, tokens):
    """Captured with one input, replayed on another through the same buffers: bit-equal to an eager call on it
    (the launch sequence has no host synchronisation and no shape-dependent choice baked in)."""
    x, weights, ids = moe_problem.inputs(tokens)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_problem.fused(x, weights, ids)
        with torch.cuda.graph(graph, stream=stream):
            captured = moe_problem.fused(x, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, moe_problem.fused(x, weights, ids))
