"""What speculative decoding's steps cost on the device: a verify step of k + 1 tokens against a 1-token decode
step, and a draft step, at batch 1 and 16 - and the speed-up those costs imply at a given acceptance.

    python -m nanoserve.bench --speculative cost                       # m3-slice on a GPU, m3-tiny on the CPU
    python -m nanoserve.bench --speculative cost --prompt-len 4096     # context per sequence (default 1024 / 64)

The steps run on a live model runner with the model's own (random) weights: acceptance does not enter a step's
cost. B sequences of C context tokens are prefilled into blocks of the runner's pool; then, timed after a warm-up:

    decode      a 1-token step per sequence, as the engine runs it (under CUDA graphs when they apply), and eager
    verify      k + 1 tokens per sequence, with the logits of every position, as the engine runs it (replaying a
                graph with switch spec_cuda_graphs, eagerly without), and eager
    draft       ngram: the prompt lookup on the host; mtp: an MTP module (random weights, the target's widths)
                over the k + 1 positions a fully accepted verify step made final, then k - 1 further passes
                (with spec_cuda_graphs each pass replays a graph, as the engine runs them);
                eagle3: the same with an EAGLE-3 layer at the target's hidden size, heads and dense MLP width
                (its passes replay graphs too)

A drafter emitting L tokens per verify step on average (the mean accepted length) gives
speed-up = L x decode / (verify + draft): printed at EAGLE-3's published 2.7 and 3.5 (k = 3) for every drafter's
measured draft cost (mtp at k = 1 too, at L = 1.5 and 2). The steps write K/V into pool blocks the engine is not
using (it runs no request meanwhile), and rewrite the same slots each repeat.

**A projection for the released M3** (`project_m3`; a model, not a measurement): the measured steps scaled to M3's 60
layers from the model's own (the whole step counted as layers - the LM head's share is larger on the slice, so this
overstates a 60-layer step's head), its weight bytes by MXFP8's share of bf16's (0.53: e4m3 plus one E8M0 scale per
32) and spread over TP ranks, plus two all-reduces per layer (and per draft pass) at AR_LATENCY_US each (an NVLink
all-reduce of a few hidden vectors is latency-bound); the MTP draft passes scaled the same way. The implied speed-up
at MTP k = 3's mean accepted length is printed beside vLLM's published 2.39x per user for M3 with EAGLE-3 on B300
at concurrency 1.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.spec_decode.ngram import NgramProposer
from nanoserve.step import ModelInput

ACCEPTANCE_AT = {1: (1.5, 2.0), 3: (2.7, 3.5)}
"""Mean accepted lengths the speed-up is computed at, per k: for k = 3 EAGLE-3's published ones."""


def _timer(device: torch.device, fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Mean seconds per call of fn, after `warmup` calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def random_drafter(method: str, runner):
    """A DraftRunner with random weights at the target's widths, its K/V pool under the runner's block ids."""
    from nanoserve.spec_decode.drafter import DraftRunner
    from nanoserve.spec_decode.eagle3 import Eagle3Config, Eagle3Drafter
    from nanoserve.spec_decode.mtp import M3MTP

    cfg, opts = runner.cfg, runner.config.optimizations
    if method == "mtp":
        module = M3MTP(cfg, opts, runner.dtype, runner.device)
    else:
        L = cfg.num_hidden_layers
        ecfg = Eagle3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                            num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                            intermediate_size=cfg.dense_intermediate_size, rms_norm_eps=cfg.rms_norm_eps,
                            rope_theta=cfg.rope_theta, vocab_size=cfg.vocab_size, draft_vocab_size=cfg.vocab_size,
                            target_hidden_size=cfg.hidden_size, aux_layer_ids=(2, L // 2, L - 3),
                            norm_before_residual=False)
        module = Eagle3Drafter(ecfg, opts, runner.dtype, runner.device)
    g = torch.Generator(device=runner.device).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.02, generator=g)
    draft = DraftRunner(method, module.eval(), runner.model, runner.dtype, runner.device, runner.block_size)
    draft.allocate(runner.num_blocks)
    return draft


