"""GPU check and benchmark of the fused MoE at m3-slice shapes (run on the H200: `python scripts/gpu_moe_bench.py`;
`--sweep` also times candidate tile configurations per token bucket and prints entries for the H200 table).

Shapes: hidden 6144, 128 routed experts of intermediate 3072, top-4, plus the shared expert (3072) as slot 128;
random bf16 weights (std 0.02, as m3-slice), uniform random routing (reference.route on random logits).

1. bf16 correctness at a few token counts: the fused kernel (fold on and off), the grouped_mm path and the bf16
   per-expert loop, each against an fp32 per-expert computation: max |diff| / max |fp32|. A CUDA-graph
   capture/replay of the fused kernel at decode sizes must reproduce the eager output exactly (this also proves
   that the launch sequence has no host synchronisation).
2. Timing at 1 ... 8192 tokens, median of triton.testing.do_bench (which flushes L2 before every call; the weights
   a call touches, >= 566 MB, exceed L2 anyway, so inputs need no rotation). Variants:
     fused+shared  fused kernel, shared expert folded in (what the model runs)
     fused         routed experts only (the same work as the baseline rows)
     fused|shared  routed fused kernel, then the shared expert as a separate torch MLP (fold_shared_expert off)
     graph         fused+shared replayed from a CUDA graph (decode sizes: launch overhead removed)
     grouped_mm    torch._grouped_mm as Hugging Face runs it: sort by expert, two grouped GEMMs, SwiGLU-OAI,
                   weight, un-sort, index_add (the Hugging Face experts path; routed only)
     loop          reference.moe_experts, one expert at a time (routed only; only up to --loop-max-tokens)
     route         the layer's torch routing (fp32 router GEMM, sigmoid, top-k, renorm), eager and as a graph
                   ("route graph"): what a fused routing kernel could save (none is used yet)
   FLOPs = 2 * 3 * H * I per (token, expert) pair computed; bytes = weights of the distinct experts touched (the
   convention of docs/benchmarks.md; activations are < 1% at these sizes). Fractions are of 772 TFLOP/s and
   4.26 TB/s.
3. --sweep: per token count, coordinate descent from the table's entry (fold on): BLOCK_M, GEMM 1 tiles, GEMM 2
   tiles, GROUP_M, BLOCK_M again (about 20 configurations), printing the best as a line for
   kernels/configs.py's MOE_TILES (scripts/tune_moe.py is the re-runnable tuner that writes them). About 30 s
   per token count: use --tokens to split long sweeps.

Prints a compact table last; writes $OUT/moe_bench.json when OUT is set. Every case catches and reports its own
exception. Needs about 16 GB of GPU memory (the expert weights are 14.6 GB).
`--dry-run` runs the whole script on the CPU under the Triton interpreter at m3-tiny widths (a smoke test).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first Triton import
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from nanoserve.kernels import moe, reference  # noqa: E402
from nanoserve.kernels.moe import GemmTiles, MoEConfig, fused_moe  # noqa: E402

ALPHA, LIMIT, SCALE = 1.702, 7.0, 2.0
"""M3's SwiGLU-OAI constants and routed_scaling_factor."""
WEIGHT_STD = 0.02
PEAK_TFLOPS = 772.0
COPY_CEILING_GBS = 4260.0
"""Measured bf16 matmul and device-copy ceilings of one H200 (docs/benchmarks.md)."""
BF16_REL_TOL = 2e-2
"""bf16 tolerance on max |kernel - fp32| / max |fp32| (activations and each expert's output are rounded)."""
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)
CHECK_TOKENS = (1, 64, 1024)
GRAPH_TOKENS = (1, 16, 64, 256)
"""Token counts timed (and checked) as CUDA-graph replays: the decode regime, where launch overhead shows."""
DRY_RUN_SHAPES = dict(hidden=128, inter=64, experts=16, top_k=4, tokens=(1, 24), check=(1, 24))

results: dict = {"device": "", "config": {}, "checks": [], "timings": [], "sweep": [], "errors": []}


def log(msg: str) -> None:
    print(msg, flush=True)


def record_error(case: str, exc: BaseException) -> None:
    msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    log(f"  ERROR {case}: {msg}")
    results["errors"].append({"case": case, "error": msg, "trace": traceback.format_exc()[-2000:]})


# -- timing ------------------------------------------------------------------------------------------------------


def bench_ms(fn, rep: int = 100) -> float:
    """Median milliseconds per call; on the CPU (dry run) a plain wall-clock median of a few calls."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn) -> float:
    """Median milliseconds per call replayed from a CUDA graph (no launch overhead)."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


