"""Tune the MXFP8-weight kernels on this GPU: every variant and tile of kernels/fp8_configs.py at a model's shapes.

    OUT=/tmp/out python scripts/tune_fp8.py [--preset m3-slice] [--rows 1,8,32,64,128,512,4096] [--workers 12]
        [--bench-budget 0]

For the preset's quantized projections (the linears' N, K at tp=1) and its fused MoE (hidden, intermediate,
routed experts, top-k + the folded shared expert), at each row count (tokens) this times every candidate
(variant x tiles) with CUDA events (2 warm-ups, then the median of 20 runs, L2 flushed before each run), checks
each against the bf16 computation on the dequantised weights (torch F.linear / the bf16 fused MoE: max |fp8 -
bf16| <= 2e-2 x max |bf16|; a candidate that fails or does not compile is dropped) and records the bf16 time
beside it. The kernels are compiled first by `--workers` processes in parallel (the Triton cache is shared).

Writes as it goes, under $OUT: tune_fp8.csv (every measurement), fp8_tuned.json (the winners with their provenance
- this card, the torch and Triton versions, the command line, the commit, the date, each entry's time and bf16's -
in the form of nanoserve/kernels/tuned/fp8.json, the built-in "cuda" tables, which it can replace as it is;
NANOSERVE_FP8_TUNED_CONFIG=that file merges it over them instead), and prints a table last: per shape and row
count the best variant, its time, GB/s of the weights read against the measured copy ceiling (small batches) or
TFLOP/s (large), and bf16's time. With --bench-budget S > 0 it then runs `python -m nanoserve.bench
--quantization mxfp8 --workloads W1,W2` with the tuned table for at most S seconds (log in $OUT/bench_log.txt).
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanoserve.bench.env import git_commit, tuning_record  # noqa: E402
from nanoserve.kernels import tuned  # noqa: E402
from nanoserve.kernels.fp8_configs import FP8_LINEAR_TILES, FP8_MOE_TILES, FP8_VARIANTS, bucket_entry  # noqa: E402
from nanoserve.kernels.moe import MOE_GEMV_MAX_TOKENS  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/tune_fp8")
RTOL = 2e-2
WEIGHT_STD = 0.02
SMALL_ROWS = 64
VARIANTS = list(FP8_VARIANTS)
"""Batches up to this many rows are judged by GB/s of weights read; larger ones by TFLOP/s."""


# ------------------------------------------------------------------------------------------------------------
# Candidates
# ------------------------------------------------------------------------------------------------------------


def linear_candidates(m: int) -> list[tuple]:
    """(variant, block_m, block_n, block_k, warps, stages[, split_waves]) entries to time at M rows."""
    return [e for e in _linear_candidates(m) if e[0] in VARIANTS]


def moe_candidates(t: int) -> list[tuple]:
    return [e for e in _moe_candidates(t) if e[0] in VARIANTS]


def incumbent_first(candidates: list[tuple], incumbent: tuple | None) -> list[tuple]:
    """The built-in table's entry for this bucket, then the candidates. Timed first, the incumbent is always
    measured before the sweep's deadline can cut it short, so a short sweep never writes an entry that it did not
    see beat the one the engine already runs (whatever --variants names)."""
    if incumbent is None:
        return candidates
    return list(dict.fromkeys([tuple(incumbent), *candidates]))


def builtin_linear(n: int, k: int, m: int) -> tuple | None:
    buckets = FP8_LINEAR_TILES.get("cuda", {}).get((n, k))
    return bucket_entry(buckets, m) if buckets else None


def builtin_moe(h: int, inter: int, experts: int, t: int) -> tuple | None:
    buckets = FP8_MOE_TILES.get("cuda", {}).get((h, inter, experts))
    return bucket_entry(buckets, t) if buckets else None


def _linear_candidates(m: int) -> list[tuple]:
    out = []
    if m <= SMALL_ROWS:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        if bm <= 32:
            out += [("acc", bm, 64, 256, 4, 4), ("acc", bm, 128, 256, 4, 3)]
        for variant in ("bcast", "swap", "scaled"):
            for bn, bk, stages in ((64, 256, 3), (64, 128, 4), (128, 128, 4), (128, 256, 3)):
                out.append((variant, bm, bn, bk, 4, stages))
        out += [("swap", bm, 64, 256, 4, 4), ("swap", bm, 128, 256, 8, 3)]
        if bm == 64:
            # row tiles narrower than the batch: the weight tile is read from memory once and from L2 by the
            # other row tiles (adjacent programs), each doing a quarter or half of the MMA work; more programs
            # need fewer K splits, whose fp32 partial sums cost memory traffic of their own
            for small in (16, 32):
                out += [("acc", small, 64, 256, 4, 4, w) for w in (2, 4)]
                out += [(v, small, 64, 256, 4, 3, w) for v in ("bcast", "scaled") for w in (2, 4)]
            # the split-K width of the 64-row tiles (the table's entries use 8 programs per multiprocessor)
            out += [(v, 64, 64, bk, 4, 4, w) for v, bk in (("bcast", 128), ("swap", 256)) for w in (1, 2, 4, 16)]
    else:
        bm_small = 64 if m <= 128 else 128
        out.append(("gather", bm_small, 128, 64, 8 if bm_small == 128 else 4, 3))  # the old large-M path
        for variant in ("bcast", "swap", "scaled"):
            for tiles in ((bm_small, 128, 64, 4, 4), (bm_small, 128, 128, 8, 3), (128, 256, 64, 8, 3),
                          (bm_small, 256, 128, 8, 3)):
                out.append((variant, *tiles))
        out.append(("dequant", 128, 128, 64, 4, 4))  # tiles unused: dequantise, then F.linear
    return list(dict.fromkeys(out))


def _moe_candidates(t: int) -> list[tuple]:
    """(variant, block_m, group_m, up tiles, down tiles) entries to time at T tokens (top-4 of 128 experts: a
    routed expert sees ~T / 32 rows, the shared one T)."""
    out = []
    if t <= MOE_GEMV_MAX_TOKENS:  # the CUDA-core variant: narrow column tiles, long K steps, the weight read once
        for up, down in (((8, 512, 4, 1), (8, 512, 4, 1)), ((16, 256, 4, 1), (16, 256, 4, 1)),
                         ((4, 1024, 4, 1), (8, 1024, 4, 1)), ((8, 1024, 8, 1), (8, 1024, 8, 1)),
                         ((8, 256, 4, 1), (8, 256, 4, 1)), ((8, 512, 2, 1), (8, 512, 2, 1)),
                         ((4, 512, 4, 1), (4, 512, 4, 1)), ((16, 512, 4, 1), (16, 512, 4, 1)),
                         ((8, 512, 4, 2), (8, 512, 4, 2)), ((4, 512, 2, 1), (4, 512, 2, 1)),
                         ((2, 1024, 4, 1), (2, 1024, 4, 1)), ((8, 512, 4, 1), (4, 512, 4, 1))):
            out.append(("gemv", 16, 8, up, down))
    if t <= 64:
        for up, down in (((32, 256, 4, 4), (64, 256, 4, 3)), ((64, 128, 4, 4), (64, 128, 4, 4)),
                         ((64, 256, 4, 3), (128, 128, 4, 3))):
            for variant in ("acc", "bcast", "swap", "scaled"):
                out.append((variant, 16, 8, up, down))
    elif t <= 512:
        bm = 16 if t <= 128 else 32
        for up, down in (((64, 128, 4, 4), (64, 128, 4, 4)), ((128, 128, 4, 3), (128, 128, 4, 3))):
            for variant in ("acc", "bcast", "swap", "scaled"):
                out.append((variant, bm, 8, up, down))
        out.append(("bcast", 64, 8, (128, 64, 4, 4), (128, 64, 4, 4)))
        out.append(("swap", 64, 8, (128, 64, 4, 4), (128, 64, 4, 4)))
    else:
        out.append(("gather", 64, 16, (256, 64, 8, 3), (128, 64, 8, 4)))  # the bf16 table's entry, old fp8 path
        for variant in ("bcast", "swap", "scaled"):
            for cfg in ((64, 16, (256, 64, 8, 3), (128, 64, 8, 4)), (128, 32, (128, 64, 8, 4), (256, 64, 8, 3)),
                        (128, 16, (128, 128, 8, 3), (128, 128, 8, 3))):
                out.append((variant, *cfg))
    return list(dict.fromkeys(out))


# ------------------------------------------------------------------------------------------------------------
# Problems
# ------------------------------------------------------------------------------------------------------------


def layout(preset: str) -> tuple[str, int, bool]:
    """"m3-slice@tp8ep" -> ("m3-slice", 8, True): the preset and rank layout (--tp, --ep) whose shapes are timed.
    One string, so that the spawned compile workers get the layout with the preset."""
    name, _, spec = preset.partition("@tp")
    return name, int(spec.removesuffix("ep") or 1), spec.endswith("ep")


def model_shapes(preset: str) -> tuple[dict[str, tuple[int, int]], tuple[int, int, int, int]]:
    """The quantizable projections' (N, K) and the fused MoE's (hidden, intermediate, routed experts, top-k) of
    rank 0 in the preset's layout (model/shapes.py)."""
    from nanoserve.model.shapes import rank_shapes
    from nanoserve.presets.catalog import get_preset

    name, tp, ep = layout(preset)
    cfg = get_preset(name).config
    rank = rank_shapes(cfg, tp, ep)
    return rank.quantizable, (*rank.experts, cfg.num_experts_per_tok)


