"""python -m nanoserve.bench: the W1-W6 benchmarks, the Hugging Face baseline, the ablation, the profile.

    python -m nanoserve.bench                                   # W1, W2, W4, W5, W6 on nanoserve (m3-slice on a GPU)
    python -m nanoserve.bench --workloads W1,W2 --engine both --hf-modes eager,static --out results/
    python -m nanoserve.bench --ablate --workloads W1           # every switch off alone, one table (CPU: 3 runs
                                                                # a row, their spread; n/a where a switch cannot act)
    python -m nanoserve.bench --workloads W1 --ablate-switches rope_table,captured_argmax   # just those rows
    python -m nanoserve.bench --profile W1,W2                   # per-kernel decode-step profile (time, bytes)
    python -m nanoserve.bench --profile W2 --quantization bf16,mxfp8   # the same per format, then side by side
    python -m nanoserve.bench --profile W4 --w4-lens 131072     # W4: the prefill profile too (TTFT)
    python -m nanoserve.bench --profile-prefill W2 --prefill-chunk 4096   # prefill steps of 4096 tokens
    python -m nanoserve.bench --serve http://127.0.0.1:8000     # W3 against a running server
    python -m nanoserve.bench --scale small                     # CPU-sized workloads (m3-tiny)
    python -m nanoserve.bench --quantization bf16,mxfp8 --workloads W1,W2,W4,W5 --micro moe,linear
                                                                # bf16 and MXFP8 weights side by side
    python -m nanoserve.bench --kv-cache-dtype fp8 --workloads W2,W4   # the KV cache in fp8 e4m3
    python -m nanoserve.bench --micro attention,route,ceilings   # kernel micro-benchmarks alone (GPU)
    python -m nanoserve.bench --memory-plan                     # the released model's memory plan per GPU (no run)
    python -m nanoserve.bench --project                         # the released M3's TTFT, TPOT, tok/s per GPU at TP 4
                                                                # and 8, projected from measured per-layer costs
    python -m nanoserve.bench --quality [--ablate]              # m3-mini on held-out requests against its targets,
                                                                # perplexity (CPU); what each approximation costs
    python -m nanoserve.bench --speculative [--spec-limit N]    # each drafter's acceptance and speed-up (m3-mini)
    python -m nanoserve.bench --speculative cost                # verify / decode / draft step costs (m3-slice)
    python -m nanoserve.bench --speculative host                # where a speculative step's host time goes (m3-mini)
    python -m nanoserve.bench --vision                          # TTFT per image size, TPOT of requests with images
    python -m nanoserve.bench --compare BASE NEW                # two runs' results side by side (NEW / BASE)
    python -m nanoserve.bench --report results/ > docs/results.md   # the page of current numbers, from the records

Every result records the effective switches, the commit, the device and the date (results.json under --out).
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial

from nanoserve.bench import workloads as W
from nanoserve.bench.floor import H200, Ceilings, ceilings_for
from nanoserve.bench.session import BenchSession, SessionConfig, parse_switch_changes
from nanoserve.config import KV_CACHE_DTYPES

DEFAULT_GPU_MODEL, DEFAULT_CPU_MODEL = "m3-slice", "m3-tiny"
CPU_ABLATE_REPEATS = 3
"""--ablate on the CPU runs each row this many times: a shared CPU's timings move by tens of percent between runs."""


def _names(text: str | None) -> list[str]:
    return [t.strip().upper() for t in text.split(",") if t.strip()] if text else []


