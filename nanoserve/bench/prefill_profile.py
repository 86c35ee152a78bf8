"""Where a prefill's time goes: torch.profiler over the prefill steps of a workload, per kernel, with the FLOPs and
bytes each kernel must do beside its time, the achieved TFLOP/s and GB/s, and its roof.

The workload's requests are run with max_tokens = 1, so every step is pure prefill (no decode joins) and the
scheduler's packing is known in advance: first come first served, `chunk` tokens per step, the last prompt of a
step split (`prefill_steps`). From that packing `kernel_costs` counts, per kernel, the work a perfect kernel could
not avoid:

- FLOPs: the matrix products (2 per multiply-add) - causal QK^T + PV over the keys each query sees (dense layers,
  and the top-k selected blocks on MSA layers), the indexer's token scores, the expert GEMMs of every computed
  (token, expert) pair, the projections (cuBLAS; one row per group, the name of a cuBLAS kernel says nothing);
- bytes: each input read once and each output written once per step (the KV a chunk attends to is read once per
  step, the weights once per step, the indexer's block-score workspace written once and read once).

roof = max(FLOPs / peak FLOP/s, bytes / peak bandwidth): the time a kernel at the ceiling would take; "% of roof"
= roof / measured. Host gaps = the wall time of the steps (synchronised) minus the GPU kernel time: time the GPU
sat idle (scheduling, input preparation, launches). On the CPU the kernels are aten operators and no costs are
attributed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from nanoserve.bench.floor import Ceilings, ModelCost
from nanoserve.bench.offline import NanoBench
from nanoserve.bench.profile import _short, group_of, profile_kernels
from nanoserve.bench.report import table
from nanoserve.bench.workloads import Request, Workload
from nanoserve.sampling import SamplingParams


@dataclass(frozen=True)
class Piece:
    """One sequence's share of a prefill step: `tokens` query tokens ending at context length `end`."""

    tokens: int
    end: int
    last: bool = False
    """This piece ends its prompt (the step samples the sequence's first token: one LM-head row)."""

    @property
    def start(self) -> int:
        return self.end - self.tokens


def prefill_steps(prompt_lens: list[int], chunk: int) -> list[list[Piece]]:
    """The scheduler's packing of prompts that all arrive at once, with no decodes (max_tokens = 1): FCFS, `chunk`
    tokens per step, a prompt that does not fit what is left of the step continues in the next."""
    steps: list[list[Piece]] = []
    cur: list[Piece] = []
    left = chunk
    for n in prompt_lens:
        done = 0
        while done < n:
            take = min(n - done, left)
            done += take
            cur.append(Piece(take, done, done == n))
            left -= take
            if left == 0:
                steps.append(cur)
                cur, left = [], chunk
    if cur:
        steps.append(cur)
    return steps


def _key_sum(start: int, end: int) -> float:
    """sum over query positions p in [start, end) of the p + 1 keys it sees."""
    return (end * (end + 1) - start * (start + 1)) / 2


def _capped_key_sum(start: int, end: int, cap: int) -> float:
    """sum over p in [start, end) of min(p + 1, cap)."""
    below = max(0, min(end, cap) - start)  # positions p < cap see p + 1 keys
    s = _key_sum(start, start + below) if below else 0.0
    return s + max(0, end - max(start, cap)) * cap


KERNELS = {
    # cost key -> (substring of the GPU kernel name, group); a kernel without an entry gets its group's
    # aggregate cost only ("GEMMs": every cuBLAS kernel together)
    "dense attention": ("_paged_prefill_kernel", "attention"),
    "MSA index scores": ("_index_score_kernel", "MSA"),
    "MSA block top-k": ("_block_topk_kernel", "MSA"),
    "MSA sparse attention": ("_sparse_attention_kernel", "MSA"),
    "MoE GEMM 1 (up + SwiGLU)": ("_up_swiglu_kernel", "MoE"),
    "MoE GEMM 2 (down, weighted)": ("_down_weighted_kernel", "MoE"),
    "MoE top-k sum": ("_sum_copies_kernel", "MoE"),
    "MoE align (count + place)": ("_count_kernel|_place_kernel", "MoE"),
    "QK-norm + RoPE + cache insert": ("_qk_norm_rope_insert_kernel", "norms / rope"),
    "add + RMSNorm": ("_add_rmsnorm_kernel", "norms / rope"),
}


