"""Tune the one-row GEMV (kernels/gemv.py) against F.linear on this card, for the 16-bit projections of a decode
step, and print the GEMV_TILES entries (kernels/configs.py; the "cuda" ones are nanoserve/kernels/tuned/gemv.json)
for the shapes where the GEMV wins.

Shapes: every distinct 2-D weight one rank of the preset multiplies by in a decode step, read off the model it
builds (model/shapes.py): at m3-slice's default tensor parallel size 1, the dense layer's QKV [9216, 6144], an MSA
layer's QKV + index projections [9856, 6144], o_proj [6144, 8192], the dense MLP's gate/up [24576, 6144] and down
[6144, 12288], the MoE router [128, 6144] (fp32 weight, fp32 output) and the LM head [200064, 6144]; `--tp 8`
(`--ep`) gives the shapes each GPU of an 8-GPU M3 deployment runs, tuned here on one. Each candidate is timed as
a CUDA graph of CALLS calls (as a decode step runs it), rotating over three copies of the weight so that no call
finds its weight in L2; the time is the median of REPLAYS replays.
A shape joins the table when its best tile beats F.linear by more than MIN_GAIN.

    python scripts/tune_gemv.py [--dtype bfloat16] [--preset m3-slice] [--tp 8 [--ep]] [--shapes 6144x8192,...]

With --mxfp8 the weights are the same draws quantised to MXFP8 and the GEMV is gemv_mxfp8, against
kernels/fp8_linear.py's tuned choice (the GEMV_MXFP8_TILES entries). --then-bench W1,W2 then puts the winners into
the table inside this process and runs `python -m nanoserve.bench [--quantization mxfp8] --workloads W1,W2`, so the
engine's numbers are measured with exactly the tiles printed. --write FILE adds them to a JSON file that
$NANOSERVE_GEMV_TUNED_CONFIG makes the engine use (another process, e.g. a later benchmark in the same call), with
a provenance record (this card, the torch and Triton versions, the command line, the commit, the date, each shape's
time against the baseline's); `--write nanoserve/kernels/tuned/gemv.json` adds them to the built-in table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from nanoserve.bench import micro
from nanoserve.bench.env import tuning_record
from nanoserve.kernels import configs, tuned
from nanoserve.kernels.fp8_linear import fp8_linear
from nanoserve.kernels.gemv import gemv, gemv_mxfp8
from nanoserve.model.mxfp8 import quantize_mxfp8
from nanoserve.model.shapes import rank_shapes
from nanoserve.presets.catalog import get_preset

BLOCK_N, BLOCK_K, WARPS, STAGES = (1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8), (1, 2)
MXFP8_BLOCK_K = (512, 1024, 2048)
"""--mxfp8 sweeps these K steps (a byte per weight: twice the columns per load) with one pipeline stage."""
MAX_ACC_PER_THREAD = 128
"""fp32 accumulator elements per thread past which a tile would spill: skipped."""
CALLS, REPLAYS, COPIES, MIN_GAIN = 12, 15, 3, 0.03


def graph_us(fn_for_copy) -> float:
    """fn_for_copy(c) multiplies by weight copy c; the graph's calls rotate over the copies."""
    return micro.graph_us(lambda i: fn_for_copy(i % COPIES), calls=CALLS, replays=REPLAYS, warm=COPIES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--preset", default="m3-slice")
    ap.add_argument("--tp", type=int, default=1, help="the shapes of one rank of this tensor-parallel size")
    ap.add_argument("--ep", action="store_true", help="with --tp: expert parallelism")
    ap.add_argument("--shapes", default=None, help="NxK,... instead of the preset's (default: all of its shapes)")
    ap.add_argument("--mxfp8", action="store_true", help="tune gemv_mxfp8 against fp8_linear on MXFP8 weights")
    ap.add_argument("--then-bench", default=None, help="workloads to bench with the winners applied")
    ap.add_argument("--bench-out", default=None, help="--out of that bench run")
    ap.add_argument("--write", default=None, metavar="FILE",
                    help="add the winners to this JSON file (the form $NANOSERVE_GEMV_TUNED_CONFIG reads)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    rank = rank_shapes(get_preset(args.preset).config, args.tp, args.ep)
    # the MoE router: an fp32 weight times the 16-bit row, into fp32 (against F.linear(x.float(), W))
    router = rank.projections.get(rank.router)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:  # MXFP8 models keep the router and the LM head in 16 / 32 bits
        shapes = list((rank.quantizable if args.mxfp8 else rank.projections).values())
    print(f"{torch.cuda.get_device_name()}, {dtype}{', MXFP8 weights' if args.mxfp8 else ''}; us per call (GB/s)")
    winners, times = {}, {}
    for n, k in shapes:
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        if args.mxfp8:
            if (n, k) == router:  # the router stays fp32
                continue
            qs = [quantize_mxfp8(torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5) for _ in range(COPIES)]
            best = pick(n, k, n * k * (1 + 1 / 32) / 1e9, "fp8_linear", lambda c: fp8_linear(x, *qs[c]),
                        "gemv_mxfp8", lambda c, t: gemv_mxfp8(x, *qs[c], t), tiles_for(n, MXFP8_BLOCK_K, (1,)))
        else:
            is_router = (n, k) == router
            w_dtype = torch.float32 if is_router else dtype
            ws = [torch.randn(n, k, device="cuda", dtype=w_dtype) / k**0.5 for _ in range(COPIES)]
            base = (lambda c: F.linear(x.float(), ws[c])) if is_router else (lambda c: F.linear(x, ws[c]))
            best = pick(n, k, n * k * w_dtype.itemsize / 1e9, "F.linear", base, "gemv",
                        lambda c, t: gemv(x, ws[c], t, w_dtype), tiles_for(n))
        if best is not None:
            winners[(n, k)], times[f"{n},{k}"] = best
    table = configs.GEMV_MXFP8_TILES if args.mxfp8 else configs.GEMV_TILES
    fmt = "mxfp8" if args.mxfp8 else "16bit"
    print(f'{"GEMV_MXFP8_TILES" if args.mxfp8 else "GEMV_TILES"} entries (tuned/gemv.json "{fmt}"):')
    for (n, k), t in winners.items():
        print(f'    "{n},{k}": {list(t)},', flush=True)
    if args.write:
        record = tuning_record({fmt: list(times)}, times={fmt: times}, dtype=args.dtype)
        write_tuned(args.write, fmt, winners, record)
    if args.then_bench:
        from nanoserve.bench.__main__ import main as bench_main

        table["cuda"].update(winners)
        bench_main((["--quantization", "mxfp8"] if args.mxfp8 else []) + ["--workloads", args.then_bench]
                   + (["--out", args.bench_out] if args.bench_out else []))


def write_tuned(path: str, fmt: str, winners: dict, record: dict) -> None:
    """Merge `winners` into the JSON file at `path` under `fmt` ("16bit" / "mxfp8"), keeping its other entries;
    `record` (bench.env.tuning_record) becomes the provenance of the shapes written."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data.setdefault(fmt, {}).update({f"{n},{k}": list(t) for (n, k), t in winners.items()})
    tuned.write(path, tuned.add_record(data, record))
    print(f"wrote {len(winners)} {fmt} entries to {path}", flush=True)


def pick(n: int, k: int, gb: float, base_name: str, base, name: str, run, tiles) -> tuple | None:
    """Time base(c) and run(c, tile) for every candidate tile, print the three fastest, and return the fastest
    tile and the times of both (us) if it beats the baseline by more than MIN_GAIN (with its output's relative
    difference to the baseline's), else None."""
    base_us = graph_us(base)
    print(f"[{n}, {k}] {base_name} {base_us:7.1f} us ({gb / base_us * 1e6:6.0f} GB/s)", flush=True)
    results = sorted((graph_us(lambda c, t=t: run(c, t)), t) for t in tiles)
    for us, t in results[:3]:
        print(f"[{n}, {k}]   {name} {t} {us:7.1f} us ({gb / us * 1e6:6.0f} GB/s)", flush=True)
    best_us, best = results[0]
    if best_us >= base_us * (1 - MIN_GAIN):
        return None
    ref = base(0).float()
    err = (run(0, best).float() - ref).abs().max().item() / ref.abs().max().item()
    print(f"[{n}, {k}]   -> {name}, {base_us / best_us:.2f}x {base_name} (rel. diff {err:.1e})", flush=True)
    return best, {"us": round(best_us, 1), f"{base_name.replace('.', '_').lower()}_us": round(base_us, 1)}


def tiles_for(n: int, block_k=BLOCK_K, stages=STAGES):
    """The candidate tiles: enough programs to stream the weight, no spilling accumulator."""
    for bn, bk, warps, stages in itertools.product(BLOCK_N, block_k, WARPS, stages):
        if bn * bk <= MAX_ACC_PER_THREAD * warps * 32 and n // bn >= 16:
            yield bn, bk, warps, stages


if __name__ == "__main__":
    main()
