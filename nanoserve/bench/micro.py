"""Kernel micro-benchmarks in bf16 and MXFP8 weights side by side, at the model's widths (GPU only).

- `moe_micro`: the fused MoE as the model runs it (routed top-k + the folded shared expert) over token counts, with
  bf16 weights and with the same weights quantized to MXFP8 (fp8 + E8M0 scales), each call taking the path the
  default switches give it in the model (MXFP8: `moe_wgmma`'s Gluon kernels on Hopper from 256 tokens,
  `moe_dequant_prefill` at 16,384 tokens elsewhere, the Triton kernels otherwise), or those the run's `--switch`
  flags set (`moe_wgmma=off`: the Triton MXFP8 kernels on Hopper too).
- `linear_micro`: the attention / dense-MLP projections, bf16 F.linear (cuBLAS / hipBLASLt) against the MXFP8
  weights on the path the default switches give in the model (one row: the GEMV; on Hopper up to
  fp8_linear.FP8_WGMMA_MAX_ROWS rows: `fp8_linear_wgmma`'s Gluon kernel; else the Triton fp8 GEMM, or at prefill
  sizes its transient bf16 copy).
- `ceilings_micro`: the card's copy bandwidth and its bf16 and fp8 matmul rates, the roofs the other two are read
  against.
- `route_micro`: the decode routing, torch + moe_align against the one-launch kernel (switch fused_routing).
- `align_micro`: the MoE alignment alone (moe_align's two launches) at every tile height the tables pad to.
- The attention kernels' tables are in bench/micro_attention.py.

Each batch is timed as the engine runs it: decode-sized batches (up to `GRAPH_MAX_TOKENS`) as calls captured back to
back in one CUDA graph and replayed (`graph_us`: no launch overhead, which at these sizes is larger than the
kernels; the weights alternate between two copies so that L2 does not serve a call from the one before), prefill-
sized ones eagerly, the median of `triton.testing.do_bench` (it clears L2 before each call; a prefill GEMM may pick a
variant that a captured graph cannot run, such as the linear's transient bf16 copy). FLOPs count 2 per multiply-add;
bytes are the weights a call reads (the distinct experts the routing touches, at 2 bytes per bf16 weight or
1 + 1/32 per MXFP8 one), which dominate at these sizes. Uniform random routing, random N(0, 0.02) weights.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
import torch.nn.functional as F

from nanoserve.bench.report import table
from nanoserve.model.m3_config import M3Config
from nanoserve.model.mxfp8 import quantize_mxfp8

FORMATS = ("bf16", "mxfp8")
WEIGHT_STD = 0.02
GRAPH_MAX_TOKENS = 256
"""Batches up to this many tokens are timed in a CUDA graph (the decode workloads' batch sizes: W5 runs 256), larger
ones eagerly (prefill chunks)."""


def graph_us(call: Callable[[int], object], calls: int = 50, replays: int = 20, warm: int = 1) -> float:
    """Microseconds per call of `call(i)`, i = 0 .. calls - 1, captured back to back in one CUDA graph (as a decode
    step runs its kernels: no launch overhead) and replayed: the median over `replays`. The first `warm` indices
    are called once outside the capture first (Triton compiles there)."""
    for i in range(warm):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def timed_as(tokens: int) -> str:
    """How a batch of `tokens` is timed: "graph" (a decode step) up to GRAPH_MAX_TOKENS, else "eager"."""
    return "graph" if tokens <= GRAPH_MAX_TOKENS else "eager"


def batch_ms(fns: list[Callable[[], object]], tokens: int) -> float:
    """Milliseconds per call of the same operation on different weight copies `fns` (called in turn), timed as the
    engine runs a batch of `tokens` (`timed_as`): in a CUDA graph, or eagerly (do_bench, the first copy)."""
    import triton

    if timed_as(tokens) == "graph":
        return graph_us(lambda i: fns[i % len(fns)](), calls=10 * len(fns), replays=20, warm=len(fns)) / 1e3
    return triton.testing.do_bench(fns[0], warmup=5, rep=40, return_mode="median")


def _bytes_per_weight(fmt: str) -> float:
    return 2.0 if fmt == "bf16" else 1.0 + 1.0 / 32


def _quantize_stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, N, K] bf16 -> (fp8 [S, N, K], uint8 [S, N, K/32]), one slot at a time (bounded fp32 scratch)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(*w.shape[:-1], w.shape[-1] // 32, dtype=torch.uint8, device=w.device)
    for i in range(w.shape[0]):
        q[i], s[i] = quantize_mxfp8(w[i])
    return q, s


def moe_micro(cfg: M3Config, tokens: list[int], device: torch.device, seed: int = 0, opts=None) -> dict:
    from nanoserve.config import Optimizations
    from nanoserve.kernels import reference
    from nanoserve.kernels.moe import fused_moe, mxfp8_thresholds

    paths = mxfp8_thresholds(opts or Optimizations())  # what the model layer passes with these switches
    h, inter, e, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(e + 1, 2 * inter, h, dtype=torch.bfloat16, device=device).normal_(0, WEIGHT_STD, generator=gen)
    w2 = torch.empty(e + 1, h, inter, dtype=torch.bfloat16, device=device).normal_(0, WEIGHT_STD, generator=gen)
    q13, s13 = _quantize_stack(w13)
    q2, s2 = _quantize_stack(w2)
    args = dict(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, routed_scaling_factor=cfg.routed_scaling_factor,
                fold_shared=True)
    rows, out = [], []
    for t in tokens:
        x = torch.empty(t, h, dtype=torch.bfloat16, device=device).normal_(0, 1, generator=gen)
        logits = torch.empty(t, e, device=device).normal_(0, 1, generator=gen)
        weights, ids = reference.route(logits, torch.zeros(e, device=device), k)
        touched = int(torch.unique(ids).numel()) + 1  # + the shared expert
        flops = 2 * 3 * h * inter * t * (k + 1)
        entry = {"tokens": t, "experts_touched": touched, "timed": timed_as(t)}
        for fmt in FORMATS:
            if fmt == "bf16":
                def fn(): return fused_moe(x, w13, w2, weights, ids, **args)
            else:
                def fn(): return fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, **args, **paths)
            ms = batch_ms([fn], t)  # one copy: the experts a call reads (>= 5 x 3 x H x I) outgrow L2
            nbytes = touched * 3 * h * inter * _bytes_per_weight(fmt)
            entry[fmt] = {"ms": ms, "tflop_s": flops / ms / 1e9, "gb_s": nbytes / ms / 1e6}
        entry["speedup"] = entry["bf16"]["ms"] / entry["mxfp8"]["ms"]
        out.append(entry)
        rows.append([t, touched, entry["timed"], entry["bf16"]["ms"] * 1e3, entry["mxfp8"]["ms"] * 1e3,
                     entry["bf16"]["tflop_s"], entry["mxfp8"]["tflop_s"], entry["bf16"]["gb_s"], entry["mxfp8"]["gb_s"],
                     entry["speedup"]])
    title = (f"Fused MoE (top-{k} + folded shared expert, H {h}, I {inter}, {e} experts), bf16 vs MXFP8 weights "
             f"(median us; GB/s of the weights read)")
    return {"rows": out, "table": table(("tokens", "experts", "timed", "bf16 us", "mxfp8 us", "bf16 TFLOP/s",
                                         "mxfp8 TFLOP/s", "bf16 GB/s", "mxfp8 GB/s", "speedup"), rows, title)}


def ceilings_micro(cfg: M3Config | None, tokens: list[int] | None, device: torch.device, size: int = 8192) -> dict:
    """The card's own ceilings, measured: copy bandwidth (a 2 GiB device-to-device copy, bytes read + written),
    the bf16 matmul rate (torch's library GEMM, size^3) and the fp8 e4m3 matmul rate (torch._scaled_mm with
    per-tensor scales, the library's fp8 tensor-core GEMM) on random data. (`cfg`, `tokens`: unused; the
    signature of the other micro-benchmarks.)"""
    import triton

    def ms(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")

    def measure_copy() -> float:  # its 4 GiB go back when it returns
        src = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return 2 * src.numel() / ms(lambda: dst.copy_(src)) / 1e6

    copy_gb_s = measure_copy()
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    flops = 2 * size**3
    bf16 = flops / ms(lambda: a @ b) / 1e9
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # _scaled_mm: B column-major
    one = torch.ones((), dtype=torch.float32, device=device)
    fp8 = flops / ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e9
    res = {"copy_gb_s": copy_gb_s, "bf16_tflop_s": bf16, "fp8_tflop_s": fp8}
    return {"rows": [res], "table": table(("copy GB/s", "bf16 matmul TFLOP/s", "fp8 e4m3 matmul TFLOP/s"),
                                          [[copy_gb_s, bf16, fp8]],
                                          f"Ceilings measured on this card (median; {size}^3 matmuls)")}


def linear_shapes(cfg: M3Config, tp_size: int = 1, expert_parallel: bool = False) -> dict[str, tuple[int, int]]:
    """(N, K) of the quantizable projections one rank runs (model/shapes.py: read off the model it builds)."""
    from nanoserve.model.shapes import rank_shapes

    return rank_shapes(cfg, tp_size, expert_parallel).quantizable


def linear_micro(cfg: M3Config, tokens: list[int], device: torch.device, seed: int = 0, opts=None) -> dict:
    from nanoserve.config import Optimizations
    from nanoserve.model.layers.linear import linear

    opts = opts or Optimizations()  # the path the model's layers take with these switches
    gen = torch.Generator(device=device).manual_seed(seed)
    rows, out = [], []
    for name, (n, k) in linear_shapes(cfg).items():
        ws = [torch.empty(n, k, dtype=torch.bfloat16, device=device).normal_(0, WEIGHT_STD, generator=gen)
              for _ in range(2)]
        qs = [quantize_mxfp8(w) for w in ws]
        for t in tokens:
            x = torch.empty(t, k, dtype=torch.bfloat16, device=device).normal_(0, 1, generator=gen)
            bf = batch_ms([lambda w=w: F.linear(x, w) for w in ws], t)
            mx = batch_ms([lambda q=q, s=s: linear(x, q, s, opts) for q, s in qs], t)
            flops = 2 * t * n * k
            entry = {"shape": name, "n": n, "k": k, "tokens": t, "bf16_ms": bf, "mxfp8_ms": mx,
                     "timed": timed_as(t),
                     "bf16_gb_s": n * k * 2 / bf / 1e6, "mxfp8_gb_s": n * k * (1 + 1 / 32) / mx / 1e6,
                     "bf16_tflop_s": flops / bf / 1e9, "mxfp8_tflop_s": flops / mx / 1e9, "speedup": bf / mx}
            out.append(entry)
            rows.append([name, t, entry["timed"], bf * 1e3, mx * 1e3, entry["bf16_gb_s"], entry["mxfp8_gb_s"],
                         entry["bf16_tflop_s"], entry["mxfp8_tflop_s"], entry["speedup"]])
        del ws, qs
    return {"rows": out, "table": table(("projection", "tokens", "timed", "bf16 us", "mxfp8 us", "bf16 GB/s",
                                         "mxfp8 GB/s", "bf16 TFLOP/s", "mxfp8 TFLOP/s", "speedup"), rows,
                                        "Projections: bf16 F.linear vs the MXFP8 weights on the default path (median)")}


ROUTE_WARPS = (1, 2, 4, 8)
ROUTE_BLOCK_M = 16
"""The MoE tile height at decode sizes (kernels/configs.py MOE_TILES), which the alignment pads each run to."""


def route_micro(cfg: M3Config, tokens: list[int], device: torch.device, seed: int = 0) -> dict:
    """The decode routing (switch fused_routing): the torch routing + moe_align (the switch off) against the
    one-launch kernels/moe_route.py at each warp count, for the token counts it takes (up to
    ROUTE_ALIGN_MAX_TOKENS; larger ones are left out). Microseconds per call, 50 calls in one CUDA graph."""
    from nanoserve.kernels import reference
    from nanoserve.kernels.moe_align import moe_align
    from nanoserve.kernels.moe_route import ROUTE_ALIGN_MAX_TOKENS, route_align_warps, route_and_align

    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    slots, block_m = e + 1, ROUTE_BLOCK_M
    gen = torch.Generator(device=device).manual_seed(seed)
    bias = torch.empty(e, device=device).normal_(0, 0.1, generator=gen)
    out, rows = [], []
    for t in (t for t in tokens if t <= ROUTE_ALIGN_MAX_TOKENS):
        logits = torch.empty(t, e, device=device).normal_(0, 1, generator=gen)

        def torch_path():
            _, ids = reference.route(logits, bias, k)
            return moe_align(ids, slots, block_m, fold_shared=True)

        entry = {"tokens": t, "torch_us": graph_us(lambda i: torch_path()), "default_warps": route_align_warps(t)}
        for w in ROUTE_WARPS:
            entry[f"fused_{w}w_us"] = graph_us(lambda i, w=w: route_and_align(logits, bias, k, slots, block_m,
                                                                               fold_shared=True, num_warps=w))
        out.append(entry)
        rows.append([t, entry["torch_us"], *(entry[f"fused_{w}w_us"] for w in ROUTE_WARPS), entry["default_warps"]])
    title = f"Decode routing + alignment ({e} experts, top-{k}, the shared expert folded; us per call in a CUDA graph)"
    headers = ("tokens", "torch + moe_align us", *(f"fused {w} warps us" for w in ROUTE_WARPS), "engine's warps")
    return {"rows": out, "table": table(headers, rows, title)}


ALIGN_BLOCK_M = (16, 32, 64, 128)
"""The MoE tile heights of the tile tables (kernels/configs.py MOE_TILES, fp8_configs.FP8_MOE_TILES): the alignment
pads every expert's run to one of them."""


def align_micro(cfg: M3Config, tokens: list[int], device: torch.device, seed: int = 0) -> dict:
    """The MoE alignment alone (kernels/moe_align.py: its count and place launches, as every fused MoE call of more
    than the fused routing's tokens runs them) on routed top-k ids plus the folded shared expert, at each tile
    height of ALIGN_BLOCK_M. Microseconds per call, 50 calls in one CUDA graph at every size: the launches take
    microseconds, which eager timing would drown in launch overhead."""
    from nanoserve.kernels import reference
    from nanoserve.kernels.moe_align import moe_align

    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(seed)
    out, rows = [], []
    for t in tokens:
        logits = torch.empty(t, e, device=device).normal_(0, 1, generator=gen)
        _, ids = reference.route(logits, torch.zeros(e, device=device), k)
        entry = {"tokens": t}
        for block_m in ALIGN_BLOCK_M:
            entry[f"block_m_{block_m}_us"] = graph_us(
                lambda i, block_m=block_m: moe_align(ids, e + 1, block_m, fold_shared=True))
        out.append(entry)
        rows.append([t, *(entry[f"block_m_{b}_us"] for b in ALIGN_BLOCK_M)])
    title = (f"MoE alignment ({e} experts + the folded shared one, top-{k}; us per call in a CUDA graph, by the tile "
             f"height each expert's run is padded to)")
    return {"rows": out, "table": table(("tokens", *(f"block_m {b} us" for b in ALIGN_BLOCK_M)), rows, title)}
