"""Long-context prefill on one GPU in one device call: kernels old vs new, choose, W4 end to end, profile.

    OUT=/tmp/out BUDGET=240 python scripts/gpu_prefill.py

"Old" kernels are the ones in OLD_KERNELS (a directory holding an earlier checkout's kernels/attention.py and
kernels/msa.py, default ../nanoserve/kernels: the checkout this one was copied beside), loaded as separate modules;
a missing directory skips the old columns. In order, each part guarded (an error is recorded and the next part
runs) and skipped when the time budget (BUDGET seconds) cannot hold it; results go to $OUT/gpu_prefill.json after
every part.

1. Kernel micro-timings, one chunk of 8192 queries at the end of a 131,072- and a 32,768-token context: dense
   causal attention (old kernel; new kernel with and without TMA tiles), block-sparse attention (old per-token
   kernel; the by-block kernel at several tile sizes) with random and slowly drifting index queries, and the MSA
   selection. Each: one untimed call (compile), the median of 3 event-timed calls. The fastest new tiles are
   checked in bf16 against kernels/reference.py (256 queries at 32,768 tokens) and applied in this process.
2. m3-slice (bf16 random weights): the W4-128k prefill wall time at 8192 / 16384 / 32768 tokens per step with the
   previous kernel choice (msa_sparse_by_block off, no TMA) and the new one, with the peak device memory of each;
   the prefill profile at the best; W4 at 32k and 128k (TTFT, TPOT) at the engine's default chunk and at the best.

Prints a short table last.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("PYTHONUNBUFFERED", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import gpu_attention_bench as AB  # noqa: E402
from nanoserve.bench import workloads as W  # noqa: E402
from nanoserve.bench.prefill_profile import prefill_steps, profile_prefill  # noqa: E402
from nanoserve.bench.session import BenchSession, SessionConfig  # noqa: E402
from nanoserve.kernels import configs, reference  # noqa: E402
from nanoserve.kernels.attention import paged_attention  # noqa: E402
from nanoserve.kernels.msa import msa_select, sparse_attention  # noqa: E402

BUDGET = float(os.environ.get("BUDGET", "240"))
OUT = os.environ.get("OUT", "prefill-out")
OLD_KERNELS = os.environ.get("OLD_KERNELS", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                          "nanoserve", "kernels"))
T0 = time.perf_counter()
CTX, CHUNK = 131072, 8192
CHUNKS = (8192, 16384, 32768)
Tl = configs.Tiles
DENSE = [Tl(128, 128, 8, 3), Tl(128, 128, 8, 3, True), Tl(128, 64, 8, 3, True), Tl(128, 128, 8, 2, True)]
BY_BLOCK = [Tl(8, 64, 8, 3), Tl(8, 128, 8, 3), Tl(4, 64, 4, 3), Tl(16, 64, 8, 3)]
COMBINE = [Tl(4, 0, 4, 1), Tl(8, 0, 8, 1), Tl(2, 0, 4, 1)]
SWEEP = os.environ.get("SWEEP", "0") == "1"
OLD_CHUNK = os.environ.get("OLD_CHUNK", "1") == "1"
"""OLD_CHUNK=0 skips the W4-128k prefill with the earlier kernels at 8192 tokens per step."""
MICRO_32K = os.environ.get("MICRO_32K", "1") == "1"
"""SWEEP=1: time every DENSE and BY_BLOCK candidate at 128k and apply the fastest (checked) in this process;
otherwise only the merge of the by-block partial results (COMBINE) is swept."""
R: dict = {"meta": {}, "micro": [], "profiles": [], "sweeps": {}, "chosen": {}, "checks": [], "chunks": [],
           "runs": [], "errors": [], "skipped": []}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def left() -> float:
    return BUDGET - (time.perf_counter() - T0)


def flush() -> None:
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_prefill.json"), "w") as f:
        json.dump(R, f, indent=1, default=str)


def part(name: str, need_s: float, fn):
    if left() < need_s:
        log(f"SKIP {name}: {left():.0f} s left, needs ~{need_s:.0f} s")
        R["skipped"].append(name)
        return None
    log(f"== {name}")
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one broken part must not lose the others
        log(f"ERROR {name}: {type(e).__name__}: {e}")
        R["errors"].append({"part": name, "error": repr(e), "trace": traceback.format_exc()[-3000:]})
        torch.cuda.synchronize()
        return None
    finally:
        flush()


def time_ms(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


# -- 1. model and profiles ---------------------------------------------------------------------------------------

state: dict = {}


def build_model() -> None:
    session = BenchSession(SessionConfig(model="m3-slice"))
    vocab = session.model_cfg.vocab_size
    w4 = W.build(["W4"], vocab, "full", w4_lens=[CTX], output_len=16)[0]
    w2 = W.build(["W2"], vocab, "full")[0]
    t0 = time.perf_counter()
    session.build_nano([w4, w2], max_num_seqs=64)
    R["meta"].update(session.meta, build_s=time.perf_counter() - t0)
    state.update(session=session, nano=session.nano, w4=w4, w2=w2)
    log(f"built in {time.perf_counter() - t0:.1f} s; {session.meta.get('device')} commit {session.meta.get('commit')}")


def profile(tag: str, wl_key: str, chunk: int) -> None:
    prof = profile_prefill(state["nano"], state[wl_key], chunk)
    prof["tag"] = tag
    R["profiles"].append(prof)
    log(f"{tag} {wl_key} chunk {chunk}: wall {prof['wall_ms']:.1f} ms, kernels {prof['kernel_ms']:.1f} ms, "
        f"host gaps {prof['host_gap_ms']:.1f} ms\n{prof['table']}")


# -- 2. attention sweeps -----------------------------------------------------------------------------------------


def sweep(kernel: str, candidates: list, runs: dict, flops: float, share_s: float) -> dict:
    """Time every candidate for each data kind in `runs`; returns {repr(cfg): {kind: ms}}."""
    default = configs.TABLES[kernel]["cuda"]
    out: dict = {}
    deadline = time.perf_counter() + share_s
    try:
        for cfg in candidates:
            if time.perf_counter() > deadline:
                log(f"  {kernel}: sweep time used up, {cfg} and later not timed")
                break
            configs.TABLES[kernel]["cuda"] = cfg
            row = {}
            for kind, fn in runs.items():
                try:
                    row[kind] = time_ms(fn)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    row[kind] = float("inf")
                    log(f"  {kernel} {cfg} {kind}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            out[repr(cfg)] = row
            rates = ", ".join(f"{k} {v:.3f} ms ({flops / v / 1e9:.0f} TFLOP/s)" for k, v in row.items())
            log(f"  {kernel} {cfg}: {rates}")
    finally:
        configs.TABLES[kernel]["cuda"] = default
    R["sweeps"][kernel] = out
    return out


def choose(kernel: str, candidates: list, timed: dict) -> configs.Tiles:
    """Minimise the worse slowdown over the data kinds against each kind's best (one kind: the fastest)."""
    rows = {c: timed[repr(c)] for c in candidates if repr(c) in timed}
    kinds = {k for r in rows.values() for k in r}
    best = {k: min(r[k] for r in rows.values()) for k in kinds}
    pick = min(rows, key=lambda c: max(rows[c][k] / best[k] for k in kinds))
    R["chosen"][kernel] = {"tiles": repr(pick), "was": repr(configs.TABLES[kernel]["cuda"]), "ms": rows[pick],
                           "was_ms": rows.get(configs.TABLES[kernel]["cuda"])}
    return pick


