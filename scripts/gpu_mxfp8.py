"""One device call for MXFP8 weights on the GPU: kernel checks in bf16, the accuracy of the native path, then the
bf16 vs MXFP8 benchmarks side by side (everything written to $OUT as it goes; a short table printed last).

    OUT=/tmp/out NANOSERVE_GIT_COMMIT=$(git rev-parse HEAD) python scripts/gpu_mxfp8.py [--bench-budget 270]
        [--ablate-budget 100 --ablate-workloads W1,W2]

1. Checks (bf16 activations, m3-slice widths): the Triton fp8-weight GEMM against `reference.fp8_linear` (decode,
   split-K, ragged K, prefill tiles), the fused MoE with fp8 experts (+ folded shared expert) against
   `reference.moe_experts` on the same fp8 weights, and a CUDA-graph replay of both equal to eager.
   Tolerance: max |kernel - reference| <= 2e-2 x max |reference| (bf16 outputs; both accumulate in fp32).
2. Accuracy (`nanoserve/bench/accuracy.py`, as `python -m nanoserve.bench --mxfp8-accuracy`): m3-slice's random
   draw quantized to MXFP8 at load, served natively (mxfp8_weights on) and dequantised at load (off, the reference
   path); log-probabilities of every position of two 1024-token prompts over the whole vocabulary: max and mean
   |difference|, and top-1 agreement. The same against the unquantized bf16 model shows what quantization itself
   changes.
3. `python -m nanoserve.bench --quantization mxfp8,bf16 --workloads W1,W2,W4,W5 --w4-lens 32768 --micro
   ceilings,moe,linear` under a time budget (W1, W2, W4-32k, W5, the card's ceilings and the MoE / projection
   micro-benchmarks); logs and result files in $OUT/bench_log.txt, $OUT/bench.tgz.
4. With --ablate-budget S: `python -m nanoserve.bench --quantization mxfp8 --ablate-switches
   mxfp8_weights,triton_fp8_linear,triton_gemv --workloads W1,W2` (the MXFP8 ablation rows; the `mxfp8_weights`
   row rebuilds the model with the weights dequantised), in $OUT/ablation_log.txt, $OUT/ablation.tgz.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nanoserve.kernels import reference  # noqa: E402
from nanoserve.model.mxfp8 import quantize_mxfp8  # noqa: E402
from scripts.tune_fp8 import rel_err  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/gpu_mxfp8")
RTOL = 2e-2
RESULTS: dict = {"checks": [], "accuracy": {}, "errors": []}


def save() -> None:
    with open(os.path.join(OUT, "mxfp8_checks.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = RTOL) -> None:
    err = rel_err(got, want)  # inf when got holds a non-finite value
    ok = err <= tol
    RESULTS["checks"].append({"name": name, "rel_err": err, "ok": ok})
    print(f"[check] {name}: rel err {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
    save()


def kernel_checks(dev: torch.device) -> None:
    from nanoserve.kernels.fp8_linear import fp8_linear
    from nanoserve.kernels.moe import fused_moe

    g = torch.Generator(device=dev).manual_seed(0)
    for n, k in ((9856, 6144), (6144, 8192), (1000, 544)):
        w = torch.empty(n, k, device=dev).normal_(0, 0.02, generator=g)
        q, s = quantize_mxfp8(w)
        for m in (1, 5, 64, 200, 4096):
            x = torch.empty(m, k, device=dev).normal_(0, 1, generator=g).bfloat16()
            check(f"fp8_linear M={m} N={n} K={k}", fp8_linear(x, q, s), reference.fp8_linear(x, q, s))
    h, inter, e, top_k = 6144, 3072, 16, 4
    w13 = torch.empty(e + 1, 2 * inter, h, device=dev, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    w2 = torch.empty(e + 1, h, inter, device=dev, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    q13, s13 = zip(*(quantize_mxfp8(w13[i]) for i in range(e + 1)))
    q2, s2 = zip(*(quantize_mxfp8(w2[i]) for i in range(e + 1)))
    q13, s13, q2, s2 = (torch.stack(t) for t in (q13, s13, q2, s2))
    args = dict(alpha=1.702, limit=7.0, routed_scaling_factor=2.0)
    for t in (1, 37, 1024):
        x = torch.empty(t, h, device=dev).normal_(0, 1, generator=g).bfloat16()
        wts, ids = reference.route(torch.empty(t, e, device=dev).normal_(0, 1, generator=g),
                                   torch.zeros(e, device=dev), top_k)
        got = fused_moe(x, q13, q2, wts, ids, fold_shared=True, w13_scale=s13, w2_scale=s2, **args)
        want = reference.moe_experts(x, q13[:e], q2[:e], ids, wts, 1.702, 7.0, None, s13[:e], s2[:e]).float() * 2.0
        up, down = reference.weight(q13[e], s13[e], x.dtype), reference.weight(q2[e], s2[e], x.dtype)
        gu = torch.nn.functional.linear(x, up)
        want += torch.nn.functional.linear(reference.swiglu_oai(gu[:, :inter], gu[:, inter:], 1.702, 7.0)
                                           .to(x.dtype), down).float()
        check(f"fused_moe fp8 T={t} (+shared)", got, want)
    # CUDA graphs: the fp8 launches (split-K decode GEMM, fused MoE) replay exactly
    x1 = torch.empty(1, 6144, device=dev).normal_(0, 1, generator=g).bfloat16()
    w = torch.empty(6144, 6144, device=dev).normal_(0, 0.02, generator=g)
    q, s = quantize_mxfp8(w)
    x4 = torch.empty(4, h, device=dev).normal_(0, 1, generator=g).bfloat16()
    wts, ids = reference.route(torch.empty(4, e, device=dev).normal_(0, 1, generator=g), torch.zeros(e, device=dev),
                               top_k)

    def step():
        return fp8_linear(x1, q, s), fused_moe(x4, q13, q2, wts, ids, fold_shared=True, w13_scale=s13,
                                               w2_scale=s2, **args)
    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(outs, eager))
    RESULTS["checks"].append({"name": "CUDA graph replay of fp8_linear + fused_moe fp8", "ok": same})
    print(f"[check] CUDA graph replay equals eager: {same}", flush=True)
    save()


def accuracy(dev: torch.device) -> None:
    from nanoserve.bench.accuracy import mxfp8_accuracy
    from nanoserve.config import Optimizations

    res = mxfp8_accuracy("m3-slice", Optimizations(), torch.bfloat16, dev)
    print(res.pop("table"), flush=True)
    RESULTS["accuracy"] = res
    save()


def bench(name: str, bench_args: list[str], timeout: float, tail: int) -> str:
    """Run `python -m nanoserve.bench <bench_args> --out <dir>` with its log in $OUT/<name>_log.txt and its result
    files packed into $OUT/<name>.tgz (the device tool returns at most 8 files); the log's last `tail` chars."""
    out_dir = f"/tmp/gpu_mxfp8_{name}"
    cmd = [sys.executable, "-m", "nanoserve.bench", *bench_args, "--out", out_dir]
    print(f"[{name}]", " ".join(cmd), flush=True)
    log_path = os.path.join(OUT, f"{name}_log.txt")
    with open(log_path, "w") as log:
        try:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"[{name}] timed out; packing what it wrote", flush=True)
    if os.path.isdir(out_dir):
        with tarfile.open(os.path.join(OUT, f"{name}.tgz"), "w:gz") as tar:
            tar.add(out_dir, arcname=name)
    with open(log_path) as f:
        return f.read()[-tail:]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-budget", type=float, default=270.0)
    ap.add_argument("--ablate-budget", type=float, default=0.0,
                    help="seconds for the MXFP8 ablation (mxfp8_weights, triton_fp8_linear, triton_gemv); 0: none")
    ap.add_argument("--ablate-workloads", default="W1,W2")
    ap.add_argument("--skip", default="", help="comma list of checks,accuracy,bench to skip")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    dev = torch.device("cuda")
    skip = set(args.skip.split(","))
    RESULTS["device"] = torch.cuda.get_device_name(dev)
    RESULTS["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    RESULTS["commit"] = os.environ.get("NANOSERVE_GIT_COMMIT", "unknown")
    for name, fn in (("checks", kernel_checks), ("accuracy", accuracy)):
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            fn(dev)
        except Exception as e:  # noqa: BLE001 - keep going: the benchmarks are still worth running
            RESULTS["errors"].append({"part": name, "error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()})
            print(f"[{name}] FAILED: {traceback.format_exc()}", flush=True)
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        save()
        torch.cuda.empty_cache()
    failed = [c["name"] for c in RESULTS["checks"] if not c["ok"]]
    # a wrong kernel must not produce numbers: the engine then runs the reference paths
    safe = ["--switch", "fused_moe=off", "--switch", "triton_fp8_linear=off"] if failed else []
    tails = []
    if "bench" not in skip:
        tails.append(bench("bench", ["--quantization", "mxfp8,bf16", "--workloads", "W1,W2,W4,W5", "--w4-lens",
                                     "32768", "--micro", "ceilings,moe,linear", "--time-budget",
                                     str(args.bench_budget), *safe], args.bench_budget + 90, 6000))
    if args.ablate_budget > 0:
        tails.append(bench("ablation", ["--quantization", "mxfp8", "--ablate-switches",
                                        "mxfp8_weights,triton_fp8_linear,triton_gemv", "--workloads",
                                        args.ablate_workloads, "--time-budget", str(args.ablate_budget), *safe],
                           args.ablate_budget + 60, 2500))
    for text in tails:
        print(text)
    print("\nchecks:", len(RESULTS["checks"]) - len(failed), "ok,", len(failed), "failed", failed or "")
    acc = RESULTS["accuracy"].get("pairs", {}).get("native vs dequantised")
    if acc:
        print(f"logprobs native vs dequantised: max |diff| {acc['max_abs_logprob_diff']:.3e}, mean "
              f"{acc['mean_abs_logprob_diff']:.3e}, top-1 agreement {acc['top1_agreement']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
