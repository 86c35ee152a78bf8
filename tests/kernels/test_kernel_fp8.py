"""MXFP8-weight kernels against their plain-torch references: the fp8-weight GEMM (kernels/fp8_linear.py) against
`reference.fp8_linear`, and the fused MoE with fp8 experts (kernels/moe.py) against `reference.moe_experts` with
the same fp8 weights and scales (both dequantise, then compute).

Every kernel variant (fp8_configs.FP8_VARIANTS: acc, gather, bcast, swap, scaled, dequant, gemv) is checked. Runs on the
CPU under TRITON_INTERPRET=1 (tests/conftest.py; the interpreter loads float8_e4m3fn and uint8 tensors and converts
them exactly), or compiled on a GPU when one is present; activations in fp32 and fp16 (the interpreter rounds
elementwise bf16 wrongly, so bf16 is checked on the GPU by scripts/tune_fp8.py and tests/model/test_gpu_mxfp8.py),
except "scaled" (tl.dot_scaled takes bf16 activations only), which the interpreter computes right in bf16. Weights are
drawn fresh per case, quantised with `quantize_mxfp8`, and include blocks whose scales differ by many octaves, so
a scale applied to the wrong 32 columns shows.

Tolerances, as max |kernel - reference| <= RTOL x max |reference|:
    fp32: 1e-5   (the dequantised weights are identical; only the summation order differs)
    fp16: 1e-2   (split-K partials and fused gate/up stay fp32 where the reference rounds to fp16)
    bf16: 2e-2   (as fp16, with bf16's 8-bit mantissa)
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.kernels import fp8_configs, reference
from nanoserve.kernels.fp8_linear import LinearTiles, fp8_linear
from nanoserve.kernels.moe import GemmTiles, MoEConfig, fused_moe
from nanoserve.model.mxfp8 import dequantize_mxfp8, quantize_mxfp8

RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
VARIANT_DTYPES = [(v, d) for v in ("acc", "gather", "bcast", "swap") for d in (torch.float32, torch.float16)] + \
    [("scaled", torch.bfloat16)]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ALPHA, LIMIT, SCALE = 1.702, 7.0, 2.0


def mx_weight(n: int, k: int, gen: torch.Generator, std: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """An [n, k] weight quantised to MXFP8, with per-block magnitudes spread over 2^-6 .. 2^6 times `std`."""
    w = torch.randn(n, k, generator=gen) * std
    octaves = torch.randint(-6, 7, (n, k // 32), generator=gen).float()
    w = w * torch.exp2(octaves).repeat_interleave(32, dim=1)
    q, s = quantize_mxfp8(w)
    return q.to(DEVICE), s.to(DEVICE)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= RTOL[dtype] * want.float().abs().max().item(), err


def test_quantize_roundtrip_is_the_checkpoint_rule():
    """dequantize_mxfp8 multiplies by 2^(S - 127), block by block along the input dim."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen)
    q, s = quantize_mxfp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (8, 2)
    manual = q.float() * torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
    torch.testing.assert_close(dequantize_mxfp8(q, s, torch.float32), manual, rtol=0, atol=0)
    assert (dequantize_mxfp8(q, s, torch.float32) - w).abs().max() <= w.abs().max() * 2 ** -3


@pytest.mark.parametrize("variant,dtype", VARIANT_DTYPES)
@pytest.mark.parametrize("m,n,k,split,block_m", [(1, 96, 128, None, 16), (5, 64, 192, 3, 16),
                                                 (37, 80, 96, 1, 64), (16, 33, 320, 2, 64)])
