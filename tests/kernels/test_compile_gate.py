"""The compile gate (scripts/compile_gate.py) in CI, and the AMD tile tables it checks.

The gate compiles the engine's Triton launches for gfx942 (MI300X), gfx950 (MI355X), sm_90 (H100/H200) and
sm_100 (B200) on the CPU and fails on a compile error, shared memory (LDS) over the chip's budget, or a register
spill to memory. CI compiles the representative subset (every kernel x weight format x TP-shape class, each with
its largest tile, on every target); `python -m scripts.compile_gate --full` compiles every recorded launch.
"""

from __future__ import annotations

import re

import pytest
import torch

from nanoserve.config import Optimizations
from nanoserve.kernels import configs, fp8_configs
from nanoserve.kernels.fp8_linear import LinearTiles, _sum_splits_kernel, fp8_linear
from nanoserve.kernels.gemv import gemv_mxfp8
from nanoserve.kernels.mx_linear import MX_LINEAR_TILES, mx_linear
from nanoserve.model.layers.moe import M3MoE
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.parallel_state import get_tp, set_tp
from nanoserve.presets.catalog import get_preset
from scripts.compile_gate import KNOWN_SPILLS, TARGETS, compile_all, representative, run_gate
from scripts.compile_gate_launches import FP8_KV, MX_ACT, SHARDINGS, recording

OCCUPANCY_2 = ("_paged_prefill_kernel", "_up_swiglu_kernel", "_down_weighted_kernel", "_fp8_linear_kernel",
               "_gemv_kernel", "_gemv_mxfp8_kernel", "_mx_linear_kernel")
"""Kernels whose AMD tiles the rule chose (configs.py): each compiles to >= 2 waves per SIMD on both AMD chips."""


@pytest.fixture(scope="module")
def gate():
    return run_gate(list(TARGETS), full=False, workers=2, log=lambda line: None)


@pytest.mark.slow
def test_every_launch_class_compiles_and_fits_every_target(gate):
    """The CI subset: no compile error, no LDS over budget, no register spill to memory, on any target."""
    results, failures, _ = gate
    assert not failures, "\n".join(failures)
    assert {r.target for _, r in results} == set(TARGETS)


@pytest.mark.slow
def test_subset_covers_every_kernel_weight_format_and_shape_class_on_every_target(gate):
    results, _, recorded = gate
    for backend, launches in recorded.items():
        want = {(launch.kernel, weights, "tp1" if sharding == "tp1" else "sharded")
                for launch in launches for weights, sharding, _ in launch.scenarios}
        for target in (t for t, spec in TARGETS.items() if spec.backend == backend):
            have = {(launch.kernel, weights, "tp1" if sharding == "tp1" else "sharded")
                    for launch, r in results if r.target == target for weights, sharding, _ in launch.scenarios}
            assert want <= have, sorted(want - have)


@pytest.mark.slow
def test_rule_chosen_amd_tiles_reach_two_waves_per_simd(gate):
    """The dense prefill tile (was one wave per SIMD on gfx942), the MoE, fp8 linear and GEMV tiles."""
    results, _, _ = gate
    low = [(r.target, launch.short_name, launch.named_constexprs(), r.occupancy) for launch, r in results
           if TARGETS[r.target].backend == "hip" and launch.short_name in OCCUPANCY_2 and r.occupancy < 2]
    assert not low, low
    seen = {launch.short_name for launch, r in results if TARGETS[r.target].backend == "hip"}
    assert set(OCCUPANCY_2) <= seen


def _meta_launch(backend: str, call) -> object:
    launches: dict = {}
    with recording(backend, launches, ["bf16", "tp1", "test"]):
        call()
    (launch,) = launches.values()
    return launch


