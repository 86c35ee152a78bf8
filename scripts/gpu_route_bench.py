"""Time M3's decode routing on the GPU: the torch routing + moe_align (switch fused_routing off) against the
one-launch kernel of kernels/moe_route.py, at several warp counts, for 1-12 tokens.

Each variant is captured 50 times in one CUDA graph (as a decode step runs it) and the graph replayed; the table
gives microseconds per call (median of 20 replays). Shapes: M3's 128 experts, top-4, the shared expert folded
(129 slots), BLOCK_M 16.

    python scripts/gpu_route_bench.py [--tokens 1,4,12] [--warps 1,2,4,8]
"""

from __future__ import annotations

import argparse

import torch

from nanoserve.bench import micro
from nanoserve.kernels import moe_route, reference
from nanoserve.kernels.moe_align import moe_align

EXPERTS, TOP_K, SLOTS, BLOCK_M, CALLS, REPLAYS = 128, 4, 129, 16, 50, 20


def graph_us(fn) -> float:
    return micro.graph_us(lambda i: fn(), calls=CALLS, replays=REPLAYS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,4,12")
    ap.add_argument("--warps", default="1,2,4,8")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bias = torch.randn(EXPERTS, device="cuda", generator=gen) * 0.1
    print(f"{'tokens':>6}  {'variant':<28} {'us/call':>8}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen)

        def torch_route():
            return reference.route(logits, bias, TOP_K)

        def torch_route_align():
            _, ids = reference.route(logits, bias, TOP_K)
            return moe_align(ids, SLOTS, BLOCK_M, fold_shared=True)

        ids = torch_route()[1]
        rows = [("torch route", torch_route), ("moe_align", lambda: moe_align(ids, SLOTS, BLOCK_M, fold_shared=True)),
                ("torch route + moe_align (off)", torch_route_align)]
        for name, fn in rows:
            print(f"{tokens:>6}  {name:<28} {graph_us(fn):8.2f}", flush=True)
        for warps in (int(w) for w in args.warps.split(",")):
            us = graph_us(lambda: moe_route.route_and_align(logits, bias, TOP_K, SLOTS, BLOCK_M, fold_shared=True,
                                                            num_warps=warps))
            print(f"{tokens:>6}  {f'route_and_align, {warps} warps':<28} {us:8.2f}", flush=True)


if __name__ == "__main__":
    main()
