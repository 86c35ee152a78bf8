"""The benchmark harness on the CPU with m3-tiny: every offline workload end to end (tiny sizes, no timing
assertions), the JSON it writes, the ablation table (every switch), the profile table, the Hugging Face baseline on
the same weights (logits and greedy tokens equal nanoserve's), the W3 client against a fake SSE server and, when
the server package is there, against `python -m nanoserve.server`; plus the vectorised input preparation against
its reference and the decode-graph plumbing with an emulated capture."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from nanoserve.batch import AttentionMetadata
from nanoserve.bench import workloads as W
from nanoserve.bench.ablation import ablate, first_divergence
from nanoserve.bench.floor import ModelCost, workload_floor
from nanoserve.bench.offline import NanoBench
from nanoserve.config import KERNEL, Optimizations, Platform
from nanoserve.presets.catalog import get_preset
from nanoserve.runner.input_prep import InputPreparer

REFERENCE = {name: False for name in Optimizations.names(KERNEL)}
"""The CPU runs use the reference kernels (the Triton interpreter is too slow for end-to-end runs)."""
FP32_RTOL = 1e-5
"""HF vs nanoserve logits, fp32: max |diff| <= FP32_RTOL x max |logit| (measured ~4e-7)."""


def tiny_workload(name: str = "W1", prompt_len: int = 20, output_len: int = 3, num_requests: int = 1) -> W.Workload:
    return W.build([name], 512, "small", prompt_len=prompt_len, output_len=output_len, num_requests=num_requests)[0]


@pytest.fixture(scope="module")
def bench() -> NanoBench:
    b = NanoBench("m3-tiny", "cpu", "float32", Optimizations(**REFERENCE), max_model_len=256, max_num_seqs=8,
                  kv_tokens=2048)
    yield b
    b.close()


# -- workloads and floors (no model) ------------------------------------------------------------------------------


def test_full_workloads_follow_the_protocol():
    wls = {w.name: w for w in W.build(list(W.OFFLINE), 200064, "full")}
    assert set(wls) == {"W1", "W2", "W4-32k", "W4-128k", "W5", "W6"}
    assert (wls["W1"].num_requests, len(wls["W1"].requests[0].prompt_ids), wls["W1"].requests[0].max_tokens) == \
        (1, 1024, 128)
    assert wls["W2"].num_requests == 64 and wls["W2"].total_output_tokens == 64 * 256
    assert [len(wls[n].requests[0].prompt_ids) for n in ("W4-32k", "W4-128k")] == [32768, 131072]
    # nano-vllm's bench.py (seed 0): its README reports 133,966 output tokens
    assert wls["W5"].num_requests == 256 and wls["W5"].total_output_tokens == 133966
    assert all(100 <= len(r.prompt_ids) <= 1024 and r.temperature == 0.6 for r in wls["W5"].requests)
    w6 = wls["W6"]
    assert w6.num_requests == 32 and all(r.prompt_ids[:4096] == w6.requests[0].prompt_ids[:4096] for r in w6.requests)
    assert len({tuple(r.prompt_ids[4096:]) for r in w6.requests}) == 32
    assert all(r.max_tokens == 128 for r in w6.requests)


def test_floors_match_docs_benchmarks():
    cost = ModelCost(get_preset("m3-slice").config)
    assert cost.active_params_per_token() == pytest.approx(2.75e9, rel=0.01)
    w1_bytes, _ = cost.decode_step(1, 1088)
    assert w1_bytes / 4.26e12 * 1e3 == pytest.approx(1.29, abs=0.02)  # ms per token
    assert cost.experts_touched(64) == pytest.approx(111, abs=1)
    assert cost.decode_step(64, 1152)[0] / 1e9 == pytest.approx(42, abs=1.5)  # GB per W2 step
    assert cost.decode_kv_bytes(131072) / 1e9 == pytest.approx(0.38, abs=0.01)
    w2 = W.build(["W2"], 200064)[0]
    fl = workload_floor(cost, [1024] * 64, [256] * 64)
    assert fl.output_tok_s == pytest.approx(5800, rel=0.05) and w2.total_output_tokens == fl.output_tokens
    assert workload_floor(cost, [131072], [1]).prefill_s == pytest.approx(0.9, rel=0.1)


# -- the harness end to end ---------------------------------------------------------------------------------------


def test_cli_runs_every_offline_workload_and_writes_json(tmp_path):
    from nanoserve.bench.__main__ import main

    out = tmp_path / "out"
    rc = main(["--model", "m3-tiny", "--device", "cpu", "--scale", "small", "--output-len", "3",
               "--workloads", "W1,W2,W4,W5,W6", "--max-num-batched-tokens", "64", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    meta = data["meta"]
    for key in ("date", "commit", "device", "torch", "triton", "transformers", "model", "switches"):
        assert meta[key], key
    assert set(meta["switches"]) == set(Optimizations.names())
    assert not meta["switches"]["triton_attention"]  # CPU: reference kernels by default
    names = [r["workload"] for r in data["runs"]]
    assert names == ["W1", "W2", "W4-96", "W4-192", "W5", "W6"]
    for r in data["runs"]:
        assert r["engine"] == "nanoserve" and r["output_tokens"] == r["num_requests"] * 3
        assert r["output_tok_s"] > 0 and r["ttft_ms"]["n"] == r["num_requests"] and r["tpot_ms"]["mean"] > 0
        for key in ("decode_gb_s", "decode_tflop_s", "floor", "tpot_fraction_of_floor",
                    "output_tok_s_fraction_of_floor"):
            assert key in r["perf"], key
        assert r["switches"] == meta["switches"]
        # the warm-up ran the same shapes first: the timed run built no kernel (the interpreter builds none)
        assert r["extra"]["triton_builds"] == 0 and r["extra"]["warmup_ttft_ms"] > 0
    w6 = next(r for r in data["runs"] if r["workload"] == "W6")
    # 64-token steps: the first request's prefix blocks are cached before the others are admitted
    assert w6["extra"]["prefix_cache_hit_rate"] > 0
    assert not data["errors"]
    assert (out / "summary.txt").exists() and (out / "runs.png").exists()


def test_micro_benchmarks_need_a_gpu_and_known_names(tmp_path):
    """--micro: an unknown name is refused with the names it takes; on the CPU the micro-benchmarks (the card's
    ceilings among them) are skipped with a note, not run on the wrong device."""
    from nanoserve.bench.__main__ import main

    with pytest.raises(SystemExit, match="choose from ceilings, moe, linear"):
        main(["--model", "m3-tiny", "--device", "cpu", "--micro", "ceilings,bogus", "--workloads", "W1",
              "--output-len", "2"])
    rc = main(["--model", "m3-tiny", "--device", "cpu", "--micro", "ceilings", "--workloads", "W1",
               "--output-len", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0 and "micro" not in data and any("--micro needs a GPU" in n for n in data["notes"])


def test_warmup_covers_the_timed_shapes(bench, monkeypatch):
    """The warm-up runs every request at its full prompt length (the prefill tiles change with the context a chunk
    attends to, so a shorter warm-up leaves kernel builds in the timed TTFT), on fresh prompts (no prefix-cache
    hits carried into the timed run), at its full output length too (sequences that finished early would leave
    the timed run's steps mixing token counts the warm-up never ran); W5's 256 requests are all warmed too."""
    ran: list[W.Workload] = []
    real_run = bench.run
    monkeypatch.setattr(bench, "run", lambda wl, **kw: ran.append(wl) or real_run(wl, **kw))
    for wl in [*W.build(["W4"], 512, "small", output_len=6), W.build(["W5"], 512, "full")[0].scaled(max_tokens=1)]:
        ran.clear()
        if wl.family == "W5":  # the full-size W5 is too long for the CPU: check the warm-up's requests only
            monkeypatch.setattr(bench, "run", lambda w, **kw: ran.append(w))
            monkeypatch.setattr(bench, "capture_graphs", lambda w: 0)
        res = bench.warmup(wl)
        (warm,) = ran
        assert [len(r.prompt_ids) for r in warm.requests] == [len(r.prompt_ids) for r in wl.requests]
        assert all(w.prompt_ids != r.prompt_ids for w, r in zip(warm.requests, wl.requests))
        assert all(w.max_tokens == r.max_tokens for w, r in zip(warm.requests, wl.requests))
        if wl.family == "W4":
            assert res.ttft_ms["n"] == 1 and res.extra["triton_builds"] == 0
            assert res.extra["computed_prefill_tokens"] == len(wl.requests[0].prompt_ids)


def test_compile_watch_counts_the_builds_inside_its_block():
    """Builds reported through Triton's post-compile hook are counted inside the block only, an already installed
    hook still sees them, and it is back in place afterwards."""
    from types import SimpleNamespace

    from nanoserve.bench.compile_watch import CompileWatch

    knobs = pytest.importorskip("triton").knobs.runtime
    seen: list[str] = []
    outer = lambda **kw: seen.append(kw["fn"].name)  # noqa: E731

    def build(name: str) -> None:  # what triton's JIT does after compiling a kernel
        hook = knobs.jit_post_compile_hook
        if hook is not None:
            hook(key=(), repr=name, fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
                 already_compiled=False)

    previous = knobs.jit_post_compile_hook
    knobs.jit_post_compile_hook = outer
    try:
        build("before")
        with CompileWatch() as w:
            build("_paged_prefill_kernel")
            with CompileWatch() as inner:
                build("_up_swiglu_kernel")
            build("_paged_prefill_kernel")
        build("after")
        assert knobs.jit_post_compile_hook is outer
    finally:
        knobs.jit_post_compile_hook = previous
    assert inner.count == 1 and inner.kernels == ["_up_swiglu_kernel"]
    assert w.count == 3 and w.summary() == "3 (_paged_prefill_kernel x2, _up_swiglu_kernel)"
    assert seen == ["before", "_paged_prefill_kernel", "_up_swiglu_kernel", "_paged_prefill_kernel", "after"]


def test_ablation_lists_every_switch(bench, tmp_path):
    """Every switch gets a row; those that cannot act on this CPU (the Triton kernels, which the reference path
    replaces here whatever they say; CUDA graphs; MXFP8 and speculative switches without MXFP8 weights or a
    speculative_config; overlap_grammar without a structured output) are n/a and not timed; every timed row runs
    `repeats` times and reports its spread."""
    wl = tiny_workload()
    # the tests run Triton interpreted on the CPU (TRITON_INTERPRET=1), where the kernels could act; the bench's
    # own command runs without it, as here
    assert bench.platform == Platform(device="cpu", triton=os.environ.get("TRITON_INTERPRET") == "1")
    cpu = dataclasses.replace(bench.platform, triton=False)
    abl = ablate(bench, wl, {n: "CPU reference kernels" for n in REFERENCE}, "m3-tiny", {"device": "cpu"},
                 warmup_tokens=1, repeats=2, platform=cpu)
    rows = {r["switch"]: r for r in abl["rows"] if r["switch"]}
    assert set(rows) == set(Optimizations.names())
    for name in Optimizations.names():
        assert name in abl["table"]
    for name in Optimizations.approximations():
        assert rows[name]["label"] == f"{name} ON" and rows[name]["approximation"]
    na = {name for name, r in rows.items() if r.get("applicable") is False}
    server_side = {sw.name for sw in Optimizations.switches() if sw.module.startswith("server/")}
    assert na == set(REFERENCE) | server_side | {"cuda_graphs", "captured_argmax", "mxfp8_weights", "mx_activations",
                                                 "overlap_grammar", "speculative_decoding", "spec_cuda_graphs",
                                                 "spec_greedy_accept", "spec_draft_chain", "spec_pad_drafts",
                                                 "spec_async", "spec_feed_in_graph", "spec_multi_step"}
    assert set(abl["not_applicable"]) == na
    assert rows["cuda_graphs"]["note"] == "n/a: no CUDA/HIP device"
    assert rows["fused_moe"]["note"].startswith("n/a: Triton kernels do not run on this device")
    assert rows["mx_activations"]["note"] == "n/a: the weights are not MXFP8"
    assert rows["overlap_grammar"]["note"] == "n/a: no request of W1 has a structured output"
    for name in na:
        assert "output_tok_s" not in rows[name], name
    # the exact (non-approximation) switches that were measured must not change greedy tokens (fp32 CPU)
    timed = {name: r for name, r in rows.items() if name not in na}
    assert timed and "paged_kv" in timed and "async_scheduling" in timed
    for name, r in timed.items():
        assert r["repeats"] == 2 and len(r["output_tok_s_runs"]) == 2 and r["spread"] is not None
        assert r["output_tok_s"] == pytest.approx(sum(r["output_tok_s_runs"]) / 2)  # the median of two
        if name not in Optimizations.approximations():
            assert r["identical"], f"{name} changed the tokens (from position {r['first_divergence']})"
            assert r["ratio"] > 0 and r["weight_format"] == "float32"
    assert abl["rows"][0]["label"] == "all on" and abl["rows"][0]["repeats"] == 2
    assert "2 runs per row" in abl["table"] and "spread" in abl["table"]
    assert "overlap_scheduling" in abl["table"] and rows["overlap_scheduling"]["note"] == ""
    assert bench.opts.as_dict() == Optimizations(**REFERENCE).as_dict()  # restored
    from nanoserve.bench.report import plot_ablation

    assert plot_ablation(abl, str(tmp_path / "abl.png")) and (tmp_path / "abl.png").exists()


def test_ablating_a_build_time_switch_rebuilds_the_model():
    """On an MXFP8 run, the mxfp8_weights-off row runs a model built again with dequantized weights (fp32 here: no
    fp8 parameter, about 4x the bytes), the all-on rows the fp8 one; in fp32 both give the same greedy tokens. The
    base model is back after the row."""
    assert "mxfp8_weights" in Optimizations.build_time()
    b = NanoBench("m3-tiny", "cpu", "float32", Optimizations(**REFERENCE), max_model_len=256, max_num_seqs=8,
                  kv_tokens=2048, quantization="mxfp8")
    try:
        base_model = b.runner.model
        abl = ablate(b, tiny_workload(prompt_len=70), warmup_tokens=1, only=["mxfp8_weights"])
        rows = {r["label"]: r for r in abl["rows"]}
        on, off = rows["all on"], rows["mxfp8_weights off"]
        assert on["weight_format"] == "mxfp8" and "float8_e4m3fn" in on["extra"]["parameter_bytes_by_dtype"]
        assert off["weight_format"] == "float32" and set(off["extra"]["parameter_bytes_by_dtype"]) == {"float32"}
        assert off["weight_bytes"] > 3 * on["weight_bytes"]
        assert off["identical"] and "model rebuilt" in off["note"]
        assert "mxfp8 " in abl["table"] and "float32 " in abl["table"]
        assert b.runner.model is not base_model and b.runner.model.weight_format == "mxfp8" and b.opts.mxfp8_weights
    finally:
        b.close()


def test_first_divergence():
    assert first_divergence([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first_divergence([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == 1
    assert first_divergence([[1, 2]], [[1, 2, 3]]) == 2


def test_profile_table(bench):
    from nanoserve.bench.profile import profile_decode

    prof = profile_decode(bench, tiny_workload("W2", num_requests=2), steps=2)
    assert prof["batch"] == 2 and prof["step_ms"] > 0 and prof["top_kernels"]
    assert abs(sum(g["share"] for g in prof["groups"].values()) - 1.0) < 1e-6
    assert "GEMMs" in prof["groups"] and "Decode step profile" in prof["table"]
    assert not bench.engine_for(tiny_workload()).has_unfinished_requests()


def test_prefill_packing_and_cost_model():
    """The prefill profile's packing model is FCFS chunking, and its per-kernel FLOPs add up to the floor's."""
    from nanoserve.bench.prefill_profile import Piece, kernel_costs, prefill_steps

    assert prefill_steps([48, 48, 10], 64) == [[Piece(48, 48, True), Piece(16, 16)], [Piece(32, 48, True),
                                                                                      Piece(10, 10, True)]]
    assert prefill_steps([130], 64) == [[Piece(64, 64)], [Piece(64, 128)], [Piece(2, 130, True)]]
    cost = ModelCost(get_preset("m3-tiny").config, weight_bytes=4, kv_bytes=4)
    for prompt, chunk in ((100, 32), (300, 128), (47, 1000)):
        costs = kernel_costs(cost, prefill_steps([prompt], chunk))
        total = sum(f for f, _ in costs.values())
        assert total == pytest.approx(cost.prefill_flops(prompt), rel=1e-9)
        assert all(b > 0 for _, b in costs.values())


def test_prefill_attribution_rates_and_roofs():
    """GPU kernel names map to their cost entries; rates = work / time; roof = the slower of the two ceilings."""
    from nanoserve.bench.floor import Ceilings
    from nanoserve.bench.prefill_profile import attribute

    hw = Ceilings("test", 1e12, 1e15)  # 1 TB/s, 1 PFLOP/s
    kernels = {"_paged_prefill_kernel": (2000.0, 4), "_up_swiglu_kernel": (500.0, 3), "_down_weighted_kernel":
               (300.0, 3), "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": (1000.0, 20), "Memcpy HtoD": (10.0, 5)}
    costs = {"dense attention": (1e12, 1e6), "MoE GEMM 1 (up + SwiGLU)": (2e11, 1e9),
             "MoE GEMM 2 (down, weighted)": (1e11, 3e8), "GEMMs": (5e11, 2e8)}
    groups, by_key, rows = attribute(kernels, costs, hw)
    assert list(groups)[0] == "attention" and groups["attention"]["us"] == 2000.0
    assert groups["MoE"]["us"] == 800.0 and groups["MoE"]["flops"] == 3e11
    dense = by_key["dense attention"]
    assert dense["tflop_s"] == pytest.approx(1e12 / 2e-3 / 1e12) and dense["bound"] == "compute"
    assert dense["roof_us"] == pytest.approx(1000.0) and dense["of_roof"] == pytest.approx(0.5)
    up = by_key["MoE GEMM 1 (up + SwiGLU)"]
    assert up["bound"] == "memory" and up["roof_us"] == pytest.approx(1000.0) and up["gb_s"] == pytest.approx(2000.0)
    assert by_key["GEMMs"]["us"] == 1000.0  # every cuBLAS kernel together
    assert rows[0]["name"] == "_paged_prefill_kernel" and rows[0]["cost_key"] == "dense attention"
    assert abs(sum(g["share"] for g in groups.values()) - 1.0) < 1e-9


def test_prefill_profile_table(bench):
    from nanoserve.bench.prefill_profile import profile_prefill

    wl = tiny_workload("W2", prompt_len=24, num_requests=3)
    prof = profile_prefill(bench, wl, chunk=32, warm=False)
    assert (prof["steps"], prof["tokens"], prof["chunk"]) == (3, 72, 32)
    assert prof["wall_ms"] > 0 and prof["kernel_ms"] > 0 and prof["top_kernels"]
    assert abs(sum(g["share"] for g in prof["groups"].values()) - 1.0) < 1e-6
    assert "Prefill profile" in prof["table"] and "host gaps" in prof["table"]


# -- the Hugging Face baseline ------------------------------------------------------------------------------------


def test_hf_weights_map_to_the_same_model(bench):
    """transformers' model built from the same random draw gives nanoserve's logits, and its greedy tokens."""
    from nanoserve.bench.hf import HFBench

    preset = get_preset("m3-tiny")
    hf = HFBench(preset.config, preset, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(0)).tolist()  # > 3 MSA blocks x 16
    runner = bench.runner
    from nanoserve.step import ModelInput

    bs = runner.block_size
    table = list(range(-(-len(ids) // bs)))
    ours = runner.execute(ModelInput(ids, [len(ids)], [len(ids)], [table], [0]))  # last position
    with torch.no_grad():
        ref = hf.model(torch.tensor([ids])).logits[0].float()
    scale = ref.abs().max().item()
    assert (ours[0] - ref[-1]).abs().max().item() <= FP32_RTOL * scale
    wl = tiny_workload(prompt_len=40, output_len=4)
    nano = bench.run(wl)
    for mode in ("eager", "static"):
        res = hf.run(wl, mode)
        assert res.token_ids == nano.token_ids, mode
        assert res.tpot_ms["mean"] > 0 and res.extra["compiled"] is False
    hf.close()


def test_hf_name_mapping_covers_every_tensor():
    from nanoserve.bench.hf import hf_name
    from nanoserve.presets.checkpoint_layout import checkpoint_specs

    cfg = get_preset("m3-tiny").config
    mapped = {hf_name(n, cfg)[0] for n in checkpoint_specs(cfg)}
    assert "model.layers.1.self_attn.indexer.k_norm.weight" in mapped
    assert "model.layers.1.mlp.experts.gate_up_proj" in mapped and "model.layers.0.mlp.gate_up_proj.weight" in mapped
    assert hf_name("language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight", cfg) == \
        ("model.layers.2.mlp.experts.gate_up_proj", ("expert_rows", 5, cfg.intermediate_size,
                                                     2 * cfg.intermediate_size))


# -- W3 -----------------------------------------------------------------------------------------------------------


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams max_tokens one-character chunks 2 ms apart, then a usage chunk, like an OpenAI server."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "fake"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    logprobs_seen: list = []

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["stream"] and req["ignore_eos"] and req["model"] == "fake"
        self.logprobs_seen.append(req.get("logprobs", "absent"))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = req["max_tokens"]
        for _ in range(n):
            self.wfile.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
            self.wfile.flush()
            time.sleep(0.002)
        usage = {"choices": [], "usage": {"prompt_tokens": len(req["prompt"]), "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()


@pytest.mark.parametrize("client, logprobs", [("httpx", None), ("aiohttp", None), ("httpx", 2)])
def test_serve_client_metrics(client, logprobs):
    pytest.importorskip(client)
    from nanoserve.bench.serve import run_sweep, sweep_table

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeOpenAI.logprobs_seen = []
    try:
        sweep = run_sweep(f"http://127.0.0.1:{server.server_port}", None, [1, 3], 2, prompt_len=8, output_len=5,
                          client=client, logprobs=logprobs)
    finally:
        server.shutdown()
    assert sweep["model"] == "fake" and sweep["client"] == client and sweep["logprobs"] == logprobs
    # warm-up and timed requests alike carry the logprobs field only when asked
    assert _FakeOpenAI.logprobs_seen == ["absent" if logprobs is None else logprobs] * (3 * 1 + 3 * 3)
    for lv, c in zip(sweep["levels"], (1, 3)):
        assert lv["concurrency"] == c and lv["completed"] == 2 * c and lv["failed"] == 0
        assert lv["output_tokens"] == 5 * 2 * c and lv["prompt_tokens"] == 8 * 2 * c
        # the fake server sleeps 2 ms between its 5 chunks; on a loaded machine the client may read several
        # chunks at once (small gaps, a late first token), so only bounds that hold under any scheduling are
        # asserted: the last token cannot arrive before the 4 sleeps are over
        assert lv["tpot_ms"]["mean"] > 0 and lv["itl_ms"]["p50"] >= 0
        assert lv["ttft_ms"]["p99"] >= lv["ttft_ms"]["p50"] > 0
        assert lv["e2el_ms"]["mean"] >= lv["ttft_ms"]["mean"] and lv["e2el_ms"]["mean"] >= 4 * 2.0
        assert lv["tpot_ms"]["mean"] * 4 == pytest.approx(lv["e2el_ms"]["mean"] - lv["ttft_ms"]["mean"], rel=1e-6)
    assert "TPOT p99" in sweep_table(sweep)


def _server_available() -> str | None:
    import importlib.util

    if importlib.util.find_spec("nanoserve.server.__main__") is None:
        return "nanoserve.server is not there yet"
    for mod in ("fastapi", "uvicorn"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    return None


@pytest.mark.skipif(_server_available() is not None, reason=str(_server_available()))
def test_w3_against_nanoserve_server(tmp_path):
    from nanoserve.bench.__main__ import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    switches = [f"--no-{n.replace('_', '-')}" for n in list(REFERENCE) + ["cuda_graphs"]]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve.server", "--model", "m3-tiny", "--port", str(port),
                             "--device", "cpu", "--max-model-len", "256", "--kv-cache-tokens", "2048",
                             "--served-model-name", "tiny", "--log-level", "warning", *switches], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"server exited: {proc.stdout.read()[-2000:]}"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except Exception:  # noqa: BLE001
                assert time.time() < deadline, "server did not come up"
                time.sleep(0.5)
        out = tmp_path / "w3"
        rc = main(["--serve", f"http://127.0.0.1:{port}", "--model", "m3-tiny", "--scale", "small",
                   "--concurrency", "1,2", "--requests-per-concurrency", "1", "--prompt-len", "16",
                   "--output-len", "4", "--serve-logprobs", "1", "--out", str(out)])
        assert rc == 0
        sweep = json.loads((out / "results.json").read_text())["serve"][0]
        assert sweep["model"] == "tiny" and [lv["concurrency"] for lv in sweep["levels"]] == [1, 2]
        assert sweep["logprobs"] == 1
        for lv in sweep["levels"]:
            assert lv["failed"] == 0 and lv["completed"] == lv["concurrency"]
            assert lv["output_tokens"] == 4 * lv["concurrency"] and lv["tpot_ms"]["mean"] > 0
        assert (out / "w3_sweep.png").exists()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- engine-side speedups: on/off agreement -----------------------------------------------------------------------


def _random_batch(rng: np.random.Generator, page: int):
    """A decode-first batch: decodes, then prefills with cached prefixes, chunks and full prompts."""
    n_dec, n_pre = int(rng.integers(0, 5)), int(rng.integers(0, 4))
    if n_dec + n_pre == 0:
        n_dec = 1
    query, seq = [], []
    for _ in range(n_dec):
        s = int(rng.integers(1, 90))
        query.append(1)
        seq.append(s)
    for _ in range(n_pre):
        s = int(rng.integers(2, 90))
        query.append(int(rng.integers(2, s + 1)))
        seq.append(s)
    free = rng.permutation(200).tolist()
    tables = [[free.pop() for _ in range(-(-s // page) + int(rng.integers(0, 2)))] for s in seq]
    ids = rng.integers(0, 500, sum(query)).tolist()
    sample = sorted(rng.choice(len(query), size=int(rng.integers(1, len(query) + 1)), replace=False).tolist())
    return ids, query, seq, tables, sample


def test_fast_input_prep_matches_reference():
    page = 16
    prep = InputPreparer(page, torch.device("cpu"))
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids, query, seq, tables, sample = _random_batch(rng, page)
        # prompt-logprob rows: some token positions whose logits are wanted after the sample rows'
        extra = sorted(rng.choice(len(ids), size=int(rng.integers(0, min(len(ids), 6) + 1)), replace=False).tolist())
        got_ids, meta, logits_index = prep.prepare(ids, query, seq, tables, sample, extra)
        ref = AttentionMetadata.build(query, seq, tables, page)
        assert got_ids.tolist() == ids and got_ids.dtype == torch.int64
        for f in ("positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            a, b = getattr(meta, f), getattr(ref, f)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f
        for f in ("block_size", "max_query_len", "max_seq_len", "num_decode_seqs", "query_lens_cpu", "seq_lens_cpu"):
            assert getattr(meta, f) == getattr(ref, f), f
        assert logits_index.tolist() == (ref.query_start_loc[1:].long() - 1)[sample].tolist() + extra
    with pytest.raises(ValueError, match="query length"):
        prep.prepare([1, 2, 3], [3], [2], [[0]], [0])
    with pytest.raises(ValueError, match="cannot hold"):
        prep.prepare([1], [1], [40], [[0, 1]], [0])


def test_graph_staging_matches_reference(bench):
    """The decode graphs' static buffers, staged for random decode batches, hold what the reference preparation
    builds for the real rows, and inert padding (token 0 at position 0, seq_len 1, zero tables, slot -1) for the
    rest of the bucket. Integers: exact."""
    from nanoserve.runner.cuda_graphs import GraphRunner

    page, max_len = 16, 96
    graphs = GraphRunner(bench.runner.model, 8, max_len, page, torch.device("cpu"), capture=lambda fn: fn)
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(1, 9))
        seq = rng.integers(1, max_len + 1, n).tolist()
        free = rng.permutation(300).tolist()
        tables = [[free.pop() for _ in range(min(-(-s // page) + int(rng.integers(0, 2)), graphs.max_blocks))]
                  for s in seq]
        ids = rng.integers(0, 500, n).tolist()
        assert graphs.fits(n, max(seq), max(len(t) for t in tables))
        bs, length = graphs.key(n, max(seq))
        graphs.stage(ids, seq, tables, bs)
        got_ids, meta = graphs.static_inputs(bs, length)
        ref = AttentionMetadata.build([1] * n, seq, tables, page)
        assert got_ids[:n].tolist() == ids and not got_ids[n:].any()
        assert torch.equal(meta.positions[:n], ref.positions) and not meta.positions[n:].any()
        assert torch.equal(meta.slot_mapping[:n], ref.slot_mapping) and (meta.slot_mapping[n:] == -1).all()
        assert torch.equal(meta.seq_lens[:n], ref.seq_lens) and (meta.seq_lens[n:] == 1).all()
        assert torch.equal(meta.query_start_loc, torch.arange(bs + 1, dtype=torch.int32))
        width = ref.block_tables.shape[1]
        assert torch.equal(meta.block_tables[:n, :width], ref.block_tables)
        assert not meta.block_tables[:n, width:].any() and not meta.block_tables[n:].any()
        assert meta.positions.dtype == ref.positions.dtype and meta.slot_mapping.dtype == ref.slot_mapping.dtype
        assert meta.block_tables.dtype == ref.block_tables.dtype and meta.seq_lens.dtype == ref.seq_lens.dtype


def test_fast_input_prep_switch_gives_same_tokens(bench):
    wl = tiny_workload("W2", num_requests=3, output_len=4)
    on = bench.run(wl)
    bench.opts.fast_input_prep = False
    try:
        off = bench.run(wl)
    finally:
        bench.opts.fast_input_prep = True
    assert on.token_ids == off.token_ids


def test_decode_graph_plumbing_emulated(bench):
    """The graph path (static buffers, padding to the bucket, context buckets) with a capture that replays by
    re-running the function: same logits as the eager path."""
    from tests.helpers.graph_check import compare_decode_logits

    runner = bench.runner
    runner.graph_capture = lambda fn: fn
    try:
        assert runner.capture_decode_graphs(40, 2) == 2  # ahead of time, on dummy (padding) rows
        assert sorted(runner.graphs.graphs) == [(1, 256), (2, 256)]
        rows = compare_decode_logits(runner, (1, 2, 3, 5), prompt_len=30)
    finally:
        runner.graph_capture = None
        runner.graphs = None
    for r in rows:
        assert r["graph_used"] and r["disabled"] is None
        assert r["max_rel_diff"] < 1e-5 and r["argmax_agreement"] == 1.0, r
    assert {k[0] for k in rows[-1]["graph_keys"]} == {1, 2, 4, 8}  # 3 runs padded to 4, 5 to 8


def test_w2j_is_w2_with_every_request_json_constrained_and_runs_full_length(bench):
    """W2J: W2's prompts, each request constrained to W2J_SCHEMA, which no request can complete before its
    max_tokens (so it runs as long as W2); the outputs are prefixes of that format."""
    w2, w2j = W.build(["W2", "W2J"], 200064, "full")
    assert [r.prompt_ids for r in w2j.requests] == [r.prompt_ids for r in w2.requests]
    assert all(r.json_schema == W.W2J_SCHEMA for r in w2j.requests) and w2j.total_output_tokens == 64 * 256
    assert W.W2J_SCHEMA["properties"]["notes"]["minItems"] >= 256
    wl = tiny_workload("W2J", output_len=12, num_requests=3)
    res = bench.run(wl)
    assert [len(t) for t in res.token_ids] == [12, 12, 12]
    from nanoserve.engine.tokenizer import load_tokenizer

    text = load_tokenizer(bench.executor.model_dir).decode(res.token_ids[0])
    assert text.startswith("{") and text[1:].lstrip().startswith('"id"'), text


def test_the_bench_reads_a_models_config_by_any_name_the_server_takes(tmp_path):
    # `--serve URL --model m3-mini` (scripts/gpu_pd.sh on a CPU) once failed: the shipped model's name was read as a
    # directory
    from nanoserve.bench.session import model_config
    from nanoserve.model.loader import CheckpointError, read_config
    from nanoserve.presets.catalog import SHIPPED, get_preset

    assert model_config("m3-mini") == read_config(SHIPPED["m3-mini"])
    assert model_config("m3-slice") == get_preset("m3-slice").config
    with pytest.raises(CheckpointError, match="does not exist"):
        model_config(str(tmp_path / "nowhere"))
