"""The decode-step profile's byte attribution (`python -m nanoserve.bench --profile W2 --quantization bf16,mxfp8`):
every component of ModelCost's decode-step bytes belongs to exactly one group of kernels, the groups' bytes add up
to the step's, MXFP8 halves (plus the scales) what the quantized groups read, GPU kernel names land in their groups
with rates = bytes / time, and the command prints and records the per-format tables and the side-by-side one on
the CPU with m3-tiny."""

from __future__ import annotations

import json
import os

import pytest

from nanoserve.bench import workloads as W
from nanoserve.bench.__main__ import main
from nanoserve.bench.floor import DECODE_COMPONENTS, H100, H200, QUANTIZABLE_COMPONENTS, ModelCost, ceilings_for
from nanoserve.bench.offline import NanoBench
from nanoserve.bench.profile import (
    attribute_bytes,
    byte_table,
    compare_profiles,
    compare_table,
    profile_decode,
)
from nanoserve.config import KERNEL, Optimizations
from nanoserve.presets.catalog import get_preset

SLICE = get_preset("m3-slice").config
MXFP8_PER_BF16 = (1 + 1 / 32) / 2
"""An MXFP8 weight: 1 fp8 byte + one E8M0 byte per 32, against bf16's 2 bytes."""
PROJECTIONS = ("attention projections", "indexer projections", "dense MLPs")


def _owners(device: str, quantized: bool, folded: bool) -> dict[str, str]:
    owners: dict[str, list[str]] = {}
    for group, _, comps in byte_table(device, quantized, folded):
        for c in comps:
            owners.setdefault(c, [])
            if group not in owners[c]:
                owners[c].append(group)
    assert all(len(g) == 1 for g in owners.values()), owners
    return {c: g[0] for c, g in owners.items()}


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("folded", [False, True])
def test_every_component_has_one_group(quantized, folded):
    for device in ("cuda", "cpu"):
        owners = _owners(device, quantized, folded)
        assert set(owners) == set(DECODE_COMPONENTS)
    gpu = _owners("cuda", quantized, folded)
    gemms = "linears (fp8)" if quantized else "GEMMs (cuBLAS / GEMV)"
    assert all(gpu[c] == gemms for c in PROJECTIONS)
    assert gpu["LM head"] == gpu["router"] == "GEMMs (cuBLAS / GEMV)"  # never quantized
    assert gpu["shared expert w13"] == gpu["shared expert w2"] == ("MoE" if folded else gemms)
    assert gpu["routed experts w13"] == gpu["routed experts w2"] == "MoE"
    assert (gpu["dense-layer KV"], gpu["MSA index keys"], gpu["MSA selected KV"]) == \
        ("attention", "MSA index", "MSA attention")


@pytest.mark.parametrize("batch,context", [(1, 1024), (64, 1279.5), (7, 20)])
def test_components_sum_to_the_step_and_mxfp8_halves_the_quantized_ones(batch, context):
    bf16, mx = ModelCost(SLICE, 2, 2), ModelCost(SLICE, 2, 2, "mxfp8")
    for cost in (bf16, mx):
        comps = cost.decode_components(batch, context)
        assert tuple(comps) == DECODE_COMPONENTS and all(v >= 0 for v in comps.values())
        assert sum(comps.values()) == pytest.approx(cost.decode_step(batch, context)[0], rel=1e-12)
    a, b = bf16.decode_components(batch, context), mx.decode_components(batch, context)
    for c in DECODE_COMPONENTS:
        assert b[c] == pytest.approx(a[c] * (MXFP8_PER_BF16 if c in QUANTIZABLE_COMPONENTS else 1.0), rel=1e-12)
    assert a["routed experts w13"] == pytest.approx(2 * a["routed experts w2"])  # gate|up against down


