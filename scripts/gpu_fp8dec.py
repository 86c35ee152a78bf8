"""Decode-sized MXFP8 linears: the tensor-core variants against the CUDA-core "gemv" variant, one run.

    OUT=/tmp/out python scripts/gpu_fp8dec.py [--preset m3-slice] [--rows 1,8,64] [--budget 200] [--write-configs]
    python scripts/gpu_fp8dec.py --cpu          # the same logic on the CPU interpreter, tiny shapes (a smoke test)

For each quantized projection of the preset (N, K at tp=1) and each row count, times the built-in table's entry
(kernels/fp8_configs.py), a few other tensor-core candidates, and "gemv" candidates (kernels/fp8_tile.py), each
checked against bf16 F.linear on the same dequantised weights (max |fp8 - bf16| <= 2e-2 x max |bf16|; a failing
or non-compiling candidate is dropped) and timed with CUDA events, L2 flushed before each run (median of 30, the
whole fp8_linear call: kernel + split-K reduction). Reports GB/s of weights read (1 + 1/32 bytes per weight)
against the measured copy ceiling. Stops starting new measurements after --budget seconds.

Writes under $OUT as it goes: fp8dec.jsonl (one line per measurement), fp8dec_tuned.json (the winners, the form
NANOSERVE_FP8_TUNED_CONFIG reads) and, with --write-configs, the winning entries patched into
nanoserve/kernels/fp8_configs.py in place and a copy of that file as $OUT/fp8_configs.py. Prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "nanoserve", "kernels", "fp8_configs.py")
RTOL = 2e-2
WEIGHT_STD = 0.02


def candidates(m: int, table_entry: tuple | None) -> list[tuple]:
    """(variant, block_m, block_n, block_k, warps, stages, split_waves) entries to time at M rows: the table's
    entry first ("old"), tensor-core ones with more K splits, then "gemv" ("new")."""
    bm = 16 if m <= 16 else 64
    old = [tuple(table_entry) + ((4,) if len(table_entry) == 6 else ())] if table_entry else []
    old += [("bcast", bm, 64, 128, 4, 4, 4), ("bcast", bm, 64, 128, 4, 4, 8), ("swap", bm, 64, 256, 4, 4, 8)]
    if m <= 16:
        old.append(("scaled", bm, 64, 256, 4, 3, 8))
    new = []
    if m <= 2:
        new += [("gemv", 1, 32, 256, 4, 1, w) for w in (4, 8, 16)]
        new += [("gemv", 1, 64, 256, 4, 1, 4), ("gemv", 1, 64, 256, 4, 1, 8), ("gemv", 1, 32, 512, 4, 1, 8),
                ("gemv", 1, 16, 256, 2, 1, 16)]
    elif m <= 16:
        new += [("gemv", 8, 16, 128, 4, 1, 8), ("gemv", 4, 32, 128, 4, 1, 8), ("gemv", 8, 16, 128, 4, 1, 16),
                ("gemv", 2, 32, 256, 4, 1, 8)]
    else:
        new += [("gemv", 8, 16, 128, 4, 1, 8)]
    return [(e, "old") for e in dict.fromkeys(old)] + [(e, "new") for e in dict.fromkeys(new)]


def gb_s(n: int, k: int, ms: float) -> float:
    return n * k * (1 + 1 / 32) / ms / 1e6


def patch_configs(text: str, shape: tuple[int, int], bucket: int, entry: tuple) -> str:
    """fp8_configs.py's text with FP8_LINEAR_TILES["cuda"][shape][bucket] set to `entry` (the line replaced, or
    added at the top of the shape's block)."""
    lines = text.splitlines(keepends=True)
    head = f"        ({shape[0]}, {shape[1]}): {{\n"
    if head not in lines:
        raise ValueError(f"fp8_configs.py has no linear block for {shape}")
    start = lines.index(head)
    line = f"            {bucket}: {entry!r},\n"
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("        }"):
            lines.insert(start + 1, line)
            break
        if re.match(rf"\s+{bucket}: \(", lines[i]):
            lines[i] = line
            break
    return "".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="m3-slice")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; no new measurement starts after it")
    ap.add_argument("--write-configs", action="store_true")
    ap.add_argument("--cpu", action="store_true", help="interpreter smoke test: tiny shapes, wall-clock timing")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out_dir = os.environ.get("OUT", "/tmp/gpu_fp8dec")
    os.makedirs(out_dir, exist_ok=True)

    from nanoserve.kernels.fp8_configs import linear_entry
    from nanoserve.kernels.fp8_linear import LinearTiles, fp8_linear
    from nanoserve.kernels.reference import dequantize_mxfp8
    from nanoserve.model.mxfp8 import quantize_mxfp8

    rows_list = [int(r) for r in args.rows.split(",")]
    table_key: dict[str, tuple[int, int]] = {}
    if args.cpu:
        dev = torch.device("cpu")
        shapes = {"small a": (96, 256), "small b": (64, 512)}
        # --write-configs patches these real table blocks with the small shapes' winners (in $OUT only)
        table_key.update({"small a": (6144, 12288), "small b": (9856, 6144)})
        dtype = torch.float32

        def timer(fn) -> float:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        ceil = {"copy_gb_s": float("nan")}
    else:
        from scripts.tune_fp8 import Timer, ceilings, model_shapes

        dev = torch.device("cuda")
        shapes, _ = model_shapes(args.preset)
        dtype = torch.bfloat16
        timer = Timer(dev, reps=30, warmup=3)
        ceil = ceilings(dev)
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "commit": os.environ.get("NANOSERVE_GIT_COMMIT", "unknown"), "preset": args.preset, "rows": rows_list,
            "ceilings": ceil}
    log = open(os.path.join(out_dir, "fp8dec.jsonl"), "w")
    log.write(json.dumps({"meta": meta}) + "\n")
    log.flush()
    print(f"[start] {meta}", flush=True)

    gen = torch.Generator(device=dev).manual_seed(0)
    results: list[dict] = []
    out_of_time = False
    for name, (n, k) in shapes.items():
        w = torch.empty(n, k, device=dev).normal_(0, WEIGHT_STD, generator=gen)
        q, s = quantize_mxfp8(w)
        wb = dequantize_mxfp8(q, s, dtype)
        del w
        for m in rows_list:
            x = torch.empty(m, k, device=dev).normal_(0, 1, generator=gen).to(dtype)
            want = F.linear(x, wb)
            ref_ms = timer(lambda: F.linear(x, wb))
            entry = linear_entry("cuda", n, k, m)
            for cand, kind in candidates(m, entry):
                if time.perf_counter() - t0 > args.budget:
                    out_of_time = True
                    break
                tiles = LinearTiles.from_entry(cand)
                rec = {"shape": name, "n": n, "k": k, "rows": m, "entry": list(cand), "kind": kind,
                       "table": list(entry) if entry else None, "bf16_ms": ref_ms}
                try:
                    got = fp8_linear(x, q, s, tiles=tiles)
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    rec["rel_err"] = err
                    if err <= RTOL:
                        rec["ms"] = timer(lambda: fp8_linear(x, q, s, tiles=tiles))
                        rec["gb_s"] = gb_s(n, k, rec["ms"])
                except Exception as e:  # noqa: BLE001 - recorded; the candidate is dropped
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                results.append(rec)
                log.write(json.dumps(rec) + "\n")
                log.flush()
            if out_of_time:
                break
        del q, s, wb
        if out_of_time:
            print(f"[budget] {args.budget:.0f} s reached: remaining candidates not timed", flush=True)
            break

    best: dict = {}
    for r in results:
        if "ms" not in r:
            continue
        for key in ((r["shape"], r["rows"], r["kind"]), (r["shape"], r["rows"], "any")):
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    tuned: dict = {"linear": {}, "meta": meta}
    for (shape, rows, kind), r in best.items():
        if kind == "any":
            tuned["linear"].setdefault(f"{r['n']},{r['k']}", {})[str(rows)] = r["entry"]
    with open(os.path.join(out_dir, "fp8dec_tuned.json"), "w") as f:
        json.dump(tuned, f, indent=1)
    if args.write_configs:
        text = open(CONFIGS).read()
        for (shape, rows, kind), r in sorted(best.items()):
            if kind == "any":
                text = patch_configs(text, table_key.get(shape, (r["n"], r["k"])), rows, tuple(r["entry"]))
        if not args.cpu:  # the smoke test leaves the repository alone
            with open(CONFIGS, "w") as f:
                f.write(text)
        with open(os.path.join(out_dir, "fp8_configs.py"), "w") as f:
            f.write(text)

    failed = [r for r in results if "ms" not in r]
    print(f"[done] {len(results)} candidates in {time.perf_counter() - t0:.0f} s, {len(failed)} dropped", flush=True)
    for r in failed[:8]:
        print("  dropped", r["shape"], r["rows"], r["entry"], r.get("rel_err"), r.get("error", ""), flush=True)
    copy = ceil["copy_gb_s"]
    lines = [f"copy ceiling {copy:.0f} GB/s; GB/s = weight bytes read (1 + 1/32 per weight) / time",
             f"{'shape':<14} {'rows':>4} {'bf16 ms':>8} {'old (table/tensor-core) best':<40} {'ms':>7} {'%copy':>5} "
             f"{'new gemv best':<34} {'ms':>7} {'%copy':>5} {'new/old':>7}"]
    for name in shapes:
        for m in rows_list:
            o, nw = best.get((name, m, "old")), best.get((name, m, "new"))
            if not (o or nw):
                continue
            ref = (o or nw)["bf16_ms"]

            def cell(r):
                if r is None:
                    return f"{'-':<40} {'':>7} {'':>5}"
                return f"{str(r['entry']):<40} {r['ms']:>7.4f} {100 * r['gb_s'] / copy:>5.0f}"
            ratio = f"{o['ms'] / nw['ms']:>6.2f}x" if o and nw else ""
            lines.append(f"{name:<14} {m:>4} {ref:>8.4f} {cell(o)} {cell(nw)} {ratio:>7}")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "fp8dec.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