def measure_costs(model: str, device: str = "auto", dtype: str = "auto", context: int | None = None,
                  batches: tuple[int, ...] = (1, 16), ks: tuple[int, ...] = (1, 3), repeats: int | None = None,
                  seed: int = 0, optimizations=None) -> dict[str, Any]:
    """The cost report (see the module docstring): a dict, with a printable `table`. `optimizations`: the
    engine's switches (None: the defaults)."""
    from nanoserve.entrypoints.llm import LLM

    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    context = context or (1024 if on_gpu else 64)
    repeats = repeats or (20 if on_gpu else 3)
    k_max, b_max = max(ks), max(batches)
    block = model_block_size(model)
    per_seq = -(-(context + 2 * k_max) // block)
    # an ngram speculative_config of the largest k: the runner sizes its verify graphs by it (spec_cuda_graphs);
    # no request runs, so nothing is drafted
    spec = {"method": "ngram", "num_speculative_tokens": k_max, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = LLM(model=model, device=device, dtype=dtype, seed=seed, max_num_seqs=b_max,
              max_model_len=context + 2 * k_max + 16, num_gpu_blocks_override=per_seq * b_max,
              speculative_config=spec, **({"optimizations": optimizations} if optimizations else {}))
    try:
        return _measure(llm.engine.executor.runner, context, batches, ks, repeats, per_seq, seed, model)
    finally:
        llm.shutdown()


def model_block_size(model: str) -> int:
    """The KV block size the engine will use (the model's MSA block size), read without loading the weights."""
    from nanoserve.presets.catalog import PRESETS, get_preset

    if model in PRESETS:
        return get_preset(model).config.index_block_size
    from nanoserve.model.loader import read_config
    from nanoserve.presets.resolve import resolve_model_dir

    return read_config(resolve_model_dir(model)).index_block_size


@torch.inference_mode()
def _measure(runner, context: int, batches, ks, repeats: int, per_seq: int, seed: int, model: str) -> dict:
    rng = np.random.default_rng(seed)
    vocab = min(runner.cfg.vocab_size, 1000)
    opts = runner.config.optimizations
    graphs_were = opts.cuda_graphs
    b_max = max(batches)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b_max)]
    contexts = [rng.integers(0, vocab, context).tolist() for _ in range(b_max)]
    opts.cuda_graphs = False
    for ids, table in zip(contexts, tables):  # one sequence at a time: a prefill's activations stay small
        runner.execute(ModelInput(ids, [context], [context], [table], [0]))
    out: dict[str, Any] = {"model": model, "device": str(runner.device), "dtype": str(runner.dtype).replace(
        "torch.", ""), "context": context, "repeats": repeats, "rows": []}
    try:
        for b in batches:
            row: dict[str, Any] = {"batch": b}
            dec = ModelInput(rng.integers(0, vocab, b).tolist(), [1] * b, [context + 1] * b, tables[:b],
                             list(range(b)))
            opts.cuda_graphs = graphs_were
            row["decode_ms"] = _timer(runner.device, lambda dec=dec: runner.execute(dec), repeats) * 1e3
            row["decode_graphs"] = runner.graphs is not None and bool(getattr(runner.graphs, "graphs", None))
            opts.cuda_graphs = False
            row["decode_eager_ms"] = _timer(runner.device, lambda dec=dec: runner.execute(dec), repeats) * 1e3
            for k in ks:
                n = k + 1
                ver = ModelInput(rng.integers(0, vocab, b * n).tolist(), [n] * b, [context + n] * b, tables[:b], [],
                                 list(range(b * n)))
                opts.cuda_graphs = graphs_were
                row[f"verify_k{k}_ms"] = _timer(runner.device, lambda ver=ver: runner.execute(ver), repeats) * 1e3
                row[f"verify_k{k}_graphs"] = runner.graphs is not None and any(
                    key[2] == n for key in runner.graphs.verify_graphs)
                opts.cuda_graphs = False
                row[f"verify_k{k}_eager_ms"] = _timer(runner.device, lambda ver=ver: runner.execute(ver),
                                                      repeats) * 1e3
            out["rows"].append(row)
    finally:
        opts.cuda_graphs = graphs_were
    # the draft models last: EAGLE-3's taps are hooks on the target's layers, which must not slow the steps above
    for method in ("ngram", "mtp", "eagle3"):
        draft = None if method == "ngram" else random_drafter(method, runner)
        try:
            for row in out["rows"]:
                b = row["batch"]
                for k in ks:
                    row[f"draft_{method}_k{k}_ms"] = _timer(
                        runner.device, _draft_step(method, draft, runner, contexts[:b], tables[:b], k, rng),
                        repeats) * 1e3
        finally:
            if draft is not None:  # its weights, pool and graphs go before the next one's are made
                draft.allocate(0)
                draft = runner.draft_graphs = None
                if runner.device.type == "cuda":
                    torch.cuda.empty_cache()
    out["speedups"] = implied_speedups(out["rows"], ks)
    out["projection"] = project_m3(out["rows"], runner.cfg.num_hidden_layers)
    out["table"] = cost_table(out, ks)
    return out


def _draft_step(method: str, draft, runner, contexts: list[list[int]], tables: list[list[int]], k: int, rng):
    """One draft step for every sequence, after a fully accepted verify step of k + 1 tokens (the one-token
    passes under graphs where the engine would replay them)."""
    if method == "ngram":
        proposer = NgramProposer(2, 4, k)
        return lambda: [proposer.propose(c) for c in contexts]
    b, n = len(contexts), k + 1
    context = len(contexts[0])
    inp = DraftInput(list(range(b * n)), rng.integers(0, min(runner.cfg.vocab_size, 1000), b * n).tolist(),
                     [n] * b, [context + n] * b, tables, [k] * b)
    width = runner.cfg.hidden_size * (len(draft.drafter.cfg.aux_layer_ids) if method == "eagle3" else 1)
    hidden = torch.randn(b * n, width, device=runner.device).to(runner.dtype)  # what the verify step left

    graphs = runner.draft_pass_graphs(draft)

    def step():
        draft.last = hidden
        return draft.propose(inp, runner.prepare, graphs)
    return step