# what an H200 decode step of m3-slice launches (names as torch.profiler reports them), us per step and launches
BF16_KERNELS = {
    "_up_swiglu_kernel": (4940.0, 3), "_down_weighted_kernel": (2478.0, 3), "_sum_copies_kernel": (30.0, 3),
    "_count_kernel": (5.0, 3), "_place_kernel": (5.0, 3),
    "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": (700.0, 9), "nvjet_tst_64x8_64x16_4x1_v_bz_TNN": (300.0, 4),
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>": (20.0, 4),
    "_paged_decode_kernel": (30.0, 1), "_combine_splits_kernel": (5.0, 1), "_index_score_kernel": (40.0, 3),
    "_block_topk_kernel": (15.0, 3), "_sparse_attention_kernel": (60.0, 3),
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, long, 2, 2, -2, true>":
        (3.0, 1),
    "_add_rmsnorm_kernel": (22.0, 9), "_qk_norm_rope_insert_kernel": (16.0, 4), "Memcpy HtoD (Pageable -> Device)":
        (10.0, 5),
}
MX_KERNELS = {**{k: v for k, v in BF16_KERNELS.items() if not k.startswith(("nvjet", "void cublasLt"))},
              "_fp8_linear_kernel": (900.0, 8), "_sum_splits_kernel": (12.0, 4),
              "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": (650.0, 1), "nvjet_tst_64x8_64x16_4x1_v_bz_TNN": (9.0, 3)}
CEILING = 4.26e12


def _profile(cost: ModelCost, kernels: dict, batch: int, context: float, step_ms: float) -> dict:
    quantized = cost.quantization == "mxfp8"
    comps = cost.decode_components(batch, context)
    groups, rows = attribute_bytes(kernels, comps, "cuda", quantized, True, CEILING)
    return {"workload": "W2", "batch": batch, "context_mean": context, "byte_groups": groups, "kernels": rows,
            "ceiling_gb_s": CEILING / 1e9, "step_bytes": cost.decode_step(batch, context)[0], "step_ms": step_ms,
            "kernel_time_per_step_us": sum(us for us, _ in kernels.values())}


