"""Which switches can act where (`Optimizations.not_applicable`, `describe`), and what the ablation makes of it: an
`n/a` row instead of a timing of a switch that changes nothing here, each timed row repeated with its spread, and a
warning where the spread is larger than the effect. The CLI run is m3-tiny on the CPU."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from nanoserve.bench import workloads as W
from nanoserve.bench.ablation import _row, not_applicable_here, spread, spread_warnings
from nanoserve.bench.offline import RunResult
from nanoserve.config import ENGINE, KERNEL, MODEL, REQUIREMENTS, SWITCH_NEEDS, Optimizations, Platform, switch
from nanoserve.kernels import triton_usable
from nanoserve.runner.model_runner import platform_of

CPU = Platform()
HOPPER_MXFP8 = Platform(device="cuda", triton=True, hopper_gluon=True, mxfp8=True)
OTHER_GPU_BF16 = Platform(device="cuda", triton=True)
SPECULATIVE = ("speculative_decoding", "spec_cuda_graphs", "spec_greedy_accept", "spec_draft_chain", "spec_pad_drafts",
               "spec_async", "spec_feed_in_graph", "spec_multi_step")


def test_on_a_cpu_the_gpu_and_kernel_switches_are_na():
    opts = Optimizations()
    na = opts.not_applicable(CPU)
    assert na["cuda_graphs"] == "no CUDA/HIP device"
    assert na["captured_argmax"] == na["cuda_graphs"]  # it works through the decode graphs
    assert all(name in na for name in Optimizations.names(KERNEL))
    assert na["moe_wgmma"].startswith("not a Hopper")
    assert na["mxfp8_weights"] == na["mx_activations"] == "the weights are not MXFP8"
    assert all(na[name] == "no speculative_config" for name in SPECULATIVE)
    acting = {"paged_kv", "prefix_caching", "continuous_batching", "chunked_prefill", "rope_table",
              "fast_input_prep", "overlap_scheduling", "async_scheduling", "overlap_grammar", "msa_topk_reuse"}
    assert not acting & set(na)
    line = opts.describe(CPU)
    on, off, rest = line.split("; ", 2)
    assert on.startswith("on: paged_kv, prefix_caching, continuous_batching, chunked_prefill, rope_table, ")
    assert set(on.removeprefix("on: ").split(", ")) >= acting - {"msa_topk_reuse"}
    assert not set(on.removeprefix("on: ").split(", ")) & set(na)
    assert "msa_topk_reuse" in off.removeprefix("off: ").split(", ")
    assert rest.startswith("n/a: cuda_graphs, captured_argmax (no CUDA/HIP device); triton_attention, ")
    assert "mxfp8_weights, mx_activations (the weights are not MXFP8)" in rest
    # without a platform, the line lists every switch by its value, as before
    assert "cuda_graphs" in opts.describe().split("; off:")[0] and "n/a" not in opts.describe()


def test_on_hopper_with_mxfp8_weights_everything_acts_but_what_moe_wgmma_replaces():
    opts = Optimizations()
    na = opts.not_applicable(HOPPER_MXFP8)
    assert na == {"moe_dequant_prefill": "moe_wgmma takes these calls here",
                  **{name: "no speculative_config" for name in SPECULATIVE}}
    assert "moe_dequant_prefill" not in opts.replace(moe_wgmma=False).not_applicable(HOPPER_MXFP8)
    other = opts.not_applicable(OTHER_GPU_BF16)  # another GPU, 16-bit weights
    assert {"moe_wgmma", "fp8_linear_wgmma", "mxfp8_weights", "triton_fp8_linear", "moe_dequant_prefill",
            "mx_activations"} <= set(other)
    assert not {"cuda_graphs", "captured_argmax", "fused_moe", "moe_tma", "triton_gemv"} & set(other)


def test_a_switch_cannot_act_through_one_that_is_off_or_cannot():
    gpu = Platform(device="cuda", triton=True)
    assert Optimizations(overlap_scheduling=False).not_applicable(gpu)["async_scheduling"] == \
        "overlap_scheduling is off"
    assert Optimizations(cuda_graphs=False).not_applicable(gpu)["captured_argmax"] == "cuda_graphs is off"
    assert Optimizations(fused_moe=False).not_applicable(gpu)["fused_routing"] == "fused_moe is off"
    two_ranks = Optimizations().not_applicable(Platform(device="cuda", triton=True, tensor_parallel_size=2))
    assert two_ranks["cuda_graphs"] == two_ranks["captured_argmax"] == two_ranks["async_scheduling"] == \
        "tensor_parallel_size > 1"
    ngram = Optimizations().not_applicable(Platform(device="cuda", triton=True, speculative="ngram"))
    assert ngram["spec_draft_chain"] == "the drafter is no model (mtp, eagle3)"
    assert not {"speculative_decoding", "spec_cuda_graphs", "spec_greedy_accept"} & set(ngram)
    assert ngram["async_scheduling"].startswith("speculative decoding")
    mtp = Optimizations().not_applicable(Platform(device="cuda", triton=True, speculative="mtp"))
    assert "spec_draft_chain" not in mtp
    mtp_cpu = Optimizations().not_applicable(Platform(speculative="mtp"))
    assert mtp_cpu["spec_draft_chain"] == mtp_cpu["spec_cuda_graphs"] == "no CUDA/HIP device"
    assert "spec_greedy_accept" not in mtp_cpu


def test_every_need_is_a_requirement_or_a_switch():
    names = set(Optimizations.names())
    assert set(SWITCH_NEEDS) <= names
    for name, needs in SWITCH_NEEDS.items():
        for need in needs:
            assert need in REQUIREMENTS or need in names or (need.startswith("not ") and need[4:] in names), \
                (name, need)


@dataclass
class WithExtra(Optimizations):
    x_demo: bool = switch(True, MODEL, "model/m3.py", "a throwaway switch of the tests", "the model as it is")


@dataclass
class WithServerSwitch(Optimizations):
    x_server: bool = switch(True, ENGINE, "server/prepare.py", "a throwaway server-side switch", "the server as it is")


def test_a_switch_that_needs_nothing_acts_everywhere_but_the_ablation_knows_server_switches():
    assert "x_demo" not in WithExtra().not_applicable(CPU)
    assert "x_demo" in WithExtra().describe(CPU).split("; off:")[0]
    w1 = W.build(["W1"], 512, "small")[0]
    w2j = W.build(["W2J"], 512, "small")[0]
    here = not_applicable_here(WithServerSwitch(), OTHER_GPU_BF16, w1)
    assert here["x_server"] == "acts in the server (server/prepare.py); the ablation drives the engine directly"
    assert here["overlap_grammar"] == "no request of W1 has a structured output"
    assert "overlap_grammar" not in not_applicable_here(WithServerSwitch(), OTHER_GPU_BF16, w2j)
    assert list(here) == [n for n in WithServerSwitch.names() if n in here]  # in declaration order


def test_platform_of_asks_the_kernels():
    cpu = torch.device("cpu")
    assert platform_of(cpu, torch.float32, mxfp8=True, speculative="ngram") == \
        Platform(device="cpu", triton=triton_usable(cpu), mxfp8=True, speculative="ngram")


def _run(tok_s: float, tokens: list[int] | None = None) -> RunResult:
    return RunResult(workload="W1", engine="nanoserve", mode="x", num_requests=1, prompt_tokens=8, output_tokens=8,
                     wall_s=8 / tok_s, output_tok_s=tok_s, total_tok_s=2 * tok_s,
                     ttft_ms={"p50": 10.0, "mean": 10.0, "n": 1}, tpot_ms={"mean": 1e3 / tok_s, "n": 1},
                     e2e_ms={}, decode_tok_s=tok_s, token_ids=[tokens or [1, 2, 3]])


def test_rows_give_medians_spread_and_flag_an_effect_inside_it():
    assert spread([100.0]) is None and spread([90.0, 100.0, 110.0]) == pytest.approx(0.2)
    base = [_run(100.0), _run(104.0), _run(96.0)]  # spread 8 %
    slower = _row("x off", "x", [_run(80.0), _run(82.0), _run(78.0)], base)  # 0.80x, spread 5 %
    assert slower["output_tok_s"] == 80.0 and slower["ratio"] == pytest.approx(0.8)
    assert slower["spread"] == pytest.approx(0.05) and slower["within_spread"] is False
    noisy = _row("y off", "y", [_run(60.0), _run(95.0), _run(130.0)], base)  # 0.95x, spread 74 %
    assert noisy["within_spread"] is True and noisy["tpot_ms"] == pytest.approx(1e3 / 95.0)
    single = _row("z off", "z", [_run(50.0, [1, 9, 3])], [_run(100.0)])  # one run each: no spread to judge by
    assert single["spread"] is None and single["within_spread"] is None and single["first_divergence"] == 1
    abl = {"rows": [_row("all on", None, base, base), slower, noisy, single]}
    assert spread_warnings(abl) == ["y off: 0.95x all-on is within the spread of repeated runs (74%): not a "
                                    "measured effect"]


def test_cli_ablation_on_the_cpu_repeats_rows_and_marks_na(tmp_path):
    """`python -m nanoserve.bench --ablate` on the CPU: 3 runs per row by default, n/a rows for switches that
    cannot act (cuda_graphs: no CUDA device; overlap_grammar: W1 has no structured output), and the summary's
    switches line says which they are."""
    from nanoserve.bench.__main__ import CPU_ABLATE_REPEATS, main

    with pytest.raises(SystemExit, match="--ablate-repeats must be >= 1"):
        main(["--ablate", "--model", "m3-tiny", "--device", "cpu", "--ablate-repeats", "0"])
    rc = main(["--ablate", "--model", "m3-tiny", "--device", "cpu", "--ablate-switches",
               "paged_kv,cuda_graphs,overlap_grammar", "--prompt-len", "16", "--output-len", "3", "--out",
               str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (abl,) = data["ablations"]
    rows = {r["label"]: r for r in abl["rows"]}
    assert list(rows) == ["all on", "paged_kv off", "cuda_graphs off", "overlap_grammar off"]
    assert abl["repeats"] == CPU_ABLATE_REPEATS == 3
    assert rows["all on"]["repeats"] == rows["paged_kv off"]["repeats"] == 3
    assert len(rows["paged_kv off"]["output_tok_s_runs"]) == 3 and rows["paged_kv off"]["identical"]
    assert rows["cuda_graphs off"]["note"] == "n/a: no CUDA/HIP device" and "output_tok_s" not in \
        rows["cuda_graphs off"]
    assert rows["overlap_grammar off"]["note"] == "n/a: no request of W1 has a structured output"
    assert data["meta"]["switches_not_applicable"]["cuda_graphs"] == "no CUDA/HIP device"
    summary = (tmp_path / "summary.txt").read_text()
    switches_line = next(line for line in summary.splitlines() if line.startswith("switches: "))
    assert "cuda_graphs" not in switches_line.split("; off:")[0] and "n/a: cuda_graphs" in switches_line
    assert "3 runs per row" in (tmp_path / "ablation_W1.txt").read_text()