def load_old():
    """The earlier checkout's attention and MSA kernels as modules of their own (None where absent)."""
    import importlib.util

    mods = {}
    for name in ("attention", "msa"):
        path = os.path.join(OLD_KERNELS, name + ".py")
        if not os.path.exists(path):
            return None
        spec = importlib.util.spec_from_file_location(f"old_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods


def micro(ctx: int, full: bool) -> None:
    """Old vs new kernels at one chunk of CHUNK queries ending at ctx; full: every candidate tile, then choose."""
    meta, kv, q, icache, iq = AB.build([CHUNK], [ctx])
    smooth = AB.smooth_index_queries(CHUNK)
    scale = AB.D ** -0.5
    start = ctx - CHUNK
    keys = (ctx * (ctx + 1) - start * (start + 1)) / 2
    dense_flops = 4 * AB.HQ * AB.D * keys
    sparse_flops = 4 * AB.HQ * AB.D * CHUNK * AB.TOPK * AB.BLOCK
    old = state.get("old")
    row: dict = {"ctx": ctx}
    sel_r = msa_select(iq, icache, meta, AB.TOPK, AB.LOCAL)
    sel_s = msa_select(smooth, icache, meta, AB.TOPK, AB.LOCAL)
    row["select_ms"] = time_ms(lambda: msa_select(iq, icache, meta, AB.TOPK, AB.LOCAL))
    if old:
        row["dense_old_ms"] = time_ms(lambda: old["attention"].paged_attention(q, kv, meta, scale))
        row["sparse_old_random_ms"] = time_ms(lambda: old["msa"].sparse_attention(q, kv, meta, sel_r, scale))
        row["sparse_old_smooth_ms"] = time_ms(lambda: old["msa"].sparse_attention(q, kv, meta, sel_s, scale))
    dense_name, bb_name = configs.prefill_kernel("paged_prefill", ctx), configs.prefill_kernel("sparse_by_block", ctx)
    if full:
        runs = {"random": lambda: sparse_attention(q, kv, meta, sel_r, scale, by_block=True),
                "smooth": lambda: sparse_attention(q, kv, meta, sel_s, scale, by_block=True)}
        if SWEEP:
            t = sweep(dense_name, DENSE, {"dense": lambda: paged_attention(q, kv, meta, scale)}, dense_flops, 60)
            state["jobs"].append((dense_name, DENSE, t))
            t = sweep(bb_name, BY_BLOCK, runs, sparse_flops, 50)
            state["jobs"].append((bb_name, BY_BLOCK, t))
        t = sweep("slot_combine", COMBINE, runs, sparse_flops, 20)
        state["jobs"].append(("slot_combine", COMBINE, t))
        for kernel, cands, timed in state["jobs"]:
            if not timed:
                continue
            pick = choose(kernel, cands, timed)
            if check_long(kernel, pick):
                configs.TABLES[kernel]["cuda"] = pick
                log(f"  chose {kernel}: {pick}")
            else:
                R["chosen"][kernel]["applied"] = False
                log(f"  {kernel}: keeping {configs.TABLES[kernel]['cuda']}")
    row["dense_new_ms"] = time_ms(lambda: paged_attention(q, kv, meta, scale))
    row["sparse_new_random_ms"] = time_ms(lambda: sparse_attention(q, kv, meta, sel_r, scale, by_block=True))
    row["sparse_new_smooth_ms"] = time_ms(lambda: sparse_attention(q, kv, meta, sel_s, scale, by_block=True))
    row["dense_tflops_new"] = dense_flops / row["dense_new_ms"] / 1e9
    row["dense_tiles"] = repr(configs.TABLES[dense_name]["cuda"])
    row["by_block_tiles"] = repr(configs.TABLES[bb_name]["cuda"])
    R["micro"].append(row)
    log(f"  micro ctx {ctx}: {row}")
    torch.cuda.empty_cache()


def check_long(kernel: str, pick: configs.Tiles) -> bool:
    """bf16 check of chosen tiles against the reference (256 queries at 32,768 tokens, the _long entries)."""
    was = configs.TABLES[kernel]["cuda"]
    configs.TABLES[kernel]["cuda"] = pick
    try:
        meta, kv, q, icache, iq = AB.build([256], [32768], seed=5)
        scale = AB.D ** -0.5
        if kernel.startswith("paged_prefill"):  # else the by-block sparse kernel or its merge
            with AB.Poisoned():
                out = paged_attention(q, kv, meta, scale)
            ref = reference.paged_attention(q, kv, meta, scale)
        else:
            sel = reference.msa_select(iq, icache, meta, AB.TOPK, AB.LOCAL)
            with AB.Poisoned():
                out = sparse_attention(q, kv, meta, sel, scale, by_block=True)
            ref = reference.sparse_attention(q, kv, meta, sel, scale)
        err = AB.rel_err(out, ref)
        ok = err < AB.BF16_REL_TOL and not out.isnan().any()
    finally:
        configs.TABLES[kernel]["cuda"] = was
    R["checks"].append({"kernel": kernel, "tiles": repr(pick), "ok": bool(ok), "rel_err": err})
    log(f"  check {kernel} {pick}: {'ok' if ok else 'FAILED'} rel_err {err:.2e}")
    return bool(ok)


# -- 4. chunk sizes and the end-to-end numbers ----------------------------------------------------------------


def prefill_wall(chunk: int, tag: str) -> float:
    nano, wl = state["nano"], state["w4"]
    steps = len(prefill_steps([CTX], chunk))
    walls = []
    torch.cuda.reset_peak_memory_stats()
    for rep in range(2):  # the first compiles what this chunk size needs
        e = nano.engine_for(wl, max_num_batched_tokens=chunk)
        from nanoserve.sampling import SamplingParams

        e.add_request(f"chunk-{tag}-{chunk}-{rep}", {"prompt_token_ids": wl.requests[0].prompt_ids},
                      SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        nano.sync()
        t0 = time.perf_counter()
        while e.has_unfinished_requests():
            e.step()
        nano.sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30
    R["chunks"].append({"tag": tag, "chunk": chunk, "steps": steps, "wall_ms": walls[-1], "first_ms": walls[0],
                        "peak_gib": peak, "kv_blocks": nano.num_blocks})
    log(f"  [{tag}] W4-128k prefill at {chunk} tokens/step ({steps} steps): {walls[-1]:.1f} ms (first "
        f"{walls[0]:.1f}), peak allocated {peak:.1f} GiB, KV pool {nano.num_blocks} blocks")
    return walls[-1]


def set_kernels(new: bool) -> None:
    """new: by-block sparse prefill + the chosen dense tiles; old: the per-token sparse kernel, no TMA."""
    nano = state["nano"]
    nano.opts.msa_sparse_by_block = new
    for name in ("paged_prefill", "paged_prefill_long"):
        cur = configs.TABLES[name]["cuda"]
        if new:
            configs.TABLES[name]["cuda"] = state["dense_pick"].get(name, cur)
        else:
            state["dense_pick"].setdefault(name, cur)
            configs.TABLES[name]["cuda"] = Tl(cur.block_m, cur.block_n, cur.num_warps, cur.num_stages)


def chunk_sweep() -> None:
    """W4-128k prefill: the earlier kernel choice at the earlier default chunk (8192), then at 16384 the new dense
    tiles without and with the by-block sparse kernel (SWEEP=1: the new kernels at every chunk size of CHUNKS)."""
    state["dense_pick"] = {}
    set_kernels(False)
    if OLD_CHUNK:
        prefill_wall(CHUNK, "old")
    set_kernels(True)
    nano = state["nano"]
    nano.opts.msa_sparse_by_block = False
    off = prefill_wall(16384, "dense TMA only") if left() > 20 else float("inf")
    nano.opts.msa_sparse_by_block = True
    best, best_ms = 16384, float("inf")
    for c in CHUNKS if SWEEP else (16384,):
        if left() > 20:
            ms = prefill_wall(c, "new")
            if ms < best_ms:
                best, best_ms = c, ms
    # what the W4 runs and the profile use: the by-block kernel only where it won
    nano.opts.msa_sparse_by_block = best_ms <= off
    R["chosen"]["msa_sparse_by_block"] = nano.opts.msa_sparse_by_block
    state["best_chunk"] = best
    R["chosen"]["max_num_batched_tokens (long prompts)"] = best


def w4_runs() -> None:
    nano = state["nano"]
    vocab = state["session"].model_cfg.vocab_size
    wls = W.build(["W4"], vocab, "full", w4_lens=[32768, CTX])
    chunks = [None]  # the engine's default
    for wl in wls:
        nano.capture_graphs(wl)  # outside the timed run
        for chunk in chunks:
            if left() < 12:
                R["skipped"].append(f"{wl.name} chunk {chunk}")
                continue
            res = nano.run(wl, max_num_batched_tokens=chunk, keep_tokens=False)
            d = res.as_dict()
            d["chunk"] = chunk or "default"
            d["workload"] = wl.name
            R["runs"].append(d)
            log(f"  {wl.name} at chunk {d['chunk']}: TTFT {d['ttft_ms']['mean']:.1f} ms, "
                f"TPOT {d['tpot_ms']['mean']:.3f} ms")


def summary() -> None:
    lines = ["", "=== gpu_prefill summary ===", f"device {R['meta'].get('device')} commit {R['meta'].get('commit')} "
             f"total {time.perf_counter() - T0:.0f} s"]
    for p in R["profiles"]:
        lines.append(f"profile {p['tag']:6s} {p['workload']:8s} chunk {p['chunk']:6d}: wall {p['wall_ms']:8.1f} ms  "
                     f"kernels {p['kernel_ms']:8.1f} ms  host {p['host_gap_ms']:7.1f} ms  roof {p['roof_ms']:7.1f} ms")
        for g, v in list(p["groups"].items())[:6]:
            tf = v.get("tflop_s")
            lines.append(f"    {g:14s} {v['us'] / 1e3:8.1f} ms  {tf or 0:6.0f} TFLOP/s  {v.get('gb_s') or 0:6.0f} GB/s")
    for k, v in R["chosen"].items():
        lines.append(f"chosen {k}: {v}")
    for m in R["micro"]:
        lines.append(f"micro ctx {m['ctx']}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in m.items() if k != "ctx"))
    for c in R["chunks"]:
        lines.append(f"chunk [{c['tag']}] {c['chunk']}: W4-128k prefill {c['wall_ms']:.1f} ms "
                     f"peak {c['peak_gib']:.1f} GiB")
    for r in R["runs"]:
        lines.append(f"run {r['workload']} chunk {r['chunk']}: TTFT {r['ttft_ms']['mean']:.1f} ms "
                     f"TPOT {r['tpot_ms']['mean']:.3f}")
    for c in R["checks"]:
        lines.append(f"check {c}")
    for e in R["errors"]:
        lines.append(f"ERROR {e['part']}: {e['error'][:200]}")
    if R["skipped"]:
        lines.append(f"skipped: {R['skipped']}")
    text = "\n".join(lines)
    with open(os.path.join(OUT, "summary.txt"), "w") as f:
        f.write(text)
    print(text, flush=True)


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, budget {BUDGET:.0f} s")
    state["old"] = part("load old kernels", 1, load_old)
    state["jobs"] = []
    part("micro 128k", 60, lambda: micro(CTX, True))
    if MICRO_32K:
        part("micro 32k", 15, lambda: micro(32768, False))
    part("micro 16k", 45, lambda: micro(16384, False))
    part("build m3-slice", 40, build_model)
    if "nano" in state:
        part("chunk sweep", 30, chunk_sweep)
        part("W4 runs", 12, w4_runs)
        part("profile W4-128k new", 10, lambda: profile("new", "w4", state.get("best_chunk", CHUNK)))
    summary()
    flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