def _ints(text: str | None) -> list[int] | None:
    return [int(t) for t in text.split(",") if t.strip()] if text else None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m nanoserve.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="preset (m3-slice, m3-tiny) or checkpoint directory "
                    f"(default: {DEFAULT_GPU_MODEL} on a GPU, {DEFAULT_CPU_MODEL} on the CPU)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    ap.add_argument("--workloads", default=None, help="comma-separated subset of W1-W6 (default: all offline ones; "
                    "W3 needs --serve)")
    ap.add_argument("--engine", default="nanoserve", choices=["nanoserve", "hf", "both"])
    ap.add_argument("--hf-modes", default="eager", help="HF configurations: eager (dynamic cache) and/or static "
                    "(static cache, torch.compile'd; compiling takes minutes)")
    ap.add_argument("--hf-max-tokens", type=int, default=None, help="cap HF output tokens (its TPOT is per token)")
    ap.add_argument("--scale", default=None, choices=["full", "small"],
                    help="workload sizes (default: full on a GPU, small on the CPU)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--w4-lens", default=None, help="W4 prompt lengths, e.g. 32768,131072")
    ap.add_argument("--ablate", action="store_true", help="ablation table for the selected workloads (default W1)")
    ap.add_argument("--ablate-switches", default=None, metavar="A,B",
                    help="with --ablate: flip only these switches (beside the all-on row)")
    ap.add_argument("--ablate-repeats", type=int, default=None, metavar="N",
                    help="with --ablate: timed runs per row, for the medians and their spread (default: 3 on the "
                         "CPU, 1 on a GPU)")
    ap.add_argument("--profile", default=None, help="profile decode steps of these workloads, e.g. W1,W2")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--profile-prefill", default=None, help="profile the whole prefill of these workloads (per "
                    "kernel, with FLOPs, bytes and roofs); --profile W4 does this too")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill step for the prefill "
                    "profiles (default: the engine's max_num_batched_tokens)")
    ap.add_argument("--serve", default=None, metavar="URL", help="run W3 against this server")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--concurrency", default=None, help="W3 concurrency levels (default 1,4,16,64)")
    ap.add_argument("--requests-per-concurrency", type=int, default=None, help="W3: requests = this x C (10)")
    ap.add_argument("--serve-logprobs", type=int, default=None, metavar="N",
                    help="W3: every request asks for logprobs=N (the chosen token's logprob and N alternatives per "
                         "token; 0 = the chosen token's only); default: no logprobs")
    ap.add_argument("--out", default=None, help="directory for results.json, tables and PNG plots")
    ap.add_argument("--switch", action="append", default=[], metavar="NAME=on|off",
                    help="set an optimization switch (repeatable)")
    ap.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    ap.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    ap.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                    default=None)
    ap.add_argument("--cpu-reference-kernels", action=argparse.BooleanOptionalAction, default=None,
                    help="on a CPU device, turn the Triton kernel switches off (default: on)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; no new part starts after it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-gbps", type=float, default=None, help="bandwidth ceiling in GB/s (default: the card's: "
                    "H200 4260 measured, H100 3350 datasheet; another card H200's)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="bf16 ceiling in TFLOP/s (default: the card's: "
                    "H200 772 measured, H100 989 datasheet; another card H200's)")
    ap.add_argument("--quantization", default=None, help="weight format (vLLM's flag; default auto = the "
                    "checkpoint's): mxfp8 quantizes bf16 weights at load (m3-slice: the same random draw), bf16 "
                    "dequantizes an MXFP8 checkpoint; a comma list (bf16,mxfp8) runs every workload in each format "
                    "and prints them side by side")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="KV cache element type (vLLM's flag): auto = the model dtype; fp8 (= fp8_e4m3) = e4m3 with "
                    "per-tensor scales, twice the tokens in the same memory")
    ap.add_argument("--micro", default=None, help="kernel micro-benchmarks (GPU, comma list): moe, linear (bf16 "
                    "and MXFP8 weights side by side, on the paths --switch gives the model); attention (dense and "
                    "MSA, decode and prefill); route (the decode routing); align (the MoE alignment at each tile "
                    "height); ceilings (the card's measured copy GB/s and bf16 / fp8 matmul TFLOP/s)")
    ap.add_argument("--mxfp8-accuracy", action="store_true",
                    help="log-probabilities of native MXFP8 weights against the same weights dequantised (and the "
                    "unquantised model): max / mean |difference| and top-1 agreement over --prompt-len-token prompts "
                    "(default 1024 on a GPU, 64 on the CPU)")
    ap.add_argument("--micro-tokens", default=None, help="token counts of --micro (default 1,16,64,256,1024,4096)")
    ap.add_argument("--cpu-threads", type=int, default=None,
                    help="torch intra-op threads on the CPU (default: $NANOSERVE_CPU_THREADS, else every physical "
                         "core)")
    ap.add_argument("--project", nargs="?", const="steps", choices=["steps", "allreduce"], default=None,
                    help="the released M3 projected from measured per-layer step costs (m3-slice on a GPU, m3-tiny on "
                         "the CPU; --quantization bf16,mxfp8 by default): TTFT, TPOT and output tok/s per GPU at TP 4 "
                         "and 8 beside SGLang's and vLLM's published numbers; 'allreduce': the all-reduce model "
                         "against gloo on this CPU (nanoserve/bench/projection.py)")
    ap.add_argument("--vision", action="store_true", help="images through the engine (m3-slice-vl on a GPU, "
                    "m3-tiny-vl on the CPU): TTFT per image size, and the TPOT of a batch whose requests carry an "
                    "image each against text only (nanoserve/bench/vision.py)")
    ap.add_argument("--vision-sizes", default=None, metavar="LIST", help="--vision: square image sides in pixels "
                    "(default 224,448,672,1344)")
    ap.add_argument("--vision-concurrency", type=int, default=16, metavar="N", help="--vision: requests in the "
                    "TPOT batch")
    ap.add_argument("--vision-repeats", type=int, default=3, metavar="N", help="--vision: requests per image size")
    ap.add_argument("--memory-plan", action="store_true", help="print the memory plan of the released M3 model "
                    "(weights and KV bytes per GPU, bf16 vs MXFP8, TP=8 and TP=8+EP on H200 and MI355X) and exit")
    ap.add_argument("--quality", action="store_true", help="a trained model (default m3-mini) on the CPU: held-out "
                    "requests (nanoserve/bench/heldout) graded against its targets, and held-out perplexity; with "
                    "--ablate, the change each approximation makes")
    ap.add_argument("--quality-limit", type=int, default=None, metavar="N", help="--quality: at most N requests per "
                    "task (default: all)")
    ap.add_argument("--quality-retrieval-limit", type=int, default=None, metavar="N",
                    help="--quality: at most N prompts per retrieval length (default: as --quality-limit)")
    ap.add_argument("--quality-text-tokens", type=int, default=8192, metavar="N",
                    help="--quality: held-out tokens per corpus for perplexity (0: none)")
    ap.add_argument("--speculative", nargs="?", const="acceptance", choices=["acceptance", "cost", "host"],
                    default=None,
                    help="speculative decoding: each drafter's acceptance and speed-up on a trained model's held-out "
                    "prompts (default m3-mini), or with `cost` the verify, decode and draft step costs (default "
                    f"{DEFAULT_GPU_MODEL} on a GPU, {DEFAULT_CPU_MODEL} on the CPU; --prompt-len: the context), or "
                    "with `host` where each step's wall time goes on the host, per engine phase, without speculation, "
                    "with ngram and with mtp (default m3-mini; --spec-limit: prompts per task)")
    ap.add_argument("--spec-limit", type=int, default=None, metavar="N", help="--speculative: at most N prompts per "
                    "task (default: all)")
    ap.add_argument("--spec-retrieval-limit", type=int, default=None, metavar="N", help="--speculative: at most N "
                    "prompts per retrieval length (default: --spec-limit; a long prompt's prefill is what costs time "
                    "on a CPU)")
    ap.add_argument("--spec-batch", type=int, default=1, metavar="N", help="--speculative: answer N prompts of a "
                    "task at once (default 1: each alone, where speculation pays most)")
    ap.add_argument("--spec-drafters", default=None, metavar="LIST", help="--speculative: measure only these "
                    "drafters (names as the table prints them, separated by ';', e.g. 'ngram k=3;mtp k=3')")
    ap.add_argument("--spec-eagle3", default=None, metavar="DIR", help="--speculative: an EAGLE-3 draft directory "
                    "for the model (without one eagle3 is skipped)")
    ap.add_argument("--compare", nargs=2, default=None, metavar=("BASE", "NEW"),
                    help="print two runs side by side, run by run (each a results.json or a bench --out directory; "
                    "with --out, also compare.json) and exit")
    ap.add_argument("--report", default=None, metavar="DIR",
                    help="print the page of current numbers rendered from the runs of record in DIR (results/: "
                         "python -m nanoserve.bench --report results/ > docs/results.md) and exit")
    ap.add_argument("--compare-tolerance", type=float, default=None, metavar="F",
                    help="--compare: a NEW / BASE ratio within 1 +- F is level (default 0.03)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        from nanoserve.bench.results_page import run as run_report

        return run_report(args.report)
    if args.compare:
        from nanoserve.bench.compare import DEFAULT_TOLERANCE
        from nanoserve.bench.compare import run as run_compare

        tolerance = DEFAULT_TOLERANCE if args.compare_tolerance is None else args.compare_tolerance
        return run_compare(*args.compare, tolerance=tolerance, out=args.out)
    if args.memory_plan:
        from nanoserve.model.m3_config import M3Config
        from nanoserve.model.memory_plan import markdown_table

        print(markdown_table(M3Config()))
        return 0
    if args.project:
        return _run_projection(args)
    if args.vision:
        return _run_vision(args)
    if args.quality:
        from nanoserve.bench.quality import run as run_quality
        from nanoserve.presets.catalog import DEFAULT_MODEL

        return run_quality(args.model or DEFAULT_MODEL, args.quality_limit, args.quality_text_tokens, args.ablate,
                           args.out, args.quality_retrieval_limit)
    if args.speculative:
        from nanoserve.bench.speculative import run as run_speculative

        return run_speculative(args)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not on_gpu:
        from nanoserve.cpu_threads import configure_cpu_threads

        configure_cpu_threads(args.cpu_threads)
    model = args.model or (DEFAULT_GPU_MODEL if on_gpu else DEFAULT_CPU_MODEL)
    scale = args.scale or ("full" if on_gpu else "small")
    hw = H200
    if on_gpu:  # the card's own ceilings where known (an unknown card keeps H200's: the label says whose they are)
        hw = ceilings_for(torch.cuda.get_device_name()) or H200
    if args.peak_gbps or args.peak_tflops:
        hw = Ceilings("given ceilings", (args.peak_gbps or hw.bytes_per_s / 1e9) * 1e9,
                      (args.peak_tflops or hw.flops_per_s / 1e12) * 1e12)
    changes = parse_switch_changes(args.switch, {"enforce_eager": args.enforce_eager,
                                                 "enable_prefix_caching": args.enable_prefix_caching,
                                                 "enable_chunked_prefill": args.enable_chunked_prefill})
    formats = _formats(args.quantization)
    base = dict(model=model, device=args.device, dtype=args.dtype, seed=args.seed,
                cpu_reference_kernels=args.cpu_reference_kernels, switch_changes=changes,
                max_num_batched_tokens=args.max_num_batched_tokens, hw=hw, kv_cache_dtype=args.kv_cache_dtype,
                copy_ceiling_known=True if args.peak_gbps else None)
    if len(formats) > 1:
        return _side_by_side(args, formats, base)
    session = BenchSession(SessionConfig(out_dir=args.out, time_budget_s=args.time_budget,
                                         quantization=formats[0], **base))
    return _run(args, session, model, scale)


QUANT_NAMES = {"auto": None, "bf16": "bf16", "mxfp8": "mxfp8"}
"""--quantization names -> EngineConfig.quantization (auto: the checkpoint's format)."""


def _formats(text: str | None) -> list[str | None]:
    if not text:
        return [None]
    out = []
    for t in (t.strip().lower() for t in text.split(",") if t.strip()):
        if t not in QUANT_NAMES:
            raise SystemExit(f"--quantization {t!r}: choose from {', '.join(QUANT_NAMES)}")
        out.append(QUANT_NAMES[t])
    return out


def _run_projection(args) -> int:
    """`--project [steps|allreduce]`: print the table, write the report under --out."""

    from nanoserve.bench import projection
    from nanoserve.bench.env import environment
    from nanoserve.bench.session import device_and_switches

    device, opts = device_and_switches(args)
    if args.project == "allreduce":
        report, name = projection.run_allreduce_check(), "allreduce_model"
    else:
        formats = [f or "bf16" for f in _formats(args.quantization or
                                                 ("bf16,mxfp8" if device.type == "cuda" else "bf16"))]
        report, name = projection.run_projection(device.type, args.dtype, formats, opts), "projection"
    _write_report(args.out, name, {**report, "environment": environment(device)})
    return 0


def _run_vision(args) -> int:
    """`--vision`: print the tables, write the report under --out."""
    from nanoserve.bench.session import device_and_switches
    from nanoserve.bench.vision import SIZES, measure_vision

    device, opts = device_and_switches(args)
    sizes = tuple(_ints(args.vision_sizes)) if args.vision_sizes else SIZES
    model = args.model or ("m3-slice-vl" if device.type == "cuda" else "m3-tiny-vl")
    report = measure_vision(model, device.type, args.dtype, sizes, args.vision_repeats, args.vision_concurrency,
                            args.prompt_len or 256, args.output_len or 128, opts=opts, seed=args.seed)
    _write_report(args.out, "vision", report)
    return 0


def _write_report(out: str | None, name: str, report: dict) -> None:
    """Print a report's table; under `out`, write NAME.json (the report without its table) and NAME.md."""
    import json
    import os

    print(report["table"], flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump({k: v for k, v in report.items() if k != "table"}, f, indent=2)
        with open(os.path.join(out, f"{name}.md"), "w") as f:
            f.write(report["table"] + "\n")


PART_ESTIMATES_S = {"build": 60, "W1": 20, "W2": 40, "W4": 25, "W5": 75, "W6": 25}
"""Seconds a part needs on an H200 with m3-slice; under --time-budget a part starts only if this much is left."""


def _side_by_side(args, formats: list[str | None], base: dict) -> int:
    """The kernel micro-benchmarks, then each format in turn - its model built, every workload and profile run,
    the model freed before the next format's is built (one resident at a time: m3-slice's bf16 and MXFP8 weights
    and KV pools together do not fit an 80 GB card) - then one table comparing them; the same for the decode-step
    profiles (--profile: one table by group, formats side by side) and the prefill profiles. Results go to
    OUT/<format>/, the profile comparison to OUT/profile_formats.json and .txt."""
    import os
    import time

    from nanoserve.bench.report import formats_table

    t0 = time.perf_counter()
    sessions: dict[str, BenchSession] = {}
    for q in formats:
        left = None if args.time_budget is None else args.time_budget - (time.perf_counter() - t0)
        out = os.path.join(args.out, q or "auto") if args.out else None
        sessions[q or "auto"] = BenchSession(SessionConfig(out_dir=out, time_budget_s=left, quantization=q, **base))
    first = next(iter(sessions.values()))
    scale = args.scale or ("full" if first.device.type == "cuda" else "small")
    if args.micro:
        _micro(args, first)
    build = dict(vocab=first.model_cfg.vocab_size, scale=scale, prompt_len=args.prompt_len,
                 output_len=args.output_len, num_requests=args.num_requests, w4_lens=_ints(args.w4_lens),
                 seed=args.seed)
    profile_names = _names(args.profile)
    prefill_names = _names(args.profile_prefill) + [n for n in profile_names if n == "W4"]
    for n in _names(args.workloads) + profile_names + prefill_names:
        if n not in W.ALL:
            raise SystemExit(f"unknown workload {n}; choose from {', '.join(W.ALL)}")
    default = [] if profile_names or prefill_names else ["W1", "W2", "W4", "W5"]
    wls = W.build([n for n in (_names(args.workloads) or default) if n != "W3"], **build)
    prof_wls = W.build([n for n in profile_names if n != "W3"], **build)
    prefill_wls = W.build([n for n in dict.fromkeys(prefill_names) if n != "W3"], **build)
    planned = wls + prof_wls + prefill_wls
    jobs = [("nanoserve", wls, lambda s, wl: s.run_nano(wl)),
            ("profile", prof_wls, lambda s, wl: s.profile(wl, args.profile_steps)),
            ("prefill profile", prefill_wls, lambda s, wl: s.profile_prefill(wl, args.prefill_chunk))]
    for name, s in sessions.items():  # one format at a time, its model freed before the next one is built
        if s.part(f"build nanoserve ({name})", lambda s=s: s.build_nano(planned),
                  min_time_s=PART_ESTIMATES_S["build"]) is not None:
            for label, group, job in jobs:
                for wl in group:
                    s.part(f"{label} {wl.name} ({name})", lambda s=s, wl=wl, job=job: job(s, wl),
                           min_time_s=PART_ESTIMATES_S.get(wl.family, 30))
        s.close_nano()
    rc = 0
    for name, s in sessions.items():
        print()
        print(s.summary())
        rc |= 1 if s.results.data["errors"] else 0
    weights = {n: (s.meta.get("nanoserve_weight_memory") or {}).get("parameter_bytes") for n, s in sessions.items()}
    text = formats_table({n: s.results.data["runs"] for n, s in sessions.items()},
                         {n: (b / 2**30 if b else None) for n, b in weights.items()})
    if text:
        print()
        print(text)
        if args.out:
            with open(os.path.join(args.out, "formats.txt"), "w") as f:
                f.write(text + "\n")
    _compare_profiles(args, sessions, [wl.name for wl in prof_wls])
    return rc


def _compare_profiles(args, sessions: dict, names: list[str]) -> None:
    """The decode-step profiles of each workload, one table with the formats side by side (printed, and under
    --out in profile_formats.txt / profile_formats.json)."""
    import json
    import os

    from nanoserve.bench.profile import compare_profiles, compare_table

    out, texts = [], []
    for name in names:
        profiles = {label: p for label, s in sessions.items() for p in s.results.data["profiles"]
                    if p["workload"] == name}
        if len(profiles) < 2:
            continue  # a format's profile failed (its error is in its summary)
        c = compare_profiles(profiles)
        c["table"] = compare_table(c)
        out.append(c)
        texts.append(c["table"])
        print()
        print(c["table"])
    if args.out and out:
        with open(os.path.join(args.out, "profile_formats.txt"), "w") as f:
            f.write("\n\n".join(texts) + "\n")
        with open(os.path.join(args.out, "profile_formats.json"), "w") as f:
            json.dump(out, f, indent=1)


def _run(args, session: BenchSession, model: str, scale: str) -> int:
    if args.micro:
        _micro(args, session)
    names = _names(args.workloads)
    profile_names = _names(args.profile)
    prefill_names = _names(args.profile_prefill) + [n for n in profile_names if n == "W4"]
    only = [n.strip() for n in (args.ablate_switches or "").split(",") if n.strip()] or None
    if only:
        from nanoserve.config import Optimizations

        bad = [n for n in only if n not in Optimizations.names()]
        if bad:
            raise SystemExit(f"unknown switch(es) {', '.join(bad)}; choose from {', '.join(Optimizations.names())}")
        args.ablate = True
    if args.ablate and not names:
        names = ["W1"]
    repeats = args.ablate_repeats if args.ablate_repeats is not None else \
        (1 if session.device.type == "cuda" else CPU_ABLATE_REPEATS)
    if repeats < 1:
        raise SystemExit(f"--ablate-repeats must be >= 1, got {repeats}")
    elif not (names or profile_names or prefill_names or args.serve or args.mxfp8_accuracy or args.micro):
        names = list(W.OFFLINE)
    for n in names + profile_names + prefill_names:
        if n not in W.ALL:
            raise SystemExit(f"unknown workload {n}; choose from {', '.join(W.ALL)}")
    vocab = session.model_cfg.vocab_size
    build = dict(vocab=vocab, scale=scale, prompt_len=args.prompt_len, output_len=args.output_len,
                 num_requests=args.num_requests, w4_lens=_ints(args.w4_lens), seed=args.seed)
    wls = W.build([n for n in names if n != "W3"], **build)
    prof_wls = W.build([n for n in profile_names if n != "W3"], **build)
    prefill_wls = W.build([n for n in dict.fromkeys(prefill_names) if n != "W3"], **build)

    if args.mxfp8_accuracy:
        _accuracy(args, session, model)
    if args.serve:
        spec = W.serve_spec(scale, args.prompt_len, args.output_len, _ints(args.concurrency),
                            args.requests_per_concurrency, args.serve_logprobs)
        tok = _tokenizer(model)
        session.part("W3 serve sweep", lambda: session.serve(args.serve, spec, args.served_model_name, tok))
    elif "W3" in names:
        session.results.add("notes", "W3 needs a running server: pass --serve URL")

    if args.engine in ("nanoserve", "both") and (wls or prof_wls or prefill_wls):
        if session.part("build nanoserve", lambda: session.build_nano(wls + prof_wls + prefill_wls)) is not None:
            for wl in wls:
                if args.ablate:
                    session.part(f"ablation {wl.name}", lambda wl=wl: session.ablate(wl, only, repeats))
                else:
                    session.part(f"nanoserve {wl.name}", lambda wl=wl: session.run_nano(wl))
            for wl in prof_wls:
                session.part(f"profile {wl.name}", lambda wl=wl: session.profile(wl, args.profile_steps))
            for wl in prefill_wls:
                session.part(f"prefill profile {wl.name}",
                             lambda wl=wl: session.profile_prefill(wl, args.prefill_chunk))
        session.close_nano()
    if args.engine in ("hf", "both") and not args.ablate:
        for mode in [m.strip() for m in args.hf_modes.split(",") if m.strip()]:
            for wl in wls:
                session.part(f"hf {mode} {wl.name}", lambda wl=wl, mode=mode: session.run_hf(wl, mode,
                                                                                             args.hf_max_tokens))
        session.close_hf()
    print()
    print(session.summary())
    return 1 if session.results.data["errors"] else 0


def _accuracy(args, session: BenchSession, model: str) -> None:
    from nanoserve.bench.accuracy import mxfp8_accuracy

    prompt_len = args.prompt_len or (1024 if session.device.type == "cuda" else 64)

    def part():
        res = mxfp8_accuracy(model, session.opts, session.dtype, session.device, prompt_len=prompt_len,
                             seed=args.seed + 5)
        session.results.data["mxfp8_accuracy"] = res
        session.say(res["table"])
        session.results.write_text("mxfp8_accuracy.txt", res["table"])
    session.part("mxfp8 accuracy", part)


def _micro(args, session: BenchSession) -> None:
    from nanoserve.bench import micro
    from nanoserve.bench.micro_attention import attention_micro

    kinds = [k.strip() for k in args.micro.split(",") if k.strip()]
    switched = {"opts": session.opts}  # the MoE and the linears take the path the run's switches give the model
    runs = {"ceilings": micro.ceilings_micro, "moe": partial(micro.moe_micro, **switched),
            "linear": partial(micro.linear_micro, **switched), "route": micro.route_micro,
            "align": micro.align_micro, "attention": attention_micro}
    unknown = sorted(set(kinds) - set(runs))
    if unknown:
        raise SystemExit(f"--micro: unknown {', '.join(unknown)}; choose from {', '.join(runs)}")
    if session.device.type != "cuda":
        session.results.add("notes", "--micro needs a GPU: skipped")
        return
    tokens = _ints(args.micro_tokens) or [1, 16, 64, 256, 1024, 4096]
    for kind in kinds:
        fn = runs[kind]

        def part(fn=fn, kind=kind):
            res = fn(session.model_cfg, tokens, session.device)
            session.results.data.setdefault("micro", {})[kind] = res
            session.say(res["table"])
            session.results.write_text(f"micro_{kind}.txt", res["table"])
        session.part(f"micro {kind}", part)
    import torch

    torch.cuda.empty_cache()  # the micro-benchmarks' weights are gone: give their memory back for the KV pools


def _tokenizer(model: str):
    """The served model's tokenizer for W3's text prompts (None: send token ids)."""
    try:
        from nanoserve.engine.tokenizer import load_tokenizer
        from nanoserve.presets.catalog import PRESETS
        from nanoserve.presets.resolve import preset_tokenizer_dir

        return load_tokenizer(preset_tokenizer_dir(model) if model in PRESETS else model)
    except Exception as e:  # noqa: BLE001
        logging.getLogger(__name__).warning("no tokenizer for W3 text prompts (%s): sending token ids", e)
        return None


if __name__ == "__main__":
    sys.exit(main())
