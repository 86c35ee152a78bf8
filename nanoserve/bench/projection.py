"""The released M3 projected from measured steps: TTFT, TPOT and output tokens/s per GPU at TP 4 and TP 8.

    python -m nanoserve.bench --project                     # m3-slice on this GPU (m3-tiny on the CPU), bf16 and MXFP8
    python -m nanoserve.bench --project --quantization bf16 # one format
    python -m nanoserve.bench --project allreduce           # the all-reduce model against gloo on this CPU

A projection, not a measurement: no machine here holds the released model. What is measured, and what is modelled:

**Measured: what a layer costs.** A step's time is a sum over its layers plus what is not a layer (the embedding,
the LM head over the whole vocabulary, staging, launches): T = F + n_dense x d + n_sparse x s, with M3's two layer
kinds - dense (full attention + dense MLP; M3's layers 0-2) and sparse (MSA + MoE; layers 3-59). Four models of
the preset's widths with its random weights are built in turn and timed on the engine's model runner, as the engine
runs a step (decode under CUDA graphs where they apply, prefill eagerly): [dense, sparse], [dense, sparse, sparse,
sparse], [sparse] and [dense x 4, sparse]. A least-squares fit of their times gives s, d and F (four variants for
three costs: the dense layer, small beside the sparse one, is timed four times over, so timing noise does not swamp
it). Each kind is timed at the steps the comparisons need: decode at a batch and a context, prefill of a prompt from
an empty context.

**Modelled: M3 over TP ranks.** M3 = F + 3 d + 57 s of the measured costs, each rank computing 1/TP of every layer
and of the LM head (an ideal split: M3's 4 KV heads are replicated past TP 4, so its attention reads at TP 8 are
understated), plus per layer two all-reduces of the step's hidden states (after the attention and after the MLP or
MoE) and one all-gather of the logits per step, each costing `allreduce_s`:
latency + 2 (TP - 1) / TP x bytes / bus bandwidth (a ring all-reduce; the all-gather moves half of that). The
latency and bandwidth are stated, not measured here: AR_LATENCY_US (NCCL's small-message latency on NVLink) and
NVLINK_BUS_GBPS (NCCL's all-reduce bus bandwidth on 8 H100 / H200 SXM). `--project allreduce` checks the model's
shape (a fixed cost plus a cost per byte) against gloo all-reduces between processes on this CPU.

**The comparisons.** Output tokens/s per GPU of a closed loop of `concurrency` requests of `prompt` tokens in and
`output` out: every request's prefill, then `output` decode steps at batch `concurrency` at the mean context
(prompt + output / 2) - tokens out / (prefills + decode steps) / TP. Beside SGLang's published 116 tokens/s/GPU
(H200, TP 8, bf16, 2k/256, concurrency 64) and vLLM's 113 (H200, TP 8, 1k/1k, concurrency 4, TPOT 8.4 ms).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Any

import numpy as np

M3_DENSE_LAYERS, M3_SPARSE_LAYERS = 3, 57
"""The released model's layers of each kind: dense attention + dense MLP (layers 0-2), then MSA + MoE (3-59)."""
AR_LATENCY_US = 15.0
"""Stated: one NCCL all-reduce of a few hidden vectors on NVLink, in microseconds (latency-bound)."""
NVLINK_BUS_GBPS = 360.0
"""Stated: NCCL's all-reduce bus bandwidth between 8 H100 / H200 SXM GPUs (NVLink 4: 450 GB/s a direction)."""
VARIANTS = {"1d+1s": ["dense", "sparse"], "1d+3s": ["dense", "sparse", "sparse", "sparse"], "1s": ["sparse"],
            "4d+1s": ["dense", "dense", "dense", "dense", "sparse"]}