# -- the problem ---------------------------------------------------------------------------------------------------


class Problem:
    """Expert weights (routed + shared as the last slot) and the activations/routings of each token count."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, device: str, seed: int):
        self.hidden, self.inter, self.experts, self.top_k, self.device = hidden, inter, experts, top_k, device
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter cannot do bf16
        gen = torch.Generator(device=device).manual_seed(seed)
        slots = experts + 1
        self.w13 = torch.empty(slots, 2 * inter, hidden, dtype=self.dtype, device=device)
        self.w2 = torch.empty(slots, hidden, inter, dtype=self.dtype, device=device)
        for e in range(slots):  # one expert at a time: no fp32 copy of 14.6 GB
            self.w13[e].normal_(0.0, WEIGHT_STD, generator=gen)
            self.w2[e].normal_(0.0, WEIGHT_STD, generator=gen)
        self.router = torch.randn(experts, hidden, device=device, generator=gen) * WEIGHT_STD  # fp32, as M3
        self.router_bias = torch.zeros(experts, device=device)
        self.gen = gen

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.inter * self.w13.element_size()

    def inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] (unit scale, like a normed hidden state) and a uniform random routing."""
        x = torch.randn(tokens, self.hidden, device=self.device, generator=self.gen).to(self.dtype)
        logits = torch.randn(tokens, self.experts, device=self.device, generator=self.gen)
        weights, ids = reference.route(logits, torch.zeros(self.experts, device=self.device), self.top_k)
        return x, weights, ids

    # the variants; all return [T, H]
    def fused(self, x, weights, ids, fold: bool, config: MoEConfig | None = None) -> torch.Tensor:
        w13, w2 = (self.w13, self.w2) if fold else (self.w13[: self.experts], self.w2[: self.experts])
        return fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE,
                         fold_shared=fold, config=config)

    def shared_mlp(self, x) -> torch.Tensor:
        gate_up = F.linear(x, self.w13[-1])
        act = reference.swiglu_oai(gate_up[:, : self.inter], gate_up[:, self.inter:], ALPHA, LIMIT).to(x.dtype)
        return F.linear(act, self.w2[-1])

    def fused_then_shared(self, x, weights, ids) -> torch.Tensor:
        return self.fused(x, weights, ids, fold=False) + self.shared_mlp(x)

    def grouped_mm(self, x, weights, ids) -> torch.Tensor:
        """The Hugging Face `grouped_mm` experts path (transformers integrations/moe.py), routed experts only."""
        tokens, top_k = ids.shape
        flat_ids = ids.reshape(-1)
        token_idx = torch.arange(tokens, device=x.device).repeat_interleave(top_k)
        perm = torch.argsort(flat_ids, stable=True)
        inv_perm = torch.argsort(perm, stable=True)
        states = x[token_idx][perm]
        counts = torch.histc(flat_ids[perm].float(), bins=self.experts, min=0, max=self.experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate_up = torch._grouped_mm(states, self.w13[: self.experts].transpose(-2, -1), offs=offsets)
        act = reference.swiglu_oai(gate_up[:, : self.inter], gate_up[:, self.inter:], ALPHA, LIMIT).to(x.dtype)
        y = torch._grouped_mm(act, self.w2[: self.experts].transpose(-2, -1), offs=offsets)
        y = (y * weights.reshape(-1)[perm, None]).to(x.dtype)[inv_perm]
        return torch.zeros_like(x).index_add_(0, token_idx, y) * SCALE

    def route(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's routing as it runs today: fp32 router GEMM + reference.route (sigmoid, top-k, renorm)."""
        return reference.route(F.linear(x.float(), self.router), self.router_bias, self.top_k)

    def loop(self, x, weights, ids) -> torch.Tensor:
        return reference.moe_experts(x, self.w13[: self.experts], self.w2[: self.experts], ids, weights, ALPHA,
                                     LIMIT) * SCALE

    def exact(self, x, weights, ids, fold: bool) -> torch.Tensor:
        """fp32 per-expert computation from the same (rounded) weights and inputs."""
        xf = x.float()
        out = torch.zeros_like(xf)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.expert_fp32(xf[token], e) * weights[token, slot, None])
        out *= SCALE
        return out + self.expert_fp32(xf, self.experts) if fold else out

    def expert_fp32(self, xf, e: int) -> torch.Tensor:
        gate_up = xf @ self.w13[e].float().T
        act = reference.swiglu_oai(gate_up[:, : self.inter], gate_up[:, self.inter:], ALPHA, LIMIT)
        return act @ self.w2[e].float().T

    # work counts
    def touched_experts(self, ids) -> int:
        return int(ids.unique().numel())

    def flops(self, tokens: int, shared: bool) -> float:
        pairs = tokens * (self.top_k + int(shared))
        return 2.0 * 3 * self.hidden * self.inter * pairs

    def bytes(self, ids, shared: bool) -> float:
        return float((self.touched_experts(ids) + int(shared)) * self.expert_bytes)


# -- 1. correctness ------------------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).abs().max() / ref.abs().max())


def run_checks(p: Problem, token_counts, graph_tokens) -> None:
    log("== correctness (bf16 vs fp32 per-expert computation; max |diff| / max |ref|) ==")
    for tokens in token_counts:
        x, weights, ids = p.inputs(tokens)
        exact_routed = p.exact(x, weights, ids, fold=False)
        exact_folded = exact_routed + p.expert_fp32(x.float(), p.experts)
        variants = {
            "fused+shared": (lambda: p.fused(x, weights, ids, fold=True), exact_folded),
            "fused": (lambda: p.fused(x, weights, ids, fold=False), exact_routed),
            "fused|shared": (lambda: p.fused_then_shared(x, weights, ids), exact_folded),
            "grouped_mm": (lambda: p.grouped_mm(x, weights, ids), exact_routed),
            "loop": (lambda: p.loop(x, weights, ids), exact_routed),
        }
        for name, (fn, ref) in variants.items():
            case = f"check {name} T={tokens}"
            try:
                out = fn()
                err = rel_err(out, ref)
                finite = bool(torch.isfinite(out).all())
                ok = finite and (err <= BF16_REL_TOL or name in ("grouped_mm", "loop"))
                results["checks"].append({"variant": name, "tokens": tokens, "rel_err": err, "finite": finite,
                                          "ok": ok})
                log(f"  {name:13s} T={tokens:5d}  rel err {err:.2e}  {'ok' if ok else 'FAIL'}")
            except Exception as e:  # noqa: BLE001 - report and continue
                record_error(case, e)
    if not torch.cuda.is_available():
        return
    for tokens in graph_tokens:
        case = f"graph capture T={tokens}"
        try:
            x, weights, ids = p.inputs(tokens)
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                p.fused(x, weights, ids, fold=True)  # warm-up (compiles) outside the capture
                with torch.cuda.graph(graph, stream=stream):
                    captured = p.fused(x, weights, ids, fold=True)
            torch.cuda.current_stream().wait_stream(stream)
            x.copy_(torch.randn_like(x))  # new inputs through the same buffers
            graph.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(captured, p.fused(x, weights, ids, fold=True)))
            results["checks"].append({"variant": "graph replay == eager", "tokens": tokens, "ok": same})
            log(f"  graph capture/replay T={tokens:5d}  {'identical to eager' if same else 'DIFFERS'}")
        except Exception as e:  # noqa: BLE001
            record_error(case, e)


