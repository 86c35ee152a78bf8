"""Where a decode step's time goes: torch.profiler over a few decode steps of a workload, per kernel, with the bytes
each group of kernels must move beside its time, the achieved GB/s and the % of the card's copy ceiling.

The workload's requests are prefilled first, then a few decode steps are timed with the configured switches
(CUDA graphs included: the real step time) and again with graphs off; the kernel table comes from the profiler
over the eager steps, so that every kernel is attributed by name. On the CPU the "kernels" are aten operators
(self CPU time).

Bytes: `ModelCost.decode_components` splits what one decode step must read (the step's floor bytes: weights once,
the experts the batch touches, the KV) into model components; BYTE_GROUPS names, per kernel-name pattern, the
components that kernel reads. A group's bytes are its components' bytes; a kernel shows bytes of its own only
when it is the one kernel seen that reads them (one fp8 linear kernel runs every quantized projection; the
library GEMMs run under several kernel names, so their bytes are the group's). GB/s = bytes / time, "% of
ceiling" = GB/s over the copy ceiling (`Ceilings.bytes_per_s`; on the CPU only a ceiling given with --peak-gbps).
"""

from __future__ import annotations

import re
import time

import torch

from nanoserve.bench.floor import DECODE_COMPONENTS
from nanoserve.bench.offline import NanoBench, sampling_params
from nanoserve.bench.report import fmt, table
from nanoserve.bench.workloads import Request, Workload

GROUPS = [
    # (group, pattern on the lower-cased kernel name), first match wins
    ("MSA", r"msa|index_score|block_topk|sparse_attention|sparse_by_block|combine_slots"),
    ("attention", r"paged|attention|attn|flash|combine_splits|sdpa"),
    ("MoE", r"moe|swiglu|down_weighted|sum_copies|_count_kernel|_place_kernel|route_align|expert"),
    ("norms / rope", r"norm|rope|rms"),
    ("GEMMs", r"gemm|gemv|cutlass|sm90|nvjet|cublas|xmma|matmul|ampere|hopper|splitk|aten::mm|aten::addmm|"
              r"aten::bmm|aten::linear|cijk|wvsplitk|_mm_|::mm|fp8_linear|sum_splits|mx_linear|mx_quantize|"
              r"_dequant_kernel"),
    ("copies / fills", r"memcpy|memset|copy|fill|cat|index_put|scatter|gather|indexselect|embedding"),
    ("sampling", r"argmax|topk|sort|softmax|multinomial"),
]

FP8_PROJECTIONS = "<the projections, with MXFP8 weights>"
BF16_PROJECTIONS = "<the projections, with 16-bit weights>"
FOLDED_SHARED_W13 = "<the shared expert's w13, when folded into the fused MoE>"
FOLDED_SHARED_W2 = "<the shared expert's w2, when folded into the fused MoE>"
CPU_MATMUL_BYTES = "<every weight and KV component but the embedding rows>"