"""The models timed (layer kinds in order): their step times give F, d and s by least squares. A dense layer costs
a tenth of a sparse one or less, so it is timed four times over: an error e in each variant's time moves d by at
most 0.54 e, where the difference of two variants that differ by one dense layer moves it by up to 2 e."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """A comparison: `concurrency` requests of `prompt` tokens in and `output` out, at `tp`, with what another
    engine published for it."""

    name: str
    prompt: int
    output: int
    concurrency: int
    published: str


WORKLOADS = (Workload("2k/256, concurrency 64", 2048, 256, 64, "SGLang: 116 tok/s/GPU (H200, TP 8, bf16)"),
             Workload("1k/1k, concurrency 4", 1024, 1024, 4, "vLLM: 113 tok/s/GPU, TPOT 8.4 ms (H200, TP 8)"))
CPU_WORKLOADS = (Workload("64/16, concurrency 4", 64, 16, 4, "-"),)
"""On the CPU, m3-tiny at sizes its context and two cores take (the method, not the numbers)."""


def allreduce_s(nbytes: float, tp: int, latency_us: float = AR_LATENCY_US, bus_gbps: float = NVLINK_BUS_GBPS,
                gather: bool = False) -> float:
    """Seconds for one all-reduce (or, `gather`, all-gather) of `nbytes` per rank over `tp` ranks (module docstring);
    0 at TP 1."""
    if tp <= 1:
        return 0.0
    moved = (tp - 1) / tp * nbytes * (1 if gather else 2)
    return latency_us * 1e-6 + moved / (bus_gbps * 1e9)


def decompose(times: dict[str, float]) -> dict[str, float]:
    """The per-kind costs from the variants' step times ({VARIANTS label: seconds}): s (a sparse layer), d (a dense
    one), F (the rest), the least-squares fit of T = F + n_dense x d + n_sparse x s over the variants."""
    labels = list(times)
    design = np.array([[1.0, VARIANTS[v].count("dense"), VARIANTS[v].count("sparse")] for v in labels])
    (f, d, s), *_ = np.linalg.lstsq(design, np.array([times[v] for v in labels]), rcond=None)
    return {"sparse_layer": float(s), "dense_layer": float(d), "rest": float(f)}


def m3_step(costs: dict[str, float], tp: int, tokens: int, hidden: int, vocab: int, **ar) -> float:
    """Seconds for one step of the released model over `tp` ranks, from the per-kind costs of a step of `tokens`
    tokens (the logits of one row per sequence: `tokens` counts those rows for the all-gather at decode)."""
    compute = (costs["rest"] + M3_DENSE_LAYERS * costs["dense_layer"] + M3_SPARSE_LAYERS * costs["sparse_layer"]) / tp
    layers = M3_DENSE_LAYERS + M3_SPARSE_LAYERS
    comm = 2 * layers * allreduce_s(tokens * hidden * 2, tp, **ar)
    return compute + comm + allreduce_s(tokens * vocab * 2, tp, gather=True, **ar)


def project(measured: dict[str, Any], workloads, tps=(4, 8), **ar) -> list[dict[str, Any]]:
    """Per format, TP size and workload: the projected TTFT (one prompt alone), TPOT and output tok/s per GPU.
    `measured`: {format: {"decode": {workload name: costs}, "prefill": {workload name: costs}}, "hidden", "vocab"}."""
    rows = []
    hidden, vocab = measured["hidden"], measured["vocab"]
    for fmt, by_step in measured["formats"].items():
        for w in workloads:
            dec, pre = by_step["decode"][w.name], by_step["prefill"][w.name]
            for tp in tps:
                ttft = m3_step(pre, tp, w.prompt, hidden, vocab, **ar)
                tpot = m3_step(dec, tp, w.concurrency, hidden, vocab, **ar)
                cycle = w.concurrency * ttft + w.output * tpot  # every request's prefill, then its decode steps
                rows.append({"format": fmt, "workload": w.name, "tp": tp, "ttft_ms": ttft * 1e3,
                             "tpot_ms": tpot * 1e3, "tok_s_per_gpu": w.concurrency * w.output / cycle / tp,
                             "published": w.published})
    return rows


# -- measuring ---------------------------------------------------------------------------------------------------


@contextmanager
def layer_variant(base: str, kinds: list[str]):
    """The preset `base` with the decoder layers `kinds` (its widths, its random weights drawn on the device),
    registered under a name of its own while the block runs; yields the name."""
    from nanoserve.presets.catalog import PRESETS, get_preset

    preset = get_preset(base)
    name = f"{base}[{','.join(kinds)}]"
    cfg = preset.config.replace(num_hidden_layers=len(kinds), attn_layer_types=list(kinds),
                                mlp_layer_types=list(kinds))
    PRESETS[name] = lambda: dataclasses.replace(preset, config=cfg, draw_on_device=True, vision=None)
    try:
        yield name
    finally:
        del PRESETS[name]


def _timed(runner, step, repeats: int) -> float:
    """The fastest of `repeats` calls of runner.execute(step), each waited for, after two warm-up calls (their graphs
    captured): the variants' times are subtracted from one another, and the minimum is the least disturbed."""
    import torch

    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    for _ in range(2):
        runner.execute(step)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(step)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def time_variant(model: str, device: str, dtype: str, quantization: str | None, workloads, repeats: int,
                 optimizations=None, seed: int = 0) -> dict[str, dict[str, float]]:
    """Seconds of each workload's decode step (batch `concurrency`, at the mean context) and prefill (the whole
    prompt, one chunk) on `model`."""
    import torch

    from nanoserve.entrypoints.llm import LLM
    from nanoserve.step import ModelInput

    longest = max(w.prompt + w.output for w in workloads)
    rows = max(max(w.concurrency for w in workloads), 1)
    llm = LLM(model=model, device=device, dtype=dtype, quantization=quantization, seed=seed, max_num_seqs=rows,
              max_model_len=longest + 16, max_num_batched_tokens=max(w.prompt for w in workloads),
              **({"optimizations": optimizations} if optimizations else {}))
    runner = llm.engine.executor.runner
    block = runner.block_size
    rng = np.random.default_rng(seed)
    vocab = min(runner.cfg.vocab_size, 1000)
    out: dict[str, dict[str, float]] = {"decode": {}, "prefill": {}}
    try:
        with torch.inference_mode():
            for w in workloads:
                per_seq = -(-(w.prompt + w.output) // block)
                tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(w.concurrency)]
                assert per_seq * w.concurrency <= runner.num_blocks, "the pool is too small for the workload"
                prompt = rng.integers(0, vocab, w.prompt).tolist()
                pre = ModelInput(prompt, [w.prompt], [w.prompt], [tables[0]], [0])
                out["prefill"][w.name] = _timed(runner, pre, repeats)
                ctx = w.prompt + w.output // 2  # the mean context of the decode steps
                dec = ModelInput(rng.integers(0, vocab, w.concurrency).tolist(), [1] * w.concurrency,
                                 [ctx] * w.concurrency, tables, list(range(w.concurrency)))
                out["decode"][w.name] = _timed(runner, dec, repeats)
    finally:  # the next variant is built next: this one's weights, pool and graphs go first
        import gc

        llm.shutdown()
        del llm, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def measure(base: str, device: str, dtype: str, formats, workloads, repeats: int, optimizations=None) -> dict:
    """Each format's per-kind costs for every workload's decode and prefill steps (the four variants timed)."""
    from nanoserve.presets.catalog import get_preset

    cfg = get_preset(base).config
    measured: dict[str, Any] = {"model": base, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "formats": {},
                                "variants": {}}
    for fmt in formats:
        times = {}
        for label, kinds in VARIANTS.items():
            with layer_variant(base, kinds) as name:
                times[label] = time_variant(name, device, dtype, None if fmt == "bf16" else fmt, workloads,
                                            repeats, optimizations)
        measured["variants"][fmt] = times
        measured["formats"][fmt] = {
            step: {w.name: decompose({v: times[v][step][w.name] for v in VARIANTS}) for w in workloads}
            for step in ("decode", "prefill")}
    return measured