def implied_speedups(rows: list[dict], ks) -> list[dict]:
    """speed-up = L x decode / (verify + draft) per batch, k, drafter and acceptance L (ACCEPTANCE_AT)."""
    out = []
    for row in rows:
        for k in ks:
            for method in ("ngram", "mtp", "eagle3"):
                cost = row[f"verify_k{k}_ms"] + row[f"draft_{method}_k{k}_ms"]
                for length in ACCEPTANCE_AT.get(k, ()):
                    out.append({"batch": row["batch"], "k": k, "drafter": method, "mean_accepted_length": length,
                                "speedup": length * row["decode_ms"] / cost})
    return out


M3_LAYERS = 60
MXFP8_BYTES_SHARE = 0.53
"""MXFP8 weight bytes over bf16's: 1 byte per value plus 1 scale byte per 32, over 2 bytes."""
AR_LATENCY_US = 15.0
"""One tensor-parallel all-reduce of a decode step's few hidden vectors over NVLink, TP 8 (a latency, not bandwidth:
the model's assumption, stated beside its output)."""
VLLM_M3_EAGLE3_SPEEDUP = 2.39
"""vLLM's published per-user speed-up for MiniMax M3 with EAGLE-3 (B300, concurrency 1, acceptance 2.3-2.7 of 4)."""


def project_m3(rows: list[dict], model_layers: int, tps=(4, 8), k: int = 3, lengths=(2.5, 2.9)) -> list[dict]:
    """The released M3's decode and verify steps and MTP draft passes, projected from the measured ones (see the
    module docstring), per batch, TP size and mean accepted length: ms per step and the implied speed-up."""
    out = []
    scale = M3_LAYERS / model_layers * MXFP8_BYTES_SHARE
    for row in rows:
        if f"verify_k{k}_ms" not in row:
            continue
        for tp in tps:
            ar = 2 * AR_LATENCY_US / 1e3
            decode = row["decode_ms"] * scale / tp + M3_LAYERS * ar
            verify = row[f"verify_k{k}_ms"] * scale / tp + M3_LAYERS * ar
            draft = row[f"draft_mtp_k{k}_ms"] * MXFP8_BYTES_SHARE / tp + k * ar
            for length in lengths:
                out.append({"batch": row["batch"], "tp": tp, "k": k, "mean_accepted_length": length,
                            "decode_ms": decode, "verify_ms": verify, "draft_ms": draft,
                            "speedup": length * decode / (verify + draft)})
    return out


def cost_table(report: dict[str, Any], ks) -> str:
    lines = [f"## Speculative step costs on {report['model']} ({report['device']}, {report['dtype']}, "
             f"{report['context']} tokens of context, mean of {report['repeats']})", ""]
    head = ["batch", "decode ms (graphs / eager)"]
    for k in ks:
        head += [f"verify {k + 1} tok ms (x decode) / eager", f"draft k={k} ms ngram / mtp / eagle3"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["rows"]:
        cells = [str(row["batch"]), f"{row['decode_ms']:.3f}{'' if row['decode_graphs'] else ' (no graphs)'} / "
                 f"{row['decode_eager_ms']:.3f}"]
        for k in ks:
            v = row[f"verify_k{k}_ms"]
            cells += [f"{v:.3f} ({v / row['decode_ms']:.2f}x){'' if row[f'verify_k{k}_graphs'] else ' (no graphs)'}"
                      f" / {row[f'verify_k{k}_eager_ms']:.3f}",
                      " / ".join(f"{row[f'draft_{m}_k{k}_ms']:.3f}" for m in ("ngram", "mtp", "eagle3"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Speed-up implied = L x decode / (verify + draft), L = mean accepted length:", "",
              "| batch | k | L | ngram | mtp | eagle3 |", "|---|---|---|---|---|---|"]
    by_key: dict[tuple, dict[str, float]] = {}
    for s in report["speedups"]:
        by_key.setdefault((s["batch"], s["k"], s["mean_accepted_length"]), {})[s["drafter"]] = s["speedup"]
    for (b, k, length), v in by_key.items():
        lines.append(f"| {b} | {k} | {length} | {v['ngram']:.2f}x | {v['mtp']:.2f}x | {v['eagle3']:.2f}x |")
    if report.get("projection"):
        lines += ["", f"Projected for the released M3 ({M3_LAYERS} layers, MXFP8, MTP k = 3; two all-reduces per layer "
                      f"at {AR_LATENCY_US:g} us: a model of the measured steps, not a measurement), beside vLLM's "
                      f"published {VLLM_M3_EAGLE3_SPEEDUP}x (EAGLE-3, B300, concurrency 1):", "",
                  "| batch | TP | L | decode ms | verify ms | draft ms | speed-up |", "|---|---|---|---|---|---|---|"]
        for s in report["projection"]:
            lines.append(f"| {s['batch']} | {s['tp']} | {s['mean_accepted_length']} | {s['decode_ms']:.2f} | "
                         f"{s['verify_ms']:.2f} | {s['draft_ms']:.2f} | {s['speedup']:.2f}x |")
    return "\n".join(lines)
