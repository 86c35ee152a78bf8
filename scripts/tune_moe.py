"""Offline autotuner for the fused MoE's tile table (kernels/configs.py MOE_TILES, whose "cuda" entries are the data
file nanoserve/kernels/tuned/moe.json): nothing is tuned at serve time.

    python scripts/tune_moe.py --tokens 4096,16384 [--budget 90] [--write-configs] [--out DIR]

For each token count: coordinate descent from the table's current entry (TMA descriptors on, BLOCK_M, GEMM 1 tiles,
GEMM 2 tiles, GROUP_M, BLOCK_M again, TMA flipped once more), each candidate timed as the median of
triton.testing.do_bench over the whole fused MoE (alignment + both GEMMs + reduction, the shared expert folded in,
as the model runs it) on random bf16 weights and a uniform random routing at the model's shapes (default m3-slice:
hidden 6144, 128 experts of 3072, top-4). The winner is checked against an fp32 per-expert computation before it is
accepted (a config that fails the check keeps the old entry). Candidates are limited to tiles that fit Hopper's
shared memory; one that fails to compile or launch is skipped. Bounded by --budget seconds in all, shared evenly by
the token counts still to run (one that runs out keeps its best so far). --decode-check also times the table's
entries at 1 and 16 tokens as GB/s of the expert weights they touch against the copy ceiling (what a prefill-bucket
change must not cost).

Results: `$OUT/tune_moe.json` (every candidate's time), the table entries printed last (JSON, as moe.json holds
them), and with --write-configs the shape's entries written into nanoserve/kernels/tuned/moe.json (the token buckets
are the tuned token counts merged with the existing ones) with a provenance record for them: this card's name, the
torch and Triton versions, the command line, the commit ($NANOSERVE_GIT_COMMIT, else the checkout's HEAD), the date
and each bucket's time (the buckets leave the records of earlier runs). Run it on the card the table is for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from nanoserve.bench.env import tuning_record  # noqa: E402
from nanoserve.bench.floor import H200  # noqa: E402
from nanoserve.bench.moe_problem import BF16_REL_TOL, rel_err  # noqa: E402
from nanoserve.bench.moe_problem import MoEProblem as Problem  # noqa: E402
from nanoserve.kernels import moe, tuned  # noqa: E402
from nanoserve.kernels.moe import GemmTiles, MoEConfig  # noqa: E402

PEAK_TFLOPS = H200.flops_per_s / 1e12
COPY_CEILING_GBS = H200.bytes_per_s / 1e9
"""One H200's bf16 matmul and device-copy ceilings (bench/floor.py): what the printed fractions are of."""

UP_TILES = [GemmTiles(*t) for t in [(64, 64, 4, 4), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4),
                                    (128, 64, 4, 4), (64, 128, 4, 3), (256, 64, 8, 3), (128, 32, 4, 5)]]