def run_projection(device: str, dtype: str, formats, optimizations=None, repeats: int | None = None) -> dict:
    """The whole report: the measured per-kind costs, the projection and its table."""
    on_gpu = device == "cuda"
    base = "m3-slice" if on_gpu else "m3-tiny"
    workloads = WORKLOADS if on_gpu else CPU_WORKLOADS
    measured = measure(base, device, dtype, formats, workloads, repeats or (20 if on_gpu else 5), optimizations)
    rows = project(measured, workloads)
    report = {"measured": measured, "projection": rows, "latency_us": AR_LATENCY_US, "bus_gbps": NVLINK_BUS_GBPS}
    report["table"] = projection_table(report, workloads)
    return report


def projection_table(report: dict, workloads) -> str:
    m = report["measured"]
    lines = [f"## The released M3 projected from {m['model']} ({M3_DENSE_LAYERS} dense + {M3_SPARSE_LAYERS} sparse "
             f"layers; all-reduce {report['latency_us']:g} us + bytes at {report['bus_gbps']:g} GB/s: a model, not "
             "a measurement)", "", "Measured per step, ms: a sparse layer / a dense layer / the rest", "",
             "| format | workload | decode | prefill of the prompt |", "|---|---|---|---|"]
    for fmt, by_step in m["formats"].items():
        for w in workloads:
            cells = [" / ".join(f"{by_step[step][w.name][k] * 1e3:.3f}" for k in ("sparse_layer", "dense_layer",
                                                                                  "rest"))
                     for step in ("decode", "prefill")]
            lines.append(f"| {fmt} | {w.name} | {cells[0]} | {cells[1]} |")
    lines += ["", "| format | workload | TP | TTFT ms | TPOT ms | output tok/s per GPU | published |",
              "|---|---|---|---|---|---|---|"]
    for r in report["projection"]:
        lines.append(f"| {r['format']} | {r['workload']} | {r['tp']} | {r['ttft_ms']:.1f} | {r['tpot_ms']:.2f} | "
                     f"{r['tok_s_per_gpu']:.1f} | {r['published']} |")
    return "\n".join(lines)