BYTE_GROUPS = [
    # (device, group, pattern on the lower-cased kernel name, the ModelCost components (floor.DECODE_COMPONENTS)
    # the kernel reads), first match for the device wins; a kernel that matches none keeps its GROUPS group and
    # no bytes. The <...> entries depend on the run (`byte_table`): the projections (attention + indexer, dense
    # MLPs, and the shared expert when it is not folded into the fused MoE) run in the fp8 linear kernels with
    # MXFP8 weights and in the library GEMMs / the GEMV with 16-bit ones; the LM head (16-bit) and the router
    # (fp32) always run in the latter.
    ("cuda", "linears (fp8)", r"_fp8_linear(_wgmma)?_kernel|_gemv_mxfp8_kernel|_mx_linear_kernel", (FP8_PROJECTIONS,)),
    ("cuda", "linears (fp8)", r"_sum_splits_kernel|_mx_quantize_kernel|_dequant_kernel", ()),
    ("cuda", "GEMMs (cuBLAS / GEMV)", r"gemv|gemm|cutlass|sm90|nvjet|cublas|xmma|ampere|hopper|splitk|cijk",
     (BF16_PROJECTIONS, "LM head", "router")),
    ("cuda", "MoE", r"_up_swiglu_kernel", ("routed experts w13", FOLDED_SHARED_W13)),
    ("cuda", "MoE", r"_down_weighted_kernel", ("routed experts w2", FOLDED_SHARED_W2)),
    ("cuda", "MoE", r"_route_align_kernel|_count_kernel|_place_kernel|_sum_copies_kernel|moe", ()),
    ("cuda", "attention", r"_paged_decode_kernel|_paged_prefill_kernel", ("dense-layer KV",)),
    ("cuda", "attention", r"_combine_splits_kernel", ()),
    ("cuda", "MSA index", r"_index_score_kernel", ("MSA index keys",)),
    ("cuda", "MSA index", r"_block_topk_kernel", ()),
    ("cuda", "MSA attention", r"_sparse_attention_kernel|_sparse_by_block_kernel", ("MSA selected KV",)),
    ("cuda", "MSA attention", r"_combine_slots_kernel", ()),
    ("cuda", "embedding", r"indexselect|embedding", ("embedding rows",)),
    # the CPU reference path: attention, experts and dequantisation all end in aten's matmuls
    ("cpu", "matmuls (CPU reference)", r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|einsum)$", (CPU_MATMUL_BYTES,)),
    ("cpu", "embedding", r"^aten::(embedding|index_select)$", ("embedding rows",)),
]


def group_of(name: str) -> str:
    low = name.lower()
    for group, pattern in GROUPS:
        if re.search(pattern, low):
            return group
    return "other"


def byte_table(device: str, quantized: bool, shared_folded: bool) -> list[tuple[str, str, tuple[str, ...]]]:
    """BYTE_GROUPS for one run: the device's entries as (group, pattern, components), the <...> entries resolved
    (`quantized`: MXFP8 weights; `shared_folded`: the fused MoE runs the shared expert). Every component of
    DECODE_COMPONENTS belongs to exactly one group."""
    projections = ("attention projections", "indexer projections", "dense MLPs")
    if not shared_folded:
        projections += ("shared expert w13", "shared expert w2")
    resolve = {FP8_PROJECTIONS: projections if quantized else (),
               BF16_PROJECTIONS: () if quantized else projections,
               FOLDED_SHARED_W13: ("shared expert w13",) if shared_folded else (),
               FOLDED_SHARED_W2: ("shared expert w2",) if shared_folded else (),
               CPU_MATMUL_BYTES: tuple(c for c in DECODE_COMPONENTS if c != "embedding rows")}
    out, owner = [], {}
    for dev, group, pattern, comps in BYTE_GROUPS:
        if dev != device:
            continue
        resolved = tuple(r for c in comps for r in resolve.get(c, (c,)))
        for c in resolved:
            if owner.setdefault(c, group) != group:
                raise ValueError(f"component {c!r} is read by two groups ({owner[c]}, {group})")
        out.append((group, pattern, resolved))
    missing = [c for c in DECODE_COMPONENTS if c not in owner]
    if missing:
        raise ValueError(f"no {device} group reads {', '.join(missing)}")
    return out


def _match(name: str, entries: list[tuple[str, str, tuple[str, ...]]]) -> tuple[str, tuple[str, ...]] | None:
    low = name.lower()
    for group, pattern, comps in entries:
        if re.search(pattern, low):
            return group, comps
    return None


def _rates(bytes_: float | None, us: float, ceiling: float | None) -> dict:
    gb_s = bytes_ / us / 1e3 if bytes_ and us > 0 else None
    return {"gb_s": gb_s, "of_ceiling": gb_s * 1e9 / ceiling if gb_s is not None and ceiling else None,
            "floor_us": bytes_ / ceiling * 1e6 if bytes_ is not None and ceiling else None}


def _empty_group() -> dict:
    return {"us_per_step": 0.0, "calls_per_step": 0.0, "kernels": 0, "components": []}