def moe_args(preset: str) -> dict:
    from nanoserve.presets.catalog import get_preset

    name, _, ep = layout(preset)
    cfg = get_preset(name).config
    return dict(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, routed_scaling_factor=cfg.routed_scaling_factor,
                fold_shared=not ep)  # expert parallelism runs the shared expert as its own MLP


def moe_config(entry: tuple):
    from nanoserve.kernels.moe import GemmTiles, MoEConfig

    variant, bm, gm, up, down = entry
    return MoEConfig(bm, gm, GemmTiles(*up), GemmTiles(*down), variant)


def linear_tiles(entry: tuple):
    from nanoserve.kernels.fp8_linear import LinearTiles

    return LinearTiles.from_entry(entry)


def quantize_stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from nanoserve.bench.micro import _quantize_stack

    return _quantize_stack(w)


def moe_problem(h: int, inter: int, experts: int, top_k: int, t: int, dev, gen):
    from nanoserve.kernels import reference

    x = torch.empty(t, h, dtype=torch.bfloat16, device=dev).normal_(0, 1, generator=gen)
    weights, ids = reference.route(torch.empty(t, experts, device=dev).normal_(0, 1, generator=gen),
                                   torch.zeros(experts, device=dev), top_k)
    return x, weights, ids


# ------------------------------------------------------------------------------------------------------------
# Compile workers (fill the shared Triton cache in parallel)
# ------------------------------------------------------------------------------------------------------------


