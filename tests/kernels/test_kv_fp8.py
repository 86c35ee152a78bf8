"""The fp8 KV cache (`kv_cache_dtype="fp8"`, vLLM's `--kv-cache-dtype fp8`): the pools in float8_e4m3fn with
per-tensor scales, against the 16/32-bit pool it replaces.

- the engine argument, the server flag and the refusals (fp8_e5m2 by name, anything else with the choices);
- writes: x / scale, saturated to +-448, rounded to nearest (reference.to_cache), by the reference and by the fused
  insert kernel alike; reads: fp8 x scale;
- the kernels (decode, prefill, MSA selection, block-sparse attention) on an fp8 pool against the reference on the
  same pool (the same fp8 values, fp32 accumulation: fp32 1e-5), and the fp8 pool against the fp32 pool holding
  the unrounded values (the quantisation error: FP8_VS_FP32 below). On the `device` fixture: the GPU where there is
  one, else the Triton interpreter, which reads float8_e4m3fn exactly (its fp32 -> fp8 rounding is wrong where
  it carries into the exponent, so the fused insert kernel's fp8 writes are checked on a GPU only);
- the pool: one byte per element, so the same bytes hold twice the blocks (runner and memory plan);
- a checkpoint's k_scale / v_scale reach the layers, bad ones are refused;
- end to end on m3-tiny (fp32): the model on fp8 pools is the model on fp32 pools holding the fp8-rounded values.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from nanoserve.batch import AttentionMetadata
from nanoserve.config import EngineConfig
from nanoserve.kernels import reference
from nanoserve.kernels.reference import FP8_KV_DTYPE, FP8_KV_MAX, from_cache, to_cache
from tests.kernels.test_kernel_attention import make_batch, poisoned_outputs

FP8 = FP8_KV_DTYPE
SAME_POOL = {"rtol": 1e-5, "atol": 1e-5}
"""Kernel against reference on one fp8 pool: both read the same fp8 values exactly and accumulate in fp32."""
FP8_VS_FP32 = {"rtol": 0.0, "atol": 0.15}
"""Attention over an fp8 pool against the fp32 pool of the same unit-normal K / V: e4m3 keeps 3 mantissa bits
(relative error <= 2^-4 per element), which moves a score q.k by a few hundredths and an output (a weighted mean
of V, |V| <~ 3) by up to ~0.1."""
FP8_VS_FP32_LOGITS = 3.0
"""m3-tiny's fp32 logits with an fp8 pool against the fp32 pool, max |difference|. Loose: m3-tiny's random weights
amplify the ~3 % rounding of K and V into 5-25 % of its logits' norm (about 1.5 at most, logits within +-4); the
trained m3-mini's quality change is measured by `python -m nanoserve.bench --quality --ablate`."""