def attribute_bytes(per_step: dict[str, tuple[float, float]], components: dict[str, float], device: str,
                    quantized: bool, shared_folded: bool, ceiling: float | None) -> tuple[dict, list]:
    """Kernel times per step (name -> (us, launches)) against the step's bytes per component: (per group: time,
    launches, kernels, components, bytes, GB/s, % of ceiling, its floor time; the kernel rows, slowest first,
    each with its own bytes where it alone reads them). `ceiling`: bytes/s, None = unknown."""
    entries = byte_table(device, quantized, shared_folded)
    total_us = sum(us for us, _ in per_step.values()) or 1.0
    matched = {name: _match(name, entries) for name in per_step}
    readers: dict[str, int] = {}  # component -> how many kernels seen read it
    for m in matched.values():
        for c in (m[1] if m else ()):
            readers[c] = readers.get(c, 0) + 1
    groups: dict[str, dict] = {}
    for group, _, comps in entries:
        g = groups.setdefault(group, _empty_group())
        g["components"] += [c for c in comps if c not in g["components"]]
    rows = []
    for name, (us, calls) in sorted(per_step.items(), key=lambda kv: -kv[1][0]):
        m = matched[name]
        group = m[0] if m else group_of(name)
        comps = m[1] if m else ()
        own = sum(components[c] for c in comps) if comps and all(readers[c] == 1 for c in comps) else None
        g = groups.setdefault(group, _empty_group())
        g["us_per_step"] += us
        g["calls_per_step"] += calls
        g["kernels"] += 1
        rows.append({"name": name, "group": group, "us_per_step": us, "calls_per_step": calls,
                     "share": us / total_us, "bytes": own, "bytes_in_group": bool(comps) and own is None,
                     **_rates(own, us, ceiling)})
    for g in groups.values():
        g["bytes"] = sum(components[c] for c in g["components"])
        g["share"] = g["us_per_step"] / total_us
        g.update(_rates(g["bytes"] if g["components"] else None, g["us_per_step"], ceiling))
    order = sorted(groups.items(), key=lambda kv: (-kv[1]["us_per_step"], -kv[1]["bytes"]))
    return {k: v for k, v in order if v["kernels"] or v["components"]}, rows


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


def _live_contexts(engine) -> list[int]:
    """Each decoding sequence's tokens (prompt + generated): the keys its next decode token attends to."""
    return [s.num_tokens for st in engine.requests.values() for s in st.seqs if not s.is_finished]


def _shared_expert_folded(bench: NanoBench) -> bool:
    """Does the fused MoE run the shared expert, as an extra slot of its launch? (M3MoE.forward's test.)"""
    opts = bench.opts
    if bench.device.type != "cuda" or not (opts.fused_moe and opts.fold_shared_expert):
        return False
    model = getattr(bench.runner, "model", None)
    return model is not None and any(getattr(m, "shared_in_stack", False) for m in model.modules())