# -- the all-reduce model against gloo ---------------------------------------------------------------------------


def fit_allreduce(samples: list[tuple[int, int, float]]) -> dict[str, float]:
    """Least squares of t = latency + 2 (n - 1) / n x bytes / bandwidth over (ranks n, bytes, seconds) samples:
    the fitted latency (us), bandwidth (GB/s) and the largest relative error of the fit."""
    x = np.array([2 * (n - 1) / n * b for n, b, _ in samples], dtype=np.float64)
    t = np.array([s for _, _, s in samples], dtype=np.float64)
    a = np.stack([np.ones_like(x), x], axis=1)
    (lat, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    pred = lat + per_byte * x
    return {"latency_us": float(lat * 1e6), "bus_gbps": float(1 / per_byte / 1e9) if per_byte > 0 else float("inf"),
            "max_rel_error": float(np.max(np.abs(pred - t) / t))}


def _gloo_worker(rank: int, world: int, port: int, sizes: list[int], repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 2, dtype=torch.float16)
            for _ in range(3):
                dist.all_reduce(x)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(repeats):
                dist.all_reduce(x)
            result.append((world, nbytes, (time.perf_counter() - t0) / repeats))
        if rank == 0:
            out.put(result)
    finally:
        dist.destroy_process_group()


def gloo_samples(worlds=(2,), sizes=(2**10, 2**14, 2**17, 2**20, 2**22, 2**24), repeats: int = 20) -> list:
    """(ranks, bytes, seconds) of gloo all-reduces of fp16 vectors between processes on this machine."""
    import socket

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    samples = []
    for world in worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, list(sizes), repeats, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        samples += q.get(timeout=300)
        for p in procs:
            p.join(60)
    return samples


def run_allreduce_check(worlds=(2,)) -> dict:
    """gloo all-reduces at several sizes between `worlds` processes (2: one per core of a small machine), the model
    fitted per number of ranks, and how far each sample lies from it."""
    samples = gloo_samples(worlds)
    fits = {n: fit_allreduce([x for x in samples if x[0] == n]) for n in worlds}
    lines = ["## The all-reduce model against gloo on this CPU (t = latency + 2 (n - 1) / n x bytes / bandwidth)", "",
             "| ranks | bytes | measured us | model us |", "|---|---|---|---|"]
    for n, b, s in samples:
        fit = fits[n]
        model = fit["latency_us"] + 2 * (n - 1) / n * b / (fit["bus_gbps"] * 1e9) * 1e6
        lines.append(f"| {n} | {b:,} | {s * 1e6:.1f} | {model:.1f} |")
    lines.append("")
    lines += [f"{n} ranks: fitted latency {f['latency_us']:.1f} us, bandwidth {f['bus_gbps']:.2f} GB/s, largest "
              f"relative error {f['max_rel_error']:.0%}" for n, f in fits.items()]
    return {"samples": samples, "fits": fits, "table": "\n".join(lines)}
