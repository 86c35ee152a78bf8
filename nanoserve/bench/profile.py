"""Where a decode step's time goes: torch.profiler over a few decode steps of a workload, summarised per kernel and
per group (attention / MSA / MoE / GEMMs / norms / other).

The workload's requests are prefilled first, then a few decode steps are timed with the configured switches
(CUDA graphs included: the real step time) and again with graphs off; the kernel table comes from the profiler
over the eager steps, so that every kernel is attributed by name. On the CPU the "kernels" are aten operators
(self CPU time).
"""

from __future__ import annotations

import re
import time

import torch

from nanoserve.bench.offline import NanoBench, sampling_params
from nanoserve.bench.report import table
from nanoserve.bench.workloads import Request, Workload

GROUPS = [
    # (group, pattern on the lower-cased kernel name), first match wins
    ("MSA", r"msa|index_score|block_topk|sparse_attention"),
    ("attention", r"paged|attention|attn|flash|combine_splits|sdpa"),
    ("MoE", r"moe|swiglu|down_weighted|sum_copies|_count_kernel|_place_kernel|expert"),
    ("norms / rope", r"norm|rope|rms"),
    ("GEMMs", r"gemm|cutlass|sm90|nvjet|cublas|xmma|matmul|ampere|hopper|splitk|aten::mm|aten::addmm|aten::bmm|"
              r"aten::linear|cijk|wvsplitk|_mm_|::mm"),
    ("copies / fills", r"memcpy|memset|copy|fill|cat|index_put|scatter|gather"),
    ("sampling", r"argmax|topk|sort|softmax|multinomial"),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, low):
            return group
    return "other"


def _device_time_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


def profile_kernels(bench: NanoBench, run) -> dict[str, list[float]]:
    """Run `run()` under torch.profiler and sum its time per kernel: name -> [microseconds, launches]. On a GPU the
    device time of device kernels; on the CPU the self CPU time of aten operators."""
    cuda = bench.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run()
    kernels: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        if cuda:
            t = _device_time_us(evt)
            if t <= 0 or getattr(evt, "device_type", None) not in (None, torch.autograd.DeviceType.CUDA):
                continue
        else:
            if not evt.key.startswith("aten::"):
                continue
            t = float(evt.self_cpu_time_total)
            if t <= 0:
                continue
        k = kernels.setdefault(evt.key, [0.0, 0])
        k[0] += t
        k[1] += evt.count
    return kernels


def _prefilled_engine(bench: NanoBench, wl: Workload, decode_steps: int):
    """An engine whose requests are all past their prefill and decoding, with room for decode_steps more."""
    need = 3 * decode_steps + 8
    reqs = [Request(r.prompt_ids, max(r.max_tokens, need), 0.0, r.json_schema) for r in wl.requests]
    wl = Workload(wl.name, wl.family, wl.description, reqs, wl.shared_prefix_len, wl.params)
    engine = bench.engine_for(wl)
    for i, r in enumerate(reqs):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": r.prompt_ids}, sampling_params(r))
    while engine.stats.num_generation_tokens < len(reqs) or engine.num_waiting:
        engine.step()
    engine.step()  # one full decode step, so every sequence is past its first token
    return engine


def _time_steps(bench: NanoBench, engine, steps: int) -> float:
    bench.sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    bench.sync()
    return (time.perf_counter() - t0) / steps


def profile_decode(bench: NanoBench, wl: Workload, steps: int = 5, top: int = 30) -> dict:
    """Profile `steps` decode steps of the workload's batch; returns the summary (with a printable table)."""
    opts = bench.opts
    graphs_were = opts.cuda_graphs
    bench.capture_graphs(wl)
    engine = _prefilled_engine(bench, wl, steps)
    try:
        _time_steps(bench, engine, 2)  # captures the graph this batch replays, if any
        step_ms = _time_steps(bench, engine, steps) * 1e3
        opts.cuda_graphs = False
        _time_steps(bench, engine, 1)
        eager_ms = _time_steps(bench, engine, steps) * 1e3

        def run() -> None:
            for _ in range(steps):
                engine.step()
            bench.sync()

        kernels = profile_kernels(bench, run)
    finally:
        opts.cuda_graphs = graphs_were
        engine.abort_request(list(engine.requests))
    total = sum(v[0] for v in kernels.values()) or 1.0
    per_step = {name: (t / steps, n / steps) for name, (t, n) in kernels.items()}
    groups: dict[str, float] = {}
    for name, (t, _) in per_step.items():
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + t
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1][0])
    out = {
        "workload": wl.name, "batch": len(wl.requests), "steps": steps, "device": bench.device.type,
        "step_ms": step_ms, "step_ms_eager": eager_ms, "cuda_graphs": graphs_were, "switches": opts.as_dict(),
        "kernel_time_per_step_us": total / steps,
        "groups": {g: {"us_per_step": t, "share": t / (total / steps)} for g, t in
                   sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n, "group": group_of(n), "us_per_step": t, "calls_per_step": c,
                         "share": t / (total / steps)} for n, (t, c) in ranked[:top]],
    }
    out["table"] = profile_table(out)
    return out


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_table(p: dict) -> str:
    unit = "GPU kernel" if p["device"] == "cuda" else "CPU op (self)"
    head = (f"Decode step profile: {p['workload']} (batch {p['batch']}), {p['steps']} steps; "
            f"step {p['step_ms']:.3f} ms with the configured switches (graphs {'on' if p['cuda_graphs'] else 'off'}), "
            f"{p['step_ms_eager']:.3f} ms eager; {unit} time {p['kernel_time_per_step_us'] / 1e3:.3f} ms per step")
    g = table(("group", "us / step", "share"),
              [[name, v["us_per_step"], f"{100 * v['share']:.1f}%"] for name, v in p["groups"].items()])
    k = table(("kernel", "group", "calls / step", "us / step", "share"),
              [[_short(x["name"]), x["group"], x["calls_per_step"], x["us_per_step"], f"{100 * x['share']:.1f}%"]
               for x in p["top_kernels"]])
    return f"{head}\n\n{g}\n\n{k}"