def test_fp8_linear_matches_reference(variant, dtype, m, n, k, split, block_m):
    """Each variant over decode-like and ragged shapes: splits of K, a ragged last row / column tile, K not a
    multiple of BLOCK_K with one split (where "acc", which needs full K tiles, runs "bcast")."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w, s = mx_weight(n, k, gen, std=1.0 / k ** 0.5)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    got = fp8_linear(x, w, s, tiles=LinearTiles(block_m, 32, 64, 4, 1, variant), split_k=split)
    assert got.dtype == dtype and got.shape == (m, n)
    close(got, reference.fp8_linear(x, w, s), dtype)


@pytest.mark.parametrize("variant", ["gather", "bcast", "swap"])
def test_fp8_linear_ragged_k_and_leading_dims(variant):
    """K not a multiple of BLOCK_K (masked tail, scales included) and a 3-D input."""
    gen = torch.Generator().manual_seed(7)
    w, s = mx_weight(48, 160, gen, std=0.1)
    x = torch.randn(2, 3, 160, generator=gen).to(DEVICE)
    got = fp8_linear(x, w, s, tiles=LinearTiles(16, 32, 64, 4, 1, variant), split_k=1)
    close(got, reference.fp8_linear(x, w, s), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_kernel_is_the_reference_rule(dtype):
    """The "dequant" variant's one-pass kernel gives exactly `dequantize_mxfp8` (ragged N and K tiles), and the
    variant (that copy, then F.linear) matches the reference GEMM."""
    from nanoserve.kernels.fp8_linear import dequantize

    gen = torch.Generator().manual_seed(11)
    w, s = mx_weight(40, 96, gen, std=0.5)
    torch.testing.assert_close(dequantize(w, s, dtype), dequantize_mxfp8(w, s, dtype), rtol=0, atol=0)
    x = torch.randn(3, 96, generator=gen).to(DEVICE, dtype)
    got = fp8_linear(x, w, s, tiles=LinearTiles(16, 32, 64, 4, 1, "dequant"))
    close(got, reference.fp8_linear(x, w, s), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,split,block_m", [(1, 96, 256, None, 1), (1, 40, 160, 2, 1), (3, 64, 192, 3, 4),
                                                 (5, 33, 128, 1, 2)])
def test_fp8_linear_gemv_matches_reference(dtype, m, n, k, split, block_m):
    """The CUDA-core "gemv" variant (decode): one to a few rows per tile (5 rows in 2-row tiles: three row tiles,
    the last one ragged), K split (by the heuristic, and into 2 or 3 ranges, the last one short), K not a multiple
    of BLOCK_K (masked weights and scales), a ragged last column tile."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k + 5)
    w, s = mx_weight(n, k, gen, std=1.0 / k ** 0.5)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    got = fp8_linear(x, w, s, tiles=LinearTiles(block_m, 32, 64, 4, 1, "gemv"), split_k=split)
    assert got.dtype == dtype and got.shape == (m, n)
    close(got, reference.fp8_linear(x, w, s), dtype)