def test_gpu_kernels_land_in_their_groups_with_rates():
    batch, context = 64, 1279.5
    bf16, mx = ModelCost(SLICE, 2, 2), ModelCost(SLICE, 2, 2, "mxfp8")
    pb, pm = _profile(bf16, BF16_KERNELS, batch, context, 10.6), _profile(mx, MX_KERNELS, batch, context, 9.0)
    for p, cost in ((pb, bf16), (pm, mx)):
        groups = p["byte_groups"]
        assert sum(g["bytes"] for g in groups.values()) == pytest.approx(p["step_bytes"], rel=1e-12)
        assert sum(g["us_per_step"] for g in groups.values()) == pytest.approx(p["kernel_time_per_step_us"])
        moe = groups["MoE"]
        assert moe["kernels"] == 5 and moe["us_per_step"] == pytest.approx(7458.0)
        assert moe["gb_s"] == pytest.approx(moe["bytes"] / 7458e-6 / 1e9)
        assert moe["of_ceiling"] == pytest.approx(moe["gb_s"] * 1e9 / CEILING)
        assert moe["floor_us"] == pytest.approx(moe["bytes"] / CEILING * 1e6)
        rows = {r["name"]: r for r in p["kernels"]}
        comps = cost.decode_components(batch, context)
        up = rows["_up_swiglu_kernel"]  # the only kernel reading w13: bytes of its own
        assert up["group"] == "MoE" and up["bytes"] == pytest.approx(comps["routed experts w13"]
                                                                     + comps["shared expert w13"])
        assert up["gb_s"] == pytest.approx(up["bytes"] / 4940e-6 / 1e9)
        gemm = rows["nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN"]  # several cuBLAS kernels: the group's bytes
        assert gemm["group"] == "GEMMs (cuBLAS / GEMV)" and gemm["bytes"] is None and gemm["bytes_in_group"]
        assert rows["_add_rmsnorm_kernel"]["group"] == "norms / rope" and rows["_add_rmsnorm_kernel"]["bytes"] is None
        assert not rows["_add_rmsnorm_kernel"]["bytes_in_group"]
        assert rows["_sparse_attention_kernel"]["bytes"] == pytest.approx(comps["MSA selected KV"])
        assert rows[next(n for n in rows if "indexSelect" in n)]["group"] == "embedding"
    # MXFP8: the fp8 linear kernel alone reads every projection, at half the bytes (plus the scales)
    fp8 = {r["name"]: r for r in pm["kernels"]}["_fp8_linear_kernel"]
    bf16_proj = sum(bf16.decode_components(batch, context)[c] for c in PROJECTIONS)
    assert fp8["group"] == "linears (fp8)" and fp8["bytes"] == pytest.approx(bf16_proj * MXFP8_PER_BF16)
    assert pm["byte_groups"]["MoE"]["bytes"] == pytest.approx(pb["byte_groups"]["MoE"]["bytes"] * MXFP8_PER_BF16)
    lm_router = sum(bf16.decode_components(batch, context)[c] for c in ("LM head", "router"))
    assert pm["byte_groups"]["GEMMs (cuBLAS / GEMV)"]["bytes"] == pytest.approx(lm_router)
    assert pb["byte_groups"]["GEMMs (cuBLAS / GEMV)"]["bytes"] == pytest.approx(bf16_proj + lm_router)
    assert "linears (fp8)" not in pb["byte_groups"]

    c = compare_profiles({"bf16": pb, "mxfp8": pm})
    rows = {r["group"]: r for r in c["rows"]}
    both = rows["all weight GEMMs but the MoE's"]
    assert both["bf16"]["bytes"] == pytest.approx(bf16_proj + lm_router)
    assert both["mxfp8"]["bytes"] == pytest.approx(bf16_proj * MXFP8_PER_BF16 + lm_router)
    assert both["mxfp8"]["us_per_step"] == pytest.approx(900 + 12 + 650 + 9)
    step = rows["step (graphs as configured)"]["mxfp8"]
    assert step["us_per_step"] == pytest.approx(9000.0)
    assert step["over_floor_us"] == pytest.approx(9000.0 - pm["step_bytes"] / CEILING * 1e6)
    assert rows["linears (fp8)"]["bf16"]["bytes"] is None and rows["linears (fp8)"]["bf16"]["us_per_step"] == 0
    text = compare_table(c)
    assert "mxfp8 - bf16 us" in text and "mxfp8 % of ceiling" in text and "mxfp8 us over floor" in text


def test_one_row_steps_share_the_projections_bytes():
    """Batch 1 with MXFP8: the GEMV and the fp8 GEMM both run projections, so neither has bytes of its own."""
    mx = ModelCost(SLICE, 2, 2, "mxfp8")
    kernels = {"_gemv_mxfp8_kernel": (150.0, 10), "_fp8_linear_kernel": (40.0, 2), "_gemv_kernel": (560.0, 4)}
    groups, rows = attribute_bytes(kernels, mx.decode_components(1, 1024), "cuda", True, True, CEILING)
    rows = {r["name"]: r for r in rows}
    assert rows["_gemv_mxfp8_kernel"]["bytes"] is None and rows["_fp8_linear_kernel"]["bytes_in_group"]
    assert rows["_gemv_kernel"]["group"] == "GEMMs (cuBLAS / GEMV)"  # the LM head and the router's row
    assert groups["linears (fp8)"]["us_per_step"] == 190.0
    assert groups["MoE"]["kernels"] == 0 and groups["MoE"]["us_per_step"] == 0  # bytes, but no kernel seen
    assert groups["MoE"]["bytes"] > 0 and groups["MoE"]["gb_s"] is None


@pytest.fixture(scope="module")
def bench() -> NanoBench:
    b = NanoBench("m3-tiny", "cpu", "float32", Optimizations(**{n: False for n in Optimizations.names(KERNEL)}),
                  max_model_len=256, max_num_seqs=8, kv_tokens=2048)
    yield b
    b.close()