def test_gate_fails_a_tile_over_the_lds_budget():
    """The CUDA "scaled" MXFP8 tile, copied to AMD, needs more LDS than gfx942 has: the gate must say so (AMD
    compiles accept it; the launch would fail)."""
    x = torch.empty(4096, 6144, dtype=torch.bfloat16, device="meta")
    w = torch.empty(6144, 6144, dtype=torch.float8_e4m3fn, device="meta")
    s = torch.empty(6144, 6144 // 32, dtype=torch.uint8, device="meta")
    launch = _meta_launch("hip", lambda: fp8_linear(x, w, s, tiles=LinearTiles(128, 128, 128, 8, 3, "scaled")))
    ((_, result),) = compile_all([(launch, "gfx942")], workers=1)
    assert not result.error
    problems = result.problems(TARGETS["gfx942"].shared_budget)
    assert any("over the 64 KiB budget" in p for p in problems), (result, problems)


@pytest.mark.parametrize("target", ["gfx942", "sm_90"])
def test_gate_fails_a_register_spill(target):
    """A reduction holding 16k fp32 values per program in one wave or warp (256 per lane on AMD, 512 per thread on
    NVIDIA, twice) spills to memory: the gate must say so, on NVIDIA from the cubin's resource usage under
    whatever Triton is installed (the registers read back too: a cuobjdump whose output the gate no longer
    parses would otherwise pass every spill)."""
    part = torch.empty(2, 16384, dtype=torch.float32, device="meta")
    out = torch.empty(16384, dtype=torch.bfloat16, device="meta")
    launch = _meta_launch(TARGETS[target].backend, lambda: _sum_splits_kernel[(1,)](part, out, 16384, SPLIT=2,
                                                                                    BLOCK=16384, num_warps=1))
    ((_, result),) = compile_all([(launch, target)], workers=1)
    problems = result.problems(TARGETS[target].shared_budget)
    assert any("register spills" in p for p in problems), (result, problems)
    assert result.registers > 0 and result.spill_bytes > 0, result


@pytest.mark.slow
def test_subset_is_deterministic_and_smaller(gate):
    launches = gate[2]["hip"]
    first, second = representative(launches), representative(list(reversed(launches)))
    assert [launch.key for launch in first] == [launch.key for launch in second]
    assert 0 < len(first) < len(launches)


# -- the AMD tables: every M3 shape has an entry, and every entry keeps the rule's static parts --------------

def _m3_shapes(tp: int, ep: bool) -> tuple[set, set]:
    """(MXFP8 linear (N, K) shapes, expert (hidden, intermediate, routed experts) shapes) of rank 0."""
    saved = get_tp()
    set_tp(0, tp, None, ep)
    try:
        cfg = get_preset("m3-slice").config
        model = M3ForCausalLM(cfg, Optimizations(), torch.bfloat16, "meta", "mxfp8")
        linears = {tuple(p.shape) for p in model.parameters() if p.dtype == torch.float8_e4m3fn and p.dim() == 2}
        experts = {(cfg.hidden_size, m.w2.shape[-1], m.num_local) for m in model.modules() if isinstance(m, M3MoE)}
    finally:
        set_tp(saved.rank, saved.size, saved.group, saved.expert_parallel)
    return linears, experts


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (4, False), (8, False), (4, True), (8, True)])
def test_every_m3_shape_has_amd_entries(tp, ep):
    linears, experts = _m3_shapes(tp, ep)
    assert linears <= set(fp8_configs.FP8_LINEAR_TILES["hip"]), linears - set(fp8_configs.FP8_LINEAR_TILES["hip"])
    assert experts <= set(configs.MOE_TILES["hip"]) and experts <= set(fp8_configs.FP8_MOE_TILES["hip"]), experts


def test_gate_records_the_recipe_and_sharded_shapes():
    assert {"tp1", "tp4", "tp8", "tp8-ep8"} <= set(SHARDINGS)


def test_amd_gemv_shapes_are_the_cuda_ones():
    assert set(configs.GEMV_TILES["hip"]) == set(configs.GEMV_TILES["cuda"])
    assert set(configs.GEMV_MXFP8_TILES["hip"]) == set(configs.GEMV_MXFP8_TILES["cuda"])