def test_sum_splits_is_the_split_k_reduction():
    """The one-launch split-K reduction: the fp32 sum over splits, rounded once to the output dtype."""
    from nanoserve.kernels.fp8_linear import sum_splits

    gen = torch.Generator().manual_seed(4)
    part = torch.randn(3, 5, 700, generator=gen).to(DEVICE)
    torch.testing.assert_close(sum_splits(part, torch.float32), part.sum(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum_splits(part, torch.float16), part.sum(0).half(), rtol=0, atol=0)


def test_linear_tiles_from_table_entry():
    """A table entry's optional 7th element is the split-K target (programs per multiprocessor)."""
    assert LinearTiles.from_entry(("gemv", 1, 64, 256, 4, 1, 8)) == LinearTiles(1, 64, 256, 4, 1, "gemv", 8)
    assert LinearTiles.from_entry(("bcast", 16, 64, 128, 4, 4)).split_waves == 4


def test_fp8_linear_tuned_table_file(tmp_path, monkeypatch):
    """A tune_fp8.py JSON file named by NANOSERVE_FP8_TUNED_CONFIG is read over the built-in table (CUDA only;
    here: the lookup itself), and a bad variant name is refused."""
    from nanoserve.kernels import fp8_configs

    path = tmp_path / "tuned.json"
    path.write_text('{"linear": {"96,128": {"1": ["swap", 16, 64, 128, 4, 3], "64": ["bcast", 64, 64, 64, 4, 3]}},'
                    ' "moe": {"64,32,6": {"16": ["scaled", 16, 1, [32, 64, 4, 3], [32, 64, 4, 3]]}}}')
    monkeypatch.setenv(fp8_configs.TUNED_CONFIG_ENV, str(path))
    assert fp8_configs.linear_entry("cuda", 96, 128, 1) == ("swap", 16, 64, 128, 4, 3)
    assert fp8_configs.linear_entry("cuda", 96, 128, 20)[0] == "bcast"
    assert fp8_configs.linear_entry("cuda", 96, 128, 4096)[0] == "bcast"  # past the last bucket: the last one
    assert fp8_configs.linear_entry("cuda", 97, 128, 1) is None
    assert fp8_configs.linear_entry("cuda", 6144, 8192, 1) is not None  # the built-in entries stay
    assert fp8_configs.moe_entry("cuda", 64, 32, 6, 3) == ("scaled", 16, 1, (32, 64, 4, 3), (32, 64, 4, 3))
    assert fp8_configs.linear_entry("hip", 96, 128, 1) is None
    gen = torch.Generator().manual_seed(2)
    w, s = mx_weight(32, 64, gen)
    with pytest.raises(ValueError, match="variant"):
        fp8_linear(torch.randn(2, 64, device=DEVICE), w, s, tiles=LinearTiles(16, 32, 64, 4, 1, "fast"))


def test_tune_sweep_times_the_builtin_entry_first():
    """scripts/tune_fp8.py times the entry the engine already runs before any candidate (so a sweep cut short by
    its deadline cannot write a worse one), also when --variants leaves its variant out, and only once."""
    from scripts import tune_fp8

    incumbent = tune_fp8.builtin_moe(6144, 3072, 128, 4096)
    assert incumbent == fp8_configs.FP8_MOE_TILES["cuda"][(6144, 3072, 128)][4096]
    saved = tune_fp8.VARIANTS[:]
    try:
        tune_fp8.VARIANTS[:] = ["bcast"]
        swept = tune_fp8.incumbent_first(tune_fp8.moe_candidates(4096), incumbent)
        assert swept[0] == incumbent and incumbent[0] == "scaled" and len(swept) == len(set(swept))
        assert all(e[0] == "bcast" for e in swept[1:])
        tune_fp8.VARIANTS[:] = list(fp8_configs.FP8_VARIANTS)
        linear = tune_fp8.builtin_linear(6144, 8192, 3)  # 3 rows: the 8-row bucket
        assert linear == fp8_configs.FP8_LINEAR_TILES["cuda"][(6144, 8192)][8]
        swept = tune_fp8.incumbent_first(tune_fp8.linear_candidates(3), linear)
        assert swept[0] == linear and swept.count(linear) == 1
        assert tune_fp8.builtin_linear(96, 128, 1) is None
        assert tune_fp8.incumbent_first([("bcast",)], None) == [("bcast",)]
    finally:
        tune_fp8.VARIANTS[:] = saved


def test_fp8_linear_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(1)
    w, s = mx_weight(32, 64, gen)
    with pytest.raises(ValueError, match="fp8_linear"):
        fp8_linear(torch.zeros(2, 64, device=DEVICE), w.float(), s)
    with pytest.raises(ValueError, match="do not fit"):
        fp8_linear(torch.zeros(2, 64, device=DEVICE), w, s[:, :1])


def make_mx_experts(slots: int, hidden: int, inter: int, gen: torch.Generator):
    w13, s13 = zip(*(mx_weight(2 * inter, hidden, gen, std=3.0 / hidden ** 0.5) for _ in range(slots)))
    w2, s2 = zip(*(mx_weight(hidden, inter, gen, std=1.0 / inter ** 0.5) for _ in range(slots)))
    return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)


@pytest.mark.parametrize("variant,dtype", VARIANT_DTYPES)
@pytest.mark.parametrize("tokens,fold,use_map,block_m", [(3, False, False, 16), (21, True, False, 64),
                                                         (9, True, True, 16)])