def kernel_costs(cost: ModelCost, steps: list[list[Piece]]) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) per KERNELS key, plus "GEMMs" (every projection, router and LM-head row), summed over the
    steps; see the module docstring for what is counted."""
    c = cost.cfg
    wb, kvb = cost.wb, cost.kvb
    h, d, hq, hkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    g, di, page = c.index_n_heads, c.index_head_dim, c.index_block_size
    sel_keys = c.index_topk_blocks * page
    kp = c.num_experts_per_tok + c.n_shared_experts
    inter = c.intermediate_size
    n_dense, n_sparse = len(cost.dense_attn_layers), len(cost.sparse_attn_layers)
    n_moe, n_dmlp, n_layers = len(cost.moe_layers), len(cost.dense_mlp_layers), c.num_hidden_layers
    kv_token = 2 * hkv * d * kvb
    out: dict[str, list[float]] = {k: [0.0, 0.0] for k in list(KERNELS) + ["GEMMs"]}

    def add(key: str, flops: float, bytes_: float, layers: int = 1) -> None:
        out[key][0] += flops * layers
        out[key][1] += bytes_ * layers

    for step in steps:
        n = sum(p.tokens for p in step)
        qo = 2 * n * hq * d * 2  # q read + o written, 16-bit
        keys = sum(_key_sum(p.start, p.end) for p in step)
        sel = sum(_capped_key_sum(p.start, p.end, sel_keys) for p in step)
        ctx_kv = sum(p.end for p in step) * kv_token
        add("dense attention", 4 * hq * d * keys, qo + ctx_kv, n_dense)
        blocks_written = keys / page  # a row writes the block maxima of its own block and every earlier one
        ws = g * blocks_written * 4
        add("MSA index scores", 2 * g * di * keys, n * g * di * 2 + sum(p.end for p in step) * di * kvb + ws,
            n_sparse)
        add("MSA block top-k", 0.0, ws + n * g * c.index_topk_blocks * 4, n_sparse)
        sel_kv = sum(min(p.end, p.tokens * sel_keys) for p in step) * kv_token  # distinct selected keys, at least
        add("MSA sparse attention", 4 * hq * d * sel, qo + sel_kv, n_sparse)
        experts = cost.experts_touched(n) + c.n_shared_experts
        pairs = n * kp
        add("MoE GEMM 1 (up + SwiGLU)", 2 * pairs * h * 2 * inter,
            experts * 2 * inter * h * wb + n * h * 2 + pairs * inter * 2, n_moe)
        add("MoE GEMM 2 (down, weighted)", 2 * pairs * inter * h,
            experts * inter * h * wb + pairs * inter * 2 + pairs * h * 2, n_moe)
        add("MoE top-k sum", 0.0, pairs * h * 2 + n * h * 2, n_moe)
        add("MoE align (count + place)", 0.0, n * c.num_experts_per_tok * 4 * 3 + pairs * 4, n_moe)
        qkv_width = c.q_size + 2 * c.kv_size
        index_width = g * di + di
        add("QK-norm + RoPE + cache insert", 0.0, n * (qkv_width * 2 + (c.q_size + 2 * c.kv_size) * 2),
            n_layers)
        add("QK-norm + RoPE + cache insert", 0.0, n * index_width * 2 * 2, n_sparse)
        add("add + RMSNorm", 0.0, 4 * n * h * 2, 2 * n_layers)
        # projections: q|k|v(|index) and o on every layer, the dense MLP, the router (fp32), one LM-head row per
        # sequence that finishes its prompt in this step
        lin_params = cost.attn * n_layers + cost.indexer * n_sparse + cost.dense_mlp * n_dmlp
        lin_bytes = lin_params * wb + cost.router * n_moe * 4
        act_bytes = n * (2 * h * n_layers * 2 + (qkv_width + c.q_size) * n_layers * 2
                         + 3 * c.dense_intermediate_size * n_dmlp * 2)
        finishing = sum(p.last for p in step)
        add("GEMMs", 2 * n * (lin_params + cost.router * n_moe) + 2 * finishing * cost.lm_head,
            lin_bytes + act_bytes + (cost.lm_head * wb if finishing else 0.0))
    return {k: (f, b) for k, (f, b) in out.items()}


def _match(name: str) -> str | None:
    import re

    for key, (pattern, _) in KERNELS.items():
        if re.search(pattern, name):
            return key
    return None


def _rates(flops: float, bytes_: float, us: float, hw: Ceilings) -> dict:
    s = us / 1e6 if us else float("nan")
    roof_us = max(flops / hw.flops_per_s, bytes_ / hw.bytes_per_s) * 1e6
    return {"tflop_s": flops / s / 1e12 if us else None, "gb_s": bytes_ / s / 1e9 if us else None,
            "roof_us": roof_us, "of_roof": roof_us / us if us else None,
            "bound": "compute" if flops / hw.flops_per_s >= bytes_ / hw.bytes_per_s else "memory"}


def attribute(kernels: dict[str, tuple[float, int]], costs: dict[str, tuple[float, float]], hw: Ceilings
              ) -> tuple[dict, dict, list]:
    """Measured kernel times (name -> (us, calls)) against the cost model: (per group: time, share, FLOPs, bytes,
    rates, roof; per cost key: the same; the kernel rows, slowest first). With no costs (CPU), times only."""
    kernel_us = sum(v[0] for v in kernels.values())
    key_us: dict[str, float] = {}
    rows = []
    for name, (us, calls) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        key = _match(name) if costs else None
        if key is not None:
            key_us[key] = key_us.get(key, 0.0) + us
        rows.append({"name": name, "group": group_of(name), "cost_key": key, "us": us, "calls": calls})
    groups: dict[str, dict] = {}
    for r in rows:
        groups.setdefault(r["group"], {"us": 0.0, "flops": 0.0, "bytes": 0.0})["us"] += r["us"]
    for key, (f, b) in costs.items():
        gd = groups.setdefault("GEMMs" if key == "GEMMs" else KERNELS[key][1], {"us": 0.0, "flops": 0.0, "bytes": 0.0})
        gd["flops"] += f
        gd["bytes"] += b
    for gd in groups.values():
        if costs:
            gd.update(_rates(gd["flops"], gd["bytes"], gd["us"], hw))
        gd["share"] = gd["us"] / kernel_us if kernel_us else 0.0
    by_key = {}
    for key, (f, b) in costs.items():
        us = groups.get("GEMMs", {}).get("us", 0.0) if key == "GEMMs" else key_us.get(key, 0.0)
        by_key[key] = {"us": us, "flops": f, "bytes": b, **_rates(f, b, us, hw)}
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["us"])), by_key, rows


def profile_prefill(bench: NanoBench, wl: Workload, chunk: int | None = None, warm: bool = True,
                    top: int = 18) -> dict:
    """Profile the whole prefill of the workload's prompts at `chunk` tokens per step (None: the engine's
    max_num_batched_tokens); returns the summary with a printable table."""
    reqs = [Request(r.prompt_ids, 1, 0.0) for r in wl.requests]
    engine = bench.engine_for(wl, max_num_batched_tokens=chunk)
    chunk = engine.max_num_batched_tokens
    steps = prefill_steps([len(r.prompt_ids) for r in reqs], chunk)

    def run(tag: str) -> float:
        e = bench.engine_for(wl, max_num_batched_tokens=chunk)
        for i, r in enumerate(reqs):
            e.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_ids},
                          SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        bench.sync()
        t0 = time.perf_counter()
        while e.has_unfinished_requests():
            e.step()
        bench.sync()
        wall = time.perf_counter() - t0
        if e.stats.num_steps != len(steps):
            raise RuntimeError(f"{wl.name}: the engine took {e.stats.num_steps} prefill steps, the packing model "
                               f"{len(steps)}: the cost table would be wrong")
        return wall

    if warm:
        run("prefill-warm")
    wall_s = run("prefill-timed")
    cuda = bench.device.type == "cuda"
    kernels = profile_kernels(bench, lambda: run("prefill-profiled"))
    kernel_us = sum(v[0] for v in kernels.values())
    costs = kernel_costs(bench.cost, steps) if cuda else {}
    hw = bench.hw
    groups, by_key, rows = attribute(kernels, costs, hw)
    tokens = sum(p.tokens for s in steps for p in s)
    flops_total = sum(f for f, _ in costs.values())
    out = {
        "workload": wl.name, "device": bench.device.type, "chunk": chunk, "steps": len(steps), "tokens": tokens,
        "wall_ms": wall_s * 1e3, "kernel_ms": kernel_us / 1e3, "host_gap_ms": wall_s * 1e3 - kernel_us / 1e3,
        "flops": flops_total, "roof_ms": sum(v["roof_us"] for v in by_key.values()) / 1e3 if cuda else None,
        "floor_ms": bench.cost.prefill_flops(len(reqs[0].prompt_ids)) / hw.flops_per_s * 1e3 * len(reqs)
        if len(reqs) == 1 else None,
        "groups": groups, "by_kernel": by_key,
        "top_kernels": rows[:top], "switches": bench.opts.as_dict(), "ceilings": hw.name,
    }
    out["table"] = prefill_table(out)
    return out


def _f(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def prefill_table(p: dict) -> str:
    cuda = p["device"] == "cuda"
    per = f"{p['steps']} steps of <= {p['chunk']} tokens"
    head = (f"Prefill profile: {p['workload']}, {p['tokens']} prompt tokens in {per}; wall {p['wall_ms']:.1f} ms "
            f"(synchronised, profiler off), {'GPU kernel' if cuda else 'CPU op (self)'} time {p['kernel_ms']:.1f} "
            f"ms, host gaps {p['host_gap_ms']:.1f} ms")
    if cuda:
        head += (f"; roof of the kernels {p['roof_ms']:.1f} ms (sum of each kernel's max(FLOPs / peak, bytes / "
                 f"bandwidth))" + (f", compute floor {p['floor_ms']:.1f} ms" if p.get("floor_ms") else ""))
    gcols = ("group", "ms", "share", "TFLOP/s", "GB/s", "roof ms", "% of roof")
    g = table(gcols, [[name, v["us"] / 1e3, f"{100 * v['share']:.1f}%", _f(v.get("tflop_s")), _f(v.get("gb_s"), ".0f"),
                       _f(v.get("roof_us", 0) / 1e3 if cuda else None, ".2f"),
                       _f(100 * v["of_roof"] if v.get("of_roof") else None)] for name, v in p["groups"].items()]
              + [["host gaps", p["host_gap_ms"], "", "", "", "", ""]])
    parts = [head, g]
    if cuda:
        k = table(("kernel (cost model)", "ms", "TFLOP/s", "GB/s", "bound", "roof ms", "% of roof"),
                  [[key, v["us"] / 1e3, _f(v["tflop_s"]), _f(v["gb_s"], ".0f"), v["bound"], v["roof_us"] / 1e3,
                    _f(100 * v["of_roof"] if v["of_roof"] else None)]
                   for key, v in sorted(p["by_kernel"].items(), key=lambda kv: -kv[1]["us"])])
        parts.append(k)
    t = table(("kernel", "group", "calls", "ms", "share"),
              [[_short(r["name"]), r["group"], r["calls"], r["us"] / 1e3,
                f"{100 * r['us'] / (p['kernel_ms'] * 1e3):.1f}%" if p["kernel_ms"] else "-"]
               for r in p["top_kernels"]])
    parts.append(t)
    return "\n\n".join(parts)