def _mfma_ok(*dims: int) -> bool:
    return all(d >= 16 and d & (d - 1) == 0 for d in dims)


def test_amd_entries_keep_the_rule():
    """MFMA dims >= 16 (except the "gemv" variant, which has no MMA), MXFP8 K steps of whole 32-column blocks,
    <= 2 stages, no TMA, no "scaled", "acc" only on 16-row tiles."""
    for buckets in fp8_configs.FP8_LINEAR_TILES["hip"].values():
        for variant, bm, bn, bk, warps, stages, *_ in buckets.values():
            assert variant not in ("scaled",) and stages <= 2 and bk % 32 == 0 and warps in (1, 2, 4, 8)
            assert variant == "gemv" or _mfma_ok(bm, bn, bk), (variant, bm, bn, bk)
            assert variant != "acc" or bm == 16
    for buckets in fp8_configs.FP8_MOE_TILES["hip"].values():
        for variant, bm, _, up, down in buckets.values():
            assert variant != "scaled" and (variant != "acc" or bm == 16)
            for bn, bk, _, stages in (up, down):
                assert stages <= 2 and bk % 32 == 0
                assert variant == "gemv" or _mfma_ok(bm, bn, bk)
    for buckets in configs.MOE_TILES["hip"].values():
        for entry in buckets.values():
            bm, _, up, down = entry[:4]
            assert len(entry) == 4, "no TMA on AMD"
            assert all(_mfma_ok(bm, bn, bk) and stages <= 2 for bn, bk, _, stages in (up, down))
    for table in (configs.GEMV_TILES["hip"], configs.GEMV_MXFP8_TILES["hip"]):
        assert all(stages <= 2 for _, _, _, stages in table.values())
    for name, per_backend in configs.TABLES.items():
        assert per_backend["hip"].num_stages <= 2 and not per_backend["hip"].tma, name