def _compile_worker(args: tuple) -> list[str]:
    preset, jobs = args
    from nanoserve.kernels.fp8_linear import fp8_linear
    from nanoserve.kernels.moe import fused_moe
    from nanoserve.model.mxfp8 import quantize_mxfp8

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    shapes, (h, inter, experts, top_k) = model_shapes(preset)
    errors = []
    cache: dict = {}
    for kind, shape, rows, entry in jobs:
        try:
            if kind == "linear":
                n, k = shapes[shape]
                if shape not in cache:
                    cache[shape] = quantize_mxfp8(torch.empty(n, k, device=dev).normal_(0, WEIGHT_STD, generator=gen))
                q, s = cache[shape]
                fp8_linear(torch.randn(rows, k, device=dev, dtype=torch.bfloat16), q, s, tiles=linear_tiles(entry))
            else:  # a few experts suffice: the kernels specialise on strides and widths, not the expert count
                if "moe" not in cache:
                    w13 = torch.empty(5, 2 * inter, h, dtype=torch.bfloat16, device=dev).normal_(0, WEIGHT_STD)
                    w2 = torch.empty(5, h, inter, dtype=torch.bfloat16, device=dev).normal_(0, WEIGHT_STD)
                    cache["moe"] = (*quantize_stack(w13), *quantize_stack(w2))
                q13, s13, q2, s2 = cache["moe"]
                x, wts, ids = moe_problem(h, inter, 4, top_k, min(rows, 256), dev, gen)
                fused_moe(x, q13, q2, wts, ids, w13_scale=s13, w2_scale=s2, config=moe_config(entry),
                          **moe_args(preset))
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported; the main process drops the candidate
            errors.append(f"{kind} {shape} {rows} {entry}: {type(e).__name__}: {str(e)[:300]}")
    return errors


def compile_all(preset: str, jobs: list[tuple], workers: int) -> list[str]:
    if workers <= 1:
        return _compile_worker((preset, jobs))
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        return [e for errs in pool.map(_compile_worker, [(preset, c) for c in chunks]) for e in errs]