def test_profile_decode_has_bytes_and_rates(bench):
    wl = W.build(["W2"], 512, "small", prompt_len=20, output_len=3, num_requests=3)[0]
    prof = profile_decode(bench, wl, steps=2, copy_ceiling_known=True)
    assert prof["batch"] == 3 and prof["context_mean"] > 20
    groups = prof["byte_groups"]
    step_bytes = bench.cost.decode_step(prof["batch"], prof["context_mean"])[0]
    assert prof["step_bytes"] == step_bytes
    assert sum(g["bytes"] for g in groups.values()) == pytest.approx(step_bytes, rel=1e-12)
    matmuls = groups["matmuls (CPU reference)"]
    assert matmuls["us_per_step"] > 0 and matmuls["bytes"] > 0
    assert matmuls["gb_s"] == pytest.approx(matmuls["bytes"] / matmuls["us_per_step"] / 1e3)
    assert matmuls["of_ceiling"] == pytest.approx(matmuls["gb_s"] * 1e9 / bench.hw.bytes_per_s)
    for column in ("launches / step", "us / step", "MB / step", "GB/s", "% of ceiling", "floor us"):
        assert column in prof["table"]
    assert "the step (graphs as configured) reads at" in prof["table"]
    unknown = profile_decode(bench, wl, steps=1)  # the CPU's ceiling is not the H200's
    assert unknown["ceiling_gb_s"] is None and "copy ceiling of this device is unknown" in unknown["table"]
    assert all(g["of_ceiling"] is None for g in unknown["byte_groups"].values())
    assert not bench.engine_for(wl).has_unfinished_requests()


def test_profile_command_side_by_side(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--profile", "W2", "--quantization", "bf16,mxfp8", "--scale", "small", "--device", "cpu",
               "--num-requests", "2", "--prompt-len", "16", "--output-len", "4", "--profile-steps", "2",
               "--peak-gbps", "50", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "Decode step by group, bf16 vs mxfp8" in text and text.count("Decode step profile: W2") >= 2
    profiles = {}
    for fmt in ("bf16", "mxfp8"):
        data = json.loads((out / fmt / "results.json").read_text())
        assert not data["errors"] and not data["runs"]  # --profile alone runs no workload
        (p,) = data["profiles"]
        assert p["ceiling_gb_s"] == 50 and p["batch"] == 2
        assert sum(g["bytes"] for g in p["byte_groups"].values()) == pytest.approx(p["step_bytes"], rel=1e-12)
        assert all(r["of_ceiling"] is not None for r in p["kernels"] if r["bytes"])
        profiles[fmt] = p
    wb = profiles["bf16"]["weight_bytes_per_element"]
    for c in QUANTIZABLE_COMPONENTS:
        assert profiles["mxfp8"]["components"][c] == pytest.approx(profiles["bf16"]["components"][c]
                                                                   * (1 + 1 / 32) / wb, rel=1e-12)
    assert profiles["mxfp8"]["step_bytes"] < profiles["bf16"]["step_bytes"]
    (cmp,) = json.loads((out / "profile_formats.json").read_text())
    assert cmp["formats"] == ["bf16", "mxfp8"] and cmp["workload"] == "W2"
    step = next(r for r in cmp["rows"] if r["group"] == "step (graphs as configured)")
    assert step["mxfp8"]["bytes"] == pytest.approx(profiles["mxfp8"]["step_bytes"])
    assert step["bf16"]["of_ceiling"] > 0
    assert os.path.exists(out / "profile_formats.txt")


@pytest.mark.parametrize("name, ceilings", [("NVIDIA H200", H200), ("NVIDIA H100 80GB HBM3", H100),
                                            ("NVIDIA A100-SXM4-80GB", None), (None, None)])
def test_the_ceilings_are_the_cards(name, ceilings):
    """A profile on an H100 reads its % of ceiling against the H100's bandwidth, not the H200's."""
    assert ceilings_for(name) is ceilings