def test_fused_moe_fp8_experts_match_reference(variant, dtype, tokens, fold, use_map, block_m):
    """Routed experts (+ the folded shared expert in the last slot, + an expert-parallel map) with MXFP8
    weights, dequantised in registers by each variant (GEMM 2's K = 96 is ragged for its 64-wide K tiles, so
    "acc" runs "bcast" there), against the reference per expert; the SwiGLU-OAI epilogue is shared."""
    experts, top_k, hidden, inter = 6, 2, 64, 96
    gen = torch.Generator().manual_seed(tokens * 10 + fold)
    slots = experts + int(fold)
    w13, s13, w2, s2 = make_mx_experts(slots, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = reference.route(torch.randn(tokens, experts, generator=gen).to(DEVICE),
                                   torch.zeros(experts, device=DEVICE), top_k)
    emap = None
    if use_map:  # this rank owns global experts 2..5 as local slots 0..3; the rest are skipped
        emap = torch.full((experts,), -1, dtype=torch.int32)
        emap[2:] = torch.arange(experts - 2, dtype=torch.int32)
        emap = emap.to(DEVICE)
    got = fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, expert_map=emap,
                    routed_scaling_factor=SCALE, fold_shared=fold, w13_scale=s13, w2_scale=s2,
                    config=MoEConfig(block_m, 1, GemmTiles(32, 32, 4, 1), GemmTiles(32, 64, 4, 1), variant))
    close(got, mx_moe_reference(x, w13, s13, w2, s2, weights, ids, fold, emap), x.dtype)


def mx_moe_reference(x, w13, s13, w2, s2, weights, ids, fold, emap=None) -> torch.Tensor:
    """reference.moe_experts on MXFP8 stacks (the last slot the shared expert when `fold`), scaled by SCALE, in
    fp32."""
    routed = w13.shape[0] - int(fold)
    inter = w2.shape[-1]
    want = reference.moe_experts(x, w13[:routed], w2[:routed], ids, weights, ALPHA, LIMIT, emap, s13[:routed],
                                 s2[:routed]).float() * SCALE
    if fold:
        up = reference.weight(w13[-1], s13[-1], x.dtype)
        down = reference.weight(w2[-1], s2[-1], x.dtype)
        gate_up = torch.nn.functional.linear(x, up)
        act = reference.swiglu_oai(gate_up[:, :inter], gate_up[:, inter:], ALPHA, LIMIT).to(x.dtype)
        want = want + torch.nn.functional.linear(act, down).float()
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fold", [False, True])
def test_fused_moe_dequantises_long_batches(dtype, fold):
    """Switch moe_dequant_prefill: a batch of at least `dequant_min_tokens` tokens dequantises the MXFP8 stacks and
    runs the 16-bit kernels - equal to those kernels on the stacks dequantised by the reference, bit for bit,
    whether the stacks are dequantised whole or one slot at a time (`dequant_group_bytes` below one slot) - and a
    shorter one keeps the MXFP8 kernels; both against the reference (fp32 1e-5 / fp16 1e-2)."""
    experts, top_k, hidden, inter = 6, 2, 64, 96
    gen = torch.Generator().manual_seed(11 + fold)
    w13, s13, w2, s2 = make_mx_experts(experts + int(fold), hidden, inter, gen)
    x = torch.randn(9, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = reference.route(torch.randn(9, experts, generator=gen).to(DEVICE),
                                   torch.zeros(experts, device=DEVICE), top_k)
    args = dict(alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE, fold_shared=fold)
    long = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, dequant_min_tokens=9, **args)
    by_slot = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, dequant_min_tokens=9,
                        dequant_group_bytes=1, **args)
    short = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, dequant_min_tokens=10, **args)
    mxfp8 = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, **args)
    sixteen = fused_moe(x, reference.weight(w13, s13, dtype), reference.weight(w2, s2, dtype), weights, ids, **args)
    assert torch.equal(long, sixteen)
    assert torch.equal(by_slot, sixteen)
    assert torch.equal(short, mxfp8)
    want = mx_moe_reference(x, w13, s13, w2, s2, weights, ids, fold)
    close(long, want, dtype)
    close(short, want, dtype)