def fp8_pool_pair(kv: torch.Tensor, k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 pool storing kv / scales, fp32 pool of the values that fp8 pool reads back) for a fp32 pool kv."""
    pool = torch.empty_like(kv, dtype=FP8)
    pool[:, 0], pool[:, 1] = to_cache(kv[:, 0], FP8, k_scale), to_cache(kv[:, 1], FP8, v_scale)
    return pool, pool.float() * torch.tensor([k_scale, v_scale], device=kv.device).view(1, 2, 1, 1, 1)


# -- the argument --------------------------------------------------------------------------------------------------


def test_engine_argument_takes_vllm_names_and_refuses_the_rest():
    assert EngineConfig().kv_cache_dtype == "auto"
    for name in ("auto", "fp8", "fp8_e4m3"):
        assert EngineConfig.from_kwargs(kv_cache_dtype=name).kv_cache_dtype == name
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported: the fp8 KV cache is e4m3"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is invalid: one of auto, fp8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int4")


def test_server_flag(capsys):
    from nanoserve.server.__main__ import build_parser, main

    assert build_parser().parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert build_parser().parse_args([]).kv_cache_dtype == "auto"
    for bad in ("int4", "fp8_e5m2"):
        with pytest.raises(SystemExit) as exit_:
            main(["--kv-cache-dtype", bad])
        assert exit_.value.code == 2 and f"invalid choice: '{bad}'" in capsys.readouterr().err


def test_pool_dtype_and_its_bytes():
    """An fp8 pool costs one byte per element: the same bytes hold twice the blocks, in the runner's sizing
    (kv_cache_bytes_per_block) and in the memory plan."""
    from nanoserve.model.m3_config import M3Config
    from nanoserve.model.memory_plan import memory_plan
    from nanoserve.runner.kv_cache import (
        allocate_kv_caches,
        kv_cache_bytes_per_block,
        kv_cache_torch_dtype,
    )

    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == kv_cache_torch_dtype("fp8_e4m3", torch.float32) == FP8
    cfg = M3Config()
    bf16, fp8 = (kv_cache_bytes_per_block(cfg, 128, d) for d in (torch.bfloat16, FP8))
    assert bf16 == 2 * fp8
    budget = 10_000 * bf16 + 17
    assert budget // fp8 == 2 * (budget // bf16)
    plan16, plan8 = (memory_plan(cfg, 143_771 * 2**20, 8, "mxfp8", kv_item_bytes=b) for b in (2, 1))
    assert plan8.pool_bytes == plan16.pool_bytes and plan8.kv_per_token * 2 == plan16.kv_per_token
    assert plan8.kv_tokens in (2 * plan16.kv_tokens, 2 * plan16.kv_tokens + 1)
    kv, index = allocate_kv_caches(cfg, 3, 128, FP8, "meta")
    assert {t.dtype for t in kv + [i for i in index if i is not None]} == {FP8}
    assert sum(t.numel() for t in kv + [i for i in index if i is not None]) == 3 * fp8


@pytest.mark.gpu
def test_gpu_pool_holds_twice_the_blocks(tiny_dir):
    """On a GPU the engine sizes its pool from the memory left (determine_num_blocks): with an fp8 pool the same
    budget gives twice the blocks of a bf16 pool (within the warm-up's run-to-run wobble)."""
    import gc

    from nanoserve.runner.model_runner import ModelRunner

    blocks = {}
    for kv in ("auto", "fp8"):
        runner = ModelRunner(EngineConfig(model=tiny_dir, device="cuda", dtype="bfloat16", kv_cache_dtype=kv,
                                          gpu_memory_utilization=0.2))
        try:
            blocks[kv] = runner.determine_num_blocks(512, 512, 4)
            runner.allocate_kv_cache(blocks[kv])
            assert runner.kv_caches[0].dtype == (FP8 if kv == "fp8" else torch.bfloat16)
        finally:
            runner.shutdown()
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    assert 1.98 < blocks["fp8"] / blocks["auto"] < 2.02, blocks


@pytest.mark.gpu
def test_gpu_decode_graphs_over_an_fp8_pool(tiny_dir):
    """The compiled kernels on an fp8 pool inside captured decode graphs (m3-tiny, bf16): the replay gives the
    eager step's logits, as for a bf16 pool (tests/engine/test_cuda_graphs.py)."""
    from nanoserve.runner.model_runner import ModelRunner
    from tests.helpers.graph_check import compare_decode_logits

    runner = ModelRunner(EngineConfig(model=tiny_dir, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8",
                                      max_model_len=512, max_num_seqs=64, num_gpu_blocks_override=64 * 7 + 8))
    try:
        runner.allocate_kv_cache(runner.determine_num_blocks(512, 1024, 64))
        assert runner.kv_caches[0].dtype == FP8
        rows = compare_decode_logits(runner, (1, 3, 64), prompt_len=100)
    finally:
        runner.shutdown()
    for r in rows:
        assert r["graph_used"] and r["disabled"] is None, r
        assert r["max_rel_diff"] <= 5e-2 and r["argmax_agreement"] >= 0.9, r


# -- writes and reads -------------------------------------------------------------------------------------------


def test_to_cache_scales_saturates_and_rounds():
    x = torch.tensor([0.0, 1.0, -3.3, 500.0, -1e6, 7e-4, 100.0])
    stored = to_cache(x, FP8, 2.0)
    assert stored.dtype == FP8
    back = from_cache(stored, 2.0)
    # 500 / 2 = 250 rounds to 256 (steps of 16 there); -1e6 / 2 saturates at -448 (not NaN: e4m3fn has no inf)
    assert back[3] == 512.0 and back[4] == -2 * FP8_KV_MAX and not back.isnan().any()
    normal = x.abs() / 2 >= 2.0**-6
    err = (back - x).abs()
    assert (err[normal & (x.abs() < 800)] <= 2.0**-4 * x.abs()[normal & (x.abs() < 800)]).all()
    assert (err[~normal] <= 2 * 2.0**-10).all()  # subnormals: half a step of 2^-9, times the scale
    assert torch.equal(to_cache(x, torch.float16, 2.0), x.half())  # a 16-bit pool ignores the scale
    assert torch.equal(from_cache(x.half(), 2.0), x.half().float())


def test_write_kv_and_index_keys_into_fp8_pools():
    gen = torch.Generator().manual_seed(0)
    k, v = 4 * torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([3, -1, 17, 8, 30])
    pool = torch.zeros(2, 2, 16, 2, 8, dtype=FP8)
    reference.write_kv(pool, k, v, slots, k_scale=0.5, v_scale=0.25)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, 16)
        assert torch.equal(pool[b, 0, o].view(torch.uint8), to_cache(k[t], FP8, 0.5).view(torch.uint8))
        assert torch.equal(pool[b, 1, o].view(torch.uint8), to_cache(v[t], FP8, 0.25).view(torch.uint8))
    assert int((pool.view(torch.uint8) != 0).sum()) <= 4 * 2 * 2 * 8  # the padding token wrote nothing
    index = torch.zeros(2, 16, 8, dtype=FP8)
    reference.write_index_keys(index, k[:, 0], slots)
    assert torch.equal(index[1, 1].view(torch.uint8), to_cache(k[2, 0], FP8).view(torch.uint8))