# -- 2. timing -----------------------------------------------------------------------------------------------------


def run_timings(p: Problem, token_counts, loop_max_tokens: int) -> None:
    log("== timing (median ms) ==")
    for tokens in token_counts:
        x, weights, ids = p.inputs(tokens)
        variants = {
            "fused+shared": (lambda: p.fused(x, weights, ids, fold=True), True, bench_ms),
            "fused": (lambda: p.fused(x, weights, ids, fold=False), False, bench_ms),
            "fused|shared": (lambda: p.fused_then_shared(x, weights, ids), True, bench_ms),
            "grouped_mm": (lambda: p.grouped_mm(x, weights, ids), False, bench_ms),
        }
        if torch.cuda.is_available() and tokens in GRAPH_TOKENS:
            variants["graph"] = (lambda: p.fused(x, weights, ids, fold=True), True, graph_ms)
        if tokens <= loop_max_tokens:
            variants["loop"] = (lambda: p.loop(x, weights, ids), False, bench_ms)
        variants["route"] = (lambda: p.route(x), None, bench_ms)
        if torch.cuda.is_available() and tokens in GRAPH_TOKENS:
            variants["route graph"] = (lambda: p.route(x), None, graph_ms)
        for name, (fn, shared, timer) in variants.items():
            try:
                fn()  # compile / warm up outside the timing
                ms = timer(fn)
                row = {"variant": name, "tokens": tokens, "ms": ms, "tflops": None, "gbs": None}
                if shared is not None:  # an experts variant: count its FLOPs and weight bytes
                    row["tflops"] = p.flops(tokens, shared) / ms / 1e9
                    row["gbs"] = p.bytes(ids, shared) / ms / 1e6
                    row.update(frac_peak_flops=row["tflops"] / PEAK_TFLOPS,
                               frac_copy_bw=row["gbs"] / COPY_CEILING_GBS,
                               experts_touched=p.touched_experts(ids) + int(shared))
                results["timings"].append(row)
                rates = "" if shared is None else f"  {row['tflops']:7.1f} TFLOP/s  {row['gbs']:7.0f} GB/s"
                log(f"  {name:13s} T={tokens:5d}  {ms:8.3f} ms{rates}")
            except Exception as e:  # noqa: BLE001
                record_error(f"time {name} T={tokens}", e)
        if loop_max_tokens < tokens:
            log(f"  loop          T={tokens:5d}  skipped (above --loop-max-tokens {loop_max_tokens})")


