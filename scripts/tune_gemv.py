"""Tune the one-row GEMV (kernels/gemv.py) against F.linear on this card, for the 16-bit projections of a decode
step, and print the GEMV_TILES entries (kernels/configs.py) for the shapes where the GEMV wins.

Shapes: M3's projections at tensor parallel size 1 (m3-slice): the dense layer's QKV [9216, 6144], an MSA layer's
QKV + index projections [9856, 6144], o_proj [6144, 8192], the dense MLP's gate/up [24576, 6144] and down
[6144, 12288], and the MoE router [128, 6144] (fp32 weight, fp32 output). Each candidate is timed as a CUDA graph of CALLS calls (as a decode step runs it), rotating over
three copies of the weight so that no call finds its weight in L2; the time is the median of REPLAYS replays.
A shape joins the table when its best tile beats F.linear by more than MIN_GAIN.

    python scripts/tune_gemv.py [--dtype bfloat16] [--shapes 6144x8192,...]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from nanoserve.bench import micro
from nanoserve.kernels.gemv import gemv

SHAPES = [(9216, 6144), (9856, 6144), (6144, 8192), (24576, 6144), (6144, 12288), (128, 6144)]
ROUTER = (128, 6144)
"""The MoE router: an fp32 weight times the 16-bit row, into fp32 (against F.linear(x.float(), W))."""
BLOCK_N, BLOCK_K, WARPS, STAGES = (1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8), (1, 2)
MAX_ACC_PER_THREAD = 128
"""fp32 accumulator elements per thread past which a tile would spill: skipped."""
CALLS, REPLAYS, COPIES, MIN_GAIN = 12, 15, 3, 0.03


def graph_us(fn_for_copy) -> float:
    """fn_for_copy(c) multiplies by weight copy c; the graph's calls rotate over the copies."""
    return micro.graph_us(lambda i: fn_for_copy(i % COPIES), calls=CALLS, replays=REPLAYS, warm=COPIES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"{torch.cuda.get_device_name()}, {dtype}; us per call (GB/s)")
    winners = {}
    for n, k in shapes:
        router = (n, k) == ROUTER
        w_dtype, out_dtype = (torch.float32, torch.float32) if router else (dtype, dtype)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        ws = [torch.randn(n, k, device="cuda", dtype=w_dtype) / k**0.5 for _ in range(COPIES)]
        gb = n * k * w_dtype.itemsize / 1e9
        base = graph_us((lambda c: F.linear(x.float(), ws[c])) if router else (lambda c: F.linear(x, ws[c])))
        print(f"[{n}, {k}] F.linear {base:7.1f} us ({gb / base * 1e6:6.0f} GB/s)", flush=True)
        results = []
        for bn, bk, warps, stages in itertools.product(BLOCK_N, BLOCK_K, WARPS, STAGES):
            if bn * bk > MAX_ACC_PER_THREAD * warps * 32:
                continue
            if n // bn < 16:  # too few programs to stream the weight
                continue
            us = graph_us(lambda c, t=(bn, bk, warps, stages): gemv(x, ws[c], t, out_dtype))
            results.append((us, (bn, bk, warps, stages)))
        results.sort()
        for us, t in results[:3]:
            print(f"[{n}, {k}]   gemv {t} {us:7.1f} us ({gb / us * 1e6:6.0f} GB/s)", flush=True)
        best_us, best = results[0]
        if best_us < base * (1 - MIN_GAIN):
            winners[(n, k)] = best
            ref = F.linear(x.float(), ws[0].float())
            err = (gemv(x, ws[0], best, out_dtype).float() - ref).abs().max().item() / ref.abs().max().item()
            print(f"[{n}, {k}]   -> gemv, {base / best_us:.2f}x F.linear (rel. error {err:.1e})", flush=True)
    print("GEMV_TILES entries:")
    for (n, k), t in winners.items():
        print(f"        ({n}, {k}): {t},")


if __name__ == "__main__":
    main()