@pytest.mark.parametrize("hidden", [256, 160])
def test_fused_moe_scaled_128_column_steps(hidden):
    """GEMM 1's "scaled" variant runs a 128-column K step as two 64-column dot_scaled calls (the 4,096-token tile,
    which spills on sm_90 as one): the same result as 64-column steps, bit for bit, and the reference's within
    bf16's tolerance, with whole K steps (hidden 256) and a ragged last one (160: a second half with no columns)."""
    experts, top_k, inter = 4, 2, 64
    gen = torch.Generator().manual_seed(hidden)
    w13, s13, w2, s2 = make_mx_experts(experts + 1, hidden, inter, gen)
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, torch.bfloat16)
    weights, ids = reference.route(torch.randn(5, experts, generator=gen).to(DEVICE),
                                   torch.zeros(experts, device=DEVICE), top_k)
    outs = [fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE,
                      fold_shared=True, w13_scale=s13, w2_scale=s2,
                      config=MoEConfig(16, 1, GemmTiles(32, block_k, 4, 1), GemmTiles(32, 32, 4, 1), "scaled"))
            for block_k in (128, 64)]
    assert torch.equal(outs[0], outs[1])
    close(outs[0], mx_moe_reference(x, w13, s13, w2, s2, weights, ids, True), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,fold,use_map", [(1, True, False), (3, False, False), (4, True, True),
                                                 (2, True, False)])
def test_fused_moe_fp8_gemv_rows(dtype, tokens, fold, use_map):
    """The MoE's "gemv" variant (batches of up to MOE_GEMV_MAX_TOKENS: a tile's first rows on CUDA cores) against
    "bcast" on the same experts: the same products, summed per 32-column block first (fp32 1e-5 / fp16 1e-2 of the
    largest output)."""
    experts, top_k, hidden, inter = 6, 2, 64, 96
    gen = torch.Generator().manual_seed(tokens * 7 + fold)
    w13, s13, w2, s2 = make_mx_experts(experts + int(fold), hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, ids = reference.route(torch.randn(tokens, experts, generator=gen).to(DEVICE),
                                   torch.zeros(experts, device=DEVICE), top_k)
    emap = None
    if use_map:
        emap = torch.full((experts,), -1, dtype=torch.int32)
        emap[2:] = torch.arange(experts - 2, dtype=torch.int32)
        emap = emap.to(DEVICE)
    outs = [fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, expert_map=emap,
                      routed_scaling_factor=SCALE, fold_shared=fold, w13_scale=s13, w2_scale=s2,
                      config=MoEConfig(16, 1, GemmTiles(32, 64, 4, 1), GemmTiles(32, 32, 4, 1), v))
            for v in ("gemv", "bcast")]
    assert torch.isfinite(outs[0]).all()
    diff = (outs[0].float() - outs[1].float()).abs().max().item()
    assert diff <= (1e-5 if dtype == torch.float32 else 1e-2) * outs[1].float().abs().max().item()


def test_fused_moe_runs_linear_only_variants_as_bcast():
    """"dequant" names a linear path and "gemv" takes batches of at most MOE_GEMV_MAX_TOKENS tokens; an MoE table
    entry naming either runs "bcast" otherwise (same result)."""
    gen = torch.Generator().manual_seed(8)
    w13, s13, w2, s2 = make_mx_experts(4, 64, 64, gen)
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    weights, ids = reference.route(torch.randn(5, 4, generator=gen).to(DEVICE), torch.zeros(4, device=DEVICE), 2)
    outs = [fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, w13_scale=s13, w2_scale=s2,
                      config=MoEConfig(16, 1, GemmTiles(32, 32, 4, 1), GemmTiles(32, 32, 4, 1), v))
            for v in ("bcast", "gemv", "dequant")]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=0)


def test_fused_moe_fp8_needs_both_scales():
    gen = torch.Generator().manual_seed(3)
    w13, s13, w2, s2 = make_mx_experts(2, 64, 32, gen)
    x = torch.randn(2, 64, device=DEVICE)
    w, ids = reference.route(torch.randn(2, 2, device=DEVICE), torch.zeros(2, device=DEVICE), 1)
    with pytest.raises(ValueError, match="together"):
        fused_moe(x, w13, w2, w, ids, alpha=ALPHA, limit=LIMIT, w13_scale=s13)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13, w2, w, ids, alpha=ALPHA, limit=LIMIT, w13_scale=s13, w2_scale=s2[..., :0])