def test_mxfp8_weights_convert_in_hardware_on_gfx950_and_in_software_on_gfx942():
    """docs/rocm.md's fp8 note: the checkpoint's OCP e4m3 bytes are read as they are on both chips; gfx950's build
    converts them with its fp8 instruction, gfx942's (whose native fp8 is the FNUZ variant) has none."""
    x = torch.empty(1, 6144, dtype=torch.bfloat16, device="meta")
    w = torch.empty(9856, 6144, dtype=torch.float8_e4m3fn, device="meta")
    s = torch.empty(9856, 6144 // 32, dtype=torch.uint8, device="meta")
    launch = _meta_launch("hip", lambda: gemv_mxfp8(x, w, s))
    found = {r.target: {i for i in r.instructions if re.fullmatch(r"v_cvt\w*_fp8", i)}
             for _, r in compile_all([(launch, "gfx942"), (launch, "gfx950")], workers=2)}
    assert not found["gfx942"] and found["gfx950"], found


def test_known_spills_are_nvidia_launches_with_a_reason():
    """The AMD builds spill nothing to memory; each listed NVIDIA spill says why it stays."""
    for (target, kernel, picks), (limit, why) in KNOWN_SPILLS.items():
        assert TARGETS[target].backend == "cuda" and kernel.startswith("_") and picks and limit > 0 and why


@pytest.mark.slow
def test_fp8_kv_kernels_are_in_the_subset(gate):
    """`--kv-cache-dtype fp8`: the decode, prefill, MSA and cache-insert kernels are recorded reading or writing an
    fp8 pool (Triton's fp8e4nv: OCP e4m3, on AMD too) and compiled on every target."""
    results, _, recorded = gate
    want = {"_paged_decode_kernel", "_paged_prefill_kernel", "_index_score_kernel", "_sparse_attention_kernel",
            "_sparse_by_block_kernel", "_qk_norm_rope_insert_kernel"}
    for backend, launches in recorded.items():
        fp8 = [launch for launch in launches if any(w == FP8_KV for w, _, _ in launch.scenarios)]
        assert {launch.short_name for launch in fp8} == want, backend
        assert all("*fp8e4nv" in launch.signature.values() for launch in fp8)
    compiled = {(launch.short_name, r.target) for launch, r in results
                if any(w == FP8_KV for w, _, _ in launch.scenarios)}
    assert compiled == {(k, t) for k in want for t in TARGETS}


# -- mx_activations: the native block-scaled instructions -----------------------------------------------------------

NATIVE_MX = {"gfx950": r"v_mfma_scale_f32_\w+_f8f6f4", "sm_100": r"tcgen05\.mma\S*kind::mxf8f6f4\.block_scale\S*"}
"""What tl.dot_scaled with two e4m3 operands must become on the chips with block-scaled matrix instructions
(AMD GCN mnemonics, PTX instructions)."""
DECOMPOSED_MX = {"gfx942": r"v_mfma_f32_\w+_bf16", "sm_90": r"wgmma\.mma_async\S*\.bf16\.bf16"}
"""...and on the chips without: both operands scaled to bf16, then a bf16 MMA (why the switch is off by default)."""


def _mx_matrix_instructions(result) -> set[str]:
    return {i for i in result.instructions if re.match(r"v_mfma|tcgen05\.mma|wgmma\.mma|mma\.", i)}


@pytest.mark.parametrize("backend", ["hip", "cuda"])
def test_every_mx_tile_compiles_to_the_native_block_scaled_mma(backend):
    """Every entry of MX_LINEAR_TILES: gfx950 builds the scaled MFMA, sm_100 the block-scaled tcgen05.mma; gfx942
    and sm_90 a bf16 MMA; each within the gate's limits on every chip of its backend."""
    targets = [t for t, spec in TARGETS.items() if spec.backend == backend]
    jobs = []
    for tiles in MX_LINEAR_TILES[backend].values():
        x = torch.empty(4096, 6144, dtype=torch.bfloat16, device="meta")
        w = torch.empty(6144, 6144, dtype=torch.float8_e4m3fn, device="meta")
        s = torch.empty(6144, 6144 // 32, dtype=torch.uint8, device="meta")
        launches: dict = {}
        with recording(backend, launches, ["mxfp8", "tp1", "test"]):
            mx_linear(x, w, s, tiles=tiles)
        (launch,) = [la for la in launches.values() if la.short_name == "_mx_linear_kernel"]
        jobs += [(launch, t) for t in targets]
    for launch, r in compile_all(jobs, workers=2):
        assert not r.problems(TARGETS[r.target].shared_budget), (r.target, r.problems(TARGETS[r.target].shared_budget))
        found = _mx_matrix_instructions(r)
        want = {**NATIVE_MX, **DECOMPOSED_MX}[r.target]
        assert found and all(re.fullmatch(want, i) for i in found), (r.target, launch.named_constexprs(), found)


@pytest.mark.slow
def test_mx_activation_launches_are_in_the_subset_and_native_where_the_chip_has_it(gate):
    """The model's own launches with `mx_activations` on (the quantize kernel and the dot_scaled GEMM) are recorded
    apart and compiled on every target; the GEMM is native on gfx950 and sm_100."""
    results, _, recorded = gate
    want = {"_mx_quantize_kernel", "_mx_linear_kernel"}
    for backend, launches in recorded.items():
        assert {la.short_name for la in launches if any(w == MX_ACT for w, _, _ in la.scenarios)} == want, backend
    compiled = {(la.short_name, r.target) for la, r in results if any(w == MX_ACT for w, _, _ in la.scenarios)}
    assert compiled == {(k, t) for k in want for t in TARGETS}
    for la, r in results:
        if la.short_name == "_mx_linear_kernel":
            want_mma = {**NATIVE_MX, **DECOMPOSED_MX}[r.target]
            found = _mx_matrix_instructions(r)
            assert found and all(re.fullmatch(want_mma, i) for i in found), (r.target, found)