def profile_decode(bench: NanoBench, wl: Workload, steps: int = 5, top: int = 40,
                   copy_ceiling_known: bool | None = None) -> dict:
    """Profile `steps` decode steps of the workload's batch; returns the summary (with a printable table).
    copy_ceiling_known: whether bench.hw's bandwidth is this device's (None: on a GPU yes, on the CPU no)."""
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
        contexts = _live_contexts(engine)

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
    # the bytes: the profiled steps' batch at their mean context (each step adds one token to every sequence)
    batch = len(contexts)
    context = sum(contexts) / max(batch, 1) + (steps - 1) / 2
    components = bench.cost.decode_components(batch, context)
    step_bytes = bench.cost.decode_step(batch, context)[0]
    known = bench.device.type == "cuda" if copy_ceiling_known is None else copy_ceiling_known
    ceiling = bench.hw.bytes_per_s if known else None
    quantized = bench.cost.quantization == "mxfp8"
    folded = _shared_expert_folded(bench)
    byte_groups, rows = attribute_bytes(per_step, components, bench.device.type, quantized, folded, ceiling)
    out = {
        "workload": wl.name, "batch": batch, "steps": steps, "device": bench.device.type,
        "weights": bench.weights["weight_format"], "quantization": bench.cost.quantization,
        "weight_bytes_per_element": bench.cost.wb, "kv_bytes_per_element": bench.cost.kvb,
        "context_mean": context, "shared_expert_folded": folded,
        "step_ms": step_ms, "step_ms_eager": eager_ms, "cuda_graphs": graphs_were, "switches": opts.as_dict(),
        "kernel_time_per_step_us": total / steps,
        "ceilings": bench.hw.name if known else None, "ceiling_gb_s": ceiling / 1e9 if ceiling else None,
        "step_bytes": step_bytes, "components": components,
        "copy_floor_ms": step_bytes / ceiling * 1e3 if ceiling else None,
        "step_of_ceiling": step_bytes / (step_ms / 1e3) / ceiling if ceiling and step_ms > 0 else None,
        "groups": {g: {"us_per_step": t, "share": t / (total / steps)} for g, t in
                   sorted(groups.items(), key=lambda kv: -kv[1])},
        "byte_groups": byte_groups,
        "kernels": rows,
        "top_kernels": rows[:top],
    }
    out["table"] = profile_table(out)
    return out


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.3f}" if x < 1e6 else f"{x / 1e6:,.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def profile_table(p: dict) -> str:
    unit = "GPU kernel" if p["device"] == "cuda" else "CPU op (self)"
    head = (f"Decode step profile: {p['workload']} (batch {p['batch']}, mean context {p['context_mean']:,.1f}), "
            f"{p['weights']} weights, {p['steps']} steps; step {p['step_ms']:.3f} ms with the configured switches "
            f"(graphs {'on' if p['cuda_graphs'] else 'off'}), {p['step_ms_eager']:.3f} ms eager; {unit} time "
            f"{p['kernel_time_per_step_us'] / 1e3:.3f} ms per step")
    if p["ceiling_gb_s"]:
        bytes_line = (f"A decode step must read {_mb(p['step_bytes'])} MB (ModelCost); copy ceiling "
                      f"{p['ceiling_gb_s']:,.0f} GB/s ({p['ceilings']}): {p['copy_floor_ms']:.3f} ms at it; the step "
                      f"(graphs as configured) reads at {_pct(p['step_of_ceiling'])} of it")
    else:
        bytes_line = (f"A decode step must read {_mb(p['step_bytes'])} MB (ModelCost); the copy ceiling of this "
                      f"device is unknown (--peak-gbps sets one): no % of ceiling")
    if p["device"] != "cuda":
        bytes_line += "; on the CPU the reference path reads every weight and the KV inside aten's matmuls"
    g = table(("group", "kernels", "launches / step", "us / step", "share", "MB / step", "GB/s", "% of ceiling",
               "floor us"),
              [[name, v["kernels"], v["calls_per_step"], v["us_per_step"], _pct(v["share"]),
                _mb(v["bytes"]) if v["components"] else "-", fmt(v["gb_s"]), _pct(v["of_ceiling"]),
                fmt(v["floor_us"])] for name, v in p["byte_groups"].items()])
    reads = "\n".join(f"  {name}: {', '.join(v['components'])}" for name, v in p["byte_groups"].items()
                      if v["components"])
    k = table(("kernel", "group", "launches / step", "us / step", "share", "MB / step", "GB/s", "% of ceiling"),
              [[_short(x["name"]), x["group"], x["calls_per_step"], x["us_per_step"], _pct(x["share"]),
                "group's" if x["bytes_in_group"] else _mb(x["bytes"]), fmt(x["gb_s"]), _pct(x["of_ceiling"])]
               for x in p["top_kernels"]])
    parts = [f"{head}\n{bytes_line}", g,
             "What each group reads (MB / step: those bytes, ModelCost; floor us: them at the copy ceiling):\n" + reads,
             k]
    rest = p["kernels"][len(p["top_kernels"]):]
    if rest:
        parts.append(f"({len(rest)} more kernels, {sum(x['us_per_step'] for x in rest):,.1f} us / step)")
    parts.append("A kernel's MB / step: the bytes it alone reads; \"group's\": it shares its group's bytes with "
                 "other kernels (the group row has them); -: it reads none of the step's weight or KV bytes")
    return "\n\n".join(parts)


GEMM_GROUPS = ("linears (fp8)", "GEMMs (cuBLAS / GEMV)")
"""The groups that together run every weight GEMM but the MoE's, in either format."""


def compare_profiles(profiles: dict[str, dict]) -> dict:
    """One workload's decode profiles in several weight formats (label -> profile_decode's dict) side by side, by
    group: time, bytes, % of ceiling and the time over the bytes' floor, per format; then every weight GEMM but
    the MoE's together (their components move between the two GEMM groups with the format), the kernels' sum
    and the step itself (graphs as configured)."""
    labels = list(profiles)
    names: dict[str, float] = {}
    for p in profiles.values():
        for name, v in p["byte_groups"].items():
            names[name] = max(names.get(name, 0.0), v["us_per_step"])
    rows = []

    def row(name: str, pick) -> None:
        r = {"group": name}
        for label, p in profiles.items():
            us, bytes_ = pick(p)
            ceiling = p["ceiling_gb_s"] * 1e9 if p["ceiling_gb_s"] else None
            r[label] = {"us_per_step": us, "bytes": bytes_, **_rates(bytes_, us, ceiling)}
            r[label]["over_floor_us"] = us - r[label]["floor_us"] if r[label]["floor_us"] is not None else None
        rows.append(r)

    def group_sum(p: dict, groups) -> tuple[float, float | None]:
        found = [p["byte_groups"][g] for g in groups if g in p["byte_groups"]]
        has_bytes = any(v["components"] for v in found)
        return sum(v["us_per_step"] for v in found), sum(v["bytes"] for v in found) if has_bytes else None

    for name in sorted(names, key=lambda n: -names[n]):
        row(name, lambda p, name=name: group_sum(p, (name,)))
    if any(g in p["byte_groups"] for p in profiles.values() for g in GEMM_GROUPS):
        row("all weight GEMMs but the MoE's", lambda p: group_sum(p, GEMM_GROUPS))
    row("kernels (sum)", lambda p: (p["kernel_time_per_step_us"], p["step_bytes"]))
    row("step (graphs as configured)", lambda p: (p["step_ms"] * 1e3, p["step_bytes"]))
    first = next(iter(profiles.values()))
    return {"workload": first["workload"], "batch": first["batch"], "context_mean": first["context_mean"],
            "formats": labels, "rows": rows}


def compare_table(c: dict) -> str:
    labels = c["formats"]
    cols = ["group"] + [f"{lb} us" for lb in labels]
    if len(labels) == 2:
        cols.append(f"{labels[1]} - {labels[0]} us")
    cols += [f"{lb} MB" for lb in labels] + [f"{lb} % of ceiling" for lb in labels]
    cols += [f"{lb} us over floor" for lb in labels]
    body = []
    for r in c["rows"]:
        line = [r["group"]] + [r[lb]["us_per_step"] for lb in labels]
        if len(labels) == 2:
            line.append(r[labels[1]]["us_per_step"] - r[labels[0]]["us_per_step"])
        line += [_mb(r[lb]["bytes"]) for lb in labels] + [_pct(r[lb]["of_ceiling"]) for lb in labels]
        line += [fmt(r[lb]["over_floor_us"]) for lb in labels]
        body.append(line)
    title = (f"Decode step by group, {' vs '.join(labels)}: {c['workload']} (batch {c['batch']}, mean context "
             f"{c['context_mean']:,.1f}); us over floor = time - bytes at the copy ceiling")
    return table(cols, body, title)