@pytest.mark.gpu
def test_fused_insert_writes_what_the_reference_writes(device):
    """The fused QK-norm + RoPE + insert kernel stores the same fp8 bytes as the reference branch (x rounded to
    the activation dtype, times 1 / scale, saturated), padding slots untouched. GPU only: Triton's interpreter
    (3.9) rounds fp32 -> fp8 wrongly where rounding up carries into the exponent (0.49 becomes 0.25), so on the
    CPU the kernel's writes are not what a GPU writes."""
    from nanoserve.kernels.norm_rope import qk_norm_rope_insert
    from tests.kernels.test_kernel_norm_rope import EPS, reference_norm_rope_insert

    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, di, rotary, tokens, bs, blocks = 4, 2, 32, 32, 16, 9, 16, 2
    sizes = [hq * d, hkv * d, hkv * d, hkv * di, di]
    qkv = (3 * torch.randn(tokens, sum(sizes), generator=gen)).to(device)
    qkv[0, hq * d + hkv * d] = 1e4  # a V value that saturates
    weights = [(0.3 * torch.randn(d, generator=gen)).to(device) for _ in range(4)]
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(device)
    cos, sin = reference.rope_cos_sin(positions, reference.rope_inv_freq(rotary, 5e6, device))
    slots = torch.randperm(blocks * bs, generator=gen)[:tokens].to(device)
    slots[4] = -1
    kv = torch.full((blocks, 2, bs, hkv, d), float("nan"), dtype=FP8, device=device)
    index = torch.full((blocks, bs, di), float("nan"), dtype=FP8, device=device)
    kv_ref, index_ref = kv.clone(), index.clone()
    qk_norm_rope_insert(qkv, sizes, d, *weights, positions, (cos, sin), EPS, slots, kv, index, 0.5, 4.0)
    # the reference branch with the layer's scales: write_kv(..., k_scale, v_scale)
    pieces = torch.split(qkv, sizes, dim=-1)
    _, k = reference.qk_norm_rope(pieces[0].reshape(tokens, -1, d), pieces[1].reshape(tokens, -1, d),
                                  weights[0], weights[1], cos, sin, EPS)
    reference.write_kv(kv_ref, k, pieces[2].reshape(tokens, -1, d), slots, 0.5, 4.0)
    reference_norm_rope_insert(qkv, sizes, d, weights, cos, sin, slots, kv_ref.clone(), index_ref, True)
    assert torch.equal(kv.view(torch.uint8), kv_ref.view(torch.uint8))
    assert torch.equal(index.view(torch.uint8), index_ref.view(torch.uint8))
    assert from_cache(kv, 4.0)[:, 1].nan_to_num().abs().max() == 4.0 * FP8_KV_MAX  # saturated, not NaN


# -- the kernels on an fp8 pool ---------------------------------------------------------------------------------