DOWN_TILES = [GemmTiles(*t) for t in [(128, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (256, 64, 8, 3),
                                      (128, 128, 8, 3), (64, 64, 4, 4), (256, 64, 8, 4), (128, 32, 4, 5)]]
BLOCK_M = (64, 128)
GROUP_M = (8, 16, 32)


def bench_ms(fn, rep: int = 100) -> float:
    """Median milliseconds per call (triton.testing.do_bench clears L2 before each call)."""
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def entry(cfg: MoEConfig) -> tuple:
    """The MOE_TILES tuple of a config (a 5th element "tma" when its GEMMs load through TMA descriptors)."""
    base = (cfg.block_m, cfg.group_m, dataclasses.astuple(cfg.up), dataclasses.astuple(cfg.down))
    return base + ("tma",) if cfg.tma else base


def tune(p: Problem, tokens: int, deadline: float, log=print) -> dict:
    x, weights, ids = p.inputs(tokens)
    start = moe.select_config(tokens, p.hidden, p.inter, p.experts, p.top_k, x.device, x.dtype)
    timed: dict[MoEConfig, float] = {}

    def measure(cfg: MoEConfig) -> float:
        if cfg not in timed:
            if time.perf_counter() > deadline:
                return float("inf")
            try:
                p.fused(x, weights, ids, fold=True, config=cfg)
                timed[cfg] = bench_ms(lambda: p.fused(x, weights, ids, fold=True, config=cfg), rep=40)
            except Exception as e:  # noqa: BLE001 - out of shared memory, a compile error: skip the candidate
                log(f"  T={tokens} {entry(cfg)}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
                timed[cfg] = float("inf")
        return timed[cfg]

    best = start
    steps = ([dict(tma=True)] + [dict(block_m=m) for m in BLOCK_M] + [dict(up=t) for t in UP_TILES]
             + [dict(down=t) for t in DOWN_TILES] + [dict(group_m=g) for g in GROUP_M]
             + [dict(block_m=m) for m in BLOCK_M] + ["flip tma"])
    for change in steps:
        cand = dataclasses.replace(best, tma=not best.tma) if change == "flip tma" else \
            dataclasses.replace(best, **change)
        if measure(cand) < measure(best):
            best = cand
    ok, err = True, 0.0
    if best != start:
        exact = p.exact(x, weights, ids, fold=True)
        out = p.fused(x, weights, ids, fold=True, config=best)
        err = rel_err(out, exact)
        ok = bool(torch.isfinite(out).all()) and err <= BF16_REL_TOL
        if not ok:
            log(f"  T={tokens}: best {entry(best)} FAILED the fp32 check (rel err {err:.2e}): keeping the old entry")
            best = start
    ms = measure(best)
    tflops = p.flops(tokens, True) / ms / 1e9
    other = timed.get(dataclasses.replace(best, tma=not best.tma), float("nan"))
    row = {"tokens": tokens, "bucket": tokens, "best": entry(best), "ms": ms, "tflop_s": tflops,
           "of_peak": tflops / PEAK_TFLOPS, "start": entry(start), "start_ms": measure(start),
           "best_with_tma_flipped_ms": other,
           "checked_rel_err": err, "check_ok": ok, "candidates": {repr(entry(c)): t for c, t in timed.items()}}
    log(f"  T={tokens:5d}: {len(timed)} configs, best {ms:.3f} ms = {tflops:.0f} TFLOP/s "
        f"({row['start_ms'] / ms:.2f}x the old entry {row['start_ms']:.3f} ms; TMA flipped {other:.3f} ms): "
        f"{entry(best)}")
    return row


def decode_check(p: Problem, tokens=(1, 16), log=print) -> list[dict]:
    """The table's entries at decode sizes: GB/s of the expert weights touched (routed + shared) vs the copy
    ceiling."""
    rows = []
    for t in tokens:
        x, weights, ids = p.inputs(t)
        ms = bench_ms(lambda: p.fused(x, weights, ids, fold=True), rep=100)
        gbs = p.bytes(ids, True) / ms / 1e6
        rows.append({"tokens": t, "ms": ms, "gb_s": gbs, "of_copy_ceiling": gbs / COPY_CEILING_GBS})
        log(f"  decode T={t}: {ms:.3f} ms, {gbs:.0f} GB/s = {gbs / COPY_CEILING_GBS:.0%} of {COPY_CEILING_GBS:.0f}")
    return rows


def table_entries(rows: list[dict]) -> dict[str, list]:
    """bucket -> its entry as tuned/moe.json holds it (tuples as lists)."""
    return {str(r["bucket"]): [list(v) if isinstance(v, tuple) else v for v in r["best"]] for r in rows}


def bucket_times(rows: list[dict]) -> dict[str, dict]:
    """bucket -> the times the provenance record keeps: the entry's, the same tiles with TMA flipped, the old
    entry's."""
    def num(v: float, digits: int = 3) -> float | None:  # never timed (the deadline) or failed: none
        return round(v, digits) if math.isfinite(v) else None

    return {str(r["bucket"]): {"ms": num(r["ms"]), "tflop_s": num(r["tflop_s"], 0),
                               "tma_flipped_ms": num(r["best_with_tma_flipped_ms"]), "old_ms": num(r["start_ms"])}
            for r in rows}


def write_configs(shape: tuple[int, int, int], rows: list[dict], record: dict, path=None) -> None:
    """Write the tuned buckets of `shape` into tuned/moe.json (or `path`): tuned buckets replaced or added, the
    others kept, in bucket order; `record` (bench.env.tuning_record) becomes their provenance."""
    path = path or tuned.path("moe")
    with open(path) as f:
        data = json.load(f)
    key = ",".join(str(v) for v in shape)
    buckets = {**data.setdefault("moe", {}).get(key, {}), **table_entries(rows)}
    data["moe"][key] = {b: buckets[b] for b in sorted(buckets, key=int)}
    tuned.write(path, tuned.add_record(data, record))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--budget", type=float, default=120.0, help="seconds for the whole sweep")
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--write-configs", action="store_true",
                    help="write the entries into nanoserve/kernels/tuned/moe.json")
    ap.add_argument("--decode-check", action="store_true", help="also time the table at 1 and 16 tokens (GB/s)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    p = Problem(args.hidden, args.inter, args.experts, args.top_k, "cuda", seed=0)
    end = time.perf_counter() + args.budget
    rows = []
    for i, t in enumerate(tokens):
        rows.append(tune(p, t, time.perf_counter() + (end - time.perf_counter()) / (len(tokens) - i)))
    decode = decode_check(p) if args.decode_check else []
    shape = (args.hidden, args.inter, args.experts)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_moe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": shape, "rows": rows, "decode": decode}, f,
                      indent=1)
    key = ",".join(str(v) for v in shape)
    if args.write_configs:
        record = tuning_record({"moe": {key: [r["bucket"] for r in rows]}},
                               times={"moe": {key: bucket_times(rows)}},
                               problem=f"top-{args.top_k}, the shared expert folded in, uniform random routing")
        write_configs(shape, rows, record)
    print(f"tuned/moe.json entries of {key} ({torch.cuda.get_device_name()}):")
    for bucket, e in table_entries(rows).items():
        print(f'   "{bucket}": {json.dumps(e)}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