# ------------------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------------------


class Timer:
    """Median of `reps` runs timed with CUDA events, the L2 flushed (a 256 MB write) before each."""

    def __init__(self, dev, reps: int = 20, warmup: int = 2):
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)
        self.reps, self.warmup = reps, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]


def ceilings(dev) -> dict:
    """The card's measured copy bandwidth and bf16 / fp8 matmul rates (bench/micro.py `ceilings_micro`)."""
    from nanoserve.bench.micro import ceilings_micro

    return ceilings_micro(None, None, dev)["rows"][0]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


class Recorder:
    def __init__(self):
        os.makedirs(OUT, exist_ok=True)
        self.f = open(os.path.join(OUT, "tune_fp8.csv"), "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(["kind", "shape", "rows", "variant", "entry", "ms", "rel_err", "ok", "bf16_ms", "note"])
        self.rows: list[dict] = []

    def add(self, **r) -> None:
        self.rows.append(r)
        self.w.writerow([r["kind"], r["shape"], r["rows"], r["entry"][0] if r["entry"] else "", json.dumps(r["entry"]),
                         f"{r['ms']:.5f}" if r["ms"] is not None else "", f"{r['err']:.2e}" if r["err"] is not None
                         else "", r["ok"], f"{r['bf16_ms']:.5f}", r.get("note", "")])
        self.f.flush()


def sweep_linear(preset: str, rows_list: list[int], dev, timer: Timer, rec: Recorder, deadline: float) -> None:
    from nanoserve.kernels.fp8_linear import fp8_linear
    from nanoserve.kernels.reference import dequantize_mxfp8
    from nanoserve.model.mxfp8 import quantize_mxfp8

    gen = torch.Generator(device=dev).manual_seed(0)
    shapes, _ = model_shapes(preset)
    for name, (n, k) in shapes.items():
        w = torch.empty(n, k, device=dev).normal_(0, WEIGHT_STD, generator=gen)
        q, s = quantize_mxfp8(w)
        wb = dequantize_mxfp8(q, s, torch.bfloat16)
        del w
        for m in rows_list:
            x = torch.empty(m, k, device=dev).normal_(0, 1, generator=gen).bfloat16()
            want = F.linear(x, wb)
            bf = timer(lambda: F.linear(x, wb))
            for entry in incumbent_first(linear_candidates(m), builtin_linear(n, k, m)):
                if time.perf_counter() > deadline:
                    return
                tiles = linear_tiles(entry)
                try:
                    err = rel_err(fp8_linear(x, q, s, tiles=tiles), want)
                    ms = timer(lambda: fp8_linear(x, q, s, tiles=tiles)) if err <= RTOL else None
                    rec.add(kind="linear", shape=name, rows=m, entry=entry, ms=ms, err=err, ok=err <= RTOL,
                            bf16_ms=bf, n=n, k=k)
                except Exception as e:  # noqa: BLE001
                    rec.add(kind="linear", shape=name, rows=m, entry=entry, ms=None, err=None, ok=False, bf16_ms=bf,
                            n=n, k=k, note=f"{type(e).__name__}: {str(e)[:200]}")
        q = s = wb = None  # release the weights before empty_cache (the timed lambdas above close over these names)
        torch.cuda.empty_cache()


def sweep_moe(preset: str, rows_list: list[int], dev, timer: Timer, rec: Recorder, deadline: float) -> None:
    from nanoserve.kernels.moe import fused_moe
    from nanoserve.kernels.reference import dequantize_mxfp8

    gen = torch.Generator(device=dev).manual_seed(0)
    _, (h, inter, experts, top_k) = model_shapes(preset)
    args = moe_args(preset)
    w13 = torch.empty(experts + 1, 2 * inter, h, dtype=torch.bfloat16, device=dev).normal_(0, WEIGHT_STD,
                                                                                           generator=gen)
    w2 = torch.empty(experts + 1, h, inter, dtype=torch.bfloat16, device=dev).normal_(0, WEIGHT_STD, generator=gen)
    q13, s13 = quantize_stack(w13)
    q2, s2 = quantize_stack(w2)
    for i in range(experts + 1):  # bf16 = exactly the dequantised fp8 weights: the same function, two formats
        w13[i] = dequantize_mxfp8(q13[i], s13[i], torch.bfloat16)
        w2[i] = dequantize_mxfp8(q2[i], s2[i], torch.bfloat16)
    shape = f"moe {h}x{inter}x{experts}"
    for t in rows_list:
        x, wts, ids = moe_problem(h, inter, experts, top_k, t, dev, gen)
        want = fused_moe(x, w13, w2, wts, ids, **args)
        bf = timer(lambda: fused_moe(x, w13, w2, wts, ids, **args))
        touched = int(torch.unique(ids).numel()) + 1
        for entry in incumbent_first(moe_candidates(t), builtin_moe(h, inter, experts, t)):
            if time.perf_counter() > deadline:
                return
            cfg = moe_config(entry)

            def fn(cfg=cfg):
                return fused_moe(x, q13, q2, wts, ids, w13_scale=s13, w2_scale=s2, config=cfg, **args)
            try:
                err = rel_err(fn(), want)
                ms = timer(fn) if err <= RTOL else None
                rec.add(kind="moe", shape=shape, rows=t, entry=entry, ms=ms, err=err, ok=err <= RTOL, bf16_ms=bf,
                        h=h, inter=inter, experts=experts, touched=touched, top_k=top_k)
            except Exception as e:  # noqa: BLE001
                rec.add(kind="moe", shape=shape, rows=t, entry=entry, ms=None, err=None, ok=False, bf16_ms=bf, h=h,
                        inter=inter, experts=experts, touched=touched, top_k=top_k,
                        note=f"{type(e).__name__}: {str(e)[:200]}")


# ------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------


def winners(rec: Recorder) -> dict:
    best: dict = {}
    for r in rec.rows:
        if r["ms"] is None:
            continue
        key = (r["kind"], r["shape"], r["rows"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    return best


def tuned_json(best: dict) -> tuple[dict, dict]:
    """The winners as tuned/fp8.json holds them, and each one's times (ms) for its provenance record."""
    out: dict = {"linear": {}, "moe": {}}
    times: dict = {"linear": {}, "moe": {}}
    for (kind, _, rows), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        key = f"{r['n']},{r['k']}" if kind == "linear" else f"{r['h']},{r['inter']},{r['experts']}"
        out[kind].setdefault(key, {})[str(rows)] = [list(v) if isinstance(v, tuple) else v for v in r["entry"]]
        times[kind].setdefault(key, {})[str(rows)] = {"ms": round(r["ms"], 5), "bf16_ms": round(r["bf16_ms"], 5)}
    return out, times


def report(best: dict, ceil: dict) -> str:
    lines = [f"copy ceiling {ceil['copy_gb_s']:.0f} GB/s, bf16 matmul {ceil['bf16_tflop_s']:.0f} TFLOP/s",
             f"{'shape':<16} {'rows':>5} {'best':<8} {'tiles':<34} {'fp8 ms':>8} {'bf16 ms':>8} {'x bf16':>6} "
             f"{'GB/s':>6} {'%copy':>5} {'TFLOP/s':>7}"]
    for (kind, shape, rows), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if kind == "linear":
            n, k = r["n"], r["k"]
            nbytes, flops = n * k * (1 + 1 / 32), 2 * rows * n * k
        else:
            w = 3 * r["h"] * r["inter"]
            nbytes, flops = r["touched"] * w * (1 + 1 / 32), 2 * w * rows * (r["top_k"] + 1)
        gbs = nbytes / r["ms"] / 1e6
        lines.append(f"{shape:<16} {rows:>5} {r['entry'][0]:<8} {str(r['entry'][1:]):<34} {r['ms']:>8.4f} "
                     f"{r['bf16_ms']:>8.4f} {r['bf16_ms'] / r['ms']:>6.2f} {gbs:>6.0f} "
                     f"{100 * gbs / ceil['copy_gb_s']:>5.0f} {flops / r['ms'] / 1e9:>7.1f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="m3-slice")
    ap.add_argument("--tp", type=int, default=1, help="time the shapes of one rank of this tensor-parallel size "
                    "(m3-slice has M3's widths: --tp 8 gives an 8-GPU deployment's shapes, on one GPU)")
    ap.add_argument("--ep", action="store_true", help="with --tp: expert parallelism (whole experts per rank)")
    ap.add_argument("--rows", default="1,8,32,64,128,512,4096")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--sweep-budget", type=float, default=200.0, help="seconds for compile + sweep")
    ap.add_argument("--bench-budget", type=float, default=0.0)
    ap.add_argument("--skip", default="", help="comma list of linear,moe")
    ap.add_argument("--variants", default=",".join(FP8_VARIANTS), help="comma list: time only these variants")
    args = ap.parse_args()
    if args.tp > 1 or args.ep:
        args.preset = f"{args.preset}@tp{args.tp}{'ep' if args.ep else ''}"
    t0 = time.perf_counter()
    deadline = t0 + args.sweep_budget
    os.makedirs(OUT, exist_ok=True)
    rows_list = [int(r) for r in args.rows.split(",")]
    VARIANTS[:] = args.variants.split(",")
    skip = set(args.skip.split(","))
    dev = torch.device("cuda")
    meta = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "commit": git_commit(),
            "preset": args.preset, "rows": rows_list}
    shapes, _ = model_shapes(args.preset)
    jobs = []
    if "linear" not in skip:
        jobs += [("linear", name, m, e) for name in list(shapes)[:1] for m in rows_list for e in linear_candidates(m)]
    if "moe" not in skip:
        jobs += [("moe", "moe", t, e) for t in rows_list for e in moe_candidates(t)]
    # one job per kernel: a linear's rows pick its split-K and with it the output dtype; the MoE's do not matter
    jobs = list({(kind, e, rows if kind == "linear" else 0): (kind, s, rows, e) for kind, s, rows, e in jobs}.values())
    errors = compile_all(args.preset, jobs, args.workers)
    meta["compile_s"] = time.perf_counter() - t0
    meta["compile_errors"] = errors
    print(f"[compile] {len(jobs)} jobs in {meta['compile_s']:.1f} s, {len(errors)} errors", flush=True)
    for e in errors[:20]:
        print("  ", e, flush=True)
    timer = Timer(dev)
    ceil = ceilings(dev)
    meta["ceilings"] = ceil
    rec = Recorder()
    for name, fn in (("linear", sweep_linear), ("moe", sweep_moe)):
        if name in skip:
            continue
        t1 = time.perf_counter()
        part_deadline = t1 + 0.45 * (deadline - t1) if name == "linear" and "moe" not in skip else deadline
        try:
            fn(args.preset, rows_list, dev, timer, rec, part_deadline)
        except Exception:  # noqa: BLE001
            print(f"[{name}] FAILED: {traceback.format_exc()}", flush=True)
        print(f"[{name}] {time.perf_counter() - t1:.1f} s", flush=True)
        torch.cuda.empty_cache()
    best = winners(rec)
    table, times = tuned_json(best)
    entries = {kind: {shape: [int(b) for b in buckets] for shape, buckets in table[kind].items()} for kind in table}
    record = tuning_record({kind: e for kind, e in entries.items() if e}, times=times, preset=args.preset)
    tuned_path = os.path.join(OUT, "fp8_tuned.json")
    tuned.write(tuned_path, {**table, "meta": meta, "provenance": [record]})
    text = report(best, ceil)
    with open(os.path.join(OUT, "tune_fp8.txt"), "w") as f:
        f.write(text + "\n")
    failed = [r for r in rec.rows if not r["ok"]]
    print(f"[sweep] {len(rec.rows)} candidates timed, {len(failed)} failed or off by more than {RTOL}", flush=True)
    for r in failed[:12]:
        print("  ", r["kind"], r["shape"], r["rows"], r["entry"], r["err"], r.get("note", ""), flush=True)
    if args.bench_budget > 0:
        del timer
        torch.cuda.empty_cache()
        env = {**os.environ, "NANOSERVE_FP8_TUNED_CONFIG": tuned_path}
        cmd = [sys.executable, "-m", "nanoserve.bench", "--quantization", "mxfp8", "--workloads", "W1,W2",
               "--time-budget", str(args.bench_budget - 30), "--out", "/tmp/tune_fp8_bench"]
        print("[bench]", " ".join(cmd), flush=True)
        with open(os.path.join(OUT, "bench_log.txt"), "w") as log:
            try:
                subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.bench_budget, env=env)
            except subprocess.TimeoutExpired:
                print("[bench] timed out", flush=True)
        with open(os.path.join(OUT, "bench_log.txt")) as f:
            print(f.read()[-3500:])
    print(f"\n[total] {time.perf_counter() - t0:.1f} s")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
