"""Everything the benchmark protocol asks for, in one process, on one GPU, under a time budget.

    OUT=/tmp/out python scripts/gpu_bench_all.py                  # ~9 minutes on an H200; results in $OUT
    python scripts/gpu_bench_all.py --parts ablation-W2,hf-static  # a second call for what the budget skipped
    python scripts/gpu_bench_all.py --model m3-tiny --scale small --budget 300   # a dry run on the CPU

Parts, in priority order (the model is built once; each part is guarded, timed and flushed to
$OUT/results.json when it ends; a part starts only if its estimated time fits in what is left of the budget,
keeping a reserve for the Hugging Face phase, which runs last because the two models do not share memory):

    graph-check   decode-graph replay vs eager logits on the real model (batch 1, 3, 64)
    W1 W2         nanoserve decode latency and throughput
    profile       per-kernel profile of a W1 and a W2 decode step
    ablation-W1   every switch off alone on W1
    W4-32k W6 W5  long context, shared prefix, the nano-vllm workload
    W4-128k       the 128k-token prompt
    ablation-W2   every switch off alone on W2 (64 output tokens)
    hf-eager      transformers generate(), dynamic cache, W1 and W2 shapes (32 output tokens)
    hf-static     transformers generate(cache_implementation="static"), compiled, W1 and W2 shapes
    W3            only with --with-w3: server + closed-loop sweep (the server's packages - fastapi, uvicorn,
                  prometheus_client - must import, or be installable from --wheels DIR without the network)
    gpu-tests     only when listed in --parts: pytest tests/test_cuda_graphs.py (real capture on m3-tiny)

Then it prints a compact summary last: runs, nanoserve vs HF, the targets, errors.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanoserve.bench import report  # noqa: E402
from nanoserve.bench import workloads as W  # noqa: E402
from nanoserve.bench.session import BenchSession, SessionConfig, parse_switch_changes  # noqa: E402

# Estimated seconds per part on an H200 with m3-slice (a part starts only if this much budget is left).
ESTIMATES = {"build": 90, "graph-check": 25, "W1": 20, "W2": 45, "profile": 40, "ablation-W1": 90, "W4-32k": 25,
             "W6": 25, "W5": 95, "W4-128k": 45, "ablation-W2": 210, "hf-build": 40, "hf-eager": 60,
             "hf-static": 200, "W3": 240}
HF_RESERVE = ESTIMATES["hf-build"] + ESTIMATES["hf-eager"]
ORDER = ["graph-check", "W1", "W2", "profile", "ablation-W1", "W4-32k", "W6", "W5", "W4-128k", "ablation-W2",
         "hf-eager", "hf-static", "W3"]
OPTIONAL = ["gpu-tests"]
SERVER_PACKAGES = ("fastapi", "uvicorn", "prometheus_client")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--model", default="m3-slice")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--scale", default="full", choices=["full", "small"])
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; no part starts that would not fit")
    ap.add_argument("--parts", default=",".join(ORDER), help=f"comma-separated subset of: {', '.join(ORDER)}")
    ap.add_argument("--hf-max-tokens", type=int, default=32, help="HF output tokens (TPOT is per token)")
    ap.add_argument("--ablation-w2-output-len", type=int, default=64)
    ap.add_argument("--with-w3", action="store_true", help="also start a server and run the W3 sweep")
    ap.add_argument("--wheels", default=None, help="directory of wheels for the server's packages (W3), installed "
                    "with pip --no-index if they do not import")
    ap.add_argument("--w3-requests-per-concurrency", type=int, default=10)
    ap.add_argument("--switch", action="append", default=[], metavar="NAME=on|off")
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(ORDER) - set(OPTIONAL))
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {ORDER + OPTIONAL}")
    if "W3" in parts and not args.with_w3:
        parts.remove("W3")
    small = args.scale == "small"
    s = BenchSession(SessionConfig(model=args.model, device=args.device, out_dir=args.out, time_budget_s=args.budget,
                                   switch_changes=parse_switch_changes(args.switch, {})))
    slow = any(v.startswith("kernel unavailable") for v in s.switch_notes.values())
    if slow:  # reference paths on the GPU: every part takes longer
        print(f"[bench] WARNING: kernel switches forced off: {s.switch_notes}", flush=True)
    estimates = {k: v * (0.1 if small else 1.0) * (4.0 if slow else 1.0) for k, v in ESTIMATES.items()}
    vocab = s.model_cfg.vocab_size
    wl = {w.name: w for w in W.build(list(W.OFFLINE), vocab, args.scale)}
    w4 = [n for n in wl if n.startswith("W4")]
    w4_short, w4_long = (w4[0], w4[-1]) if w4 else (None, None)
    abl_w2 = W.build(["W2"], vocab, args.scale, output_len=args.ablation_w2_output_len if not small else None)[0]
    hf_wls = [wl["W1"], wl["W2"]]
    nano_parts = [p for p in parts if not p.startswith("hf-") and p not in ("W3", "gpu-tests")]
    reserve = HF_RESERVE / (10 if small else 1) if any(p.startswith("hf-") for p in parts) else 0.0

    def nano_part(name: str, fn) -> None:
        est = estimates.get(name, estimates.get(name.split("-")[0], 30))
        s.part(name, fn, min_time_s=est + reserve, reserve_s=reserve)

    if nano_parts:
        planned = list(wl.values())
        built = s.part("build nanoserve", lambda: s.build_nano(planned), min_time_s=estimates["build"] + reserve,
                       reserve_s=reserve)
        if built is not None:
            for p in nano_parts:
                if p == "graph-check":
                    nano_part(p, lambda: graph_check(s, [1, 3] if small else [1, 3, 64], 24 if small else 200))
                elif p in ("W1", "W2", "W5", "W6"):
                    nano_part(p, lambda p=p: s.run_nano(wl[p]))
                elif p == "W4-32k" and w4_short:
                    nano_part(p, lambda: s.run_nano(wl[w4_short]))
                elif p == "W4-128k" and w4_long:
                    nano_part(p, lambda: s.run_nano(wl[w4_long]))
                elif p == "profile":
                    nano_part(p, lambda: (s.profile(wl["W1"]), s.profile(wl["W2"])))
                elif p == "ablation-W1":
                    nano_part(p, lambda: s.ablate(wl["W1"]))
                elif p == "ablation-W2":
                    nano_part(p, lambda: s.ablate(abl_w2))
        s.close_nano()
    if "hf-eager" in parts or "hf-static" in parts:
        if s.part("build HF", s.build_hf, min_time_s=estimates["hf-build"]) is not None:
            for mode in ("eager", "static"):
                if f"hf-{mode}" not in parts:
                    continue
                for w in hf_wls:
                    s.part(f"hf-{mode} {w.name}", lambda w=w, mode=mode: s.run_hf(w, mode, args.hf_max_tokens),
                           min_time_s=estimates[f"hf-{mode}"] / 2)
        s.close_hf()
    if "W3" in parts:
        s.part("W3", lambda: w3(s, args, small), min_time_s=estimates["W3"])
    if "gpu-tests" in parts:
        s.part("gpu-tests", lambda: gpu_tests(s), min_time_s=30)

    full = s.summary()  # also written to $OUT/summary.txt with every table
    print("\n" + "=" * 100)
    print(compact(s))
    print(f"(every table: {os.path.join(args.out, 'summary.txt')}; every number: "
          f"{os.path.join(args.out, 'results.json')})")
    del full
    return 0


def graph_check(s: BenchSession, batch_sizes: list[int], prompt_len: int) -> list[dict]:
    from nanoserve.bench.graph_check import compare_decode_logits

    runner = s.nano.runner
    rows = compare_decode_logits(runner, tuple(batch_sizes), prompt_len=prompt_len)
    s.results.data.setdefault("graph_check", []).extend(rows)
    s.results.flush()
    s.say(report.table(("batch", "step", "graph used", "max |diff|", "max rel", "argmax agree", "disabled"),
                       [[r["batch"], r["step"], r["graph_used"], f"{r['max_abs_diff']:.3g}",
                         f"{r['max_rel_diff']:.3g}", f"{r['argmax_agreement']:.3f}", r["disabled"] or "-"]
                        for r in rows], "decode graph replay vs eager (logits)"))
    return rows


def gpu_tests(s: BenchSession) -> None:
    """tests/test_cuda_graphs.py in a subprocess (its own GPU memory), within what is left of the budget."""
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda_graphs.py", "-q", "-rs", "-p", "no:cacheprovider"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(s.time_left(), 30))
    tail = (done.stdout + done.stderr)[-3000:]
    s.results.data["gpu_tests"] = {"returncode": done.returncode, "output": tail}
    s.say(f"pytest tests/test_cuda_graphs.py -> exit {done.returncode}\n{tail}")
    if done.returncode != 0:
        raise RuntimeError(f"tests/test_cuda_graphs.py failed (exit {done.returncode})")


def _missing_server_packages() -> list[str]:
    import importlib.util

    return [m for m in SERVER_PACKAGES if importlib.util.find_spec(m) is None]


def w3(s: BenchSession, args, small: bool) -> None:
    """Start `python -m nanoserve.server` on the model, run the sweep, stop the server."""
    missing = _missing_server_packages()
    if missing and args.wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--find-links", args.wheels, *missing],
                       check=False)
        missing = _missing_server_packages()
    if missing:
        raise RuntimeError(f"W3 needs the server's packages: {', '.join(missing)} do not import (pass --wheels DIR)")
    import urllib.request

    port = 8123
    cmd = [sys.executable, "-m", "nanoserve.server", "--model", args.model, "--port", str(port),
           "--served-model-name", "bench", "--max-model-len", "4096", "--log-level", "warning"]
    server = subprocess.Popen(cmd, cwd=REPO)
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with code {server.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline:
                    raise RuntimeError("the server did not come up within 300 s")
                time.sleep(2)
        spec = W.serve_spec("small" if small else "full",
                            requests_per_concurrency=args.w3_requests_per_concurrency)
        from nanoserve.bench.__main__ import _tokenizer

        s.serve(f"http://127.0.0.1:{port}", spec, "bench", _tokenizer(args.model))
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


def compact(s: BenchSession) -> str:
    d = s.results.data
    m = s.meta
    out = [f"SUMMARY  {m['model']} on {m['device']}  {m['date']}  commit {m['commit']}  "
           f"torch {m['torch']} triton {m['triton']} transformers {m['transformers']}"]
    if d["runs"]:
        out += [report.runs_table(d["runs"])]
        ratio = report.hf_ratio_table(d["runs"])
        if ratio:
            out += ["", ratio]
        out += ["", report.targets_table(d["runs"])]
    for a in d["ablations"]:
        rows = [r for r in a.get("rows", []) if r.get("ratio") is not None and r["label"] != "all on"]
        if rows:
            out.append(f"\nablation {a['workload']}: " + ", ".join(
                f"{r['label']} {r['ratio']:.2f}x{'' if r.get('identical') else '*'}" for r in rows)
                + "   (x all-on tok/s; * = tokens differ)")
    for p in d["profiles"]:
        groups = ", ".join(f"{g} {100 * v['share']:.0f}%" for g, v in p["groups"].items())
        out.append(f"profile {p['workload']}: step {p['step_ms']:.3f} ms (eager {p['step_ms_eager']:.3f} ms); {groups}")
    for sweep in d["serve"]:
        out.append("W3: " + "; ".join(
            f"C={lv['concurrency']} {lv['output_throughput']:.0f} tok/s TTFT p50/p99 {lv['ttft_ms']['p50']:.0f}/"
            f"{lv['ttft_ms']['p99']:.0f} ms TPOT p50/p99 {lv['tpot_ms']['p50']:.1f}/{lv['tpot_ms']['p99']:.1f} ms"
            for lv in sweep["levels"]))
    if "gpu_tests" in d:
        out.append(f"gpu tests: exit {d['gpu_tests']['returncode']}")
    for g in d.get("graph_check", []):
        if g["step"] == 1:
            out.append(f"graph check bs {g['batch']}: used {g['graph_used']}, max rel diff {g['max_rel_diff']:.2g}, "
                       f"argmax agree {g['argmax_agreement']:.3f}")
    for n in d["notes"]:
        out.append(f"note: {n}")
    for e in d["errors"]:
        out.append(f"ERROR {e['part']}: {e['error']}")
    out.append(f"total {s.elapsed():.0f} s of a {s.cfg.time_budget_s:.0f} s budget")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