# -- 3. tile sweep -------------------------------------------------------------------------------------------------

SMALL_M_TILES = [GemmTiles(16, 256, 4, 4), GemmTiles(32, 128, 4, 4), GemmTiles(32, 256, 4, 3),
                 GemmTiles(32, 256, 4, 4), GemmTiles(64, 128, 4, 3), GemmTiles(64, 128, 4, 4),
                 GemmTiles(64, 256, 4, 3), GemmTiles(128, 128, 4, 3)]
LARGE_M_TILES = [GemmTiles(64, 64, 4, 3), GemmTiles(64, 64, 4, 4), GemmTiles(128, 64, 4, 3),
                 GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 4), GemmTiles(64, 128, 4, 3),
                 GemmTiles(128, 128, 8, 3), GemmTiles(256, 64, 8, 3)]


def sweep_candidates(tokens: int) -> tuple[list[int], list[int], list[GemmTiles]]:
    """(BLOCK_M values, GROUP_M values, GEMM tiles) worth trying at this token count."""
    if tokens <= 64:
        return [16, 32], [1, 8], SMALL_M_TILES
    if tokens <= 256:
        return [16, 32, 64], [1, 8], SMALL_M_TILES
    if tokens <= 1024:
        return [32, 64, 128], [1, 8], SMALL_M_TILES[4:] + LARGE_M_TILES
    return [64, 128], [8, 16], LARGE_M_TILES


def run_sweep(p: Problem, token_counts) -> None:
    log("== tile sweep (fused+shared, median ms; coordinate descent from the table's entry: BLOCK_M, GEMM 1 "
        "tiles, GEMM 2 tiles, GROUP_M, BLOCK_M again) ==")
    best_lines = []
    for tokens in token_counts:
        x, weights, ids = p.inputs(tokens)
        start = moe.select_config(tokens, p.hidden, p.inter, p.experts, p.top_k, x.device, x.dtype)
        timed: dict[MoEConfig, float] = {}

        def measure(cfg: MoEConfig) -> float:
            if cfg not in timed:
                try:
                    p.fused(x, weights, ids, fold=True, config=cfg)
                    timed[cfg] = bench_ms(lambda: p.fused(x, weights, ids, fold=True, config=cfg), rep=30)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the candidate
                    record_error(f"sweep T={tokens} {cfg}", e)
                    timed[cfg] = float("inf")
            return timed[cfg]

        block_ms, group_ms, tiles = sweep_candidates(tokens)
        best = start
        steps = ([dict(block_m=m) for m in block_ms] + [dict(up=t) for t in tiles] + [dict(down=t) for t in tiles]
                 + [dict(group_m=g) for g in group_ms] + [dict(block_m=m) for m in block_ms])
        for change in steps:
            cand = dataclasses.replace(best, **change)
            if measure(cand) < measure(best):
                best = cand
        ms = measure(best)
        gain = measure(start) / ms if ms > 0 else float("nan")
        line = (f"{moe.token_bucket(tokens)}: ({best.block_m}, {best.group_m}, "
                f"({best.up.block_n}, {best.up.block_k}, {best.up.num_warps}, {best.up.num_stages}), "
                f"({best.down.block_n}, {best.down.block_k}, {best.down.num_warps}, {best.down.num_stages})),")
        best_lines.append(f"        {line}  # {ms:.3f} ms at {tokens} tokens")
        results["sweep"].append({"tokens": tokens, "bucket": moe.token_bucket(tokens), "best": repr(best), "ms": ms,
                                 "start": repr(start), "start_ms": measure(start), "speedup": gain,
                                 "candidates": len(timed)})
        log(f"  T={tokens:5d}: {len(timed)} configs, best {ms:.3f} ms ({gain:.2f}x the table's entry): {line}")
    if best_lines:
        log(f"  MOE_TILES['cuda'][({p.hidden}, {p.inter}, {p.experts})] entries:\n" + "\n".join(best_lines))


