"""`python -m nanoserve.bench --project`: the released M3 projected from per-layer step costs. The arithmetic on
known costs (the decomposition, the all-reduce model, the step and throughput formulas, the fit), the layer variants
it builds, and the command end to end on m3-tiny on the CPU (its structure: CPU timings decide nothing here)."""

from __future__ import annotations

import json
import math

import pytest

from nanoserve.bench import projection as P

COSTS = {"rest": 1e-3, "dense_layer": 2e-3, "sparse_layer": 3e-3}


def variant_times(costs: dict[str, float]) -> dict[str, float]:
    return {v: costs["rest"] + kinds.count("dense") * costs["dense_layer"] + kinds.count("sparse") *
            costs["sparse_layer"] for v, kinds in P.VARIANTS.items()}


def test_the_variants_give_the_three_costs():
    assert P.decompose(variant_times(COSTS)) == pytest.approx(COSTS, rel=1e-9)


def test_timing_noise_moves_the_dense_layer_cost_by_about_half_of_itself():
    """Each variant's time off by up to e: the fitted dense-layer cost moves by at most 0.54 e (the difference of two
    variants one dense layer apart, which the fit replaced, moved it by up to 2 e and came out negative on a GPU)."""
    import itertools

    e = 1e-4
    exact = variant_times(COSTS)
    worst = 0.0
    for signs in itertools.product((-1, 1), repeat=len(exact)):
        noisy = {v: t + sign * e for (v, t), sign in zip(exact.items(), signs)}
        worst = max(worst, abs(P.decompose(noisy)["dense_layer"] - COSTS["dense_layer"]))
    assert 0.5 * e < worst <= 0.54 * e


def test_the_allreduce_model():
    assert P.allreduce_s(1e6, 1) == 0.0
    # 8 ranks, 1 MB: 15 us + 2 x 7/8 x 1 MB at 360 GB/s
    assert P.allreduce_s(1e6, 8) == pytest.approx(15e-6 + 1.75e6 / 360e9)
    assert P.allreduce_s(1e6, 8, gather=True) == pytest.approx(15e-6 + 0.875e6 / 360e9)
    assert P.allreduce_s(1e6, 4, latency_us=0.0, bus_gbps=1.0) == pytest.approx(1.5e6 / 1e9)


def test_an_m3_step_is_its_layers_over_the_ranks_plus_its_collectives():
    free = {"latency_us": 0.0, "bus_gbps": math.inf}
    assert P.m3_step(COSTS, 4, 16, 6144, 200064, **free) == pytest.approx((1e-3 + 3 * 2e-3 + 57 * 3e-3) / 4)
    comm = P.m3_step(COSTS, 8, 16, 6144, 200064) - P.m3_step(COSTS, 8, 16, 6144, 200064, **free)
    assert comm == pytest.approx(120 * P.allreduce_s(16 * 6144 * 2, 8) + P.allreduce_s(16 * 200064 * 2, 8,
                                                                                         gather=True))


def test_throughput_per_gpu_counts_every_prefill_and_decode_step():
    w = P.Workload("w", 100, 10, 4, "-")
    measured = {"hidden": 8, "vocab": 16, "formats": {"bf16": {"decode": {"w": COSTS}, "prefill": {"w": COSTS}}}}
    free = {"latency_us": 0.0, "bus_gbps": math.inf}
    [row] = P.project(measured, [w], tps=(2,), **free)
    step = (1e-3 + 3 * 2e-3 + 57 * 3e-3) / 2
    assert row["ttft_ms"] == pytest.approx(step * 1e3) and row["tpot_ms"] == pytest.approx(step * 1e3)
    assert row["tok_s_per_gpu"] == pytest.approx(4 * 10 / (4 * step + 10 * step) / 2)


def test_the_fit_recovers_a_latency_and_a_bandwidth():
    samples = [(n, b, 20e-6 + 2 * (n - 1) / n * b / 5e9) for n in (2, 4) for b in (1024, 2**16, 2**20, 2**22)]
    fit = P.fit_allreduce(samples)
    assert fit["latency_us"] == pytest.approx(20.0, rel=1e-6)
    assert fit["bus_gbps"] == pytest.approx(5.0, rel=1e-6) and fit["max_rel_error"] < 1e-9


def test_a_layer_variant_is_the_preset_with_those_layers_while_it_lasts():
    from nanoserve.presets.catalog import PRESETS, get_preset

    with P.layer_variant("m3-tiny", ["dense", "sparse"]) as name:
        cfg = get_preset(name).config
        assert cfg.attn_layer_types == ["dense", "sparse"] == cfg.mlp_layer_types and cfg.num_hidden_layers == 2
        assert cfg.hidden_size == get_preset("m3-tiny").config.hidden_size and get_preset(name).draw_on_device
    assert name not in PRESETS


def test_the_command_on_the_cpu(tmp_path):
    from nanoserve.bench.__main__ import main

    assert main(["--project", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "projection.json").read_text())
    assert set(report["measured"]["variants"]["bf16"]) == set(P.VARIANTS)
    rows = report["projection"]
    assert {(r["format"], r["tp"]) for r in rows} == {("bf16", 4), ("bf16", 8)}
    table = (tmp_path / "projection.md").read_text()
    assert "| bf16 | 64/16, concurrency 4 | 8 |" in table and "a model, not a measurement" in table