def test_paged_attention_reads_fp8(device):
    """Decodes and prefill chunks (mid-block, cached prefixes, GQA 2) over an fp8 pool with scales."""
    from nanoserve.kernels.attention import paged_attention

    meta, kv, q = make_batch([1, 1, 20, 9], [50, 3, 45, 60], device=device)
    pool, seen = fp8_pool_pair(kv, 0.5, 2.0)
    scale = q.shape[-1] ** -0.5
    with poisoned_outputs():
        out = paged_attention(q, pool, meta, scale, k_scale=0.5, v_scale=2.0)
    assert not out.isnan().any()
    ref = reference.paged_attention(q, pool, meta, scale, k_scale=0.5, v_scale=2.0)
    torch.testing.assert_close(out, ref, **SAME_POOL)
    torch.testing.assert_close(ref, reference.paged_attention(q, seen, meta, scale), **SAME_POOL)
    torch.testing.assert_close(out, reference.paged_attention(q, kv, meta, scale), **FP8_VS_FP32)


def test_msa_kernels_read_fp8(device):
    """MSA selection over an fp8 index-key pool and block-sparse attention (decode split-K, prefill per token
    tile and by block) over an fp8 K/V pool, against the reference on the same pools."""
    from nanoserve.kernels.msa import msa_select, sparse_attention
    from tests.kernels.test_kernel_msa import make_msa_batch

    meta, kv, q, index_q, index_keys, topk, local = make_msa_batch("mixed_chunks_mid_block", torch.float32, True,
                                                                   device)
    index_pool = to_cache(index_keys, FP8)  # small integers: exact in fp8, so ties still break by block
    selected = msa_select(index_q, index_pool, meta, topk, local)
    assert torch.equal(selected, reference.msa_select(index_q, index_pool, meta, topk, local))
    assert torch.equal(selected, reference.msa_select(index_q, index_keys, meta, topk, local))
    pool, _ = fp8_pool_pair(kv, 0.25, 0.5)
    scale = q.shape[-1] ** -0.5
    ref = reference.sparse_attention(q, pool, meta, selected, scale, k_scale=0.25, v_scale=0.5)
    for by_block in (False, True):
        with poisoned_outputs():
            out = sparse_attention(q, pool, meta, selected, scale, by_block=by_block, k_scale=0.25, v_scale=0.5)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, **SAME_POOL)
    torch.testing.assert_close(ref, reference.sparse_attention(q, kv, meta, selected, scale), **FP8_VS_FP32)


# -- checkpoint scales and the whole model --------------------------------------------------------------------


def add_tensors(model_dir: str, tensors: dict[str, torch.Tensor]) -> None:
    """Add a safetensors file with `tensors` to a checkpoint directory (and to its index if it has one)."""
    save_file(tensors, os.path.join(model_dir, "kv_scales.safetensors"))
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"].update({k: "kv_scales.safetensors" for k in tensors})
        with open(index, "w") as f:
            json.dump(data, f)


@pytest.fixture
def scaled_dir(tiny_dir, tmp_path):
    import shutil

    path = str(tmp_path / "scaled")
    shutil.copytree(tiny_dir, path)
    return path


def test_checkpoint_kv_scales_reach_the_layers(scaled_dir):
    from nanoserve.model.loader import load_model

    prefix = "language_model.model.layers"
    add_tensors(scaled_dir, {f"{prefix}.0.self_attn.k_scale": torch.tensor(0.5),
                             f"{prefix}.0.self_attn.v_scale": torch.tensor([0.125]),
                             f"{prefix}.2.self_attn.k_scale": torch.tensor(2.0, dtype=torch.bfloat16)})
    model, _ = load_model(scaled_dir)
    attn = [layer.self_attn for layer in model.layers]
    assert (attn[0].k_scale, attn[0].v_scale, attn[2].k_scale, attn[2].v_scale, attn[1].k_scale) == \
        (0.5, 0.125, 2.0, 1.0, 1.0)


@pytest.mark.parametrize("value,words", [(torch.tensor([1.0, 2.0]), "one value per tensor"),
                                         (torch.tensor(-1.0), "must be finite and > 0"),
                                         (torch.tensor(float("inf")), "must be finite and > 0")])
def test_bad_checkpoint_kv_scales_are_refused(scaled_dir, value, words):
    from nanoserve.model.loader import CheckpointError, load_model

    add_tensors(scaled_dir, {"language_model.model.layers.1.self_attn.v_scale": value})
    with pytest.raises(CheckpointError, match=words):
        load_model(scaled_dir)