# -- report --------------------------------------------------------------------------------------------------------


def print_table(token_counts) -> None:
    rows = {}
    for r in results["timings"]:
        rows.setdefault(r["variant"], {})[r["tokens"]] = r
    head = f"{'variant':13s} {'metric':8s}" + "".join(f"{t:>9d}" for t in token_counts)
    lines = ["", "== MoE at m3-slice shapes: tokens ->", head, "-" * len(head)]
    for name, per_t in rows.items():
        for metric, fmt in (("ms", "{:9.3f}"), ("TFLOP/s", "{:9.1f}"), ("GB/s", "{:9.0f}")):
            key = {"ms": "ms", "TFLOP/s": "tflops", "GB/s": "gbs"}[metric]
            if all(per_t[t][key] is None for t in per_t):
                continue  # routing rows: time only
            cells = "".join(fmt.format(per_t[t][key]) if t in per_t else f"{'-':>9s}" for t in token_counts)
            lines.append(f"{name:13s} {metric:8s}{cells}")
    fused = rows.get("fused+shared", {})
    if fused:
        lines.append(f"{'fused+shared':13s} {'%peak':8s}" + "".join(
            f"{max(fused[t]['frac_peak_flops'], fused[t]['frac_copy_bw']) * 100:8.0f}%" if t in fused
            else f"{'-':>9s}" for t in token_counts) + "   (max of FLOP/s / 772T and GB/s / 4.26 TB/s)")
    fails = [c for c in results["checks"] if not c.get("ok", True)]
    lines.append(f"checks: {len(results['checks']) - len(fails)} ok, {len(fails)} failed; "
                 f"errors: {len(results['errors'])}")
    log("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=list(TOKENS),
                        help="comma-separated token counts (default %(default)s)")
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs per token count")
    parser.add_argument("--sweep-only", action="store_true", help="skip the checks and timings")
    parser.add_argument("--loop-max-tokens", type=int, default=1024,
                        help="time the per-expert reference loop only up to this many tokens")
    parser.add_argument("--inter", type=int, default=3072,
                        help="expert intermediate size on this rank (a TP shard: 1536, 768, ...)")
    parser.add_argument("--experts", type=int, default=128, help="routed experts on this rank (EP: 64, 32, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, m3-tiny widths (smoke test)")
    args = parser.parse_args()

    if args.dry_run:
        shapes, device = DRY_RUN_SHAPES, "cpu"
        token_counts, check_tokens = list(shapes["tokens"]), list(shapes["check"])
    else:
        if not torch.cuda.is_available():
            log("no GPU: run on the GPU machine, or pass --dry-run for a CPU smoke test")
            return 2
        shapes, device = dict(hidden=6144, inter=args.inter, experts=args.experts, top_k=4), "cuda"
        token_counts, check_tokens = args.tokens, [t for t in CHECK_TOKENS if t in args.tokens] or args.tokens[:1]
    results["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    results["config"] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
                         "triton": triton.__version__, "shapes": {k: shapes[k] for k in
                                                                  ("hidden", "inter", "experts", "top_k")},
                         "tokens": token_counts, "argv": sys.argv[1:]}
    log(f"device: {results['device']}; torch {torch.__version__}, triton {triton.__version__}; "
        f"hidden {shapes['hidden']}, {shapes['experts']} experts x {shapes['inter']} top-{shapes['top_k']} + shared")

    t0 = time.time()
    try:
        p = Problem(shapes["hidden"], shapes["inter"], shapes["experts"], shapes["top_k"], device, args.seed)
    except Exception as e:  # noqa: BLE001
        record_error("setup", e)
        p = None
    if p is not None:
        if not args.sweep_only:
            run_checks(p, check_tokens, [t for t in GRAPH_TOKENS if t in token_counts])
            run_timings(p, token_counts, args.loop_max_tokens)
        if args.sweep or args.sweep_only:
            run_sweep(p, token_counts)
    print_table(token_counts)
    log(f"total {time.time() - t0:.0f} s")

    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "moe_bench.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1, default=str)
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
