"""Speculative decoding, measured: what each drafter is accepted and gains on a trained model, and what a verify
step and a draft step cost on the device.

    python -m nanoserve.bench --speculative                      # m3-mini: every drafter on its held-out prompts
    python -m nanoserve.bench --speculative --spec-limit 2       # at most 2 prompts per task
    python -m nanoserve.bench --speculative --spec-limit 20 --spec-retrieval-limit 2   # fewer long prompts
    python -m nanoserve.bench --speculative cost                 # m3-slice on a GPU (m3-tiny on the CPU)
    python -m nanoserve.bench --speculative host                 # where a step's host time goes (m3-mini)

**Acceptance** (`acceptance`). A trained model's directory carries its held-out prompts (`heldout.jsonl.gz`, rows
{"task", "prompt", ...}). Each prompt is answered greedily, alone (batch 1, where speculation pays), once without
speculation and once per drafter (ngram k=3, mtp k=1 and k=3 when the checkpoint has an MTP module - on a GPU also
k=3 with switch spec_async, spec_draft_chain or spec_feed_in_graph off - and eagle3 k=3 with --spec-eagle3 DIR),
each by an engine that on a GPU first
warms up as the server does (kernels built, and every decode, verify and draft graph captured: engine/warmup.py), so
no TPOT pays for them. Per drafter and task: the mean accepted length (tokens a verify step emits: accepted drafts +
1) and the acceptance per draft position (the fraction of verify steps that accepted position j), from the engine's
counters (vLLM's spec_decode_* names); output tokens/s and TPOT without and with, and the speed-up (TPOT without /
TPOT with). Greedy output with speculation must be the output without it, token for token: a difference is printed
and the command fails.

**Cost** (`cost`). On a live model runner (random weights are fine: acceptance does not enter), B sequences of
C context tokens: the time of a 1-token decode step (as the engine runs it: under CUDA graphs when they apply,
and eagerly), of a verify step of k + 1 tokens per sequence (eager, as the engine runs it), and of a draft step
(ngram: the host lookup; mtp and eagle3: a draft layer with random weights at the target's widths, over the k + 1
positions a fully accepted verify step made final, then k - 1 further passes). The speed-up a drafter would give
at a mean accepted length L is L x decode / (verify + draft); it is printed at EAGLE-3's published 2.7 and 3.5
(k = 3).

**Host** (`host`, nanoserve/bench/speculative_host.py): per configuration (no speculation, ngram k=3, mtp k=3),
the mean wall time per step of each engine phase (draft, schedule, forward launch, sample, verify, the wait for the
tokens, detokenisation), timed around the engine's objects while it answers the chat prompts alone.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nanoserve.bench.quality import heldout_rows
from nanoserve.bench.speculative_llm import (
    MULTI,
    NO_ASYNC,
    NO_CHAIN,
    NO_FEED,
    build_llm,
    first_difference,
    max_tokens_for,
    no_chain_skip,
    switches_for,
)

NGRAM_K3 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MTP = {"method": "mtp"}
PUBLISHED_EAGLE3_ACCEPTANCE = (2.7, 3.5)
"""Mean accepted length of Inferact/MiniMax-M3-EAGLE3 with 3 draft tokens: MT-Bench, and GSM8K / HumanEval."""


def drafters(model_dir: str, eagle3_dir: str | None, device: str = "cpu"
             ) -> list[tuple[str, dict | None, str | None]]:
    """(name, speculative_config, why it is skipped or None) for every drafter this model can be measured with."""
    from nanoserve.spec_decode.mtp import has_mtp

    no_mtp = None if has_mtp(model_dir) else f"{model_dir} has no MTP module (language_model.model.mtp.*)"
    no_eagle = None if eagle3_dir else "no EAGLE-3 draft directory given (--spec-eagle3 DIR)"
    return [("ngram k=3", NGRAM_K3, None),
            ("mtp k=1", {**MTP, "num_speculative_tokens": 1}, no_mtp),
            ("mtp k=3", {**MTP, "num_speculative_tokens": 3}, no_mtp),
            (NO_ASYNC, {**MTP, "num_speculative_tokens": 3}, no_chain_skip(no_mtp, device)),
            (NO_CHAIN, {**MTP, "num_speculative_tokens": 3}, no_chain_skip(no_mtp, device)),
            (NO_FEED, {**MTP, "num_speculative_tokens": 3}, no_chain_skip(no_mtp, device)),
            (MULTI, {**MTP, "num_speculative_tokens": 3}, no_chain_skip(no_mtp, device)),
            ("eagle3 k=3", {"method": "eagle3", "model": eagle3_dir, "num_speculative_tokens": 3}, no_eagle)]


# -- acceptance on a trained model -------------------------------------------------------------------------------


@dataclass
class TaskRun:
    """One engine's greedy answers to one task's prompts, each alone, and its speculation counters over them."""

    tokens: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0
    tpot_s: list[float] = field(default_factory=list)  # per prompt: (last token - first token) / (tokens - 1)
    num_drafts: int = 0  # verify steps (vLLM's spec_decode_num_drafts)
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_tpot_s(self) -> float | None:
        return sum(self.tpot_s) / len(self.tpot_s) if self.tpot_s else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []


def answer_alone(llm, rows: list[dict], batch: int = 1) -> dict[str, TaskRun]:
    """Answer every row greedily, one at a time (`batch`: that many of a task's rows at once); per task the
    outputs, timings and the acceptance counters."""
    from nanoserve.sampling import SamplingParams

    stats = llm.engine.stats
    runs: dict[str, TaskRun] = {}
    groups: list[list[dict]] = []
    for task in dict.fromkeys(r["task"] for r in rows):
        of_task = [r for r in rows if r["task"] == task]
        groups += [of_task[i: i + batch] for i in range(0, len(of_task), batch)]
    for group in groups:
        run = runs.setdefault(group[0]["task"], TaskRun())
        before = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                  stats.spec_decode_num_accepted_tokens, list(stats.spec_decode_accepted_per_pos))
        t0 = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens_for(group[0]["task"]))
        outs = llm.generate([r["prompt"] for r in group], params, use_tqdm=False)
        run.wall_s += time.perf_counter() - t0
        for out in outs:
            ids = list(out.outputs[0].token_ids)
            run.tokens.append(ids)
            m = out.metrics
            if m is not None and m.first_token_time is not None and m.last_token_time is not None and len(ids) > 1:
                run.tpot_s.append((m.last_token_time - m.first_token_time) / (len(ids) - 1))
        run.num_drafts += stats.spec_decode_num_drafts - before[0]
        run.num_draft_tokens += stats.spec_decode_num_draft_tokens - before[1]
        run.num_accepted += stats.spec_decode_num_accepted_tokens - before[2]
        for j, n in enumerate(stats.spec_decode_accepted_per_pos):  # grows to the longest draft seen
            if j == len(run.accepted_per_pos):
                run.accepted_per_pos.append(0)
            run.accepted_per_pos[j] += n - (before[3][j] if j < len(before[3]) else 0)
    return runs


def measure_acceptance(model: str, limit: int | None = None, eagle3_dir: str | None = None, device: str = "cpu",
                       dtype: str = "auto", optimizations=None, retrieval_limit: int | None = None, batch: int = 1,
                       only: list[str] | None = None) -> dict[str, Any]:
    """The report of the acceptance part (see the module docstring): a dict, with a printable `table`.
    `optimizations`: the engines' switches (None: the defaults); `retrieval_limit`: prompts per retrieval length
    (None: `limit`); `batch`: prompts answered at once (1: alone); `only`: the drafters measured (None: all)."""
    from nanoserve.presets.resolve import resolve_model_dir

    model_dir = resolve_model_dir(model)
    retrieval_limit = limit if retrieval_limit is None else retrieval_limit
    rows = heldout_rows(model_dir, limit, retrieval_limit, flag="--speculative")
    report: dict[str, Any] = {"model": model, "device": device, "dtype": dtype, "limit": limit,
                              "retrieval_limit": retrieval_limit, "batch": batch,
                              "prompts": {t: sum(r["task"] == t for r in rows) for t in dict.fromkeys(
                                  r["task"] for r in rows)}, "drafters": {}, "skipped": {}}
    base = _answer_with(model, device, dtype, None, rows, optimizations, batch)
    report["baseline"] = {t: _timing(run) for t, run in base.items()}
    _progress("no speculation", base)
    for name, config, skip in drafters(model_dir, eagle3_dir, device):
        if only is not None and name not in only:
            continue
        if skip:
            report["skipped"][name] = skip
            continue
        spec = _answer_with(model, device, dtype, config, rows, switches_for(name, optimizations), batch)
        _progress(name, spec)
        tasks = {}
        for task, run in spec.items():
            ref = base[task]
            diffs = [(i, d) for i, (a, b) in enumerate(zip(ref.tokens, run.tokens))
                     if (d := first_difference(a, b)) is not None]
            tasks[task] = {**_timing(run), "mean_accepted_length": run.mean_accepted_length,
                           "acceptance_per_pos": run.acceptance_per_pos, "num_drafts": run.num_drafts,
                           "num_draft_tokens": run.num_draft_tokens, "num_accepted_tokens": run.num_accepted,
                           "speedup_tpot": (ref.mean_tpot_s / run.mean_tpot_s
                                            if ref.mean_tpot_s and run.mean_tpot_s else None),
                           "speedup_tokens_per_s": (run.tokens_per_s / ref.tokens_per_s
                                                    if ref.tokens_per_s else None),
                           "identical": not diffs,
                           "differences": [{"prompt": i, "first_token": d} for i, d in diffs]}
        report["drafters"][name] = {"config": config, "tasks": tasks}
    report["identical"] = all(t["identical"] for d in report["drafters"].values() for t in d["tasks"].values())
    report["table"] = acceptance_table(report)
    return report


def _answer_with(model: str, device: str, dtype: str, config: dict | None, rows: list[dict], optimizations,
                 batch: int = 1) -> dict[str, TaskRun]:
    from nanoserve.sampling import SamplingParams

    llm = build_llm(model, device, dtype, config, optimizations, max_num_seqs=batch)
    try:
        # one short request first, so the timed ones do not pay for first-use work (allocations, kernel builds)
        llm.generate([rows[0]["prompt"]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        return answer_alone(llm, rows, batch)
    finally:
        llm.shutdown()


def _progress(name: str, runs: dict[str, TaskRun]) -> None:
    """One line per engine as it finishes (a pass over long prompts takes minutes on the CPU)."""
    import sys

    done = ", ".join(f"{task} {run.output_tokens} tokens in {run.wall_s:.1f} s" for task, run in runs.items())
    print(f"{name}: {done}", file=sys.stderr, flush=True)


def _timing(run: TaskRun) -> dict[str, Any]:
    return {"output_tokens": run.output_tokens, "wall_s": run.wall_s, "tokens_per_s": run.tokens_per_s,
            "tpot_ms": run.mean_tpot_s * 1e3 if run.mean_tpot_s is not None else None}


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def acceptance_table(report: dict[str, Any]) -> str:
    lines = [f"## Speculative decoding on {report['model']} (held-out prompts, greedy, batch {report.get('batch', 1)}, "
             f"{report['device']})",
             "", "| drafter | task | prompts | mean accepted length | acceptance per position | tok/s without / with "
             "| TPOT ms without / with | speed-up (TPOT) | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for name, d in report["drafters"].items():
        for task, t in d["tasks"].items():
            b = report["baseline"][task]
            per_pos = " / ".join(f"{p:.2f}" for p in t["acceptance_per_pos"]) or "-"
            lines.append(f"| {name} | {task} | {report['prompts'][task]} | {_f(t['mean_accepted_length'], '.2f')} | "
                         f"{per_pos} | {_f(b['tokens_per_s'], '.1f')} / {_f(t['tokens_per_s'], '.1f')} | "
                         f"{_f(b['tpot_ms'], '.2f')} / {_f(t['tpot_ms'], '.2f')} | "
                         f"{_f(t['speedup_tpot'], '.2f')}x | {'yes' if t['identical'] else 'NO'} |")
    for name, why in report["skipped"].items():
        lines.append(f"\n{name}: skipped, {why}")
    if not report["identical"]:
        lines.append("\nGREEDY OUTPUT DIFFERS WITH SPECULATION: " + "; ".join(
            f"{name} {task}: prompts {[x['prompt'] for x in t['differences']]}"
            for name, d in report["drafters"].items() for task, t in d["tasks"].items() if not t["identical"]))
    return "\n".join(lines)


# -- the command ----------------------------------------------------------------------------------------------------


def run(args) -> int:
    """`python -m nanoserve.bench --speculative [acceptance|cost|host]`: print the report, write it under --out;
    exit status 1 when greedy output changed with speculation."""
    from nanoserve.bench.session import device_and_switches
    from nanoserve.cpu_threads import configure_cpu_threads

    dev, opts = device_and_switches(args)
    on_gpu, device = dev.type == "cuda", dev.type
    if not on_gpu:
        configure_cpu_threads(args.cpu_threads)
    if args.speculative == "cost":
        from nanoserve.bench.speculative_cost import measure_costs

        model = args.model or ("m3-slice" if on_gpu else "m3-tiny")
        report = measure_costs(model, device, args.dtype, context=args.prompt_len, seed=args.seed, optimizations=opts)
        name, rc = "speculative_cost", 0
    elif args.speculative == "host":
        from nanoserve.bench.speculative_host import measure_host
        from nanoserve.presets.catalog import DEFAULT_MODEL

        try:
            report = measure_host(args.model or DEFAULT_MODEL, device, args.dtype, args.spec_limit, opts)
        except ValueError as e:  # no held-out set: the reason, not a traceback
            raise SystemExit(f"error: {e}") from None
        name, rc = "speculative_host", 0 if report["identical"] else 1
    else:
        from nanoserve.presets.catalog import DEFAULT_MODEL

        # float32 on the CPU; a GPU runs the model's dtype, where a verify step's other kernel shapes may round
        # differently from a decode step's (a difference is reported, not hidden)
        try:
            only = [name.strip() for name in args.spec_drafters.split(";")] if args.spec_drafters else None
            report = measure_acceptance(args.model or DEFAULT_MODEL, args.spec_limit, args.spec_eagle3, device,
                                        args.dtype, opts, args.spec_retrieval_limit, args.spec_batch, only)
        except ValueError as e:  # no held-out set, a bad draft directory: the reason, not a traceback
            raise SystemExit(f"error: {e}") from None
        name, rc = "speculative", 0 if report["identical"] else 1
    print(report["table"], flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        from nanoserve.bench.env import environment

        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump({**{k: v for k, v in report.items() if k != "table"},
                       "environment": environment(torch.device(device))}, f, indent=2)
        with open(os.path.join(args.out, f"{name}.md"), "w") as f:
            f.write(report["table"] + "\n")
    return rc