def tiny_logits(tiny_dir: str, pool_dtype: torch.dtype, scales: tuple[float, float] | None = None) -> torch.Tensor:
    """m3-tiny's logits (fp32, reference kernels) at every position of two prompts, each prefilled in two chunks
    (70 tokens: MSA drops blocks; the second chunk reads the cached first), then three decode steps of fixed
    tokens (so both pools run the same steps), with the pools in pool_dtype and the layers' scales set."""
    from nanoserve.config import Optimizations
    from nanoserve.model.loader import load_model
    from nanoserve.runner.kv_cache import allocate_kv_caches

    model, _ = load_model(tiny_dir, Optimizations.reference_kernels(), torch.float32)
    if scales:
        for layer in model.layers:
            layer.self_attn.k_scale, layer.self_attn.v_scale = scales
    bs = model.cfg.index_block_size
    model.bind_kv_caches(*allocate_kv_caches(model.cfg, 12, bs, pool_dtype, "cpu"))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).tolist() for n in (70, 56)]
    tables = [list(range(6)), list(range(6, 12))]
    steps = [([p[:40] for p in prompts], [40, 40]), ([p[40:] for p in prompts], [70, 56])]
    steps += [([[1 + i], [2 + i]], [71 + i, 57 + i]) for i in range(3)]
    out = []
    with torch.inference_mode():
        for toks, seq_lens in steps:
            meta = AttentionMetadata.build([len(t) for t in toks], seq_lens, tables, bs)
            hidden = model(torch.tensor([x for t in toks for x in t]), meta.positions, meta)
            out.append(model.compute_logits(hidden).float())
    return torch.cat(out)


def test_m3_tiny_with_an_fp8_pool_is_the_model_on_fp8_rounded_kv(tiny_dir, monkeypatch):
    """The whole model (prefill chunks against a cached prefix, MSA dropping blocks, decodes) with fp8 pools
    computes what it computes with fp32 pools holding the fp8-rounded K, V and index keys (fp32 1e-5): every write
    and read goes through the pool's scales, and nothing else changes. Checked with the default scales and with
    checkpoint-like ones; fp32 pools ignore the scales (as vLLM's auto cache does). The rounding itself moves
    m3-tiny's logits (random weights, +-4) by up to FP8_VS_FP32_LOGITS."""
    ref = tiny_logits(tiny_dir, torch.float32)
    assert torch.equal(tiny_logits(tiny_dir, torch.float32, (0.5, 4.0)), ref)
    for scales in (None, (0.5, 0.25)):
        got = tiny_logits(tiny_dir, FP8, scales)
        assert 0 < (got - ref).abs().max() < FP8_VS_FP32_LOGITS
        with monkeypatch.context() as m:  # fp32 pools that store what an fp8 pool would read back
            write_kv, write_index_keys = fp8_rounding_writes(*(scales or (1.0, 1.0)))
            m.setattr(reference, "write_kv", write_kv)
            m.setattr(reference, "write_index_keys", write_index_keys)
            rounded = tiny_logits(tiny_dir, torch.float32, scales)
        torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-5)


def fp8_rounding_writes(k_scale: float, v_scale: float):
    """reference.write_kv / write_index_keys for a 16/32-bit pool that stores what an fp8 pool with these scales
    would read back."""
    write_kv, write_index_keys = reference.write_kv, reference.write_index_keys

    def kv(cache, k, v, slots, *_):
        write_kv(cache, from_cache(to_cache(k, FP8, k_scale), k_scale), from_cache(to_cache(v, FP8, v_scale), v_scale),
                 slots)

    def index(cache, k, slots):
        write_index_keys(cache, from_cache(to_cache(k, FP8)), slots)

    return kv, index


# -- the bench ------------------------------------------------------------------------------------------------


def test_bench_flag_and_quality_row():
    """`python -m nanoserve.bench --kv-cache-dtype fp8` builds its engine with an fp8 pool and counts one KV byte
    per element in its cost model; the quality ablation has an fp8 KV row beside the MXFP8 one."""
    from nanoserve.bench.__main__ import parser
    from nanoserve.bench.offline import NanoBench
    from nanoserve.bench.quality import variants
    from nanoserve.config import Optimizations

    assert parser().parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser().parse_args(["--kv-cache-dtype", "int4"])
    assert dict(variants())["--kv-cache-dtype fp8"] == {"kv_cache_dtype": "fp8"}
    b = NanoBench("m3-tiny", "cpu", "float32", Optimizations.reference_kernels(), max_model_len=128, max_num_seqs=2,
                  kv_tokens=256, kv_cache_dtype="fp8")
    try:
        assert b.runner.kv_dtype == FP8 and b.runner.kv_caches[0].dtype == FP8 and b.cost.kvb == 1
        from nanoserve.sampling import SamplingParams

        engine = b.engine(128, 2)
        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=4))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    finally:
        b.close()
